// Host buffers under one host budget (since 1.5; strata.h "Host buffers"): every promise of the
// header, on the host backend (ordinary memory, the same accounting): the budget starts at the
// arena, a buffer beyond its room or the machine's reserve is refused with OUT_OF_MEMORY naming
// the figures and charging nothing, freeing returns the room, a freed, foreign or made-up
// handle is NOT_FOUND, the memory is zero, usable and page-aligned, threads allocate and free
// at once, and the runtime's destroy frees the buffers still live.
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "support/test_support.h"

using namespace strata_test;

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kArena = 8 * kMiB;

RuntimePtr host_runtime() {
  return make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 4 * kMiB, kArena));
}

strata_host_usage_t usage(strata_runtime_t* r) {
  strata_host_usage_t u{};
  u.struct_size = STRATA_HOST_USAGE_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_host_usage(r, &u));
  return u;
}

strata_host_buffer_desc_t buffer_desc(uint64_t bytes, const char* name = "b") {
  strata_host_buffer_desc_t d{};
  d.struct_size = STRATA_HOST_BUFFER_DESC_STRUCT_SIZE;
  d.bytes = bytes;
  d.name = name;
  return d;
}

strata_host_buffer_t* make_buffer(strata_runtime_t* r, uint64_t bytes, const char* name = "b") {
  const strata_host_buffer_desc_t d = buffer_desc(bytes, name);
  strata_host_buffer_t* b = nullptr;
  STRATA_REQUIRE_OK(strata_host_buffer_create(r, &d, &b));
  REQUIRE(b != nullptr);
  return b;
}

strata_host_buffer_info_t info_of(strata_runtime_t* r, strata_host_buffer_t* b) {
  strata_host_buffer_info_t i{};
  i.struct_size = STRATA_HOST_BUFFER_INFO_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_host_buffer_get_info(r, b, &i));
  return i;
}

}  // namespace

TEST_CASE("host budget: the arena's until set, then the arena and the buffers together",
          "[abi][host_buffer]") {
  RuntimePtr rt = host_runtime();
  strata_host_usage_t u = usage(rt.get());
  REQUIRE(u.arena_bytes == kArena);
  REQUIRE(u.budget_bytes == kArena);
  REQUIRE(u.room_bytes == 0);
  REQUIRE(u.buffer_count == 0);
  REQUIRE(u.reserve_bytes > 0);  // Linux: MemTotal is known
  REQUIRE(u.available_bytes > 0);
  // No room until the budget is raised: refused, naming the way out.
  const strata_host_buffer_desc_t d = buffer_desc(4096, "spill 0");
  strata_host_buffer_t* b = nullptr;
  STRATA_REQUIRE_ERROR(strata_host_buffer_create(rt.get(), &d, &b), STRATA_ERROR_OUT_OF_MEMORY,
                       "host buffer 'spill 0': 4096 bytes");
  REQUIRE_THAT(strata_last_error_message(), Catch::Contains("strata_runtime_set_host_budget"));
  REQUIRE(b == nullptr);
  // Below the arena, which the budget includes: refused, nothing changed.
  STRATA_REQUIRE_ERROR(strata_runtime_set_host_budget(rt.get(), kArena - 1),
                       STRATA_ERROR_INVALID_ARGUMENT, "below the DRAM arena's");
  REQUIRE(usage(rt.get()).budget_bytes == kArena);
  STRATA_REQUIRE_OK(strata_runtime_set_host_budget(rt.get(), kArena + 3 * kMiB));
  u = usage(rt.get());
  REQUIRE(u.budget_bytes == kArena + 3 * kMiB);
  REQUIRE(u.room_bytes == 3 * kMiB);
}

