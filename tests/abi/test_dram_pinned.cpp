// The DRAM arena's pinned part (strata_runtime_config_t.dram_pinned_bytes, since 1.5): the
// config's rules, what the capabilities and tier usage report, which part each role's blocks
// land in, the fallback to the other part, moves coming back to their role's part, and 1.4
// callers' structs. On the host backend pinning is a no-op, so the parts are told apart by the
// blocks' addresses: the pinned part is the arena's first dram_pinned_bytes.
#include <dlfcn.h>

#include <cstring>

#include "support/test_support.h"

using namespace strata_test;

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr std::size_t kConfigV1_4Size = STRATA_STRUCT_SIZE(strata_runtime_config_t, io_dram_direct);

strata_runtime_config_t pinned_config(uint64_t dram, uint64_t pinned) {
  strata_runtime_config_t c = config_for(STRATA_DEVICE_BACKEND_HOST, 4 * kMiB, dram);
  c.dram_pinned_bytes = pinned;
  return c;
}

strata_capabilities_t capabilities(strata_runtime_t* r) {
  strata_capabilities_t caps{};
  caps.struct_size = STRATA_CAPABILITIES_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_capabilities(r, &caps));
  return caps;
}

strata_tier_usage_t dram_usage(strata_runtime_t* r) {
  strata_tier_usage_t u{};
  u.struct_size = STRATA_TIER_USAGE_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_tier_usage(r, STRATA_TIER_DRAM, &u));
  return u;
}

strata_tensor_t* register_role(strata_runtime_t* r, const std::string& name, uint64_t bytes,
                               strata_role_t role) {
  const int64_t shape[1] = {static_cast<int64_t>(bytes)};
  const strata_tensor_desc_t d =
      desc(name.c_str(), shape, 1, STRATA_TIER_DRAM, STRATA_DTYPE_U8, role);
  strata_tensor_t* t = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_register(r, &d, &t));
  return t;
}

uintptr_t address(strata_runtime_t* r, strata_tensor_t* t) {
  void* p = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_data_pointer(r, t, &p));
  return reinterpret_cast<uintptr_t>(p);
}

void move_and_wait(strata_runtime_t* r, strata_tensor_t* t, strata_tier_t dst) {
  strata_event_t* e = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_move(r, t, dst, nullptr, &e));
  EventPtr owner(e);
  STRATA_REQUIRE_OK(strata_event_wait(e, 60000));
}

}  // namespace

TEST_CASE("dram_pinned_bytes: 0 and the whole budget pin everything; a part rounds up to 4 KiB",
          "[abi][dram_pinned]") {
  strata_runtime_config_t defaults;
  STRATA_REQUIRE_OK(strata_runtime_config_init(&defaults));
  REQUIRE(defaults.dram_pinned_bytes == 0);
  REQUIRE(defaults.struct_size == STRATA_RUNTIME_CONFIG_STRUCT_SIZE);

  for (uint64_t pinned : {uint64_t{0}, 8 * kMiB}) {
    INFO("dram_pinned_bytes " << pinned);
    RuntimePtr rt = make_runtime(pinned_config(8 * kMiB, pinned));
    REQUIRE(capabilities(rt.get()).dram_pinned_bytes == 8 * kMiB);
    const strata_tier_usage_t u = dram_usage(rt.get());
    REQUIRE(u.budget_bytes == 8 * kMiB);
    REQUIRE(u.pinned_budget_bytes == 8 * kMiB);
    // Everything in the one part, whatever its role.
    strata_tensor_t* state = register_role(rt.get(), "state", 4096, STRATA_ROLE_OPTIMIZER_STATE);
    REQUIRE(dram_usage(rt.get()).pinned_used_bytes == 4096);
    STRATA_REQUIRE_OK(strata_tensor_unregister(rt.get(), state));
  }

  RuntimePtr rt = make_runtime(pinned_config(8 * kMiB, 4 * kMiB + 1));
  const strata_capabilities_t caps = capabilities(rt.get());
  REQUIRE(caps.dram_pinned_bytes == 4 * kMiB + 4096);
  REQUIRE(caps.tier_budget_bytes[STRATA_TIER_DRAM] == 8 * kMiB);
  const strata_tier_usage_t u = dram_usage(rt.get());
  REQUIRE(u.budget_bytes == 8 * kMiB);
  REQUIRE(u.pinned_budget_bytes == 4 * kMiB + 4096);
  REQUIRE(u.used_bytes == 0);
  REQUIRE(u.pinned_used_bytes == 0);
  REQUIRE(u.dram_fallbacks == 0);
  REQUIRE(u.largest_free_bytes == 4 * kMiB + 4096);
  // The other tiers report no pinned part.
  strata_tier_usage_t hbm{};
  hbm.struct_size = STRATA_TIER_USAGE_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_tier_usage(rt.get(), STRATA_TIER_HBM, &hbm));
  REQUIRE(hbm.pinned_budget_bytes == 0);
  REQUIRE(hbm.dram_fallbacks == 0);
}

