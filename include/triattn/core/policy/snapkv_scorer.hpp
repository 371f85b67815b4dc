// SPDX-License-Identifier: Apache-2.0
// Scorer policy "SnapKV": keys are scored by the attention that an observation window of recent
// queries paid them. The engine supplies the queries (observe()); score() computes, per layer and
// query head, the causal softmax attention of each window query over the cached keys, averages
// it over the window, and max-pools it along the tokens (baseline::snapkv_scores). The GQA max and
// the top-k are the selector's, as for every scorer. CPU path; the CUDA kernels are
// cuda/algorithms/snapkv.cuh (pack_window() produces their input).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/cache_geometry.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/baseline_scores.hpp>

namespace triattn {

/// Parameters of the SnapKV scorer.
struct SnapKvParams {
  int window = 32;      ///< w: observed queries kept per (sequence, layer), newest w
  int pool_kernel = 7;  ///< max-pool kernel along tokens, odd ("same" padding); 1 = no pooling

  /// @throws triattn::logic_error naming the first bad value.
  void validate() const {
    TRIATTN_EXPECTS(window >= 1, "SnapKvParams::window must be >= 1, got " + std::to_string(window));
    TRIATTN_EXPECTS(pool_kernel >= 1 && pool_kernel % 2 == 1,
                    "SnapKvParams::pool_kernel must be odd and >= 1, got " + std::to_string(pool_kernel));
  }
};

/// SnapKV as a scorer.
///
/// Queries: the engine calls observe(seq, layer, q, position) with the post-RoPE query [Hq, d]
/// of each new token (keys in the cache are post-RoPE too), for every layer. Each (sequence,
/// layer) keeps a ring of the newest `window` queries; forget(seq) drops a sequence's rings (call
/// it when the sequence is released). Queries are not slots, so compaction does not move them.
///
/// Score of slot j for layer l and query head h (baseline::snapkv_scores):
///   a[j]     = mean over window queries i that see at least one key of
///              softmax_{j' <= lim_i}(q_i · k_{j'} / sqrt(d))[j]      (0 for j > lim_i)
///   score[j] = max of a over [j − pool_kernel/2, j + pool_kernel/2] ∩ [0, length)
/// with the causal limit lim_i = snapkv_visible_limit(length, t0, position_i): the tokens
/// after query i are taken to be the newest slots. That holds while no compaction has run since
/// the query was observed, i.e. when rounds are at least `window` decode steps apart
/// (SelectionParams::divide_length >= window, as with the defaults 128 >= 32) or when
/// SelectionParams::window >= window protects the window's tokens.
/// Use SelectionParams::window = SnapKvParams::window: the observation window's own tokens are
/// always kept, as in SnapKV.
class SnapKvScorer {
 public:
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;

  /// @throws logic_error on an invalid geometry or params.
  explicit SnapKvScorer(const ModelGeometry& geometry, const SnapKvParams& params = {})
      : g_(geometry), params_(params) {
    g_.validate();
    params_.validate();
  }
  explicit SnapKvScorer(const CacheConfig& cfg, const SnapKvParams& params = {}) : SnapKvScorer(cfg.model, params) {}

  [[nodiscard]] const SnapKvParams& params() const noexcept { return params_; }
  [[nodiscard]] const ModelGeometry& geometry() const noexcept { return g_; }