TEST_CASE("host buffer: charged rounded up to the page, refused beyond the room, freed back",
          "[abi][host_buffer]") {
  RuntimePtr rt = host_runtime();
  STRATA_REQUIRE_OK(strata_runtime_set_host_budget(rt.get(), kArena + 3 * kMiB));
  strata_host_buffer_t* a = make_buffer(rt.get(), 2 * kMiB - 100, "a");
  const strata_host_buffer_info_t ia = info_of(rt.get(), a);
  REQUIRE(ia.bytes == 2 * kMiB - 100);
  REQUIRE(ia.charged_bytes == 2 * kMiB);
  REQUIRE(ia.pinned == 0);  // the host backend pins nothing
  REQUIRE(reinterpret_cast<uintptr_t>(ia.data) % 4096 == 0);
  // Zero, and usable to its last byte.
  auto* bytes = static_cast<unsigned char*>(ia.data);
  for (uint64_t i = 0; i < ia.bytes; i += 4093) REQUIRE(bytes[i] == 0);
  std::memset(bytes, 0x5A, ia.bytes);
  REQUIRE(bytes[ia.bytes - 1] == 0x5A);
  strata_host_usage_t u = usage(rt.get());
  REQUIRE(u.buffer_bytes == 2 * kMiB);
  REQUIRE(u.buffer_count == 1);
  REQUIRE(u.room_bytes == kMiB);

  // One page more than the room: refused, the figures named, nothing charged.
  const strata_host_buffer_desc_t big = buffer_desc(kMiB + 1, "b");
  strata_host_buffer_t* b = nullptr;
  STRATA_REQUIRE_ERROR(strata_host_buffer_create(rt.get(), &big, &b), STRATA_ERROR_OUT_OF_MEMORY,
                       "host buffer 'b': 1052672 bytes (rounded up to 4 KiB) exceed the host "
                       "budget's room");
  REQUIRE_THAT(strata_last_error_message(), Catch::Contains("room 1048576"));
  REQUIRE(b == nullptr);
  REQUIRE(usage(rt.get()).buffer_bytes == 2 * kMiB);
  strata_host_buffer_t* c = make_buffer(rt.get(), kMiB, "c");  // exactly the room
  REQUIRE(usage(rt.get()).room_bytes == 0);

  // Freeing returns the room; the next buffer fits again.
  STRATA_REQUIRE_OK(strata_host_buffer_free(rt.get(), a));
  u = usage(rt.get());
  REQUIRE(u.buffer_bytes == kMiB);
  REQUIRE(u.buffer_count == 1);
  REQUIRE(u.room_bytes == 2 * kMiB);
  strata_host_buffer_t* d = make_buffer(rt.get(), 2 * kMiB, "d");
  STRATA_REQUIRE_OK(strata_host_buffer_free(rt.get(), c));
  STRATA_REQUIRE_OK(strata_host_buffer_free(rt.get(), d));
  REQUIRE(usage(rt.get()).room_bytes == 3 * kMiB);

  // A budget lowered below what is held takes nothing back: no room until buffers are freed.
  strata_host_buffer_t* e = make_buffer(rt.get(), 2 * kMiB, "e");
  STRATA_REQUIRE_OK(strata_runtime_set_host_budget(rt.get(), kArena + kMiB));
  u = usage(rt.get());
  REQUIRE(u.buffer_bytes == 2 * kMiB);
  REQUIRE(u.room_bytes == 0);
  REQUIRE(info_of(rt.get(), e).bytes == 2 * kMiB);
  STRATA_REQUIRE_OK(strata_host_buffer_free(rt.get(), e));
  REQUIRE(usage(rt.get()).room_bytes == kMiB);
}

TEST_CASE("host buffer: the machine's reserve is kept whatever the budget", "[abi][host_buffer]") {
  RuntimePtr rt = host_runtime();
  const strata_host_usage_t before = usage(rt.get());
  REQUIRE(before.reserve_bytes > 0);
  // A budget with room for anything: the machine refuses what would leave less than its reserve
  // available (the buffer is bigger than the memory available).
  STRATA_REQUIRE_OK(strata_runtime_set_host_budget(rt.get(), UINT64_MAX));
  const uint64_t too_big = before.available_bytes + kMiB;
  const strata_host_buffer_desc_t d = buffer_desc(too_big, "huge");
  strata_host_buffer_t* b = nullptr;
  STRATA_REQUIRE_ERROR(strata_host_buffer_create(rt.get(), &d, &b), STRATA_ERROR_OUT_OF_MEMORY,
                       "would leave less than the reserve of");
  REQUIRE_THAT(strata_last_error_message(),
               Catch::Contains(std::to_string(STRATA_HOST_RESERVE_PERCENT) + "% of the machine"));
  REQUIRE(b == nullptr);
  const strata_host_usage_t after = usage(rt.get());
  REQUIRE(after.buffer_bytes == 0);  // nothing charged
  REQUIRE(after.buffer_count == 0);
}

