// The DRAM arena's set-up (backends/memory/host_memory.h, runtime/memory/memory_region.h):
// faulted in by threads in address order while one pinning call covers the whole mapping on a
// thread of its own; every byte usable and zero; a failed pin releases everything; a refused
// pinning thread pins after the fault-in, still once. Pinning goes through the device
// backend's pin_host, counted here by a backend that wraps the host backend.
#include <sched.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "backends/device/device_backend.h"
#include "backends/memory/host_memory.h"
#include "common/spawn.h"
#include "runtime/memory/memory_region.h"
#include "tests/support/counting_backend.h"

namespace {

struct PinCall {
  void* ptr;
  uint64_t bytes;
  std::thread::id thread;
};

// Records every pin; optionally fails it.
struct PinRecorder {
  std::mutex mutex;
  std::vector<PinCall> calls;
  strata::Status result = strata::Status::ok();
  strata::PinHostMemory function() {
    return [this](void* ptr, uint64_t bytes) {
      std::lock_guard lock(mutex);
      calls.push_back({ptr, bytes, std::this_thread::get_id()});
      return result;
    };
  }
};

// Every byte reads zero, then holds what is written to it.
void check_zero_and_usable(void* p, uint64_t bytes) {
  auto* b = static_cast<unsigned char*>(p);
  uint64_t nonzero = 0;
  for (uint64_t i = 0; i < bytes; ++i) nonzero += b[i] != 0;
  REQUIRE(nonzero == 0);
  for (uint64_t i = 0; i < bytes; ++i) b[i] = static_cast<unsigned char>(i * 131 + 7);
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < bytes; ++i) wrong += b[i] != static_cast<unsigned char>(i * 131 + 7);
  REQUIRE(wrong == 0);
}

// Refuses exactly the spawn numbered `which` (1-based), for the test's scope.
struct RefuseSpawn {
  explicit RefuseSpawn(int which) {
    strata::set_spawn_thread_fault([this, which] { return ++spawned == which; });
  }
  ~RefuseSpawn() { strata::set_spawn_thread_fault({}); }
  std::atomic<int> spawned{0};
};

}  // namespace

TEST_CASE("the DRAM arena is pinned once, whole, on its own thread while it is faulted in",
          "[host_memory]") {
  const uint64_t page = 4096;
  // Less than a chunk, chunks and a partial one, with fewer and more threads than chunks.
  for (uint64_t bytes : {64 * page, 3 * strata::kFaultChunkBytes + 5 * page}) {
    for (unsigned threads : {1u, 2u, 7u}) {
      INFO(bytes << " bytes, " << threads << " threads");
      PinRecorder pins;
      strata::HostMemoryOptions options;
      options.threads = threads;
      void* p = nullptr;
      strata::HostMemoryReport report;
      REQUIRE(strata::map_host_memory(bytes, options, &p, &report, pins.function()).is_ok());
      REQUIRE(pins.calls.size() == 1);
      REQUIRE(pins.calls[0].ptr == p);
      REQUIRE(pins.calls[0].bytes == bytes);
      REQUIRE(pins.calls[0].thread != std::this_thread::get_id());
      REQUIRE(report.pinned_concurrently);
      REQUIRE(report.threads == threads);
      REQUIRE(report.pin_seconds >= 0);
      REQUIRE(report.pin_call_seconds >= 0);
      check_zero_and_usable(p, bytes);
      strata::unmap_host_memory(p, bytes);
    }
  }
}

TEST_CASE("without a pin function nothing is pinned and the memory is faulted in, zero",
          "[host_memory]") {
  const uint64_t bytes = strata::kFaultChunkBytes + 4096;
  strata::HostMemoryOptions options;
  options.threads = 2;
  void* p = nullptr;
  strata::HostMemoryReport report;
  REQUIRE(strata::map_host_memory(bytes, options, &p, &report).is_ok());
  REQUIRE_FALSE(report.pinned_concurrently);
  REQUIRE(report.pin_seconds == 0);
  REQUIRE(report.pin_call_seconds == 0);
  check_zero_and_usable(p, bytes);
  strata::unmap_host_memory(p, bytes);
}

TEST_CASE("the default fault-in threads are the cores of the process's affinity", "[host_memory]") {
  // strata.h: dram_fault_threads 0 = one per core the calling process may run on (a rank
  // pinned to its share of a host starts that many, not the machine's).
  cpu_set_t before;
  CPU_ZERO(&before);
  REQUIRE(sched_getaffinity(0, sizeof(before), &before) == 0);
  cpu_set_t one;
  CPU_ZERO(&one);
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &before)) {
      CPU_SET(cpu, &one);
      break;
    }
  }
  REQUIRE(sched_setaffinity(0, sizeof(one), &one) == 0);
  const uint64_t bytes = 4 * strata::kFaultChunkBytes;
  strata::HostMemoryOptions options;  // threads = 0: the default
  void* p = nullptr;
  strata::HostMemoryReport report;
  const bool ok = strata::map_host_memory(bytes, options, &p, &report).is_ok();
  REQUIRE(sched_setaffinity(0, sizeof(before), &before) == 0);
  REQUIRE(ok);
  REQUIRE(report.threads == 1);
  strata::unmap_host_memory(p, bytes);
  // And with the whole affinity back, as many threads as its cores (up to the chunks).
  REQUIRE(strata::map_host_memory(bytes, options, &p, &report).is_ok());
  REQUIRE(report.threads == std::min<unsigned>(4, static_cast<unsigned>(CPU_COUNT(&before))));
  strata::unmap_host_memory(p, bytes);
}

