#include <triattn/core/config.hpp>
#include <triattn/core/config.hpp>  // twice: include guards work
#if defined(__CUDA_RUNTIME_H__) || defined(__CUDACC__) || defined(__CUDA_FP16_H__) || defined(CUB_VERSION)
#error "core header triattn/core/config.hpp pulled in CUDA"
#endif
int triattn_core_config_hpp_anchor = 0;