TEST_CASE("host buffer: bad input, double free, foreign and made-up handles",
          "[abi][host_buffer]") {
  RuntimePtr rt = host_runtime();
  RuntimePtr other = host_runtime();
  STRATA_REQUIRE_OK(strata_runtime_set_host_budget(rt.get(), kArena + 2 * kMiB));
  STRATA_REQUIRE_OK(strata_runtime_set_host_budget(other.get(), kArena + 2 * kMiB));
  const strata_host_buffer_desc_t d = buffer_desc(4096);
  strata_host_buffer_t* b = nullptr;
  STRATA_REQUIRE_ERROR(strata_host_buffer_create(nullptr, &d, &b), STRATA_ERROR_INVALID_ARGUMENT,
                       "runtime is NULL");
  STRATA_REQUIRE_ERROR(strata_host_buffer_create(rt.get(), nullptr, &b),
                       STRATA_ERROR_INVALID_ARGUMENT, "pointer is NULL");
  STRATA_REQUIRE_ERROR(strata_host_buffer_create(rt.get(), &d, nullptr),
                       STRATA_ERROR_INVALID_ARGUMENT, "out_buffer is NULL");
  const strata_host_buffer_desc_t zero = buffer_desc(0, "z");
  STRATA_REQUIRE_ERROR(strata_host_buffer_create(rt.get(), &zero, &b),
                       STRATA_ERROR_INVALID_ARGUMENT, "host buffer 'z' of 0 bytes");
  const strata_host_buffer_desc_t unnamed = buffer_desc(0, nullptr);
  STRATA_REQUIRE_ERROR(strata_host_buffer_create(rt.get(), &unnamed, &b),
                       STRATA_ERROR_INVALID_ARGUMENT, "host buffer of 0 bytes");
  REQUIRE(b == nullptr);
  STRATA_REQUIRE_ERROR(strata_runtime_set_host_budget(nullptr, 1), STRATA_ERROR_INVALID_ARGUMENT,
                       "runtime is NULL");
  STRATA_REQUIRE_ERROR(strata_runtime_host_usage(rt.get(), nullptr), STRATA_ERROR_INVALID_ARGUMENT,
                       "pointer is NULL");

  strata_host_buffer_t* mine = make_buffer(rt.get(), 4096);
  strata_host_buffer_info_t i{};
  i.struct_size = STRATA_HOST_BUFFER_INFO_STRUCT_SIZE;
  STRATA_REQUIRE_ERROR(strata_host_buffer_get_info(nullptr, mine, &i),
                       STRATA_ERROR_INVALID_ARGUMENT, "runtime is NULL");
  STRATA_REQUIRE_ERROR(strata_host_buffer_get_info(rt.get(), mine, nullptr),
                       STRATA_ERROR_INVALID_ARGUMENT, "pointer is NULL");
  STRATA_REQUIRE_ERROR(strata_host_buffer_free(nullptr, mine), STRATA_ERROR_INVALID_ARGUMENT,
                       "runtime is NULL");
  // Another runtime's buffer: not found there, untouched here.
  STRATA_REQUIRE_ERROR(strata_host_buffer_free(other.get(), mine), STRATA_ERROR_NOT_FOUND,
                       "is not a live host buffer of this runtime");
  STRATA_REQUIRE_ERROR(strata_host_buffer_get_info(other.get(), mine, &i), STRATA_ERROR_NOT_FOUND,
                       "is not a live host buffer of this runtime");
  REQUIRE(usage(rt.get()).buffer_count == 1);
  // Handles never made, NULL among them.
  STRATA_REQUIRE_ERROR(strata_host_buffer_free(rt.get(), nullptr), STRATA_ERROR_NOT_FOUND,
                       "not a live host buffer");
  auto* made_up = reinterpret_cast<strata_host_buffer_t*>(uintptr_t{0xdeadbeef});
  STRATA_REQUIRE_ERROR(strata_host_buffer_free(rt.get(), made_up), STRATA_ERROR_NOT_FOUND,
                       "not a live host buffer");
  // Freed twice: the second is NOT_FOUND and changes nothing; the handle stays dead even after
  // new buffers are made (handles are never reused).
  STRATA_REQUIRE_OK(strata_host_buffer_free(rt.get(), mine));
  STRATA_REQUIRE_ERROR(strata_host_buffer_free(rt.get(), mine), STRATA_ERROR_NOT_FOUND,
                       "freed already");
  STRATA_REQUIRE_ERROR(strata_host_buffer_get_info(rt.get(), mine, &i), STRATA_ERROR_NOT_FOUND,
                       "not a live host buffer");
  strata_host_buffer_t* next = make_buffer(rt.get(), 4096);
  REQUIRE(next != mine);
  STRATA_REQUIRE_ERROR(strata_host_buffer_free(rt.get(), mine), STRATA_ERROR_NOT_FOUND,
                       "not a live host buffer");
  const strata_host_usage_t u = usage(rt.get());
  REQUIRE(u.buffer_count == 1);
  REQUIRE(u.buffer_bytes == 4096);
  // The runtime's destroy frees the buffers still live (no leak under the sanitizers).
}

