// SPDX-License-Identifier: Apache-2.0
// Tensor parallelism for Model<Backend> (model.hpp), Megatron style. With degree tp, rank r holds
//   query heads [r·Hq/tp, (r+1)·Hq/tp) and KV heads [r·Hkv/tp, (r+1)·Hkv/tp):
//     wq, wk, wv (and their biases)  row shards     (the rank's heads' output rows)
//     wo                             column shard   (the rank's heads' input columns)
//   MLP columns [r·H/tp, (r+1)·H/tp):
//     w1, w3                         row shards
//     w2                             column shard
//   embeddings, RMSNorm weights and the classifier: replicated.
// A rank's shard is an ordinary, smaller model (shard_config: Hq/tp, Hkv/tp, hidden/tp; dim,
// head_dim and vocab unchanged), so the same Model code runs it. The only cross-rank step: the
// attention output projection and the MLP down projection each produce a partial sum of the
// residual update, and Model all-reduces (sums) it over the ranks before the residual add. Every
// rank then holds the same residual stream, the same logits and samples the same token.
// Each rank's KvCache holds only its KV heads (geometry of shard_config), and its TriAttention
// scorer gets the statistics of its query heads (triattn::slice_for_rank).
//
// One thread per rank (run_ranks): on the CPU with triattn::tp::ThreadTeamCollective as the
// all-reduce (cpu_backend_for), on the GPU with NCCL (tp_cuda.cuh).
#pragma once

#include <algorithm>
#include <cstddef>
#include <exception>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/tp/collective.hpp>

#include "cpu_backend.hpp"
#include "model_config.hpp"

