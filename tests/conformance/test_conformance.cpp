// Backend conformance suite: the same tests for every device backend. The backend comes from
// STRATA_TEST_BACKEND (host, cuda); ctest registers one run per backend, and the cuda run exits
// 77 (skipped) on a machine without a usable GPU.
#define CATCH_CONFIG_RUNNER
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "support/test_support.h"

using namespace strata_test;

namespace {

constexpr uint64_t kMiB = 1ull << 20;
const strata_tier_t kTiers[] = {STRATA_TIER_HBM, STRATA_TIER_DRAM, STRATA_TIER_NVME};
const strata_tier_t kAddressableTiers[] = {STRATA_TIER_HBM, STRATA_TIER_DRAM};

// Every runtime under test has all three tiers; NVMe striped over two files.
ScratchDir* scratch = nullptr;

RuntimePtr runtime_under_test(uint64_t hbm = 256 * kMiB, uint64_t dram = 256 * kMiB,
                              uint64_t nvme = 256 * kMiB) {
  static int serial = 0;
  const std::string a = scratch->file("nvme" + std::to_string(serial) + "a");
  const std::string b = scratch->file("nvme" + std::to_string(serial++) + "b");
  const char* paths[2] = {a.c_str(), b.c_str()};
  strata_runtime_config_t c = config_for(backend_under_test(), hbm, dram);
  c.nvme_paths = paths;
  c.nvme_path_count = 2;
  c.nvme_budget_bytes = nvme;
  c.io_engine = io_engine_under_test();
  c.io_queue_depth = 8;
  c.nvme_checksums = 1;
  return make_runtime(c);
}

void wait_ok(strata_event_t* e) {
  STRATA_REQUIRE_OK(strata_event_wait(e, 60000));
}

void move_and_wait(strata_runtime_t* r, strata_tensor_t* t, strata_tier_t dst) {
  strata_event_t* e = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_move(r, t, dst, nullptr, &e));
  EventPtr owner(e);
  wait_ok(e);
  strata_tier_t now = -1;
  STRATA_REQUIRE_OK(strata_tensor_tier(r, t, &now));
  REQUIRE(now == dst);
}

std::vector<unsigned char> read_all(strata_runtime_t* r, strata_tensor_t* t, std::size_t n) {
  std::vector<unsigned char> out(n, 0xA5);
  STRATA_REQUIRE_OK(strata_tensor_read(r, t, 0, out.data(), n));
  return out;
}

}  // namespace

TEST_CASE("round trips of random bytes through every pair of tiers", "[conformance]") {
  RuntimePtr rt = runtime_under_test();
  const uint64_t sizes[] = {1, 7, 255, 256, 257, 4096, 65537, kMiB + 3, 4 * kMiB, 9 * kMiB + 1};
  uint64_t seed = 1;
  for (strata_tier_t src : kTiers) {
    for (strata_tier_t dst : kTiers) {
      for (uint64_t size : sizes) {
        const std::string name = std::string("t.") + strata_tier_name(src) + "." +
                                 strata_tier_name(dst) + "." + std::to_string(size);
        INFO(name);
        strata_tensor_t* t = register_bytes(rt.get(), name, size, src);
        const auto data = random_bytes(size, seed++);
        STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), t, 0, data.data(), size));
        move_and_wait(rt.get(), t, dst);
        REQUIRE(read_all(rt.get(), t, size) == data);
        move_and_wait(rt.get(), t, src);
        REQUIRE(read_all(rt.get(), t, size) == data);
        STRATA_REQUIRE_OK(strata_tensor_unregister(rt.get(), t));
      }
    }
  }
  // Everything freed: the arenas are whole again.
  for (strata_tier_t tier : kTiers) {
    strata_tier_usage_t u{};
    u.struct_size = STRATA_TIER_USAGE_STRUCT_SIZE;
    STRATA_REQUIRE_OK(strata_runtime_tier_usage(rt.get(), tier, &u));
    REQUIRE(u.used_bytes == 0);
    REQUIRE(u.tensor_count == 0);
    REQUIRE(u.largest_free_bytes == u.budget_bytes);
  }
}

