// The host buffers' core (runtime/memory/host_buffers.h): the machine's reserve rule on given
// figures, each buffer pinned once over its whole mapping and unpinned at its free (through
// the backend, counted), the budget's arithmetic with the arena inside it, and a runtime's
// buffers sharing the DRAM arena's NUMA options. The C ABI's promises are tests/abi's.
#include <catch2/catch.hpp>

#include "runtime/memory/host_buffers.h"
#include "runtime/runtime.h"
#include "tests/support/core_support.h"
#include "tests/support/counting_backend.h"

namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kMiB = 1ull << 20;

}  // namespace

TEST_CASE("a host buffer leaves the reserve of the machine's memory available", "[host_buffers]") {
  using strata::check_machine_room;
  using strata::MachineMemory;
  REQUIRE(strata::host_reserve_bytes(100 * kGiB) == 10 * kGiB);
  const MachineMemory machine{100 * kGiB, 30 * kGiB};
  REQUIRE_OK(check_machine_room(20 * kGiB, machine, "x"));  // leaves exactly the reserve
  const strata::Status refused = check_machine_room(20 * kGiB + 1, machine, "spill");
  REQUIRE(refused.code() == strata::Code::kOutOfMemory);
  REQUIRE_THAT(refused.message(), Catch::Contains("host buffer 'spill'") &&
                                      Catch::Contains("reserve of 10737418240 bytes (10%"));
  // Less available than the reserve already: nothing fits.
  REQUIRE(check_machine_room(1, {100 * kGiB, 9 * kGiB}, "").code() == strata::Code::kOutOfMemory);
  // Unknown figures (no /proc): the budget alone bounds it.
  REQUIRE_OK(check_machine_room(1000 * kGiB, {0, 0}, ""));
  REQUIRE_OK(check_machine_room(1000 * kGiB, {100 * kGiB, 0}, ""));
}

TEST_CASE("each host buffer is pinned once, whole, and unpinned when freed", "[host_buffers]") {
  auto backend = strata_test::counting_host_backend();
  REQUIRE(backend != nullptr);
  strata::HostBuffers buffers(backend, {}, 16 * kMiB);
  REQUIRE_OK(buffers.set_budget(16 * kMiB + 8 * kMiB));
  uint64_t a = 0, b = 0;
  REQUIRE_OK(buffers.create(3 * kMiB + 1, "a", &a));
  REQUIRE_OK(buffers.create(4096, "b", &b));
  REQUIRE(a != b);
  strata::HostBufferInfo ia, ib;
  REQUIRE_OK(buffers.info(a, &ia));
  REQUIRE_OK(buffers.info(b, &ib));
  REQUIRE(ia.charged == 3 * kMiB + 4096);
  REQUIRE(backend->pins ==
          std::vector<std::pair<void*, uint64_t>>{{ia.data, ia.charged}, {ib.data, 4096}});
  const strata::HostBudgetUsage u = buffers.usage();
  REQUIRE(u.buffers == 3 * kMiB + 2 * 4096);
  REQUIRE(u.room == 8 * kMiB - u.buffers);
  REQUIRE(u.count == 2);
  REQUIRE_OK(buffers.destroy(a));
  REQUIRE(backend->unpins == std::vector<std::pair<void*, uint64_t>>{{ia.data, ia.charged}});
  REQUIRE(buffers.destroy(a).code() == strata::Code::kNotFound);
  REQUIRE(backend->unpins.size() == 1);
  REQUIRE(buffers.usage().buffers == 4096);
}

TEST_CASE("a runtime's host budget starts as its DRAM arena, which the budget includes",
          "[host_buffers]") {
  strata::RuntimeOptions options;
  options.device.kind = strata::DeviceKind::kHost;
  options.budgets = {4 * kMiB, 6 * kMiB + 1, 0};  // the arena: rounded up to 4 KiB
  std::shared_ptr<strata::Runtime> rt;
  REQUIRE_OK(strata::Runtime::create(options, &rt));
  strata::HostBuffers& buffers = rt->host_buffers();
  const uint64_t arena = 6 * kMiB + 4096;
  REQUIRE(buffers.usage().arena == arena);
  REQUIRE(buffers.usage().budget == arena);
  uint64_t id = 0;
  REQUIRE(buffers.create(1, "", &id).code() == strata::Code::kOutOfMemory);
  REQUIRE(buffers.set_budget(arena - 1).code() == strata::Code::kInvalidArgument);
  REQUIRE_OK(buffers.set_budget(arena + 4096));
  REQUIRE_OK(buffers.create(1, "", &id));
  REQUIRE(buffers.usage().room == 0);
  // Freed with the runtime when still live (the sanitizers' builds see no leak).
}
