// WorkerPool: a fixed set of threads, bound to one NUMA node's CPUs, that run a parallel-for.
// The optimizer's update is memory-bound: its threads belong next to the DRAM arena (the GPU's
// node), and a persistent pool avoids paying thread start-up on every layer.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace strata::optim {

class WorkerPool {
 public:
  // At most this many threads in a pool: far more than any host's cores, far fewer than a
  // hostile count (UINT32_MAX) that would exhaust the process's threads.
  static constexpr unsigned kMaxThreads = 4096;

  // `threads` (1..kMaxThreads; 0 means 1) in total: the caller of run() is one of them.
  // numa_node < 0: no binding. When a thread cannot be started (a pids limit), the ones already
  // running are stopped and joined and the status says why (kOutOfMemory, with the errno).
  static Status create(unsigned threads, int numa_node, std::unique_ptr<WorkerPool>* out);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  unsigned size() const { return static_cast<unsigned>(workers_.size()) + 1; }
  const std::string& binding() const { return binding_; }

  // Runs task(0) .. task(count - 1) on the pool and the calling thread; returns when all are
  // done. Tasks are claimed dynamically, so uneven ones balance. One run() at a time.
  void run(std::size_t count, const std::function<void(std::size_t)>& task);

  // CPUs of a NUMA node (all CPUs for node < 0 or when the topology is unknown).
  static unsigned cpus_of_node(int numa_node);

 private:
  WorkerPool() = default;
  void stop();
  void worker_main();
  void claim_tasks();

  std::vector<std::thread> workers_;
  std::string binding_;
  std::mutex mutex_;
  std::condition_variable start_cv_, done_cv_;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  const std::function<void(std::size_t)>* task_ = nullptr;
  std::size_t count_ = 0;
  std::size_t next_ = 0;      // next task to claim (under mutex_)
  std::size_t finished_ = 0;  // tasks done (under mutex_)
  unsigned busy_ = 0;         // workers inside the current run
};

}  // namespace strata::optim
