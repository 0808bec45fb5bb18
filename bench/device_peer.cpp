#include "device_peer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#ifdef STRATA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata_bench {
namespace {
using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double seconds(Clock::time_point a) {
  return std::chrono::duration<double>(Clock::now() - a).count();
}

bool time_memcpy(void* host, void* device, void* host2, void* device2, uint64_t bytes, int reps,
                 CopyTimes* out) {
  std::vector<double> h2d, d2h, both;
  for (int r = 0; r < reps; ++r) {
    auto t = Clock::now();
    std::memcpy(device, host, bytes);
    h2d.push_back(seconds(t));
    t = Clock::now();
    std::memcpy(host, device, bytes);
    d2h.push_back(seconds(t));
    t = Clock::now();
    std::thread other([&] { std::memcpy(host2, device2, bytes); });
    std::memcpy(device, host, bytes);
    other.join();
    both.push_back(seconds(t));
  }
  *out = CopyTimes{median(h2d), median(d2h), median(both)};
  return true;
}
}  // namespace

#ifdef STRATA_WITH_CUDA
bool time_peer_copies(bool cuda, int ordinal, void* host, void* device, void* host2, void* device2,
                      uint64_t bytes, int reps, CopyTimes* out, std::string* error) {
  if (!cuda) return time_memcpy(host, device, host2, device2, bytes, reps, out);
  if (cudaSetDevice(ordinal) != cudaSuccess) {
    *error = "cudaSetDevice failed";
    return false;
  }
  cudaStream_t s1 = nullptr, s2 = nullptr;
  cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
  std::vector<double> h2d, d2h, both;
  bool ok = true;
  auto timed = [&](auto&& issue) {
    cudaDeviceSynchronize();
    const auto t = Clock::now();
    issue();
    if (cudaStreamSynchronize(s1) != cudaSuccess || cudaStreamSynchronize(s2) != cudaSuccess)
      ok = false;
    return seconds(t);
  };
  for (int r = 0; r < reps && ok; ++r) {
    h2d.push_back(timed([&] { cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, s1); }));
    d2h.push_back(timed([&] { cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, s1); }));
    both.push_back(timed([&] {
      cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, s1);
      cudaMemcpyAsync(host2, device2, bytes, cudaMemcpyDeviceToHost, s2);
    }));
  }
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
  if (!ok) {
    *error = cudaGetErrorString(cudaGetLastError());
    return false;
  }
  *out = CopyTimes{median(h2d), median(d2h), median(both)};
  return true;
}

double time_pageable_h2d(bool cuda, int ordinal, const void* host, void* device, uint64_t bytes,
                         int reps) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    if (cuda) {
      cudaSetDevice(ordinal);
      cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice);
    } else {
      std::memcpy(device, host, bytes);
    }
    t.push_back(seconds(start));
  }
  return median(t);
}

double time_cuda_host_alloc(int ordinal, uint64_t bytes) {
  if (cudaSetDevice(ordinal) != cudaSuccess) return -1;
  void* p = nullptr;
  const auto t = Clock::now();
  if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) return -1;
  const double s = seconds(t);
  cudaFreeHost(p);
  return s;
}
#else
bool time_peer_copies(bool /*cuda*/, int /*ordinal*/, void* host, void* device, void* host2,
                      void* device2, uint64_t bytes, int reps, CopyTimes* out,
                      std::string* /*error*/) {
  return time_memcpy(host, device, host2, device2, bytes, reps, out);
}
double time_cuda_host_alloc(int /*ordinal*/, uint64_t /*bytes*/) {
  return -1;
}
#endif

}  // namespace strata_bench
