#include "host_triad.h"

#include <sys/mman.h>

#include <functional>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

namespace strata_bench {
namespace {

// The widest vectors the CPU has (chosen at load time), as the optimizer's kernels use: a
// baseline-SSE triad understated one core's bandwidth by 1.5x on a Zen 4 host.
__attribute__((target_clones("avx512f", "avx2", "default"))) void triad_range(
    float* __restrict a, const float* __restrict b, const float* __restrict c, std::size_t lo,
    std::size_t hi) {
  for (std::size_t i = lo; i < hi; ++i) a[i] = b[i] + 3.0f * c[i];
}

}  // namespace

double triad_gbps(uint64_t bytes_per_array, unsigned threads, int reps) {
  const std::size_t n = bytes_per_array / sizeof(float);
  // One allocation, the arrays at different offsets within a page (STREAM's OFFSET): arrays at
  // equal page offsets collide in the caches and would understate the ceiling.
  constexpr std::size_t kSkew = 272;  // floats: 1088 bytes
  // Huge pages, as Strata's DRAM arena has them: with 4 KiB pages the triad measures TLB misses.
  const std::size_t bytes = (3 * (n + kSkew) + 64) * sizeof(float);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::runtime_error("triad: mmap failed");
  (void)madvise(mem, bytes, MADV_HUGEPAGE);
  std::unique_ptr<void, std::function<void(void*)>> storage(mem,
                                                            [bytes](void* p) { munmap(p, bytes); });
  float* const a = static_cast<float*>(mem);
  float* const b = a + n + kSkew;
  float* const c = b + n + kSkew;
  auto run = [&](auto&& body) {
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] { body(n * t / threads, n * (t + 1) / threads); });
    }
    for (auto& th : pool) th.join();
  };
  run([&](std::size_t lo, std::size_t hi) {  // first touch by the thread that uses the pages
    for (std::size_t i = lo; i < hi; ++i) {
      a[i] = 0.0f;
      b[i] = 1.0f;
      c[i] = 2.0f;
    }
  });
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    run([&](std::size_t lo, std::size_t hi) { triad_range(a, b, c, lo, hi); });
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, 3.0 * static_cast<double>(n * sizeof(float)) / s / 1e9);
  }
  if (a[n / 2] != 7.0f) throw std::runtime_error("triad computed a wrong value");
  return best;
}

}  // namespace strata_bench