TEST_CASE("partial reads and writes at offsets", "[conformance]") {
  RuntimePtr rt = runtime_under_test();
  for (strata_tier_t tier : kTiers) {
    INFO(strata_tier_name(tier));
    const std::string name = std::string("partial.") + strata_tier_name(tier);
    const uint64_t size = 3 * kMiB + 11;
    strata_tensor_t* t = register_bytes(rt.get(), name, size, tier);
    auto data = random_bytes(size, 42);
    STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), t, 0, data.data(), size));
    const auto patch = random_bytes(1000, 43);
    STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), t, kMiB + 1, patch.data(), patch.size()));
    std::copy(patch.begin(), patch.end(), data.begin() + kMiB + 1);
    std::vector<unsigned char> middle(5000);
    STRATA_REQUIRE_OK(strata_tensor_read(rt.get(), t, kMiB - 2000, middle.data(), middle.size()));
    REQUIRE(std::equal(middle.begin(), middle.end(), data.begin() + kMiB - 2000));
    REQUIRE(read_all(rt.get(), t, size) == data);
  }
}

TEST_CASE("concurrent migrations from many threads keep every byte", "[conformance]") {
  RuntimePtr rt = runtime_under_test();
  constexpr int kThreads = 6;
  constexpr int kTensorsPerThread = 4;
  constexpr int kRounds = 8;  // HBM, DRAM, NVMe, ...: the last round (7) ends in DRAM
  std::atomic<int> failures{0};
  std::mutex first_error_mutex;
  std::string first_error;
  auto failed = [&](const std::string& what) {
    std::lock_guard lock(first_error_mutex);
    if (first_error.empty()) first_error = what + ": " + strata_last_error_message();
    ++failures;
  };
  std::vector<std::thread> threads;
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      std::vector<strata_tensor_t*> tensors;
      std::vector<std::vector<unsigned char>> data;
      for (int i = 0; i < kTensorsPerThread; ++i) {
        const uint64_t size =
            (1 + (th * 7 + i * 3) % 5) * kMiB + static_cast<uint64_t>(th * 13 + i);
        const int64_t shape[1] = {static_cast<int64_t>(size)};
        const std::string name = "c." + std::to_string(th) + "." + std::to_string(i);
        const strata_tensor_desc_t d = desc(name.c_str(), shape, 1, STRATA_TIER_DRAM);
        strata_tensor_t* t = nullptr;
        if (strata_tensor_register(rt.get(), &d, &t) != STRATA_OK) {
          failed("register");
          return;
        }
        data.push_back(random_bytes(size, 1000 + th * 10 + i));
        if (strata_tensor_write(rt.get(), t, 0, data.back().data(), size) != STRATA_OK)
          failed("write");
        tensors.push_back(t);
      }
      for (int round = 0; round < kRounds; ++round) {
        const strata_tier_t dst = kTiers[round % 3];
        std::vector<strata_event_t*> events;
        for (auto* t : tensors) {  // all of this thread's moves in flight at once
          strata_event_t* e = nullptr;
          if (strata_tensor_move(rt.get(), t, dst, nullptr, &e) != STRATA_OK) {
            failed("move");
            continue;
          }
          events.push_back(e);
        }
        for (auto* e : events) {
          if (strata_event_wait(e, 60000) != STRATA_OK) failed("wait");
          strata_event_destroy(e);
        }
      }
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        std::vector<unsigned char> back(data[i].size());
        if (strata_tensor_read(rt.get(), tensors[i], 0, back.data(), back.size()) != STRATA_OK ||
            back != data[i]) {
          failed("read back");
        }
        strata_tier_t tier = -1;
        if (strata_tensor_tier(rt.get(), tensors[i], &tier) != STRATA_OK ||
            tier != STRATA_TIER_DRAM)
          failed("final tier");
      }
    });
  }
  for (auto& t : threads) t.join();
  INFO(first_error);
  REQUIRE(failures.load() == 0);
}

