// A CUDA program using triattn through its public API. On a GPU machine it runs the device path;
// without a GPU it checks what can be checked on the host and says so.
#include <triattn/triattn.cuh>

#include <cstdio>

int main() {
  triattn::CacheConfig cfg;
  cfg.model = {2, 4, 2, 128};
  cfg.block_size = 16;
  cfg.num_blocks = 8;
  cfg.max_seqs = 2;
  cfg.dtype = triattn::DType::kBF16;
  cfg.validate();
  const int hd = triattn::cuda::dispatch_head_dim(cfg.model.head_dim, [](auto h) { return decltype(h)::value; });
  const std::size_t elem = triattn::cuda::dispatch_dtype(cfg.dtype, [](auto t) {
    return sizeof(triattn::cuda::device_type_t<typename decltype(t)::type>);
  });
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  std::printf("consumer_cuda: head_dim %d, element bytes %zu, CUDA devices: %d (%s)\n", hd, elem,
              e == cudaSuccess ? devices : 0, e == cudaSuccess ? "ok" : cudaGetErrorName(e));
  return (hd == 128 && elem == 2) ? 0 : 1;
}
