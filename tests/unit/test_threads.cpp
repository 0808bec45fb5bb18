// Thread creation refused by the OS, through the spawn_thread seam (the same path a pids limit
// takes): pools stop what they started, the DRAM fault-in finishes on the calling thread, a
// runtime whose copy, transfer or storage engine thread is refused fails cleanly.
#include <catch2/catch.hpp>

#include <atomic>
#include <map>

#include "backends/memory/host_memory.h"
#include "common/spawn.h"
#include "runtime/optimizer/worker_pool.h"
#include "runtime/runtime.h"
#include "tests/support/scratch_dir.h"

using strata::Code;

namespace {

// Refuses exactly the spawn numbered `which` (1-based), for the test's scope; counts them all.
struct RefuseOne {
  explicit RefuseOne(int which) {
    strata::set_spawn_thread_fault([this, which] { return ++spawned == which; });
  }
  ~RefuseOne() { strata::set_spawn_thread_fault({}); }
  std::atomic<int> spawned{0};
};

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

// Every thread a runtime starts (the host backend's two copy queues, the NVMe tier's two
// transfer workers, the storage engine's threads, the DRAM fault-in), refused in turn. Those
// the runtime needs fail create with OUT_OF_MEMORY naming the thread and errno (they used to
// escape as std::system_error, INTERNAL at the ABI, or std::terminate for the POSIX pool); a
// fault-in thread's share is done by the caller. Each failure releases everything: the same
// NVMe file (locked while a runtime holds it) serves the next create.
TEST_CASE("every thread a runtime starts, refused in turn, is a clean OUT_OF_MEMORY", "[threads]") {
  strata_test::ScratchDir scratch;
  for (auto engine : {strata::IoEngineKind::kPosix, strata::IoEngineKind::kUring}) {
    INFO("engine " << static_cast<int>(engine));
    strata::RuntimeOptions o;
    o.device.kind = strata::DeviceKind::kHost;
    o.budgets = {16ull << 20, 16ull << 20, 16ull << 20};
    o.nvme.paths = {scratch.file("nvme")};
    o.nvme.engine = engine;
    o.nvme.block_size = 64 * 1024;
    o.nvme.queue_depth = 3;
    o.dram.threads = 2;
    int spawns = 0;
    {
      RefuseOne none(0);
      std::shared_ptr<strata::Runtime> rt;
      const strata::Status s = strata::Runtime::create(o, &rt);
      INFO(s.message());
      REQUIRE(s.is_ok());
      spawns = none.spawned;
    }
    // Threads the runtime cannot do without: 2 copy queues, 2 NVMe workers, and the engine's
    // (the POSIX pool: one per queue slot; io_uring: one completion thread).
    const int needed = 4 + (engine == strata::IoEngineKind::kPosix ? 3 : 1);
    REQUIRE(spawns > needed);  // and the fault-in threads of the DRAM arena and staging slots
    std::map<std::string, int> refused;
    for (int k = 1; k <= spawns; ++k) {
      INFO("spawn " << k << " of " << spawns << " refused");
      std::shared_ptr<strata::Runtime> rt;
      strata::Status s;
      {
        RefuseOne refuse(k);
        s = strata::Runtime::create(o, &rt);
      }
      if (s.is_ok()) continue;  // a fault-in thread: the caller faulted its share in
      INFO(s.message());
      REQUIRE(s.code() == strata::Code::kOutOfMemory);
      REQUIRE(rt == nullptr);
      REQUIRE_THAT(s.message(), Catch::Contains("errno 11"));
      const std::string m = s.message();
      const auto at = m.find("cannot start ");
      REQUIRE(at != std::string::npos);
      ++refused[m.substr(at, m.find(" thread:") - at)];
      // Nothing leaked a lock or a thread: the next runtime gets the same file.
      REQUIRE(strata::Runtime::create(o, &rt).is_ok());
    }
    std::map<std::string, int> expected = {{"cannot start a host backend copy", 2},
                                           {"cannot start an nvme write", 1},
                                           {"cannot start an nvme read", 1}};
    if (engine == strata::IoEngineKind::kPosix) {
      expected["cannot start a posix storage engine"] = 3;
    } else {
      expected["cannot start an io_uring completion"] = 1;
    }
    std::string seen;
    for (const auto& [what, n] : refused) seen += what + " x" + std::to_string(n) + "; ";
    INFO("refused: " << seen << " of " << spawns << " spawns");
    REQUIRE(refused == expected);
  }
}
