// SPDX-License-Identifier: Apache-2.0
// Build-cost probe (benchmarks/build_cost.sh): a downstream translation unit that runs a whole
// compression round (score, normalise, select, compact) on a bf16 cache.
#include <triattn/cuda/algorithms/compression_round.cuh>

namespace tc = triattn::cuda;

cudaError_t downstream_round(const triattn::KvCacheView<triattn::bf16_storage>& view, const tc::ScoreModelView& model,
                             const triattn::SelectionParams& params, const tc::RoundBatch& batch,
                             const tc::DeviceKeepPlanView& plan, void* workspace, std::size_t workspace_bytes,
                             cudaStream_t stream) {
  return tc::compression_round::run(view, model, params, batch, plan, workspace, workspace_bytes, stream);
}
