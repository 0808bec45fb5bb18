// For C ABI tests that run on the backend under test (STRATA_TEST_BACKEND) and touch the views
// the executor hands out: those are device memory on cuda, host memory on the host backend.
// The test's main() is run_on_backend_under_test(), which skips (77) where cuda is asked for
// but unavailable.
#pragma once

#include <cstdio>
#include <cstring>

#include "support/test_support.h"

#ifdef STRATA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata_test {

inline bool g_cuda = false;

// Whether `p` is device memory: decided by the pointer, not by the backend under test, since a
// test may also run a host-backend runtime beside it (a throttled link, say) whose views are
// plain host memory even when cuda is under test.
inline bool is_device_memory(const void* p) {
#ifdef STRATA_WITH_CUDA
  if (!g_cuda) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // an unknown pointer: host memory, and the error is not sticky
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
#else
  (void)p;
  return false;
#endif
}

inline void view_to_host(void* dst, const void* view, std::size_t n) {
#ifdef STRATA_WITH_CUDA
  if (g_cuda) REQUIRE(cudaDeviceSynchronize() == cudaSuccess);  // pinned views too
  if (is_device_memory(view)) {
    REQUIRE(cudaMemcpy(dst, view, n, cudaMemcpyDeviceToHost) == cudaSuccess);
    return;
  }
#endif
  std::memcpy(dst, view, n);
}

inline void host_to_view(void* view, const void* src, std::size_t n) {
#ifdef STRATA_WITH_CUDA
  if (g_cuda) REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  if (is_device_memory(view)) {
    REQUIRE(cudaMemcpy(view, src, n, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    return;
  }
#endif
  std::memcpy(view, src, n);
}

#ifdef CATCH_CONFIG_RUNNER  // the one file of a test program that defines main()
// Catch's session, after checking that the backend under test can start.
inline int run_on_backend_under_test(int argc, char** argv) {
  const strata_device_backend_t backend = backend_under_test();
  strata_runtime_config_t probe = config_for(backend, 1 << 20, 1 << 20);
  strata_runtime_t* r = nullptr;
  if (strata_runtime_create(&probe, &r) != STRATA_OK) {
    if (backend == STRATA_DEVICE_BACKEND_CUDA) {
      std::printf("SKIP: cuda backend unavailable: %s\n", strata_last_error_message());
      return 77;
    }
    std::fprintf(stderr, "cannot create a runtime: %s\n", strata_last_error_message());
    return 1;
  }
  strata_runtime_destroy(r);
  g_cuda = backend == STRATA_DEVICE_BACKEND_CUDA;
  return Catch::Session().run(argc, argv);
}
#endif

}  // namespace strata_test
