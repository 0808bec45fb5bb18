#include "runtime/optimizer/update_probe.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "common/clock.h"
#include "runtime/optimizer/kernels.h"
#include "runtime/optimizer/worker_pool.h"

namespace strata::optim {

Status measure_update_rate(unsigned threads, int numa_node, double* elements_per_second) {
  if (threads == 0) {
    const unsigned cpus = WorkerPool::cpus_of_node(numa_node);
    threads = cpus > 1 ? cpus - 1 : 1;
  }
  std::unique_ptr<WorkerPool> pool;
  STRATA_RETURN_IF_ERROR(WorkerPool::create(threads, numa_node, &pool));
  // 64M elements (1 GiB of arrays): past any host's caches (a server's L3 can hold 256 MiB),
  // so the rate is the memory's, as for a real layer; 16M measured 50% above the rate a
  // streamed 8B's updates ran at on the H200 host.
  constexpr std::size_t kCount = 64u << 20, kChunk = 256u << 10;
  std::vector<float> master(kCount, 0.5f), m(kCount, 0.f), v(kCount, 0.f);
  std::vector<uint16_t> grad(kCount, 0x3c00), weight(kCount, 0);  // bf16 1/128 and 0
  ParamArrays a;
  a.master = master.data();
  a.exp_avg = m.data();
  a.exp_avg_sq = v.data();
  a.grad = grad.data();
  a.grad_dtype = DType::kBF16;
  a.weight = weight.data();
  a.weight_dtype = DType::kBF16;
  a.count = kCount;
  AdamWScalars s;
  s.step_size = 1e-3f;
  s.lr_decay = 1e-5f;
  const KernelTable& k = kernels(best_isa());
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {  // the first touches the pages
    const auto start = std::chrono::steady_clock::now();
    pool->run(kCount / kChunk, [&](std::size_t c) { k.adamw(s, a, c * kChunk, (c + 1) * kChunk); });
    const double t = seconds_since(start);
    if (rep > 0 && t > 0) best = std::max(best, static_cast<double>(kCount) / t);
  }
  *elements_per_second = best;
  return Status::ok();
}

}  // namespace strata::optim
