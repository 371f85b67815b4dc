#include <triattn/core/stats/query_stats.hpp>
#include <triattn/core/stats/query_stats.hpp>  // twice: include guards work
#if defined(__CUDA_RUNTIME_H__) || defined(__CUDACC__) || defined(__CUDA_FP16_H__) || defined(CUB_VERSION)
#error "core header triattn/core/stats/query_stats.hpp pulled in CUDA"
#endif
int triattn_core_stats_query_stats_hpp_anchor = 0;
