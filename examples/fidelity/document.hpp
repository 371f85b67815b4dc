// SPDX-License-Identifier: Apache-2.0
// Long-document fidelity runs (examples/fidelity, the SmolLM2 tables of docs/fidelity.md): a real
// text is teacher-forced through the full-KV model and through every compressing cache in lock
// step, chunk by chunk, and each position's next-token distribution, true-token likelihood and
// attention are compared. Also the retrieval task: a fact planted in a document, asked about at
// the end, the compressed answer scored against the full-KV answer.
//
// Prompt setting: the whole document is fed as decode chunks (prompt length 0), so every token
// of it competes for the budget; rounds run whenever the trigger fires (length reaches budget +
// divide_length). Chunks are divide_length tokens and budgets are multiples of it, so the rounds
// fall exactly where token-by-token decoding would run them; the model's rows are independent of
// how many are computed together, so a chunk gives the logits that single steps would.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "harness.hpp"

namespace triattn_fidelity {

/// Negative log-likelihood (nats) of token `target` under `logits`, in float64.
[[nodiscard]] inline double token_nll(std::span<const float> logits, int target) {
  TRIATTN_EXPECTS(target >= 0 && static_cast<std::size_t>(target) < logits.size(), "token_nll: target outside the vocabulary");
  return -log_softmax(logits)[static_cast<std::size_t>(target)];
}

/// What the full-KV model produced for one chunk: per row its logits and attention [L, Hq, p + 1].
struct FullChunk {
  std::int64_t p0 = 0;
  int rows = 0;
  int vocab = 0;
  std::vector<float> logits;                  ///< [rows, vocab]
  std::vector<std::vector<float>> probs;      ///< [rows][L * Hq * (p0 + r + 1)] (empty when not recorded)
  [[nodiscard]] std::span<const float> row(int r) const {
    return {logits.data() + static_cast<std::size_t>(r) * vocab, static_cast<std::size_t>(vocab)};
  }
};

/// Per-position comparison of one compressed run against the full-KV run (positions after the
/// policy's first round only: before it the two caches are identical).
struct DocumentStats {
  std::vector<std::int64_t> pos;  ///< position of the row whose next token is predicted
  std::vector<double> kl;         ///< KL(full || compressed) of the next-token distribution
  std::vector<double> recall;     ///< attention recall of the full-KV query
  std::vector<double> nll;        ///< compressed model's NLL of the true next token (NaN at the document's end)
  std::vector<double> nll_full;   ///< full-KV NLL of the same token
  std::vector<char> top1;         ///< compressed argmax == full-KV argmax
  std::int64_t first_round_pos = -1;  ///< last position fed before the first round
  int rounds = 0;
  int max_kept = 0;
};

/// One compressing cache under evaluation (type-erased over its scorer).
class DocumentPolicy {
 public:
  virtual ~DocumentPolicy() = default;
  /// Opens a new sequence (the previous one, if any, is released).
  virtual void start() = 0;
  /// Feeds `tokens` at positions p0.. (teacher-forced); compares with `full` when given (its rows
  /// are the same positions) against the true next tokens `next` (-1: none); then runs a round
  /// if the trigger fires. Returns the last row's logits.
  virtual std::vector<float> feed(std::span<const int> tokens, std::int64_t p0, const FullChunk* full,
                                  std::span<const int> next) = 0;
  [[nodiscard]] virtual const DocumentStats& stats() const = 0;
  [[nodiscard]] virtual const std::string& name() const = 0;
  [[nodiscard]] virtual int budget() const = 0;
};

/// A cache without a selector never compresses: it runs the model in its own KV format (e.g. fp8
/// KV without eviction), compared row by row with the full-KV reference.
template <class ModelT, class Cache>
class DocumentPolicyImpl final : public DocumentPolicy {
 public:
  /// count_from < 0: rows are compared after the first round (before it the cache equals the
  /// reference's); otherwise every row at position >= count_from is (a cache whose KV format
  /// differs from the reference's differs from the first token on).
  DocumentPolicyImpl(ModelT& model, std::string name, int budget, std::unique_ptr<Cache> cache,
                     std::int64_t count_from = -1)
      : model_(model), name_(std::move(name)), budget_(budget), count_from_(count_from), cache_(std::move(cache)),
        rotator_(model.config()), held_(model.config().n_layers, model.config().n_kv_heads) {}
  ~DocumentPolicyImpl() override {
    if (seq_ >= 0) cache_->release(seq_);
  }

  void start() override {
    if (seq_ >= 0) cache_->release(seq_);
    seq_ = cache_->add_sequence();
    held_ = PositionTracker(model_.config().n_layers, model_.config().n_kv_heads);
    stats_ = DocumentStats{};
  }

