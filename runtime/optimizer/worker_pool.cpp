#include "runtime/optimizer/worker_pool.h"

#include <hwloc.h>

namespace strata::optim {
namespace {

// The node's cpuset, or null (no binding) when the node is unknown. Caller frees it.
hwloc_bitmap_t node_cpuset(hwloc_topology_t topology, int numa_node) {
  if (numa_node < 0) return nullptr;
  hwloc_obj_t node = hwloc_get_numanode_obj_by_os_index(topology, static_cast<unsigned>(numa_node));
  if (node == nullptr || node->cpuset == nullptr || hwloc_bitmap_iszero(node->cpuset)) {
    return nullptr;
  }
  return hwloc_bitmap_dup(node->cpuset);
}

struct Topology {
  hwloc_topology_t t = nullptr;
  Topology() {
    if (hwloc_topology_init(&t) != 0) {
      t = nullptr;
    } else if (hwloc_topology_load(t) != 0) {
      hwloc_topology_destroy(t);
      t = nullptr;
    }
  }
  ~Topology() {
    if (t != nullptr) hwloc_topology_destroy(t);
  }
};

}  // namespace

unsigned WorkerPool::cpus_of_node(int numa_node) {
  Topology topo;
  unsigned n = std::thread::hardware_concurrency();
  if (topo.t == nullptr) return n > 0 ? n : 1;
  hwloc_bitmap_t set = node_cpuset(topo.t, numa_node);
  if (set != nullptr) {
    const int w = hwloc_bitmap_weight(set);
    if (w > 0) n = static_cast<unsigned>(w);
    hwloc_bitmap_free(set);
  }
  return n > 0 ? n : 1;
}

WorkerPool::WorkerPool(unsigned threads, int numa_node) {
  if (threads == 0) threads = 1;
  Topology topo;
  hwloc_bitmap_t set = topo.t != nullptr ? node_cpuset(topo.t, numa_node) : nullptr;
  for (unsigned i = 1; i < threads; ++i) {
    workers_.emplace_back([this] { worker_main(); });
    if (set != nullptr) {
      // Bound to the node, not to single cores: the scheduler still balances within it.
      (void)hwloc_set_thread_cpubind(topo.t, workers_.back().native_handle(), set, 0);
    }
  }
  binding_ = set != nullptr ? "NUMA node " + std::to_string(numa_node) : "unbound";
  if (set != nullptr) hwloc_bitmap_free(set);
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void WorkerPool::claim_tasks() {
  std::unique_lock lock(mutex_);
  while (next_ < count_) {
    const std::size_t i = next_++;
    const auto* task = task_;
    lock.unlock();
    (*task)(i);
    lock.lock();
    ++finished_;
  }
}

void WorkerPool::worker_main() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      start_cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      ++busy_;
    }
    claim_tasks();
    {
      std::lock_guard lock(mutex_);
      --busy_;
    }
    done_cv_.notify_all();
  }
}

void WorkerPool::run(std::size_t count, const std::function<void(std::size_t)>& task) {
  if (count == 0) return;
  {
    std::lock_guard lock(mutex_);
    task_ = &task;
    count_ = count;
    next_ = 0;
    finished_ = 0;
    ++generation_;
  }
  start_cv_.notify_all();
  claim_tasks();
  std::unique_lock lock(mutex_);
  // Every task done, and no worker still inside this run (it may hold a pointer to `task`).
  done_cv_.wait(lock, [&] { return finished_ == count_ && busy_ == 0; });
  task_ = nullptr;
  count_ = 0;
}

}  // namespace strata::optim
