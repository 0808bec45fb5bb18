// Fault campaigns (issue 15; test_fault_campaign.cpp describes them) over whole training steps
// streaming NVMe-homed weights with an optimizer attached, and over checkpoint saves, replaces
// and loads; and a checkpoint load retried after an I/O error.
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "storage/fault_campaign.h"

using namespace fault_campaign;

namespace {

// ----- whole training steps: NVMe-homed weights streamed, an optimizer attached --------------

// Layers 0 and 2 stream their (frozen) weights from NVMe; layer 1's weight lives in DRAM and
// is trained by AdamW in explicit mode (the framework zeroes the grads after each update and
// those of an abandoned step, as torch's optimizer.zero_grad() would) and keeps an activation
// checkpoint.
class Training : public Scenario {
 public:
  static constexpr int kSteps = 3;

  Training(const Variant& v, std::shared_ptr<Injector> injector) {
    rt = make_runtime(scratch, v, injector);
    const uint64_t sizes[3][2] = {{100 * kKiB, 70 * kKiB + 1}, {96 * kKiB, 0}, {130 * kKiB, 0}};
    for (int l = 0; l < 3; ++l) {
      LayerSpec layer;
      layer.name = "layer" + std::to_string(l);
      for (int i = 0; i < 2 && sizes[l][i] != 0; ++i) {
        const std::string n = "l" + std::to_string(l) + ".w" + std::to_string(i);
        const bool trained = l == 1;
        const TensorId w = add_tensor(*rt, n, sizes[l][i], trained ? Tier::kDram : Tier::kNvme,
                                      Role::kWeight, trained ? DType::kF32 : DType::kU8);
        const TensorId g = add_tensor(*rt, n + ".grad", sizes[l][i], Tier::kDram, Role::kGrad,
                                      trained ? DType::kF32 : DType::kU8);
        layer.weights.push_back(w);
        layer.grads.push_back(g);
        if (trained) {
          const auto init = float_pattern(sizes[l][i] / 4, 7);
          REQUIRE(rt->write(w, 0, init.data(), init.size()).is_ok());
          trained_ = w;
          trained_grad_ = g;
        } else {
          frozen_.push_back({w, pattern(sizes[l][i], 10 + l * 2 + i)});
        }
      }
      if (l == 1) {
        activation_ = add_tensor(*rt, "l1.act", 20 * kKiB, Tier::kDram, Role::kActivation);
        layer.activations.push_back(activation_);
      }
      graph_.layers.push_back(std::move(layer));
    }
    OptimizerConfig c;
    c.kind = OptimizerKind::kAdamW;
    c.lr = 1e-2f;
    c.threads = 1;
    c.explicit_updates = true;
    REQUIRE(Optimizer::create(rt, c, &optimizer_).is_ok());
    REQUIRE(optimizer_->add_param(trained_, trained_grad_, 0).is_ok());
  }

  ~Training() override {
    if (optimizer_) (void)optimizer_->detach();
    executor_.reset();
  }

  std::vector<Step> steps() override {
    std::vector<Step> out;
    out.push_back(Step{"write the nvme weights",
                       [this] {
                         for (const auto& [id, data] : frozen_) {
                           STRATA_RETURN_IF_ERROR(rt->write(id, 0, data.data(), data.size()));
                         }
                         return Status::ok();
                       },
                       nullptr, nullptr});
    out.push_back(Step{"plan (measures nvme reads)",
                       [this] {
                         PlanConfig pc;
                         pc.h2d_bytes_per_second = 1e10;
                         pc.d2h_bytes_per_second = 1e10;
                         pc.hbm_slot_budget = 800 * kKiB;  // two slots: loads wait for free slots
                         return make_plan(*rt, graph_, pc, &plan_);
                       },
                       nullptr, nullptr});
    out.push_back(Step{"executor",
                       [this] {
                         STRATA_RETURN_IF_ERROR(Executor::create(rt, plan_, &executor_));
                         return optimizer_->attach(executor_.get());
                       },
                       nullptr, nullptr});
    for (int s = 0; s < kSteps; ++s) {
      out.push_back(Step{"training step " + std::to_string(s), [this, s] { return step(s); },
                         [this] {
                           // Abandon the step: it must not fail for a load that failed.
                           const Status a = executor_->step_abort(nullptr);
                           INFO(a.message());
                           REQUIRE(a.is_ok());
                           REQUIRE(optimizer_->grad_zero(trained_, false).is_ok());
                         },
                         [this] { check_frozen(); }});
    }
    return out;
  }

