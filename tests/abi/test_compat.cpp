// Compat symbols: a struct a *_config_init fills grew in a minor release, so programs linked
// against the older release keep an init that writes only the bytes their struct has
// (docs/abi.md, "*_config_init and growing structs").
#include <dlfcn.h>

#include <cstring>

#include "support/test_support.h"

namespace {

using OptimizerConfigInit = strata_status_t (*)(strata_optimizer_kind_t,
                                                strata_optimizer_config_t*);

OptimizerConfigInit optimizer_config_init(const char* node) {
  return reinterpret_cast<OptimizerConfigInit>(
      dlvsym(RTLD_DEFAULT, "strata_optimizer_config_init", node));
}

// A config with room after it, every byte set to `fill`.
struct Guarded {
  alignas(strata_optimizer_config_t) unsigned char bytes[sizeof(strata_optimizer_config_t) + 32];
  explicit Guarded(unsigned char fill) { std::memset(bytes, fill, sizeof bytes); }
  strata_optimizer_config_t* config() {
    return reinterpret_cast<strata_optimizer_config_t*>(bytes);
  }
  // The first byte from `from` on that is no longer `fill`, or sizeof bytes.
  size_t first_written_from(size_t from, unsigned char fill) const {
    for (size_t i = from; i < sizeof bytes; ++i) {
      if (bytes[i] != fill) return i;
    }
    return sizeof bytes;
  }
};

}  // namespace

TEST_CASE("strata_optimizer_config_init@STRATA_1.0 writes only a 1.0 or 1.1 program's struct",
          "[abi]") {
  const OptimizerConfigInit old_init = optimizer_config_init("STRATA_1.0");
  const OptimizerConfigInit new_init = optimizer_config_init("STRATA_1.2");
  REQUIRE(old_init != nullptr);
  REQUIRE(new_init != nullptr);
  REQUIRE(old_init != new_init);
  // 1.1's struct ended at update_mode; 1.0's ended at threads, padded to the same size.
  constexpr size_t kOldSize = STRATA_STRUCT_SIZE(strata_optimizer_config_t, update_mode);
  static_assert(kOldSize < sizeof(strata_optimizer_config_t));

  Guarded old_config(0xAB);
  REQUIRE(old_init(STRATA_OPTIMIZER_ADAMW, old_config.config()) == STRATA_OK);
  CHECK(old_config.first_written_from(kOldSize, 0xAB) == sizeof old_config.bytes);
  CHECK(old_config.config()->struct_size == kOldSize);
  CHECK(old_config.config()->weight_decay == 1e-2f);
  CHECK(old_config.config()->update_mode == STRATA_UPDATE_AUTO);
  CHECK(old_init(7, old_config.config()) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(strata_last_error_message()).find("kind") != std::string::npos);

  // What a program built against this header calls: the whole struct, defaults everywhere.
  Guarded config(0xAB);
  REQUIRE(strata_optimizer_config_init(STRATA_OPTIMIZER_SGD, config.config()) == STRATA_OK);
  CHECK(config.first_written_from(sizeof(strata_optimizer_config_t), 0xAB) == sizeof config.bytes);
  CHECK(config.config()->struct_size == STRATA_OPTIMIZER_CONFIG_STRUCT_SIZE);
  CHECK(config.config()->state_placement == STRATA_STATE_PLACEMENT_DRAM);
  CHECK(config.config()->nvme_staging_bytes == 0);
  CHECK(config.config()->weight_decay == 0.f);
  Guarded same(0xAB);
  REQUIRE(new_init(STRATA_OPTIMIZER_SGD, same.config()) == STRATA_OK);
  CHECK(std::memcmp(same.bytes, config.bytes, sizeof same.bytes) == 0);
}

TEST_CASE("strata_layout_request_init@STRATA_1.3 writes only a 1.3 or 1.4 program's 80 bytes",
          "[abi]") {
  using Init = strata_status_t (*)(strata_layout_request_t*);
  const auto old_init =
      reinterpret_cast<Init>(dlvsym(RTLD_DEFAULT, "strata_layout_request_init", "STRATA_1.3"));
  const auto new_init =
      reinterpret_cast<Init>(dlvsym(RTLD_DEFAULT, "strata_layout_request_init", "STRATA_1.5"));
  REQUIRE(old_init != nullptr);
  REQUIRE(new_init != nullptr);
  REQUIRE(old_init != new_init);
  // 1.5 appended grad_sum after nvme_budget_bytes.
  constexpr size_t kOldSize = STRATA_STRUCT_SIZE(strata_layout_request_t, nvme_budget_bytes);
  static_assert(kOldSize == 80);
  static_assert(sizeof(strata_layout_request_t) == 88);
  alignas(strata_layout_request_t) unsigned char bytes[sizeof(strata_layout_request_t) + 16];
  std::memset(bytes, 0xAB, sizeof bytes);
  auto* request = reinterpret_cast<strata_layout_request_t*>(bytes);
  REQUIRE(old_init(request) == STRATA_OK);
  CHECK(request->struct_size == kOldSize);
  CHECK(request->dtype == STRATA_DTYPE_BF16);
  CHECK(request->staging_slots == 4);
  for (size_t i = kOldSize; i < sizeof bytes; ++i) REQUIRE(bytes[i] == 0xAB);
  CHECK(old_init(nullptr) == STRATA_ERROR_INVALID_ARGUMENT);

  // What a program built against this header calls: the whole struct, defaults everywhere.
  std::memset(bytes, 0xAB, sizeof bytes);
  REQUIRE(strata_layout_request_init(request) == STRATA_OK);
  CHECK(request->struct_size == STRATA_LAYOUT_REQUEST_STRUCT_SIZE);
  CHECK(request->grad_sum == STRATA_GRAD_SUM_ACCUMULATOR);
  CHECK(request->nvme_budget_bytes == 0);
  for (size_t i = sizeof(strata_layout_request_t); i < sizeof bytes; ++i) {
    REQUIRE(bytes[i] == 0xAB);
  }
  unsigned char same[sizeof bytes];
  std::memset(same, 0xAB, sizeof same);
  REQUIRE(new_init(reinterpret_cast<strata_layout_request_t*>(same)) == STRATA_OK);
  CHECK(std::memcmp(same, bytes, sizeof bytes) == 0);
}
