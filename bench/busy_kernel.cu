// The CUDA stand-in for compute: one thread spinning on the global timer keeps the stream busy
// for a set time, whatever the clocks do.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace strata_bench {
namespace {
__global__ void spin(unsigned long long nanoseconds) {
  unsigned long long start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= nanoseconds) break;
  }
}
}  // namespace

bool launch_busy_kernel(void* stream, uint64_t nanoseconds) {
  spin<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(nanoseconds);
  return cudaGetLastError() == cudaSuccess;
}

}  // namespace strata_bench