  /// Records the query of one new token of `seq` for `layer`; the oldest one of the ring is
  /// dropped once `window` are held.
  /// @param q        [num_q_heads, head_dim] post-RoPE query (copied)
  /// @param position the token's logical (RoPE) position
  /// @throws logic_error on a bad layer, a null q or a negative position.
  void observe(std::int32_t seq, int layer, const float* q, std::int64_t position) {
    TRIATTN_EXPECTS(layer >= 0 && layer < g_.num_layers, "SnapKvScorer::observe: layer " + std::to_string(layer) +
                                                             " out of [0, " + std::to_string(g_.num_layers) + ")");
    TRIATTN_EXPECTS(q != nullptr, "SnapKvScorer::observe: q is null");
    TRIATTN_EXPECTS(position >= 0, "SnapKvScorer::observe: position must be >= 0, got " + std::to_string(position));
    Window& w = windows_[seq];
    if (w.q.empty()) {
      w.q.resize(static_cast<std::size_t>(g_.num_layers) * params_.window * qsize());
      w.pos.resize(static_cast<std::size_t>(g_.num_layers) * params_.window);
      w.count.assign(static_cast<std::size_t>(g_.num_layers), 0);
      w.next.assign(static_cast<std::size_t>(g_.num_layers), 0);
    }
    const std::size_t l = static_cast<std::size_t>(layer);
    const std::size_t at = l * params_.window + static_cast<std::size_t>(w.next[l]);
    std::memcpy(w.q.data() + at * qsize(), q, qsize() * sizeof(float));
    w.pos[at] = position;
    w.next[l] = (w.next[l] + 1) % params_.window;
    w.count[l] = std::min(w.count[l] + 1, params_.window);
  }

  /// Drops every query observed for `seq` (no-op when there is none). Call it whenever the
  /// sequence is released, before its slot is reused.
  void forget(std::int32_t seq) noexcept { windows_.erase(seq); }

  /// Queries currently held for (seq, layer), at most `window`.
  [[nodiscard]] int num_observed(std::int32_t seq, int layer) const {
    TRIATTN_EXPECTS(layer >= 0 && layer < g_.num_layers, "SnapKvScorer::num_observed: layer " + std::to_string(layer) +
                                                             " out of [0, " + std::to_string(g_.num_layers) + ")");
    const auto it = windows_.find(seq);
    return it == windows_.end() ? 0 : it->second.count[static_cast<std::size_t>(layer)];
  }

  /// The window of `seq` in the CUDA launcher's input format (one sequence of
  /// cuda::SnapKvWindow), oldest first. Layers with fewer than `window` queries are padded with
  /// zero queries of position −1 (empty slots, which see nothing).
  /// @param q         [num_layers, window, num_q_heads, head_dim]
  /// @param positions [num_layers, window] logical positions
  /// @throws logic_error on wrong span sizes.
  void pack_window(std::int32_t seq, std::span<float> q, std::span<std::int64_t> positions) const {
    const std::size_t w = static_cast<std::size_t>(params_.window);
    TRIATTN_EXPECTS(q.size() == static_cast<std::size_t>(g_.num_layers) * w * qsize() &&
                        positions.size() == static_cast<std::size_t>(g_.num_layers) * w,
                    "SnapKvScorer::pack_window: q must hold L*window*Hq*d floats and positions L*window values");
    std::fill(q.begin(), q.end(), 0.0f);
    std::fill(positions.begin(), positions.end(), std::int64_t{-1});
    const auto it = windows_.find(seq);
    if (it == windows_.end()) return;
    for (int l = 0; l < g_.num_layers; ++l)
      for (int i = 0; i < it->second.count[static_cast<std::size_t>(l)]; ++i) {
        const std::size_t src = slot_of(it->second, l, i);
        const std::size_t dst = static_cast<std::size_t>(l) * w + static_cast<std::size_t>(i);
        std::memcpy(q.data() + dst * qsize(), it->second.q.data() + src * qsize(), qsize() * sizeof(float));
        positions[dst] = it->second.pos[src];
      }
  }

