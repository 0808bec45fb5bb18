// Host-side halves of busy_compute.h (the whole of it in builds without CUDA).
#include <chrono>
#include <thread>

#include "busy_compute.h"

#ifdef STRATA_WITH_CUDA
#include <cuda_runtime_api.h>
namespace strata_bench {
bool launch_busy_kernel(void* stream, uint64_t nanoseconds);  // busy_kernel.cu
}
#endif

namespace strata_bench {
namespace {
using Clock = std::chrono::steady_clock;
struct HostMarker {
  Clock::time_point at;
};
}  // namespace

bool busy_compute(bool cuda, void* stream, uint64_t nanoseconds) {
#ifdef STRATA_WITH_CUDA
  if (cuda) return launch_busy_kernel(stream, nanoseconds);
#endif
  (void)cuda;
  (void)stream;
  std::this_thread::sleep_for(std::chrono::nanoseconds(nanoseconds));
  return true;
}

bool timer_create(bool cuda, StreamTimer* t) {
#ifdef STRATA_WITH_CUDA
  if (cuda) {
    cudaEvent_t a = nullptr, b = nullptr;
    if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess) return false;
    t->start = a;
    t->end = b;
    return true;
  }
#endif
  (void)cuda;
  t->start = new HostMarker();
  t->end = new HostMarker();
  return true;
}

void timer_destroy(bool cuda, StreamTimer* t) {
#ifdef STRATA_WITH_CUDA
  if (cuda) {
    cudaEventDestroy(static_cast<cudaEvent_t>(t->start));
    cudaEventDestroy(static_cast<cudaEvent_t>(t->end));
    return;
  }
#endif
  (void)cuda;
  delete static_cast<HostMarker*>(t->start);
  delete static_cast<HostMarker*>(t->end);
}

void timer_mark(bool cuda, void* stream, void* marker) {
#ifdef STRATA_WITH_CUDA
  if (cuda) {
    cudaEventRecord(static_cast<cudaEvent_t>(marker), static_cast<cudaStream_t>(stream));
    return;
  }
#endif
  (void)cuda;
  (void)stream;
  static_cast<HostMarker*>(marker)->at = Clock::now();
}

double timer_seconds(bool cuda, const StreamTimer& t) {
#ifdef STRATA_WITH_CUDA
  if (cuda) {
    float ms = 0;
    cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(t.start), static_cast<cudaEvent_t>(t.end));
    return static_cast<double>(ms) * 1e-3;
  }
#endif
  (void)cuda;
  return std::chrono::duration<double>(static_cast<HostMarker*>(t.end)->at -
                                       static_cast<HostMarker*>(t.start)->at)
      .count();
}

void* stream_create(bool cuda) {
#ifdef STRATA_WITH_CUDA
  if (cuda) {
    cudaStream_t s = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    return s;
  }
#endif
  (void)cuda;
  return nullptr;
}

void stream_destroy(bool cuda, void* stream) {
#ifdef STRATA_WITH_CUDA
  if (cuda) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
#endif
  (void)cuda;
  (void)stream;
}

void stream_synchronize(bool cuda, void* stream) {
#ifdef STRATA_WITH_CUDA
  if (cuda) cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
#endif
  (void)cuda;
  (void)stream;
}

}  // namespace strata_bench
