#include <triattn/triattn.hpp>
#include <triattn/triattn.hpp>  // twice: include guards work
#if defined(__CUDA_RUNTIME_H__) || defined(__CUDACC__) || defined(__CUDA_FP16_H__) || defined(CUB_VERSION)
#error "core header triattn/triattn.hpp pulled in CUDA"
#endif
int triattn_triattn_hpp_anchor = 0;
