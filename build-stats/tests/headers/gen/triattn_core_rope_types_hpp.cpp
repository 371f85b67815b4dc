#include <triattn/core/rope_types.hpp>
#include <triattn/core/rope_types.hpp>  // twice: include guards work
#if defined(__CUDA_RUNTIME_H__) || defined(__CUDACC__) || defined(__CUDA_FP16_H__) || defined(CUB_VERSION)
#error "core header triattn/core/rope_types.hpp pulled in CUDA"
#endif
int triattn_core_rope_types_hpp_anchor = 0;