TEST_CASE("dram_pinned_bytes above the budget is INVALID_ARGUMENT naming both",
          "[abi][dram_pinned]") {
  strata_runtime_config_t c = pinned_config(8 * kMiB, 8 * kMiB + 1);
  strata_runtime_t* r = nullptr;
  STRATA_REQUIRE_ERROR(strata_runtime_create(&c, &r), STRATA_ERROR_INVALID_ARGUMENT,
                       "dram_pinned_bytes 8388609");
  REQUIRE_THAT(std::string(strata_last_error_message()),
               Catch::Contains("dram_budget_bytes 8388608"));
  REQUIRE(r == nullptr);
  // Rounding up to 4 KiB overflows: too large all the same.
  c.dram_pinned_bytes = UINT64_MAX;
  STRATA_REQUIRE_ERROR(strata_runtime_create(&c, &r), STRATA_ERROR_INVALID_ARGUMENT,
                       "dram_pinned_bytes");
}

TEST_CASE("optimizer state lands in the unpinned part, every other role in the pinned one",
          "[abi][dram_pinned]") {
  RuntimePtr rt = make_runtime(pinned_config(8 * kMiB, 2 * kMiB));
  strata_runtime_t* r = rt.get();
  // The first block of the pinned part starts the arena.
  strata_tensor_t* weight = register_role(r, "weight", 10000, STRATA_ROLE_WEIGHT);
  const uintptr_t base = address(r, weight);
  const uintptr_t boundary = base + 2 * kMiB;
  strata_tensor_t* state = register_role(r, "state", 10000, STRATA_ROLE_OPTIMIZER_STATE);
  REQUIRE(address(r, state) == boundary);  // the unpinned part's first block
  for (strata_role_t role : {STRATA_ROLE_GRAD, STRATA_ROLE_ACTIVATION, STRATA_ROLE_OTHER}) {
    INFO("role " << strata_role_name(role));
    strata_tensor_t* t = register_role(r, strata_role_name(role), 5000, role);
    REQUIRE(address(r, t) >= base);
    REQUIRE(address(r, t) + 5000 <= boundary);
  }
  const strata_tier_usage_t u = dram_usage(r);
  REQUIRE(u.pinned_used_bytes == 3 * 4096 + 3 * 8192);
  REQUIRE(u.used_bytes == u.pinned_used_bytes + 3 * 4096);
  REQUIRE(u.tensor_count == 5);
  REQUIRE(u.dram_fallbacks == 0);
  REQUIRE(u.largest_free_bytes == 6 * kMiB - 3 * 4096);  // the unpinned part's rest
}

