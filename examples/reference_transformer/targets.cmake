# SPDX-License-Identifier: Apache-2.0
# The reference transformer's header-only model code as link targets, defined by the top-level
# CMakeLists.txt before tests/, benchmarks/ and fuzz/ so their targets can link them (also with
# TRIATTN_BUILD_EXAMPLES=OFF). Consumers include the headers as <reference_transformer/model.hpp>
# (and the fidelity harness as <fidelity/harness.hpp>): the include folder is examples/.

# Loader, tokenizer, Model<Backend>, CPU backend, sampler, generate loop: host-only.
add_library(triattn_example_model INTERFACE)
target_include_directories(triattn_example_model INTERFACE ${CMAKE_CURRENT_LIST_DIR}/..)
target_link_libraries(triattn_example_model INTERFACE triattn::core)

if(TRIATTN_ENABLE_CUDA)
  # The CUDA backend (cuda_backend.cuh, cuda_device_model.cuh, ...): also header-only; its link
  # needs triattn::cuda, cuBLAS for the matmuls of many rows (gemm_cublas.cuh; runtime only, no
  # libcuda) and the NVTX headers (decode steps named for a profiler). Every target that includes
  # cuda_backend.cuh links this.
  add_library(triattn_example_cuda INTERFACE)
  target_link_libraries(triattn_example_cuda INTERFACE triattn_example_model triattn::cuda
                        CUDA::cublas CUDA::cublasLt CUDA::nvtx3)
endif()