TEST_CASE("events: query, wait, stream wait, many waiters, destroy before completion",
          "[conformance]") {
  RuntimePtr rt = runtime_under_test();
  const uint64_t size = 32 * kMiB;
  strata_tensor_t* t = register_bytes(rt.get(), "ev", size, STRATA_TIER_DRAM);
  const auto data = random_bytes(size, 9);
  STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), t, 0, data.data(), size));

  strata_event_t* e = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_move(rt.get(), t, STRATA_TIER_HBM, nullptr, &e));
  EventPtr owner(e);
  const strata_status_t q = strata_event_query(e);
  REQUIRE((q == STRATA_OK || q == STRATA_ERROR_NOT_READY));
  std::vector<std::thread> waiters;
  std::atomic<int> ok{0};
  for (int i = 0; i < 4; ++i) {
    waiters.emplace_back([&] { ok += strata_event_wait(e, -1) == STRATA_OK ? 1 : 0; });
  }
  for (auto& w : waiters) w.join();
  REQUIRE(ok == 4);
  STRATA_REQUIRE_OK(strata_event_query(e));
  STRATA_REQUIRE_OK(strata_event_stream_wait(e, nullptr));  // already complete: immediate

  // A second move whose event is dropped at once: the move still completes.
  strata_event_t* dropped = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_move(rt.get(), t, STRATA_TIER_DRAM, nullptr, &dropped));
  STRATA_REQUIRE_OK(strata_event_destroy(dropped));
  STRATA_REQUIRE_OK(strata_runtime_synchronize(rt.get()));
  strata_tier_t tier = -1;
  STRATA_REQUIRE_OK(strata_tensor_tier(rt.get(), t, &tier));
  REQUIRE(tier == STRATA_TIER_DRAM);
  REQUIRE(read_all(rt.get(), t, size) == data);

  // Moving to the tier it is in completes at once.
  strata_event_t* same = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_move(rt.get(), t, STRATA_TIER_DRAM, nullptr, &same));
  EventPtr same_owner(same);
  STRATA_REQUIRE_OK(strata_event_query(same));

  // Fire and forget (no event requested).
  STRATA_REQUIRE_OK(strata_tensor_move(rt.get(), t, STRATA_TIER_HBM, nullptr, nullptr));
  STRATA_REQUIRE_OK(strata_runtime_synchronize(rt.get()));
  REQUIRE(read_all(rt.get(), t, size) == data);
}

TEST_CASE("link statistics count every completed byte", "[conformance]") {
  RuntimePtr rt = runtime_under_test();
  STRATA_REQUIRE_OK(strata_runtime_reset_stats(rt.get()));
  const uint64_t size = 8 * kMiB;
  strata_tensor_t* t = register_bytes(rt.get(), "stats", size, STRATA_TIER_DRAM);
  for (int i = 0; i < 3; ++i) {
    move_and_wait(rt.get(), t, STRATA_TIER_HBM);
    move_and_wait(rt.get(), t, STRATA_TIER_DRAM);
  }
  for (strata_link_t link : {STRATA_LINK_H2D, STRATA_LINK_D2H}) {
    strata_link_stats_t s{};
    s.struct_size = STRATA_LINK_STATS_STRUCT_SIZE;
    STRATA_REQUIRE_OK(strata_runtime_link_stats(rt.get(), link, &s));
    REQUIRE(s.bytes == 3 * size);
    REQUIRE(s.transfers == 3);
    REQUIRE(s.busy_ns > 0);
  }
  for (strata_link_t link : {STRATA_LINK_NVME_READ, STRATA_LINK_NVME_WRITE}) {
    strata_link_stats_t s{};
    s.struct_size = STRATA_LINK_STATS_STRUCT_SIZE;
    STRATA_REQUIRE_OK(strata_runtime_link_stats(rt.get(), link, &s));
    REQUIRE(s.bytes == 0);
  }
  // Through NVMe: DRAM -> NVMe -> HBM -> NVMe -> DRAM, each leg counted on its links.
  move_and_wait(rt.get(), t, STRATA_TIER_NVME);
  move_and_wait(rt.get(), t, STRATA_TIER_HBM);
  move_and_wait(rt.get(), t, STRATA_TIER_NVME);
  move_and_wait(rt.get(), t, STRATA_TIER_DRAM);
  strata_link_stats_t w{}, r{}, h2d{}, d2h{};
  for (auto* s : {&w, &r, &h2d, &d2h}) s->struct_size = STRATA_LINK_STATS_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_link_stats(rt.get(), STRATA_LINK_NVME_WRITE, &w));
  STRATA_REQUIRE_OK(strata_runtime_link_stats(rt.get(), STRATA_LINK_NVME_READ, &r));
  STRATA_REQUIRE_OK(strata_runtime_link_stats(rt.get(), STRATA_LINK_H2D, &h2d));
  STRATA_REQUIRE_OK(strata_runtime_link_stats(rt.get(), STRATA_LINK_D2H, &d2h));
  REQUIRE(w.bytes == 2 * size);
  REQUIRE(r.bytes == 2 * size);
  REQUIRE(w.busy_ns > 0);
  REQUIRE(r.busy_ns > 0);
  REQUIRE(h2d.bytes == 4 * size);  // three DRAM->HBM moves before, one staged NVMe->HBM
  REQUIRE(d2h.bytes == 4 * size);
  STRATA_REQUIRE_OK(strata_runtime_reset_stats(rt.get()));
  strata_link_stats_t after{};
  after.struct_size = STRATA_LINK_STATS_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_link_stats(rt.get(), STRATA_LINK_H2D, &after));
  REQUIRE(after.bytes == 0);
}

