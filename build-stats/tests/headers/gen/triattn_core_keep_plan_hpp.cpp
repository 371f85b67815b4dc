#include <triattn/core/keep_plan.hpp>
#include <triattn/core/keep_plan.hpp>  // twice: include guards work
#if defined(__CUDA_RUNTIME_H__) || defined(__CUDACC__) || defined(__CUDA_FP16_H__) || defined(CUB_VERSION)
#error "core header triattn/core/keep_plan.hpp pulled in CUDA"
#endif
int triattn_core_keep_plan_hpp_anchor = 0;