TEST_CASE(
    "a full part lends the other room, both ways, a GPU-touched block in the unpinned part "
    "counted; no room is an error naming both",
    "[abi][dram_pinned]") {
  RuntimePtr rt = make_runtime(pinned_config(4 * kMiB, kMiB));
  strata_runtime_t* r = rt.get();
  strata_tensor_t* weights = register_role(r, "weights", kMiB, STRATA_ROLE_WEIGHT);
  const uintptr_t base = address(r, weights);
  const uintptr_t boundary = base + kMiB;
  // The pinned part is full: a grad goes to the unpinned part rather than fail.
  strata_tensor_t* grad = register_role(r, "grad", 4096, STRATA_ROLE_GRAD);
  REQUIRE(address(r, grad) >= boundary);
  REQUIRE(dram_usage(r).dram_fallbacks == 1);
  // Fill the unpinned part with state; free the pinned part: state goes there.
  strata_tensor_t* state = register_role(r, "state", 3 * kMiB - 4096, STRATA_ROLE_OPTIMIZER_STATE);
  REQUIRE(address(r, state) >= boundary);
  REQUIRE(dram_usage(r).dram_fallbacks == 1);
  STRATA_REQUIRE_OK(strata_tensor_unregister(r, weights));
  strata_tensor_t* more = register_role(r, "more state", 8192, STRATA_ROLE_OPTIMIZER_STATE);
  REQUIRE(address(r, more) == base);
  strata_tier_usage_t u = dram_usage(r);
  REQUIRE(u.dram_fallbacks == 1);  // state in the pinned part only takes room: not counted
  REQUIRE(u.pinned_used_bytes == 8192);
  REQUIRE(u.used_bytes == 4 * kMiB - kMiB + 8192);
  // Neither part has room: OUT_OF_MEMORY, both parts named, nothing counted.
  const int64_t shape[1] = {static_cast<int64_t>(2 * kMiB)};
  const strata_tensor_desc_t d = desc("too big", shape, 1, STRATA_TIER_DRAM);
  strata_tensor_t* t = nullptr;
  STRATA_REQUIRE_ERROR(strata_tensor_register(r, &d, &t), STRATA_ERROR_OUT_OF_MEMORY,
                       "pinned part");
  REQUIRE_THAT(std::string(strata_last_error_message()), Catch::Contains("unpinned part"));
  REQUIRE(dram_usage(r).dram_fallbacks == 1);
}

TEST_CASE("tensors moved out of DRAM come back into their role's part", "[abi][dram_pinned]") {
  ScratchDir scratch;
  const std::string path = scratch.file("nvme");
  const char* paths[1] = {path.c_str()};
  strata_runtime_config_t c = pinned_config(8 * kMiB, 2 * kMiB);
  c.nvme_paths = paths;
  c.nvme_path_count = 1;
  c.nvme_budget_bytes = 16 * kMiB;
  c.io_queue_depth = 4;
  RuntimePtr rt = make_runtime(c);
  strata_runtime_t* r = rt.get();
  strata_tensor_t* first = register_role(r, "first", 4096, STRATA_ROLE_WEIGHT);
  const uintptr_t base = address(r, first);
  const uintptr_t boundary = base + 2 * kMiB;
  STRATA_REQUIRE_OK(strata_tensor_unregister(r, first));

  // Registered elsewhere, each comes into DRAM for the first time through a move, and from
  // DRAM goes round both other tiers, its bytes intact.
  struct Case {
    const char* name;
    strata_role_t role;
    strata_tier_t home;
    bool pinned;
  };
  const Case cases[] = {{"state", STRATA_ROLE_OPTIMIZER_STATE, STRATA_TIER_NVME, false},
                        {"weight", STRATA_ROLE_WEIGHT, STRATA_TIER_HBM, true},
                        {"grad", STRATA_ROLE_GRAD, STRATA_TIER_NVME, true},
                        {"moments", STRATA_ROLE_OPTIMIZER_STATE, STRATA_TIER_HBM, false}};
  uint64_t seed = 7;
  for (const Case& k : cases) {
    INFO(k.name);
    const uint64_t bytes = 3 * 4096 + 5;
    const int64_t shape[1] = {static_cast<int64_t>(bytes)};
    const strata_tensor_desc_t d = desc(k.name, shape, 1, k.home, STRATA_DTYPE_U8, k.role);
    strata_tensor_t* t = nullptr;
    STRATA_REQUIRE_OK(strata_tensor_register(r, &d, &t));
    const auto data = random_bytes(bytes, seed++);
    STRATA_REQUIRE_OK(strata_tensor_write(r, t, 0, data.data(), bytes));
    for (strata_tier_t via : {STRATA_TIER_HBM, STRATA_TIER_NVME, STRATA_TIER_DRAM}) {
      move_and_wait(r, t, STRATA_TIER_DRAM);
      const uintptr_t at = address(r, t);
      REQUIRE((at + bytes <= boundary) == k.pinned);
      REQUIRE(at >= base);
      REQUIRE(at < base + 8 * kMiB);
      move_and_wait(r, t, via);
      std::vector<unsigned char> back(bytes);
      STRATA_REQUIRE_OK(strata_tensor_read(r, t, 0, back.data(), bytes));
      REQUIRE(back == data);
    }
  }
  REQUIRE(dram_usage(r).dram_fallbacks == 0);
}