  /// Scores slots [0, length) of `seq` for round start t0 (its logical position).
  /// @param out [num_layers, num_q_heads, length]
  /// @throws logic_error when the cache geometry differs from the scorer's, out has the wrong
  ///         size, a layer of `seq` has no observed query, or a query's position is not below t0
  ///         (a stale window: see forget()).
  template <class T, class Id>
  void score(const KvCacheView<T, Id>& view, int seq, int length, std::int64_t t0, std::span<float> out) {
    check_cache_geometry(cache_geometry(view), cache_geometry(g_), "SnapKvScorer", "the scorer's");
    (void)detail::scorer_num_q_heads(out.size(), g_.num_layers, g_.num_kv_heads, length, g_.num_q_heads,
                                     "SnapKvScorer");
    if (length == 0) return;
    const auto it = windows_.find(seq);
    for (int l = 0; l < g_.num_layers; ++l)
      TRIATTN_EXPECTS(it != windows_.end() && it->second.count[static_cast<std::size_t>(l)] > 0,
                      "SnapKvScorer: no query observed for sequence " + std::to_string(seq) + ", layer " +
                          std::to_string(l) + " (call observe() for every layer of each new token)");
    const Window& win = it->second;
    const int d = g_.head_dim, hq = g_.num_q_heads, G = g_.group_size();
    const std::size_t n_tok = static_cast<std::size_t>(length);
    keys_.resize(n_tok * static_cast<std::size_t>(d));
    for (int l = 0; l < g_.num_layers; ++l) {
      const int n = win.count[static_cast<std::size_t>(l)];
      limits_.resize(static_cast<std::size_t>(n));
      for (int i = 0; i < n; ++i)
        limits_[i] = snapkv_visible_limit(length, t0, checked_position(win.pos[slot_of(win, l, i)], seq, t0));
      qbuf_.resize(static_cast<std::size_t>(n) * d);
      for (int g = 0; g < g_.num_kv_heads; ++g) {
        dequantize_rows(view, l, KvKind::kKey, seq, g, length, keys_.data());  // one (layer, KV head) row
        for (int h = g * G; h < (g + 1) * G; ++h) {
          for (int i = 0; i < n; ++i)
            std::memcpy(qbuf_.data() + static_cast<std::size_t>(i) * d,
                        win.q.data() + slot_of(win, l, i) * qsize() + static_cast<std::size_t>(h) * d, d * sizeof(float));
          baseline::snapkv_scores(qbuf_.data(), limits_.data(), n, keys_.data(), length, d, params_.pool_kernel,
                             out.data() + (static_cast<std::size_t>(l) * hq + h) * n_tok);
        }
      }
    }
  }

 private:
  struct Window {
    std::vector<float> q;            // [L, window, Hq, d] ring per layer
    std::vector<std::int64_t> pos;   // [L, window] logical positions
    std::vector<int> count;          // [L] queries held
    std::vector<int> next;           // [L] ring write index
  };

  [[nodiscard]] std::size_t qsize() const noexcept {
    return static_cast<std::size_t>(g_.num_q_heads) * static_cast<std::size_t>(g_.head_dim);
  }
  /// A window query belongs to a token already in the cache (position < t0). A later position
  /// means the window outlived its sequence: the slot was released and reused without forget().
  static std::int64_t checked_position(std::int64_t position, std::int32_t seq, std::int64_t t0) {
    TRIATTN_EXPECTS(position < t0, "SnapKvScorer: sequence " + std::to_string(seq) + " holds a query of position " +
                                       std::to_string(position) + " but only " + std::to_string(t0) +
                                       " tokens were processed; call forget(seq) when a sequence is released");
    return position;
  }
  /// Ring entry of the i-th oldest query of layer l.
  [[nodiscard]] std::size_t slot_of(const Window& w, int l, int i) const noexcept {
    const int n = w.count[static_cast<std::size_t>(l)];
    const int oldest = (w.next[static_cast<std::size_t>(l)] - n + params_.window) % params_.window;
    return static_cast<std::size_t>(l) * params_.window + static_cast<std::size_t>((oldest + i) % params_.window);
  }

  ModelGeometry g_;
  SnapKvParams params_;
  std::unordered_map<std::int32_t, Window> windows_;  // per sequence
  std::vector<float> keys_;   // [length, d] scratch
  std::vector<float> qbuf_;   // [n, d] scratch
  std::vector<int> limits_;   // [n] scratch
};

}  // namespace triattn