namespace triattn_example {

/// Which share of the model this rank runs: rank in [0, size); {0, 1} = no tensor parallelism.
struct TpRank {
  int rank = 0;
  int size = 1;
};

/// Why `c` cannot be split `tp` ways (empty when it can).
[[nodiscard]] inline std::string tp_problem(const ModelConfig& c, int tp) {
  if (tp < 1) return "tp = " + std::to_string(tp) + " must be >= 1";
  auto bad = [&](const char* what, int v) {
    return "model " + c.name + ": " + what + " = " + std::to_string(v) + " is not divisible by tp = " + std::to_string(tp);
  };
  if (c.n_heads % tp != 0) return bad("n_heads", c.n_heads);
  // Whole KV heads per rank: a GQA group never straddles ranks.
  if (c.n_kv_heads % tp != 0) return bad("n_kv_heads", c.n_kv_heads);
  if (c.hidden_dim % tp != 0) return bad("hidden_dim", c.hidden_dim);
  return {};
}

/// @throws triattn::logic_error when `c` cannot be split `t.size` ways or t.rank is out of range.
inline void check_tp(const ModelConfig& c, TpRank t) {
  const std::string why = tp_problem(c, t.size);
  TRIATTN_EXPECTS(why.empty(), "tensor parallelism: " + why);
  TRIATTN_EXPECTS(t.rank >= 0 && t.rank < t.size, "tensor parallelism: rank " + std::to_string(t.rank) +
                                                      " is outside [0, tp = " + std::to_string(t.size) + ")");
}

/// The model rank t.rank runs: n_heads, n_kv_heads and hidden_dim divided by t.size.
[[nodiscard]] inline ModelConfig shard_config(const ModelConfig& full, TpRank t) {
  full.validate();
  check_tp(full, t);
  ModelConfig c = full;
  c.n_heads /= t.size;
  c.n_kv_heads /= t.size;
  c.hidden_dim /= t.size;
  return c;
}

namespace tp_detail {

/// Rows [r0, r0 + nr) and columns [c0, c0 + nc) of each of `outer` stacked row-major
/// [rows, cols] matrices. t: [outer, rows, cols] -> [outer, nr, nc].
inline std::vector<float> block(const std::vector<float>& t, std::size_t outer, std::size_t rows, std::size_t cols,
                                std::size_t r0, std::size_t nr, std::size_t c0, std::size_t nc) {
  TRIATTN_EXPECTS(t.size() == outer * rows * cols && r0 + nr <= rows && c0 + nc <= cols,
                  "shard_weights: tensor of " + std::to_string(t.size()) + " elements is not [" + std::to_string(outer) +
                      ", " + std::to_string(rows) + ", " + std::to_string(cols) + "]");
  std::vector<float> out(outer * nr * nc);
  float* o = out.data();
  for (std::size_t m = 0; m < outer; ++m)
    for (std::size_t r = 0; r < nr; ++r) {
      const float* src = t.data() + (m * rows + r0 + r) * cols + c0;
      o = std::copy(src, src + nc, o);
    }
  return out;
}

}  // namespace tp_detail

/// Rank t.rank's weights (a copy): see the file comment for what is split and what replicated.
/// The result validates against shard_config(full.config, t).
/// @throws triattn::logic_error when the model cannot be split t.size ways.
[[nodiscard]] inline ModelWeights shard_weights(const ModelWeights& full, TpRank t) {
  full.validate();
  const ModelConfig& f = full.config;
  ModelWeights w;
  w.config = shard_config(f, t);
  const ModelConfig& c = w.config;
  using tp_detail::block;
  const std::size_t L = static_cast<std::size_t>(f.n_layers), D = static_cast<std::size_t>(f.dim);
  const std::size_t QD = static_cast<std::size_t>(f.q_dim()), KVD = static_cast<std::size_t>(f.kv_dim());
  const std::size_t H = static_cast<std::size_t>(f.hidden_dim), r = static_cast<std::size_t>(t.rank);
  const std::size_t qd = static_cast<std::size_t>(c.q_dim()), kvd = static_cast<std::size_t>(c.kv_dim());
  const std::size_t h = static_cast<std::size_t>(c.hidden_dim);
  w.tok_emb = full.tok_emb;
  w.rms_att = full.rms_att;
  w.rms_ffn = full.rms_ffn;
  w.rms_final = full.rms_final;
  w.wcls = full.wcls;
  w.wq = block(full.wq, L, QD, D, r * qd, qd, 0, D);     // [L, Hq·d, dim] -> rows of the rank's q heads
  w.wk = block(full.wk, L, KVD, D, r * kvd, kvd, 0, D);  // [L, Hkv·d, dim]
  w.wv = block(full.wv, L, KVD, D, r * kvd, kvd, 0, D);
  w.wo = block(full.wo, L, D, QD, 0, D, r * qd, qd);     // [L, dim, Hq·d] -> columns of those heads
  w.w1 = block(full.w1, L, H, D, r * h, h, 0, D);        // [L, hidden, dim]
  w.w3 = block(full.w3, L, H, D, r * h, h, 0, D);
  w.w2 = block(full.w2, L, D, H, 0, D, r * h, h);        // [L, dim, hidden]
  if (f.has_qkv_bias) {
    w.bq = block(full.bq, L, 1, QD, 0, 1, r * qd, qd);  // [L, Hq·d]
    w.bk = block(full.bk, L, 1, KVD, 0, 1, r * kvd, kvd);
    w.bv = block(full.bv, L, 1, KVD, 0, 1, r * kvd, kvd);
  }
  w.validate();
  return w;
}

/// A CPU backend whose all-reduce is `comm`'s (which must outlive it). tp = 1: no all-reduce.
template <triattn::tp::HostCollective C>
[[nodiscard]] CpuBackend cpu_backend_for(C& comm) {
  CpuBackend b;
  if (comm.size() > 1) b.set_all_reduce(comm.size(), [&comm](std::span<float> x) { comm.all_reduce_sum(x); });
  return b;
}

/// Runs f(rank) for rank = 0 .. tp-1, each in its own thread, and joins them. Rethrows the
/// exception of the lowest failing rank. Ranks meet in collectives, so an error raised on some
/// ranks only can leave the others waiting: check inputs (tp_problem, sizes) before calling.
template <class F>
void run_ranks(int tp, F&& f) {
  TRIATTN_EXPECTS(tp >= 1, "run_ranks: tp = " + std::to_string(tp) + " must be >= 1");
  std::vector<std::exception_ptr> err(static_cast<std::size_t>(tp));
  {
    std::vector<std::jthread> threads;
    threads.reserve(static_cast<std::size_t>(tp));
    for (int r = 0; r < tp; ++r)
      threads.emplace_back([&f, &err, r] {
        try {
          f(r);
        } catch (...) {
          err[static_cast<std::size_t>(r)] = std::current_exception();
        }
      });
  }  // jthreads join here
  for (const std::exception_ptr& e : err)
    if (e) std::rethrow_exception(e);
}

}  // namespace triattn_example