  std::vector<float> feed(std::span<const int> tokens, std::int64_t p0, const FullChunk* full,
                          std::span<const int> next) override {
    TRIATTN_EXPECTS(seq_ >= 0, "DocumentPolicy::feed: start() first");
    const ex::ModelConfig& mc = model_.config();
    const int n = static_cast<int>(tokens.size());
    TRIATTN_EXPECTS(full == nullptr || (full->p0 == p0 && full->rows == n), "DocumentPolicy::feed: full chunk of another span");
    if constexpr (requires(Cache& c, const float* q) { c.scorer().observe(triattn::SeqId{}, 0, q, std::int64_t{0}); }) {
      model_.set_query_observer([&](int layer, const float* q, int rows) {
        const std::size_t qs = static_cast<std::size_t>(mc.n_heads) * mc.head_dim;
        qbuf_.assign(q, q + static_cast<std::size_t>(rows) * qs);
        rotator_.rotate(qbuf_.data(), rows, p0);
        for (int r = 0; r < rows; ++r)
          cache_->scorer().observe(seq_, layer, qbuf_.data() + static_cast<std::size_t>(r) * qs, p0 + r);
      });
    }
    ex::Chunk ch{seq_, tokens, triattn::Phase::kDecode};
    const ex::StepOutput out = model_.step(*cache_, std::span<const ex::Chunk>(&ch, 1), ex::LogitsFor::kAllRows);
    model_.set_query_observer({});
    held_.append(p0, n);
    if (full != nullptr && (count_from_ >= 0 || stats_.rounds > 0)) {
      for (int r = 0; r < n; ++r) {
        if (count_from_ >= 0 && p0 + r < count_from_) continue;
        const std::span<const float> mine = out.row(r), ref = full->row(r);
        stats_.pos.push_back(p0 + r);
        stats_.kl.push_back(kl_divergence(ref, mine));
        stats_.top1.push_back(ex::Sampler::argmax(mine) == ex::Sampler::argmax(ref) ? 1 : 0);
        const int target = next[static_cast<std::size_t>(r)];
        stats_.nll.push_back(target >= 0 ? token_nll(mine, target) : std::nan(""));
        stats_.nll_full.push_back(target >= 0 ? token_nll(ref, target) : std::nan(""));
        const std::vector<float>& pr = full->probs[static_cast<std::size_t>(r)];
        stats_.recall.push_back(pr.empty() ? std::nan("")
                                           : attention_recall(pr, mc.n_heads, static_cast<int>(p0 + r + 1), held_, true));
      }
    }
    if constexpr (!std::is_same_v<typename Cache::selector_type, triattn::NoSelector>) {
      if (cache_->needs_compression(seq_)) {
        const triattn::KeepPlan plan = compress_round(*cache_, seq_, scores_);
        held_.apply(plan);
        TRIATTN_EXPECTS(held_.length() == cache_->physical_length(seq_), "DocumentPolicy: position tracker out of step");
        stats_.max_kept = std::max(stats_.max_kept, cache_->physical_length(seq_));
        if (stats_.rounds++ == 0) stats_.first_round_pos = p0 + n - 1;
      }
    }
    const std::span<const float> last = out.row(n - 1);
    return {last.begin(), last.end()};
  }

  [[nodiscard]] const DocumentStats& stats() const override { return stats_; }
  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] int budget() const override { return budget_; }

 private:
  ModelT& model_;
  std::string name_;
  int budget_;
  std::int64_t count_from_;
  std::unique_ptr<Cache> cache_;
  QueryRotator rotator_;
  PositionTracker held_;
  triattn::SeqId seq_ = -1;
  DocumentStats stats_;
  std::vector<float> scores_, qbuf_;
};