  std::vector<unsigned char> snapshot() override {
    check_frozen();
    REQUIRE(optimizer_->synchronize().is_ok());
    std::vector<unsigned char> all = read_all(*rt, trained_);
    for (StateKind k : {StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      TensorId id = 0;
      REQUIRE(optimizer_->state_tensor(trained_, k, &id).is_ok());
      const auto st = read_all(*rt, id);
      all.insert(all.end(), st.begin(), st.end());
    }
    REQUIRE(optimizer_->stats().step == static_cast<uint64_t>(kSteps));
    REQUIRE(executor_->stats().steps == static_cast<uint64_t>(kSteps));
    return all;
  }

 private:
  void check_frozen() {
    for (const auto& [id, data] : frozen_) REQUIRE_SAME(read_all(*rt, id), data);
  }

  // The framework's side of one step: checks every NVMe weight it is handed, writes the
  // checkpoint in the forward pass and finds it again in the backward pass, writes grads.
  Status step(int s) {
    STRATA_RETURN_IF_ERROR(executor_->step_begin());
    const auto act = pattern(20 * kKiB, 100 + s);
    auto pass = [&](uint32_t l, Phase phase) -> Status {
      LayerViews views;
      STRATA_RETURN_IF_ERROR(executor_->acquire(l, phase, nullptr, Executor::Wait::kHost, &views));
      const LayerSpec& layer = graph_.layers[l];
      for (std::size_t i = 0; i < layer.weights.size(); ++i) {
        for (const auto& [id, data] : frozen_) {
          if (id == layer.weights[i])
            REQUIRE(std::memcmp(views.weights[i], data.data(), data.size()) == 0);
        }
      }
      if (l == 1 && phase == Phase::kForward)
        std::memcpy(views.activations[0], act.data(), act.size());
      if (l == 1 && phase == Phase::kBackward) {
        REQUIRE(std::memcmp(views.activations[0], act.data(), act.size()) == 0);
      }
      if (phase == Phase::kBackward) {
        for (std::size_t i = 0; i < layer.grads.size(); ++i) {
          TensorRecord r;
          REQUIRE(rt->info(layer.grads[i], &r).is_ok());
          const auto g = l == 1 ? float_pattern(r.nbytes / 4, 200 + s) : pattern(r.nbytes, 300 + s);
          std::memcpy(views.grads[i], g.data(), g.size());
        }
      }
      return executor_->release(l, phase, nullptr);
    };
    for (uint32_t l = 0; l < 3; ++l) STRATA_RETURN_IF_ERROR(pass(l, Phase::kForward));
    for (uint32_t l = 3; l-- > 0;) STRATA_RETURN_IF_ERROR(pass(l, Phase::kBackward));
    STRATA_RETURN_IF_ERROR(executor_->step_end());
    STRATA_RETURN_IF_ERROR(optimizer_->step());
    STRATA_RETURN_IF_ERROR(optimizer_->synchronize());
    return optimizer_->grad_zero(trained_, false);  // optimizer.zero_grad()
  }

  LayerGraph graph_;
  Plan plan_;
  std::shared_ptr<Optimizer> optimizer_;
  std::unique_ptr<Executor> executor_;
  std::vector<std::pair<TensorId, std::vector<unsigned char>>> frozen_;
  TensorId trained_ = 0, trained_grad_ = 0, activation_ = 0;
};

// ----- checkpoints: save (reads NVMe weights), replace a saved one, load (writes them) --------

class Checkpoints : public Scenario {
 public:
  // load_state: the load restores the optimizer's state too; else the weights only, and the
  // optimizer goes on from where it was.
  Checkpoints(const Variant& v, std::shared_ptr<Injector> injector, bool load_state)
      : load_state_(load_state) {
    rt = make_runtime(scratch, v, injector);
    nvme_ = add_tensor(*rt, "w.nvme", 150 * kKiB + 7, Tier::kNvme, Role::kWeight);
    dram_ = add_tensor(*rt, "w.dram", 64 * kKiB, Tier::kDram, Role::kWeight, DType::kF32);
    grad_ = add_tensor(*rt, "w.dram.grad", 64 * kKiB, Tier::kDram, Role::kGrad, DType::kF32);
    const auto w = float_pattern(16 * kKiB, 20);
    const auto g = float_pattern(16 * kKiB, 21);
    REQUIRE(rt->write(dram_, 0, w.data(), w.size()).is_ok());
    REQUIRE(rt->write(grad_, 0, g.data(), g.size()).is_ok());
    OptimizerConfig c;
    c.kind = OptimizerKind::kAdamW;
    c.threads = 1;
    REQUIRE(Optimizer::create(rt, c, &optimizer_).is_ok());
    REQUIRE(optimizer_->add_param(dram_, grad_, 0).is_ok());
    REQUIRE(optimizer_->step().is_ok());
    path_ = scratch.file("ck");
  }

  std::vector<Step> steps() override {
    const auto v1 = pattern(150 * kKiB + 7, 22);
    const auto v2 = pattern(150 * kKiB + 7, 23);
    const auto v3 = pattern(150 * kKiB + 7, 24);
    return {
        Step{"write the nvme weight", [=, this] { return write_nvme(v1); }, nullptr, nullptr},
        Step{"save", [this] { return save(); }, nullptr, nullptr},
        Step{"train on: nvme weight rewritten, an update",
             [=, this] {
               STRATA_RETURN_IF_ERROR(write_nvme(v2));
               return optimizer_->step();
             },
             nullptr, nullptr},
        Step{"save over the first checkpoint", [this] { return save(); }, nullptr,
             [this] {
               // The checkpoint on disk is still the first one, whole.
               REQUIRE_SAME(saved_model(path_), saved_[0]);
             }},
        Step{"train on: the state changes again",
             [=, this] {
               STRATA_RETURN_IF_ERROR(write_nvme(v3));
               return optimizer_->step();
             },
             nullptr, nullptr},
        Step{"load",
             [this] {
               return load_checkpoint(*rt, load_state_ ? optimizer_.get() : nullptr, path_);
             },
             nullptr,
             [this] {
               // The checkpoint is untouched by a failed load.
               REQUIRE_SAME(saved_model(path_), saved_[1]);
             }},
    };
  }