TEST_CASE("DLPack export describes the tensor and pins it in place", "[conformance]") {
  RuntimePtr rt = runtime_under_test();
  const int64_t shape[2] = {64, 32};
  const strata_tensor_desc_t d = desc("dl", shape, 2, STRATA_TIER_HBM, STRATA_DTYPE_BF16);
  strata_tensor_t* t = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_register(rt.get(), &d, &t));
  strata_capabilities_t caps{};
  caps.struct_size = STRATA_CAPABILITIES_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_capabilities(rt.get(), &caps));
  const bool cuda = caps.device_backend == STRATA_DEVICE_BACKEND_CUDA;

  for (strata_tier_t tier : kAddressableTiers) {
    move_and_wait(rt.get(), t, tier);
    void* ptr = nullptr;
    STRATA_REQUIRE_OK(strata_tensor_data_pointer(rt.get(), t, &ptr));
    DLManagedTensorVersioned* m = nullptr;
    STRATA_REQUIRE_OK(strata_tensor_export_dlpack(rt.get(), t, &m));
    REQUIRE(m->version.major == 1);
    REQUIRE(m->dl_tensor.data == ptr);
    REQUIRE(reinterpret_cast<uintptr_t>(ptr) % 256 == 0);
    REQUIRE(m->dl_tensor.ndim == 2);
    REQUIRE(m->dl_tensor.shape[0] == 64);
    REQUIRE(m->dl_tensor.shape[1] == 32);
    REQUIRE(m->dl_tensor.strides == nullptr);
    REQUIRE(m->dl_tensor.dtype.code == kDLBfloat);
    REQUIRE(m->dl_tensor.dtype.bits == 16);
    REQUIRE(m->dl_tensor.dtype.lanes == 1);
    const DLDeviceType expected =
        !cuda ? kDLCPU : (tier == STRATA_TIER_HBM ? kDLCUDA : kDLCUDAHost);
    REQUIRE(m->dl_tensor.device.device_type == expected);

    strata_tensor_info_t info{};
    info.struct_size = STRATA_TENSOR_INFO_STRUCT_SIZE;
    STRATA_REQUIRE_OK(strata_tensor_get_info(rt.get(), t, &info));
    REQUIRE(info.export_count == 1);
    STRATA_REQUIRE_ERROR(strata_tensor_move(rt.get(), t, STRATA_TIER_DRAM + STRATA_TIER_HBM - tier,
                                            nullptr, nullptr),
                         STRATA_ERROR_BUSY, "DLPack exports");
    STRATA_REQUIRE_ERROR(strata_tensor_unregister(rt.get(), t), STRATA_ERROR_BUSY, "DLPack");
    m->deleter(m);
    STRATA_REQUIRE_OK(strata_tensor_get_info(rt.get(), t, &info));
    REQUIRE(info.export_count == 0);
  }
  // NVMe has no address to hand out.
  move_and_wait(rt.get(), t, STRATA_TIER_NVME);
  void* ptr = nullptr;
  DLManagedTensorVersioned* m = nullptr;
  STRATA_REQUIRE_ERROR(strata_tensor_data_pointer(rt.get(), t, &ptr), STRATA_ERROR_INVALID_STATE,
                       "nvme");
  STRATA_REQUIRE_ERROR(strata_tensor_export_dlpack(rt.get(), t, &m), STRATA_ERROR_INVALID_STATE,
                       "nvme");
}

