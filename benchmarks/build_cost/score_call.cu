// SPDX-License-Identifier: Apache-2.0
// Build-cost probe (benchmarks/build_cost.sh): a downstream translation unit that calls
// cuda::score on a bf16 cache, the kernels a scoring call site instantiates.
#include <triattn/cuda/algorithms/score.cuh>

namespace tc = triattn::cuda;

cudaError_t downstream_score(const triattn::KvCacheView<triattn::bf16_storage>& view, const tc::ScoreModelView& model,
                             const tc::ScoreBatch& batch, float* scores, cudaStream_t stream) {
  return tc::score(view, model, batch, scores, stream);
}
