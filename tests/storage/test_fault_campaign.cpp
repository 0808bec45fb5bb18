// Fault campaigns (issue 15): every I/O request of a scenario fails in turn. A scenario is a
// list of steps a caller takes (tensor moves between every tier and NVMe, byte ranges of NVMe
// tensors, whole training steps streaming NVMe-homed weights with an optimizer attached,
// checkpoint saves and loads). A clean run counts the scenario's transfers through the storage
// engine's fault hook; then, for each transfer k, the scenario runs again with the k-th one
// failing with ENOSPC, then EIO, then cut short. A failed step must end in IO naming the errno,
// leave what it did not write intact (checked at once), and succeed when retried once the fault
// is gone; a short transfer must be resumed without anyone noticing. Every run ends with all
// data bit-identical to the clean run's, no extent, file descriptor or thread left behind, and
// a watchdog against hangs.
//
// The default run (a few seconds) fails every transfer of each scenario once, with ENOSPC, EIO
// or a short transfer in turn, on one engine/DRAM-path variant per scenario.
// STRATA_FAULT_CAMPAIGN=full fails every transfer with each of the three, on all four variants
// (io_uring and POSIX, staged and direct DRAM transfers); "full:N" on variant N only, which
// scripts/soak.sh rotates. This file: the tensor moves and byte ranges campaigns;
// test_fault_campaign_training.cpp: training steps and checkpoints; fault_campaign.h: the
// harness.
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "storage/fault_campaign.h"

using namespace fault_campaign;

namespace {

// ----- moves: DRAM -> NVMe -> HBM -> NVMe -> DRAM, and HBM -> NVMe -> DRAM -----------------

class Moves : public Scenario {
 public:
  Moves(const Variant& v, std::shared_ptr<Injector> injector) {
    rt = make_runtime(scratch, v, injector);
    a_ = add_tensor(*rt, "a", 300 * kKiB + 5, Tier::kDram);  // 5 pieces, the last partial
    b_ = add_tensor(*rt, "b", 150 * kKiB, Tier::kHbm);
    REQUIRE(rt->write(a_, 0, data_a_.data(), data_a_.size()).is_ok());
    REQUIRE(rt->write(b_, 0, data_b_.data(), data_b_.size()).is_ok());
  }

  std::vector<Step> steps() override {
    auto move_step = [this](const char* name, TensorId id, Tier from, Tier to) {
      return Step{name, [=, this] { return move(*rt, id, to); }, nullptr,
                  [=, this] {
                    // A failed move leaves the tensor where it was, whole.
                    REQUIRE(tier_of(*rt, id) == from);
                    REQUIRE_SAME(read_all(*rt, id), id == a_ ? data_a_ : data_b_);
                  }};
    };
    return {move_step("a dram->nvme", a_, Tier::kDram, Tier::kNvme),
            move_step("b hbm->nvme", b_, Tier::kHbm, Tier::kNvme),
            move_step("a nvme->hbm", a_, Tier::kNvme, Tier::kHbm),
            move_step("b nvme->dram", b_, Tier::kNvme, Tier::kDram),
            move_step("a hbm->nvme", a_, Tier::kHbm, Tier::kNvme),
            move_step("a nvme->dram", a_, Tier::kNvme, Tier::kDram)};
  }

  std::vector<unsigned char> snapshot() override {
    REQUIRE_SAME(read_all(*rt, a_), data_a_);
    REQUIRE_SAME(read_all(*rt, b_), data_b_);
    return {static_cast<unsigned char>(tier_of(*rt, a_)),
            static_cast<unsigned char>(tier_of(*rt, b_))};
  }

 private:
  TensorId a_ = 0, b_ = 0;
  const std::vector<unsigned char> data_a_ = pattern(300 * kKiB + 5, 1);
  const std::vector<unsigned char> data_b_ = pattern(150 * kKiB, 2);
};

// ----- byte ranges of NVMe-homed tensors (strata_tensor_read / strata_tensor_write) ----------

class Ranges : public Scenario {
 public:
  Ranges(const Variant& v, std::shared_ptr<Injector> injector) {
    rt = make_runtime(scratch, v, injector);
    r_ = add_tensor(*rt, "r", model_.size(), Tier::kNvme);  // 4 pieces, the last partial
    s_ = add_tensor(*rt, "s", 10 * kKiB, Tier::kNvme);
  }

  std::vector<Step> steps() override {
    return {write_step("s whole", s_, 0, pattern(10 * kKiB, 3)),
            write_step("r whole", r_, 0, pattern(model_.size(), 4)),
            write_step("r unaligned", r_, 70000, pattern(100000, 5)),
            read_step("r read part", 1000, 149000),
            write_step("r across a piece boundary", r_, 131070, pattern(5, 6)),
            read_step("r read whole", 0, model_.size())};
  }

  std::vector<unsigned char> snapshot() override {
    REQUIRE_SAME(read_all(*rt, r_), model_);
    std::vector<unsigned char> all = read_all(*rt, s_);
    all.insert(all.end(), model_.begin(), model_.end());
    return all;
  }

 private:
  std::vector<unsigned char>& model_of(TensorId id) { return id == r_ ? model_ : model_s_; }

  Step write_step(const char* name, TensorId id, uint64_t offset, std::vector<unsigned char> d) {
    auto data = std::make_shared<std::vector<unsigned char>>(std::move(d));
    return Step{name,
                [=, this] {
                  STRATA_RETURN_IF_ERROR(rt->write(id, offset, data->data(), data->size()));
                  std::copy(data->begin(), data->end(), model_of(id).begin() + offset);
                  return Status::ok();
                },
                nullptr,
                [=, this] {
                  // The tensor stays readable (no false DATA_CORRUPTION from a piece the failed
                  // write may have reached); bytes outside the range are as they were, each
                  // byte inside holds its old or its new value.
                  const auto now = read_all(*rt, id);
                  const auto& before = model_of(id);
                  for (uint64_t i = 0; i < now.size(); ++i) {
                    const bool inside = i >= offset && i < offset + data->size();
                    if (now[i] == before[i] || (inside && now[i] == (*data)[i - offset])) continue;
                    FAIL("byte " << i << " of the tensor is neither its old nor its new value");
                  }
                  if (id == r_) REQUIRE_SAME(read_all(*rt, s_), model_s_);
                }};
  }

  Step read_step(const char* name, uint64_t offset, uint64_t bytes) {
    return Step{name,
                [=, this] {
                  std::vector<unsigned char> out(bytes);
                  STRATA_RETURN_IF_ERROR(rt->read(r_, offset, out.data(), bytes));
                  REQUIRE(std::equal(out.begin(), out.end(), model_.begin() + offset));
                  return Status::ok();
                },
                nullptr, nullptr};
  }

  TensorId r_ = 0, s_ = 0;
  std::vector<unsigned char> model_ = std::vector<unsigned char>(200 * kKiB + 3, 0);
  std::vector<unsigned char> model_s_ = std::vector<unsigned char>(10 * kKiB, 0);
};

}  // namespace

TEST_CASE("fault campaign: tensor moves between every tier and NVMe", "[nvme][campaign]") {
  for (const Variant& v : variants({IoEngineKind::kUring, false})) {
    run_campaign("moves", factory<Moves>(), v);
  }
  if (!full_campaign()) run_campaign("moves", factory<Moves>(), {IoEngineKind::kPosix, true});
}

TEST_CASE("fault campaign: byte ranges of NVMe tensors", "[nvme][campaign]") {
  for (const Variant& v : variants({IoEngineKind::kPosix, false})) {
    run_campaign("ranges", factory<Ranges>(), v);
  }
}