TEST_CASE("a DLPack export outlives its runtime", "[conformance]") {
  RuntimePtr rt = runtime_under_test();
  const uint64_t size = 1 << 16;
  strata_tensor_t* t = register_bytes(rt.get(), "survivor", size, STRATA_TIER_DRAM);
  const auto data = random_bytes(size, 5);
  STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), t, 0, data.data(), size));
  DLManagedTensorVersioned* m = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_export_dlpack(rt.get(), t, &m));
  STRATA_REQUIRE_OK(strata_runtime_destroy(rt.release()));
  // DRAM is host-addressable on every backend: the memory is still there and intact.
  REQUIRE(std::memcmp(m->dl_tensor.data, data.data(), size) == 0);
  m->deleter(m);
}

TEST_CASE("a full tier reports out-of-memory with the numbers and loses nothing", "[conformance]") {
  RuntimePtr rt = runtime_under_test(8 * kMiB, 64 * kMiB);
  strata_tensor_t* big = register_bytes(rt.get(), "big", 6 * kMiB, STRATA_TIER_DRAM);
  strata_tensor_t* fits = register_bytes(rt.get(), "fits", 4 * kMiB, STRATA_TIER_DRAM);
  const auto data = random_bytes(6 * kMiB, 77);
  STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), big, 0, data.data(), data.size()));
  move_and_wait(rt.get(), fits, STRATA_TIER_HBM);
  STRATA_REQUIRE_ERROR(strata_tensor_move(rt.get(), big, STRATA_TIER_HBM, nullptr, nullptr),
                       STRATA_ERROR_OUT_OF_MEMORY, "'big'");
  REQUIRE_THAT(
      std::string(strata_last_error_message()),
      Catch::Contains("6291456 bytes") && Catch::Contains("4194304 of 8388608 bytes free"));
  strata_tier_t tier = -1;
  STRATA_REQUIRE_OK(strata_tensor_tier(rt.get(), big, &tier));
  REQUIRE(tier == STRATA_TIER_DRAM);
  REQUIRE(read_all(rt.get(), big, data.size()) == data);
  const int64_t huge[1] = {1ll << 40};
  const strata_tensor_desc_t d = desc("huge", huge, 1, STRATA_TIER_HBM);
  STRATA_REQUIRE_ERROR(strata_tensor_register(rt.get(), &d, nullptr), STRATA_ERROR_OUT_OF_MEMORY,
                       "'huge'");
}

TEST_CASE("a full NVMe tier reports out-of-memory and the tensor stays put", "[conformance]") {
  RuntimePtr rt = runtime_under_test(64 * kMiB, 64 * kMiB, 8 * kMiB);
  strata_tensor_t* a = register_bytes(rt.get(), "a", 6 * kMiB, STRATA_TIER_DRAM);
  strata_tensor_t* b = register_bytes(rt.get(), "b", 6 * kMiB, STRATA_TIER_HBM);
  const auto data = random_bytes(6 * kMiB, 3);
  STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), b, 0, data.data(), data.size()));
  move_and_wait(rt.get(), a, STRATA_TIER_NVME);
  STRATA_REQUIRE_ERROR(strata_tensor_move(rt.get(), b, STRATA_TIER_NVME, nullptr, nullptr),
                       STRATA_ERROR_OUT_OF_MEMORY, "nvme tier");
  REQUIRE_THAT(std::string(strata_last_error_message()), Catch::Contains("'b'"));
  strata_tier_t tier = -1;
  STRATA_REQUIRE_OK(strata_tensor_tier(rt.get(), b, &tier));
  REQUIRE(tier == STRATA_TIER_HBM);
  REQUIRE(read_all(rt.get(), b, data.size()) == data);
}

TEST_CASE("tensors registered straight on NVMe can be written, read and moved", "[conformance]") {
  RuntimePtr rt = runtime_under_test();
  const uint64_t size = 5 * kMiB + 123;
  strata_tensor_t* t = register_bytes(rt.get(), "cold", size, STRATA_TIER_NVME);
  const auto data = random_bytes(size, 8);
  STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), t, 0, data.data(), size));
  REQUIRE(read_all(rt.get(), t, size) == data);
  move_and_wait(rt.get(), t, STRATA_TIER_HBM);
  REQUIRE(read_all(rt.get(), t, size) == data);
  move_and_wait(rt.get(), t, STRATA_TIER_NVME);
  move_and_wait(rt.get(), t, STRATA_TIER_DRAM);
  REQUIRE(read_all(rt.get(), t, size) == data);
}

