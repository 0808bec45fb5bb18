#include "runtime/optimizer/worker_pool.h"

#include <hwloc.h>

#include "common/spawn.h"

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

Status WorkerPool::create(unsigned threads, int numa_node, std::unique_ptr<WorkerPool>* out) {
  if (threads > kMaxThreads) {
    return error(Code::kInvalidArgument, "threads ", threads, " is over the limit of ",
                 kMaxThreads);
  }
  if (threads == 0) threads = 1;
  std::unique_ptr<WorkerPool> pool(new WorkerPool);
  Topology topo;
  hwloc_bitmap_t set = topo.t != nullptr ? node_cpuset(topo.t, numa_node) : nullptr;
  Status status;
  pool->workers_.reserve(threads - 1);
  for (unsigned i = 1; i < threads && status.is_ok(); ++i) {
    std::thread t;
    status = spawn_thread(
        "an optimizer worker", [p = pool.get()] { p->worker_main(); }, &t);
    if (!status.is_ok()) break;
    pool->workers_.push_back(std::move(t));
    if (set != nullptr) {
      // Bound to the node, not to single cores: the scheduler still balances within it.
      (void)hwloc_set_thread_cpubind(topo.t, pool->workers_.back().native_handle(), set, 0);
    }
  }
  pool->binding_ = set != nullptr ? "NUMA node " + std::to_string(numa_node) : "unbound";
  if (set != nullptr) hwloc_bitmap_free(set);
  if (!status.is_ok()) {
    // The started workers wait on start_cv_: stop and join them before the pool goes away.
    pool->stop();
    return error(status.code(), status.message(), " (", pool->workers_.size() + 1, " of ", threads,
                 " threads started; all stopped)");
  }
  *out = std::move(pool);
  return Status::ok();
}

WorkerPool::~WorkerPool() {
  stop();
}

void WorkerPool::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
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
