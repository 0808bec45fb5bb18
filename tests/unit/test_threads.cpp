// Thread creation refused by the OS, through the spawn_thread seam (the same path a pids limit
// takes): pools stop what they started, the DRAM fault-in finishes on the calling thread.
#include <catch2/catch.hpp>

#include <atomic>

#include "backends/memory/host_memory.h"
#include "backends/threads/spawn.h"
#include "runtime/optimizer/worker_pool.h"

using strata::Code;

namespace {

// Refuses every spawn after the first `allowed`, for the test's scope.
struct RefuseAfter {
  explicit RefuseAfter(int allowed) {
    strata::set_spawn_thread_fault([this, allowed] { return ++spawned > allowed; });
  }
  ~RefuseAfter() { strata::set_spawn_thread_fault({}); }
  std::atomic<int> spawned{0};
};

}  // namespace

TEST_CASE("a worker pool whose threads are refused stops those it started", "[threads]") {
  std::unique_ptr<strata::optim::WorkerPool> pool;
  strata::Status s;
  {
    RefuseAfter refuse(3);
    s = strata::optim::WorkerPool::create(8, -1, &pool);
  }
  INFO(s.message());
  REQUIRE(s.code() == Code::kOutOfMemory);
  REQUIRE(pool == nullptr);
  REQUIRE_THAT(s.message(), Catch::Contains("cannot start an optimizer worker thread") &&
                                Catch::Contains("errno 11") &&
                                Catch::Contains("4 of 8 threads started"));
  // Without the fault the same pool starts and runs.
  REQUIRE(strata::optim::WorkerPool::create(8, -1, &pool).is_ok());
  std::atomic<int> ran{0};
  pool->run(100, [&](std::size_t) { ++ran; });
  REQUIRE(ran == 100);
}

TEST_CASE("a worker pool of more threads than any host has is refused", "[threads]") {
  std::unique_ptr<strata::optim::WorkerPool> pool;
  const strata::Status s = strata::optim::WorkerPool::create(UINT32_MAX, -1, &pool);
  REQUIRE(s.code() == Code::kInvalidArgument);
  REQUIRE(pool == nullptr);
}

TEST_CASE("the DRAM fault-in finishes on the calling thread when threads are refused",
          "[threads]") {
  for (int allowed : {0, 2}) {
    RefuseAfter refuse(allowed);
    strata::HostMemoryOptions options;
    options.threads = 8;
    void* p = nullptr;
    strata::HostMemoryReport report;
    const uint64_t bytes = 8ull << 20;
    REQUIRE(strata::map_host_memory(bytes, options, &p, &report).is_ok());
    // The threads that started, and the caller that did the rest.
    REQUIRE(report.threads == static_cast<unsigned>(allowed) + 1);
    strata::unmap_host_memory(p, bytes);
  }
}