TEST_CASE("a failed pin is the set-up's error and nothing is returned", "[host_memory]") {
  PinRecorder pins;
  pins.result = strata::error(strata::Code::kOutOfMemory, "registration refused");
  strata::HostMemoryOptions options;
  options.threads = 3;
  void* p = nullptr;
  strata::HostMemoryReport report;
  const strata::Status s =
      strata::map_host_memory(4 * strata::kFaultChunkBytes, options, &p, &report, pins.function());
  REQUIRE(s.code() == strata::Code::kOutOfMemory);
  REQUIRE_THAT(s.message(), Catch::Contains("registration refused"));
  REQUIRE(p == nullptr);
  REQUIRE(pins.calls.size() == 1);
}

TEST_CASE("a refused pinning thread pins after the fault-in, once, on the calling thread",
          "[host_memory]") {
  PinRecorder pins;
  strata::HostMemoryOptions options;
  options.threads = 2;
  void* p = nullptr;
  strata::HostMemoryReport report;
  const uint64_t bytes = 2 * strata::kFaultChunkBytes;
  {
    RefuseSpawn refuse(1);  // the pinning thread is the first spawned
    REQUIRE(strata::map_host_memory(bytes, options, &p, &report, pins.function()).is_ok());
  }
  REQUIRE_FALSE(report.pinned_concurrently);
  REQUIRE(report.threads == 2);
  REQUIRE(pins.calls.size() == 1);
  REQUIRE(pins.calls[0].ptr == p);
  REQUIRE(pins.calls[0].bytes == bytes);
  REQUIRE(pins.calls[0].thread == std::this_thread::get_id());
  REQUIRE(report.pin_seconds == Approx(report.pin_call_seconds).margin(0.05));
  check_zero_and_usable(p, bytes);
  strata::unmap_host_memory(p, bytes);
}

TEST_CASE("a DRAM memory region is pinned and unpinned once through its backend", "[host_memory]") {
  std::shared_ptr<strata::DeviceBackend> host;
  std::string reason;
  strata::DeviceOptions device;
  device.kind = strata::DeviceKind::kHost;
  REQUIRE(strata::create_device_backend(device, &host, &reason).is_ok());
  auto backend = std::make_shared<strata_test::CountingBackend>(host);
  const uint64_t bytes = 2 * strata::kFaultChunkBytes + 3 * 4096;
  void* base = nullptr;
  {
    std::shared_ptr<strata::MemoryRegion> region;
    strata::HostMemoryOptions options;
    options.threads = 3;
    REQUIRE(strata::MemoryRegion::allocate_host(backend, bytes, bytes, options, &region).is_ok());
    REQUIRE(region->pinned_bytes() == bytes);
    base = region->base();
    REQUIRE(backend->pins == std::vector<std::pair<void*, uint64_t>>{{base, bytes}});
    REQUIRE(backend->unpins.empty());
    REQUIRE(region->host_report().pinned_concurrently);
    REQUIRE(region->pin_seconds() == region->host_report().pin_seconds);
    check_zero_and_usable(region->base(), bytes);
  }
  REQUIRE(backend->pins.size() == 1);
  REQUIRE(backend->unpins == std::vector<std::pair<void*, uint64_t>>{{base, bytes}});
}

TEST_CASE("a DRAM memory region pins only its first part, faults in all of it, unpins that part",
          "[host_memory]") {
  std::shared_ptr<strata::DeviceBackend> host;
  std::string reason;
  strata::DeviceOptions device;
  device.kind = strata::DeviceKind::kHost;
  REQUIRE(strata::create_device_backend(device, &host, &reason).is_ok());
  auto backend = std::make_shared<strata_test::CountingBackend>(host);
  const uint64_t bytes = 3 * strata::kFaultChunkBytes;
  const uint64_t pinned = strata::kFaultChunkBytes + 5 * 4096;
  void* base = nullptr;
  {
    std::shared_ptr<strata::MemoryRegion> region;
    strata::HostMemoryOptions options;
    options.threads = 2;
    REQUIRE(strata::MemoryRegion::allocate_host(backend, bytes, pinned, options, &region).is_ok());
    base = region->base();
    REQUIRE(region->size() == bytes);
    REQUIRE(region->pinned_bytes() == pinned);
    REQUIRE(backend->pins == std::vector<std::pair<void*, uint64_t>>{{base, pinned}});
    check_zero_and_usable(region->base(), bytes);  // the unpinned rest is resident and zero
  }
  REQUIRE(backend->unpins == std::vector<std::pair<void*, uint64_t>>{{base, pinned}});
  std::shared_ptr<strata::MemoryRegion> region;
  strata::HostMemoryOptions options;
  REQUIRE(strata::MemoryRegion::allocate_host(backend, 4096, 8192, options, &region).code() ==
          strata::Code::kInternal);
}
