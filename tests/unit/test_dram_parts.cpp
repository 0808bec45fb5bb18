// The DRAM arena's two parts (RuntimeOptions::dram_pinned): new optimizer state is known zero
// in the unpinned part as it was in the one arena (Runtime::register_tensor's `zeroed`), each
// part keeping its own mark, and a block in a hole is not. The probes standing for the state
// (the update rate, the disk's) measure in the state's part.
#include <catch2/catch.hpp>

#include <cstring>

#include "runtime/optimizer/update_probe.h"
#include "runtime/runtime.h"
#include "tests/support/scratch_dir.h"

namespace {

constexpr uint64_t kMiB = 1ull << 20;

// `nvme_file`: an NVMe tier of 8 MiB in that file.
std::shared_ptr<strata::Runtime> make(uint64_t dram, uint64_t pinned,
                                      const std::string& nvme_file = "") {
  strata::RuntimeOptions options;
  options.device.kind = strata::DeviceKind::kHost;
  options.budgets = {4 * kMiB, dram, nvme_file.empty() ? 0 : 8 * kMiB};
  options.dram_pinned = pinned;
  if (!nvme_file.empty()) options.nvme.paths = {nvme_file};
  std::shared_ptr<strata::Runtime> rt;
  const strata::Status s = strata::Runtime::create(options, &rt);
  INFO(s.message());
  REQUIRE(s.is_ok());
  return rt;
}

strata::TensorId add(strata::Runtime& rt, const std::string& name, uint64_t bytes,
                     strata::Role role, bool* zeroed, uint64_t skew = 0) {
  strata::TensorSpec spec;
  spec.name = name;
  spec.dtype = strata::DType::kU8;
  spec.shape = {static_cast<int64_t>(bytes)};
  spec.role = role;
  spec.home = strata::Tier::kDram;
  strata::TensorId id = 0;
  const strata::Status s = rt.register_tensor(spec, &id, skew, zeroed);
  INFO(s.message());
  REQUIRE(s.is_ok());
  return id;
}

uint64_t offset_of(strata::Runtime& rt, strata::TensorId id) {
  strata::TensorRecord r;
  REQUIRE(rt.info(id, &r).is_ok());
  return r.offset - r.skew;
}

}  // namespace

TEST_CASE("new optimizer state in the unpinned part is known zero; a hole is not", "[dram_parts]") {
  auto rt = make(8 * kMiB, 2 * kMiB);
  REQUIRE(rt->dram_pinned_size() == 2 * kMiB);
  REQUIRE(rt->dram_region().pinned_bytes() == 2 * kMiB);
  bool zeroed = false;
  // The pinned part hands out blocks first: the unpinned part's mark is its own.
  const strata::TensorId w = add(*rt, "w", 3 * 4096, strata::Role::kWeight, &zeroed);
  REQUIRE(zeroed);
  REQUIRE(offset_of(*rt, w) == 0);
  const strata::TensorId m =
      add(*rt, "m", 2 * 4096 - 64, strata::Role::kOptimizerState, &zeroed, 64);
  REQUIRE(zeroed);
  REQUIRE(offset_of(*rt, m) == 2 * kMiB);
  // Written, freed, and taken again: not known zero any more.
  const std::vector<unsigned char> ones(2 * 4096 - 64, 1);
  REQUIRE(rt->write(m, 0, ones.data(), ones.size()).is_ok());
  REQUIRE(rt->unregister(m).is_ok());
  const strata::TensorId v = add(*rt, "v", 2 * 4096, strata::Role::kOptimizerState, &zeroed);
  REQUIRE_FALSE(zeroed);
  REQUIRE(offset_of(*rt, v) == 2 * kMiB);
  // Beyond the unpinned part's mark: zero, whatever the pinned part's blocks reached.
  const strata::TensorId low = add(*rt, "low", 3 * 4096, strata::Role::kOptimizerState, &zeroed);
  REQUIRE(zeroed);
  REQUIRE(offset_of(*rt, low) == 2 * kMiB + 2 * 4096);
  std::vector<unsigned char> back(3 * 4096, 0xFF);
  REQUIRE(rt->read(low, 0, back.data(), back.size()).is_ok());
  REQUIRE(back == std::vector<unsigned char>(3 * 4096, 0));
  // The pinned part's own mark: a weight after the first is zero there, above w.
  const strata::TensorId g = add(*rt, "g", 4096, strata::Role::kGrad, &zeroed);
  REQUIRE(zeroed);
  REQUIRE(offset_of(*rt, g) == 3 * 4096);
}