TEST_CASE("a 1.4 caller's structs: its config pins everything, nothing past its size is written",
          "[abi][dram_pinned]") {
  // A 1.4 config ends before dram_pinned_bytes: whatever lies past it is not read.
  strata_runtime_config_t c = pinned_config(8 * kMiB, 4096);
  c.struct_size = kConfigV1_4Size;
  RuntimePtr rt = make_runtime(c);
  strata_runtime_t* r = rt.get();
  strata_capabilities_t caps{};
  std::memset(static_cast<void*>(&caps), 0xAB, sizeof caps);
  caps.struct_size = STRATA_STRUCT_SIZE(strata_capabilities_t, io_engine_reason);
  STRATA_REQUIRE_OK(strata_runtime_capabilities(r, &caps));
  REQUIRE(caps.tier_budget_bytes[STRATA_TIER_DRAM] == 8 * kMiB);
  uint64_t untouched = 0;
  std::memset(&untouched, 0xAB, sizeof untouched);
  REQUIRE(caps.dram_pinned_bytes == untouched);
  REQUIRE(capabilities(r).dram_pinned_bytes == 8 * kMiB);

  strata_tier_usage_t u{};
  std::memset(static_cast<void*>(&u), 0xAB, sizeof u);
  u.struct_size = STRATA_STRUCT_SIZE(strata_tier_usage_t, tensor_count);
  STRATA_REQUIRE_OK(strata_runtime_tier_usage(r, STRATA_TIER_DRAM, &u));
  REQUIRE(u.budget_bytes == 8 * kMiB);
  REQUIRE(u.pinned_budget_bytes == untouched);
  REQUIRE(u.dram_fallbacks == untouched);
  REQUIRE(dram_usage(r).pinned_budget_bytes == 8 * kMiB);

  strata_layout_request_t q;
  STRATA_REQUIRE_OK(strata_layout_request_init(&q));
  const uint32_t counts[1] = {1};
  const uint64_t elements[1] = {1000};
  q.layer_count = 1;
  q.trainable_counts = counts;
  q.trainable_elements = elements;
  strata_layout_totals_t totals{};
  std::memset(static_cast<void*>(&totals), 0xAB, sizeof totals);
  totals.struct_size = STRATA_STRUCT_SIZE(strata_layout_totals_t, accum_bytes);
  STRATA_REQUIRE_OK(strata_layout_query(&q, nullptr, &totals));
  REQUIRE(totals.dram_gpu_bytes == untouched);
}

TEST_CASE("strata_runtime_config_init@STRATA_1.0 writes only a 1.4 program's 96 bytes",
          "[abi][dram_pinned]") {
  using Init = strata_status_t (*)(strata_runtime_config_t*);
  const auto old_init =
      reinterpret_cast<Init>(dlvsym(RTLD_DEFAULT, "strata_runtime_config_init", "STRATA_1.0"));
  const auto new_init =
      reinterpret_cast<Init>(dlvsym(RTLD_DEFAULT, "strata_runtime_config_init", "STRATA_1.5"));
  REQUIRE(old_init != nullptr);
  REQUIRE(new_init != nullptr);
  REQUIRE(old_init != new_init);
  static_assert(kConfigV1_4Size == 96);
  static_assert(sizeof(strata_runtime_config_t) == 104);
  alignas(strata_runtime_config_t) unsigned char bytes[sizeof(strata_runtime_config_t) + 16];
  std::memset(bytes, 0xAB, sizeof bytes);
  auto* config = reinterpret_cast<strata_runtime_config_t*>(bytes);
  REQUIRE(old_init(config) == STRATA_OK);
  REQUIRE(config->struct_size == kConfigV1_4Size);
  REQUIRE(config->nvme_checksums == 1);
  for (std::size_t i = kConfigV1_4Size; i < sizeof bytes; ++i) REQUIRE(bytes[i] == 0xAB);

  std::memset(bytes, 0xAB, sizeof bytes);
  REQUIRE(new_init(config) == STRATA_OK);
  REQUIRE(config->struct_size == STRATA_RUNTIME_CONFIG_STRUCT_SIZE);
  REQUIRE(config->dram_pinned_bytes == 0);
  for (std::size_t i = sizeof(strata_runtime_config_t); i < sizeof bytes; ++i) {
    REQUIRE(bytes[i] == 0xAB);
  }
}