  std::vector<unsigned char> snapshot() override {
    // The loaded weights are the second checkpoint's, and training goes on from them.
    REQUIRE_SAME(state(), saved_[1]);
    REQUIRE(optimizer_->stats().step == (load_state_ ? 2u : 3u));
    REQUIRE(optimizer_->step().is_ok());
    return saved_[1];
  }

 private:
  Status write_nvme(const std::vector<unsigned char>& v) {
    STRATA_RETURN_IF_ERROR(rt->write(nvme_, 0, v.data(), v.size()));
    nvme_value_ = v;
    return Status::ok();
  }

  Status save() {
    STRATA_RETURN_IF_ERROR(save_checkpoint(*rt, optimizer_.get(), path_));
    // What it saved, without reading NVMe (a read here would be one of the steps' transfers).
    auto all = read_all(*rt, dram_);
    all.insert(all.end(), nvme_value_.begin(), nvme_value_.end());
    saved_.push_back(std::move(all));
    return Status::ok();
  }

  // The weights (by name order, as the checkpoint holds them), read from their tiers.
  std::vector<unsigned char> state() {
    auto all = read_all(*rt, dram_);
    const auto n = read_all(*rt, nvme_);
    all.insert(all.end(), n.begin(), n.end());
    return all;
  }

  // The weights as the checkpoint directory holds them, read with the safetensors reader.
  static std::vector<unsigned char> saved_model(const std::string& path) {
    std::string dir;
    REQUIRE(resolve_atomic_directory(path, &dir).is_ok());
    std::unique_ptr<safetensors::Reader> reader;
    REQUIRE(safetensors::Reader::open(dir + "/" + kModelFile, &reader).is_ok());
    std::vector<unsigned char> all;
    for (const char* name : {"w.dram", "w.nvme"}) {
      const safetensors::TensorInfo* info = reader->find(name);
      REQUIRE(info != nullptr);
      REQUIRE(reader
                  ->read_tensor(*info, 1 << 20,
                                [&](const void* d, uint64_t, uint64_t n) {
                                  const auto* p = static_cast<const unsigned char*>(d);
                                  all.insert(all.end(), p, p + n);
                                  return Status::ok();
                                })
                  .is_ok());
    }
    return all;
  }

  const bool load_state_;
  TensorId nvme_ = 0, dram_ = 0, grad_ = 0;
  std::shared_ptr<Optimizer> optimizer_;
  std::string path_;
  std::vector<unsigned char> nvme_value_;          // what the NVMe weight holds
  std::vector<std::vector<unsigned char>> saved_;  // the state each successful save wrote
};

}  // namespace

TEST_CASE("fault campaign: training steps streaming NVMe-homed weights", "[nvme][campaign]") {
  for (const Variant& v : variants({IoEngineKind::kUring, false})) {
    run_campaign("training", factory<Training>(), v);
  }
}

// Saves carry the optimizer's state; loads restore the weights only, or the optimizer's state
// too (a load that failed part-way fails the optimizer until a load succeeds).
TEST_CASE("fault campaign: checkpoint save, replace and load", "[nvme][campaign]") {
  for (const bool load_state : {false, true}) {
    const Factory factory = [load_state](const Variant& v, std::shared_ptr<Injector> injector) {
      return std::unique_ptr<Scenario>(new Checkpoints(v, std::move(injector), load_state));
    };
    for (const Variant& v : variants({IoEngineKind::kPosix, true})) {
      run_campaign(load_state ? "checkpoints with state" : "checkpoints", factory, v);
    }
  }
}

// strata.h: after a load failed part-way "the optimizer refuses to step until a load succeeds".
// It once could never succeed (the load's quiesce returned the failure it was meant to clear).
TEST_CASE("a checkpoint load with the optimizer can be retried after an I/O error",
          "[nvme][campaign]") {
  auto injector = std::make_shared<Injector>();
  Checkpoints scenario({IoEngineKind::kPosix, false}, injector, true);
  for (Step& step : scenario.steps()) {
    if (step.name == "load") {
      injector->target = injector->calls + 1;  // the load's first transfer
      injector->fault = Fault::kEio;
      const Status failed = step.run();
      INFO(failed.message());
      REQUIRE(failed.code() == Code::kIo);
      injector->disarm();
    }
    const Status s = step.run();
    INFO(step.name << ": " << s.message());
    REQUIRE(s.is_ok());
  }
}