TEST_CASE("host buffer: threads allocate, write and free at once within the budget",
          "[abi][host_buffer]") {
  RuntimePtr rt = host_runtime();
  constexpr int kThreads = 8;
  constexpr int kRounds = 20;
  constexpr uint64_t kBytes = 64 * 1024;
  // Room for half the threads' buffers at once: some creations are refused, none overruns.
  const uint64_t room = kThreads / 2 * kBytes;
  STRATA_REQUIRE_OK(strata_runtime_set_host_budget(rt.get(), kArena + room));
  std::atomic<int> made{0};
  std::atomic<int> refused{0};
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        const strata_host_buffer_desc_t d = buffer_desc(kBytes);
        strata_host_buffer_t* b = nullptr;
        const strata_status_t s = strata_host_buffer_create(rt.get(), &d, &b);
        if (s == STRATA_ERROR_OUT_OF_MEMORY) {
          ++refused;
          continue;
        }
        if (s != STRATA_OK) {
          ++wrong;
          continue;
        }
        ++made;
        strata_host_buffer_info_t i{};
        i.struct_size = STRATA_HOST_BUFFER_INFO_STRUCT_SIZE;
        if (strata_host_buffer_get_info(rt.get(), b, &i) != STRATA_OK) ++wrong;
        strata_host_usage_t u{};
        u.struct_size = STRATA_HOST_USAGE_STRUCT_SIZE;
        if (strata_runtime_host_usage(rt.get(), &u) != STRATA_OK || u.buffer_bytes > room) {
          ++wrong;  // the budget is never overrun, even by buffers being made
        }
        std::memset(i.data, t, kBytes);  // each thread's own memory
        const auto* p = static_cast<const unsigned char*>(i.data);
        if (p[0] != t || p[kBytes - 1] != t) ++wrong;
        if (strata_host_buffer_free(rt.get(), b) != STRATA_OK) ++wrong;
      }
    });
  }
  for (auto& t : threads) t.join();
  REQUIRE(wrong == 0);
  REQUIRE(made + refused == kThreads * kRounds);
  REQUIRE(made > 0);
  const strata_host_usage_t u = usage(rt.get());
  REQUIRE(u.buffer_count == 0);
  REQUIRE(u.buffer_bytes == 0);
  REQUIRE(u.room_bytes == room);
}