TEST_CASE("destroying a runtime with transfers in flight neither hangs nor leaks",
          "[conformance]") {
  std::vector<strata_event_t*> events;
  {
    RuntimePtr rt = runtime_under_test();
    for (int i = 0; i < 8; ++i) {
      strata_tensor_t* t =
          register_bytes(rt.get(), "inflight." + std::to_string(i), 16 * kMiB, STRATA_TIER_DRAM);
      strata_event_t* e = nullptr;
      STRATA_REQUIRE_OK(strata_tensor_move(rt.get(), t, STRATA_TIER_HBM, nullptr, &e));
      events.push_back(e);
    }
    const strata_status_t s = strata_runtime_destroy(rt.release());
    REQUIRE((s == STRATA_OK || s == STRATA_ERROR_CANCELLED));
  }
  // Every event is complete after destroy: done or cancelled, never pending.
  for (auto* e : events) {
    const strata_status_t s = strata_event_query(e);
    REQUIRE((s == STRATA_OK || s == STRATA_ERROR_CANCELLED));
    strata_event_destroy(e);
  }
}

TEST_CASE("capabilities describe the backend under test", "[conformance]") {
  RuntimePtr rt = runtime_under_test(16 * kMiB, 32 * kMiB);
  strata_capabilities_t caps{};
  caps.struct_size = STRATA_CAPABILITIES_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_capabilities(rt.get(), &caps));
  REQUIRE(caps.device_backend == backend_under_test());
  REQUIRE(caps.tiers_available[STRATA_TIER_HBM] == 1);
  REQUIRE(caps.tiers_available[STRATA_TIER_DRAM] == 1);
  REQUIRE(caps.tiers_available[STRATA_TIER_NVME] == 1);
  REQUIRE(caps.tier_budget_bytes[STRATA_TIER_HBM] == 16 * kMiB);
  REQUIRE(caps.tier_budget_bytes[STRATA_TIER_DRAM] == 32 * kMiB);
  REQUIRE(caps.tier_budget_bytes[STRATA_TIER_NVME] == 256 * kMiB);
  REQUIRE(std::strlen(caps.device_name) > 0);
  REQUIRE(std::strlen(caps.backend_reason) > 0);
  REQUIRE(std::strlen(caps.dram_placement) > 0);
  REQUIRE(caps.dram_fault_threads >= 1);
  const std::string engine = caps.io_engine;
  if (io_engine_under_test() == STRATA_IO_ENGINE_POSIX) REQUIRE(engine == "posix");
  if (io_engine_under_test() == STRATA_IO_ENGINE_URING) REQUIRE(engine == "io_uring");
  REQUIRE((engine == "posix" || engine == "io_uring"));
  std::printf("backend %s: %s (%s), GPU NUMA node %d\n",
              strata_device_backend_name(caps.device_backend), caps.device_name,
              caps.backend_reason, caps.device_numa_node);
  std::printf("dram: %s, huge pages %d, faulted in by %u threads in %.3f s, pinned in %.3f s\n",
              caps.dram_placement, caps.dram_huge_pages, caps.dram_fault_threads,
              caps.dram_fault_seconds, caps.dram_pin_seconds);
  std::printf("storage engine %s (%s)\n", caps.io_engine, caps.io_engine_reason);
}

int main(int argc, char** argv) {
  const strata_device_backend_t backend = backend_under_test();
  // Probe the backend once: a cuda run on a machine without a GPU is skipped, not failed.
  strata_runtime_config_t probe = config_for(backend, 1 << 20, 1 << 20);
  strata_runtime_t* r = nullptr;
  const strata_status_t s = strata_runtime_create(&probe, &r);
  if (s != STRATA_OK) {
    if (backend == STRATA_DEVICE_BACKEND_CUDA &&
        (s == STRATA_ERROR_NO_DEVICE || s == STRATA_ERROR_UNSUPPORTED)) {
      std::printf("SKIP: cuda backend unavailable: %s\n", strata_last_error_message());
      return 77;
    }
    std::fprintf(stderr, "cannot create a %s runtime: %s\n", strata_device_backend_name(backend),
                 strata_last_error_message());
    return 1;
  }
  strata_runtime_destroy(r);
  ScratchDir dir;
  scratch = &dir;
  return Catch::Session().run(argc, argv);
}
