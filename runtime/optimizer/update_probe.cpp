#include "runtime/optimizer/update_probe.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "common/clock.h"
#include "runtime/optimizer/kernels.h"
#include "runtime/optimizer/worker_pool.h"

namespace strata::optim {

namespace {
// Bytes an element of the probe's arrays takes: fp32 master, m and v, bf16 grad and weight.
constexpr uint64_t kElementBytes = 3 * sizeof(float) + 2 * sizeof(uint16_t);
constexpr std::size_t kChunk = 256u << 10;
// 64M elements (1 GiB of arrays): past any host's caches (a server's L3 can hold 256 MiB),
// so the rate is the memory's, as for a real layer; 16M measured 50% above the rate a
// streamed 8B's updates ran at on the H200 host. In the arena, as many as its free space holds
// (a model whose DRAM budget is that small has layers the caches hold too), at least 1M.
constexpr std::size_t kCount = 64u << 20, kLeastCount = 1u << 20;

// AdamW over `count` elements of `memory` (count * kElementBytes bytes) on a pool of `threads`.
Status measure_on(unsigned threads, int numa_node, unsigned char* memory, std::size_t count,
                  double* elements_per_second) {
  if (threads == 0) {
    const unsigned cpus = WorkerPool::cpus_of_node(numa_node);
    threads = cpus > 1 ? cpus - 1 : 1;
  }
  std::unique_ptr<WorkerPool> pool;
  STRATA_RETURN_IF_ERROR(WorkerPool::create(threads, numa_node, &pool));
  auto* master = reinterpret_cast<float*>(memory);
  float* m = master + count;
  float* v = m + count;
  auto* grad = reinterpret_cast<uint16_t*>(v + count);
  uint16_t* weight = grad + count;
  std::fill(master, master + count, 0.5f);
  std::fill(m, v + count, 0.f);
  std::fill(grad, grad + count, uint16_t{0x3c00});  // bf16 1/128
  std::fill(weight, weight + count, uint16_t{0});
  ParamArrays a;
  a.master = master;
  a.exp_avg = m;
  a.exp_avg_sq = v;
  a.grad = grad;
  a.grad_dtype = DType::kBF16;
  a.weight = weight;
  a.weight_dtype = DType::kBF16;
  a.count = count;
  AdamWScalars s;
  s.step_size = 1e-3f;
  s.lr_decay = 1e-5f;
  const KernelTable& k = kernels(best_isa());
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {  // the first after the fill is not counted either
    const auto start = std::chrono::steady_clock::now();
    pool->run(count / kChunk, [&](std::size_t c) { k.adamw(s, a, c * kChunk, (c + 1) * kChunk); });
    const double t = seconds_since(start);
    if (rep > 0 && t > 0) best = std::max(best, static_cast<double>(count) / t);
  }
  *elements_per_second = best;
  return Status::ok();
}

Status measure_on_heap(unsigned threads, int numa_node, std::size_t count, double* rate) {
  std::vector<unsigned char> memory(count * kElementBytes + alignof(float));
  return measure_on(threads, numa_node, memory.data(), count, rate);
}
}  // namespace

Status measure_update_rate(unsigned threads, int numa_node, double* elements_per_second) {
  return measure_on_heap(threads, numa_node, kCount, elements_per_second);
}

Status measure_update_rate(Runtime& runtime, double* elements_per_second) {
  const int node = runtime.device_numa_node();
  // Sized by the largest free block of the part the state lives in (Runtime::dram_parts_for:
  // the unpinned one when the arena is split), so that its arrays are allocated there and it
  // times the memory the state's updates run over, not the pinned room kept for the GPU's
  // blocks.
  const uint64_t free = runtime.dram_largest_free_for(Role::kOptimizerState);
  // Whole chunks, as many as the arena's largest free block holds, at most kCount.
  const std::size_t count = std::min<uint64_t>(kCount, free / kElementBytes / kChunk * kChunk);
  if (count < kLeastCount) return measure_on_heap(0, node, kLeastCount, elements_per_second);
  TensorSpec spec;
  spec.name = "strata.update_probe";
  spec.dtype = DType::kU8;
  spec.shape = {static_cast<int64_t>(count * kElementBytes)};
  // The optimizer's state's role: measured in the part of the arena the state lives in.
  spec.role = Role::kOptimizerState;
  spec.home = Tier::kDram;
  TensorId id = 0;
  Status s = runtime.register_tensor(spec, &id);
  if (!s.is_ok()) return measure_on_heap(0, node, kLeastCount, elements_per_second);
  TensorRecord r;
  s = runtime.info(id, &r);
  if (s.is_ok()) {
    s = measure_on(0, node, runtime.tier_base(Tier::kDram) + r.offset, count, elements_per_second);
  }
  (void)runtime.unregister(id);
  return s;
}

}  // namespace strata::optim