TEST_CASE("state falling back into the pinned part is known zero only above its mark",
          "[dram_parts]") {
  auto rt = make(2 * kMiB, kMiB);
  bool zeroed = false;
  const strata::TensorId fill = add(*rt, "fill", kMiB, strata::Role::kOptimizerState, &zeroed);
  REQUIRE(offset_of(*rt, fill) == kMiB);
  const strata::TensorId w = add(*rt, "w", 4096, strata::Role::kWeight, &zeroed);
  const std::vector<unsigned char> ones(4096, 1);
  REQUIRE(rt->write(w, 0, ones.data(), ones.size()).is_ok());
  REQUIRE(rt->unregister(w).is_ok());
  // The unpinned part is full: state goes to the pinned part, into w's old block first.
  const strata::TensorId s1 = add(*rt, "s1", 4096, strata::Role::kOptimizerState, &zeroed);
  REQUIRE(offset_of(*rt, s1) == 0);
  REQUIRE_FALSE(zeroed);
  const strata::TensorId s2 = add(*rt, "s2", 4096, strata::Role::kOptimizerState, &zeroed);
  REQUIRE(offset_of(*rt, s2) == 4096);
  REQUIRE(zeroed);
  // State in the pinned part only takes pinned room: no fallback counted.
  REQUIRE(rt->tier_usage(strata::Tier::kDram).fallbacks == 0);
}

TEST_CASE("no dram_pinned: one part, every role in it, as before", "[dram_parts]") {
  auto rt = make(4 * kMiB, 0);
  REQUIRE(rt->dram_pinned_size() == 4 * kMiB);
  REQUIRE(rt->dram_region().pinned_bytes() == 4 * kMiB);
  bool zeroed = false;
  const strata::TensorId w = add(*rt, "w", 4096, strata::Role::kWeight, &zeroed);
  const strata::TensorId m = add(*rt, "m", 4096, strata::Role::kOptimizerState, &zeroed);
  REQUIRE(offset_of(*rt, w) == 0);
  REQUIRE(offset_of(*rt, m) == 4096);
  const strata::TierUsage u = rt->tier_usage(strata::Tier::kDram);
  REQUIRE(u.budget == 4 * kMiB);
  REQUIRE(u.pinned_budget == 4 * kMiB);
  REQUIRE(u.pinned_used == 2 * 4096);
  REQUIRE(u.fallbacks == 0);
}

TEST_CASE(
    "the update-rate probe is sized by the state's part, the memory the state it stands "
    "for lives in",
    "[dram_parts]") {
  // The pinned part is the larger: a probe sized by the tier's largest free block would not
  // fit the unpinned part and would take pinned room instead.
  auto rt = make(64 * kMiB, 40 * kMiB);
  REQUIRE(rt->dram_largest_free_for(strata::Role::kOptimizerState) == 24 * kMiB);
  REQUIRE(rt->dram_largest_free_for(strata::Role::kWeight) == 40 * kMiB);
  double rate = 0;
  REQUIRE(strata::optim::measure_update_rate(*rt, &rate).is_ok());
  REQUIRE(rate > 0);
  const strata::TierUsage u = rt->tier_usage(strata::Tier::kDram);
  REQUIRE(u.fallbacks == 0);
  REQUIRE(u.used == 0);
}

TEST_CASE("the disk probes move data through the state's part, at its offset in the tier",
          "[dram_parts]") {
  strata_test::ScratchDir scratch;
  auto rt = make(4 * kMiB, kMiB, scratch.file("nvme"));
  // The pinned part full of a weight: a probe buffer there would be no room at all
  // (OUT_OF_MEMORY), and the read probe's buffer placed at the unpinned arena's own offset
  // rather than the tier's would land on the weight's bytes. (The write probe reads back the
  // bytes it wrote from the same buffers, so a wrong offset there leaves the weight as it was:
  // only its use of the state's part is checked.)
  bool zeroed = false;
  const strata::TensorId w = add(*rt, "w", kMiB, strata::Role::kWeight, &zeroed);
  REQUIRE(offset_of(*rt, w) == 0);
  const std::vector<unsigned char> pattern(kMiB, 0xA5);
  REQUIRE(rt->write(w, 0, pattern.data(), pattern.size()).is_ok());
  REQUIRE(rt->dram_largest_free_for(strata::Role::kWeight) == 0);
  REQUIRE(rt->dram_largest_free_for(strata::Role::kOptimizerState) == 3 * kMiB);

  double read_rate = 0;
  strata::Status s = rt->measure_nvme_read(&read_rate);
  INFO(s.message());
  REQUIRE(s.is_ok());
  REQUIRE(read_rate > 0);
  double read = 0, write = 0, mixed = 0;
  s = rt->measure_nvme(&read, &write, &mixed);
  INFO(s.message());
  REQUIRE(s.is_ok());
  REQUIRE(read > 0);
  REQUIRE(write > 0);

  // The buffers went back to the part they came from, and the weight is untouched.
  const strata::TierUsage u = rt->tier_usage(strata::Tier::kDram);
  REQUIRE(u.used == kMiB);
  REQUIRE(u.pinned_used == kMiB);
  REQUIRE(u.fallbacks == 0);
  REQUIRE(rt->dram_largest_free_for(strata::Role::kOptimizerState) == 3 * kMiB);
  std::vector<unsigned char> back(kMiB, 0);
  REQUIRE(rt->read(w, 0, back.data(), back.size()).is_ok());
  REQUIRE(back == pattern);
}