/// The full-KV side of a lock-step run: one uncompressed cache (float32 unless `kv` says
/// otherwise), attention recorded per chunk.
template <class ModelT>
class FullDocument {
 public:
  FullDocument(ModelT& model, int max_tokens, const KvFormat& kv = {})
      : model_(model), cache_(cache_config(model.config(), 1, max_tokens, 16, kv)) {}
  void start() {
    if (seq_ >= 0) cache_.release(seq_);
    seq_ = cache_.add_sequence();
  }
  /// Feeds `tokens` at positions p0..; fills `out` (attention only when record_attention).
  void feed(std::span<const int> tokens, std::int64_t p0, bool record_attention, FullChunk& out) {
    const ex::ModelConfig& mc = model_.config();
    const int n = static_cast<int>(tokens.size());
    TRIATTN_EXPECTS(cache_.logical_position(seq_) == p0, "FullDocument::feed: chunk out of order");
    out.p0 = p0;
    out.rows = n;
    out.probs.resize(static_cast<std::size_t>(record_attention ? n : 0));  // rows keep their capacity
    for (int r = 0; r < static_cast<int>(out.probs.size()); ++r)
      out.probs[static_cast<std::size_t>(r)].assign(static_cast<std::size_t>(mc.n_layers) * mc.n_heads *
                                                        static_cast<std::size_t>(p0 + r + 1),
                                                    0.0f);
    if (record_attention)
      model_.set_attention_observer([&](int layer, int row, triattn::SeqId, int h, std::span<const float> p) {
        const std::size_t T = static_cast<std::size_t>(p0 + row + 1);
        TRIATTN_EXPECTS(p.size() == T, "FullDocument: attention row of unexpected length");
        std::copy(p.begin(), p.end(),
                  out.probs[static_cast<std::size_t>(row)].begin() +
                      static_cast<std::ptrdiff_t>((static_cast<std::size_t>(layer) * mc.n_heads + h) * T));
      });
    ex::Chunk ch{seq_, tokens, triattn::Phase::kDecode};
    ex::StepOutput o = model_.step(cache_, std::span<const ex::Chunk>(&ch, 1), ex::LogitsFor::kAllRows);
    model_.set_attention_observer({});
    out.vocab = o.vocab;
    out.logits = std::move(o.logits);
  }
  /// Largest |K| and |V| per layer over the tokens fed so far ([num_layers, 2], kv_abs_max).
  [[nodiscard]] std::vector<float> kv_abs_max() const { return triattn_fidelity::kv_abs_max(cache_, seq_); }

 private:
  ModelT& model_;
  PlainCache cache_;
  triattn::SeqId seq_ = -1;
};

/// Runs fn(i) for i in [0, n) on `threads` threads (i mod threads on thread i mod threads);
/// rethrows the first exception.
inline void parallel_for(int n, int threads, const std::function<void(int worker, int i)>& fn) {
  threads = std::max(1, std::min(threads, n));
  if (threads == 1) {
    for (int i = 0; i < n; ++i) fn(0, i);
    return;
  }
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(threads));
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w)
    pool.emplace_back([&, w] {
      try {
        for (int i = w; i < n; i += threads) fn(w, i);
      } catch (...) {
        errors[static_cast<std::size_t>(w)] = std::current_exception();
      }
    });
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

/// Teacher-forces `doc` through `full` and every policy in lock step, `chunk` tokens at a time.
/// policies[w] belong to worker thread w % threads (each worker's policies share one model, so a
/// policy must be built on the model of the worker that runs it: worker i % threads).
/// progress(pos) is called after every chunk.
template <class ModelT>
void run_document(FullDocument<ModelT>& full, std::span<const std::unique_ptr<DocumentPolicy>> policies, int threads,
                  std::span<const int> doc, int chunk, bool record_attention,
                  const std::function<void(std::int64_t)>& progress = {}) {
  TRIATTN_EXPECTS(chunk >= 1 && !doc.empty(), "run_document: need a document and chunk >= 1");
  full.start();
  for (const auto& p : policies) p->start();
  FullChunk fc;
  std::vector<int> next;
  for (std::size_t p0 = 0; p0 < doc.size(); p0 += static_cast<std::size_t>(chunk)) {
    const std::size_t n = std::min(static_cast<std::size_t>(chunk), doc.size() - p0);
    const std::span<const int> tokens = doc.subspan(p0, n);
    next.assign(n, -1);
    for (std::size_t r = 0; r < n; ++r)
      if (p0 + r + 1 < doc.size()) next[r] = doc[p0 + r + 1];
    full.feed(tokens, static_cast<std::int64_t>(p0), record_attention, fc);
    parallel_for(static_cast<int>(policies.size()), threads, [&](int, int i) {
      policies[static_cast<std::size_t>(i)]->feed(tokens, static_cast<std::int64_t>(p0), &fc, next);
    });
    if (progress) progress(static_cast<std::int64_t>(p0 + n));
  }
}

/// The retrieval task's answer for one cache: feed `context` (chunked, rounds as they fire), then
/// generate `answer_len` tokens greedily one at a time (rounds as they fire).
template <class Feed>
std::vector<int> answer_greedy(std::span<const int> context, int chunk, int answer_len, Feed&& feed) {
  std::vector<float> last;
  for (std::size_t p0 = 0; p0 < context.size(); p0 += static_cast<std::size_t>(chunk)) {
    const std::size_t n = std::min(static_cast<std::size_t>(chunk), context.size() - p0);
    last = feed(context.subspan(p0, n), static_cast<std::int64_t>(p0));
  }
  std::vector<int> answer;
  std::int64_t pos = static_cast<std::int64_t>(context.size());
  for (int i = 0; i < answer_len; ++i) {
    answer.push_back(ex::Sampler::argmax(last));
    if (i + 1 < answer_len) last = feed(std::span<const int>(&answer.back(), 1), pos++);
  }
  return answer;
}

}  // namespace triattn_fidelity
