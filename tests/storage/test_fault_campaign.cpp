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
// scripts/soak.sh rotates.
#include <catch2/catch.hpp>

#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <thread>

#include "runtime/checkpoint/atomic_directory.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/optimizer/optimizer.h"
#include "runtime/runtime.h"
#include "runtime/stream/executor.h"
#include "support/scratch_dir.h"

using namespace strata;
using strata_test::ScratchDir;

namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kBlock = 64 * kKiB;  // stripe unit: tensors below span 1-5 pieces

enum class Fault { kEnospc, kEio, kShort };
const Fault kFaults[] = {Fault::kEnospc, Fault::kEio, Fault::kShort};

const char* fault_name(Fault f) {
  return f == Fault::kEnospc ? "ENOSPC" : f == Fault::kEio ? "EIO" : "short";
}

// Sees every transfer of one runtime's storage engine: counts them, and alters the target-th.
struct Injector {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> target{0};  // 1-based; 0: none
  Fault fault = Fault::kEio;
  std::atomic<bool> fired{false};
  std::atomic<int> fired_op{-1};

  int64_t filter(IoOp op, int64_t result) {
    const uint64_t n = calls.fetch_add(1) + 1;
    if (n != target.load()) return result;
    fired = true;
    fired_op = static_cast<int>(op);
    switch (fault) {
      case Fault::kEnospc:
        return -ENOSPC;
      case Fault::kEio:
        return -EIO;
      case Fault::kShort:  // half of it, still 512-aligned: the engine must resume the rest
        return result > 1024 ? result / 2 / 512 * 512 : result;
    }
    return result;
  }
  void disarm() { target = 0; }
};

struct Variant {
  IoEngineKind engine;
  bool direct;
};
std::string variant_name(const Variant& v) {
  return std::string(v.engine == IoEngineKind::kUring ? "io_uring" : "posix") +
         (v.direct ? ", direct" : ", staged");
}

std::shared_ptr<Runtime> make_runtime(const ScratchDir& scratch, const Variant& v,
                                      const std::shared_ptr<Injector>& injector) {
  RuntimeOptions o;
  o.device.kind = DeviceKind::kHost;
  o.budgets = {4ull << 20, 4ull << 20, 1ull << 20};  // planning reads all free NVMe
  o.dram.threads = 1;
  o.nvme.paths = {scratch.file("nvme0"), scratch.file("nvme1")};  // striped over two files
  o.nvme.engine = v.engine;
  o.nvme.block_size = kBlock;
  o.nvme.queue_depth = 2;  // fewer staging slots than pieces: the pipelines wrap around
  o.nvme.checksums = true;
  o.nvme.direct_dram = v.direct;
  o.nvme.fault_hook = [injector](IoOp op, int, uint64_t, uint64_t, int64_t result) {
    return injector->filter(op, result);
  };
  std::shared_ptr<Runtime> rt;
  const Status s = Runtime::create(o, &rt);
  INFO(s.message());
  REQUIRE(s.is_ok());
  return rt;
}

std::vector<unsigned char> pattern(uint64_t n, uint64_t seed) {
  std::vector<unsigned char> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  return v;
}

// Small finite floats (grads, weights) as bytes.
std::vector<unsigned char> float_pattern(uint64_t count, uint64_t seed) {
  std::vector<float> f(count);
  const auto bits = pattern(count, seed);
  for (uint64_t i = 0; i < count; ++i) f[i] = (static_cast<float>(bits[i]) - 127.5f) / 512.f;
  std::vector<unsigned char> out(count * sizeof(float));
  std::memcpy(out.data(), f.data(), out.size());
  return out;
}

TensorId add_tensor(Runtime& rt, const std::string& name, uint64_t bytes, Tier home,
                    Role role = Role::kOther, DType dtype = DType::kU8) {
  TensorSpec spec;
  spec.name = name;
  spec.dtype = dtype;
  spec.shape = {static_cast<int64_t>(bytes / dtype_size(dtype))};
  spec.role = role;
  spec.home = home;
  TensorId id = 0;
  const Status s = rt.register_tensor(spec, &id);
  INFO(s.message());
  REQUIRE(s.is_ok());
  return id;
}

std::vector<unsigned char> read_all(Runtime& rt, TensorId id) {
  TensorRecord r;
  REQUIRE(rt.info(id, &r).is_ok());
  std::vector<unsigned char> out(r.nbytes);
  const Status s = rt.read(id, 0, out.data(), out.size());
  INFO("reading '" << r.spec.name << "': " << s.message());
  REQUIRE(s.is_ok());
  return out;
}

// Byte-for-byte equality that names the first difference (Catch would print both vectors).
std::string difference(const std::vector<unsigned char>& got,
                       const std::vector<unsigned char>& want) {
  if (got.size() != want.size()) {
    return "sizes differ: " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  }
  const auto m = std::mismatch(got.begin(), got.end(), want.begin());
  if (m.first == got.end()) return "";
  return "first difference at byte " + std::to_string(m.first - got.begin()) + " of " +
         std::to_string(got.size());
}
#define REQUIRE_SAME(got, want) REQUIRE(difference((got), (want)) == "")

Tier tier_of(Runtime& rt, TensorId id) {
  TensorRecord r;
  REQUIRE(rt.info(id, &r).is_ok());
  return r.tier;
}

Status move(Runtime& rt, TensorId id, Tier dst) {
  std::shared_ptr<Completion> done;
  STRATA_RETURN_IF_ERROR(rt.move(id, dst, nullptr, &done));
  return done->wait(-1);
}

std::size_t count_fds() {
  std::size_t n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

// The process's threads, less io_uring's kernel workers ("iou-wrk-N"), which the kernel
// starts and retires on its own schedule.
std::size_t count_threads() {
  std::size_t n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
      std::string name;
      std::getline(comm, name);
      if (name.rfind("iou-", 0) != 0) ++n;
    }
    closedir(d);
  }
  return n;
}

// Aborts the process if `body` runs longer than `seconds`: a hang is a failure, not a stuck job.
void with_watchdog(int seconds, const std::string& what, const std::function<void()>& body) {
  std::promise<void> finished;
  std::thread watchdog([seconds, what, f = finished.get_future()]() mutable {
    if (f.wait_for(std::chrono::seconds(seconds)) == std::future_status::timeout) {
      std::fprintf(stderr, "WATCHDOG: %s still running after %d s\n", what.c_str(), seconds);
      std::abort();
    }
  });
  struct Stop {
    std::promise<void>& p;
    std::thread& t;
    ~Stop() {
      p.set_value();
      t.join();
    }
  } stop{finished, watchdog};
  body();
}

// One thing a caller does. After `run` failed: `recover` is what the caller does before trying
// again (abandon a step...), `check` that the data the step did not set out to change survived.
struct Step {
  std::string name;
  std::function<Status()> run;
  std::function<void()> recover;
  std::function<void()> check;
};

class Scenario {
 public:
  virtual ~Scenario() = default;
  virtual std::vector<Step> steps() = 0;
  // Every byte the scenario owns, and where it lives: equal to the clean run's at the end.
  virtual std::vector<unsigned char> snapshot() = 0;
  // Tier usage at the end: no extent or block leaked by a failure.
  std::vector<uint64_t> usage() {
    std::vector<uint64_t> u;
    for (Tier t : {Tier::kHbm, Tier::kDram, Tier::kNvme}) u.push_back(rt->tier_usage(t).used);
    return u;
  }

  ScratchDir scratch;
  std::shared_ptr<Runtime> rt;
};

using Factory = std::function<std::unique_ptr<Scenario>(const Variant&, std::shared_ptr<Injector>)>;

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

// ----- the campaign driver --------------------------------------------------------------------

struct Tally {
  uint64_t points = 0;                    // transfers of a clean run
  std::map<Fault, uint64_t> runs;         // scenario runs per fault
  std::map<Fault, uint64_t> failed;       // runs whose step failed cleanly, retried, recovered
  std::map<std::string, uint64_t> where;  // failed steps by name
};

// STRATA_FAULT_CAMPAIGN: unset, the default run; "full", every fault at every transfer on all
// four variants; "full:N", the same on variant N of kAllVariants only (the soak rotates N).
std::string campaign_mode() {
  const char* e = std::getenv("STRATA_FAULT_CAMPAIGN");
  return e != nullptr ? e : "";
}
bool full_campaign() {
  return campaign_mode().rfind("full", 0) == 0;
}

// One run with transfer `k` altered by `fault`.
void run_injected(const Factory& factory, const Variant& v, uint64_t k, Fault fault,
                  const std::vector<unsigned char>& golden, const std::vector<uint64_t>& usage,
                  Tally* tally) {
  auto injector = std::make_shared<Injector>();
  injector->target = k;
  injector->fault = fault;
  auto scenario = factory(v, injector);
  int failures = 0;
  std::string failed_steps;
  for (Step& step : scenario->steps()) {
    const Status s = step.run();
    if (s.is_ok()) continue;
    ++failures;
    failed_steps += "'" + step.name + "': " + s.message() + "; ";
    INFO("step '" << step.name << "' failed: " << s.message());
    REQUIRE(injector->fired);
    REQUIRE(fault != Fault::kShort);  // a short transfer is resumed, never an error
    REQUIRE(s.code() == Code::kIo);
    const int err = fault == Fault::kEnospc ? ENOSPC : EIO;
    REQUIRE_THAT(s.message(), Catch::Contains(std::strerror(err)) &&
                                  Catch::Contains("(errno " + std::to_string(err) + ")") &&
                                  Catch::Contains(scenario->scratch.path()));
    injector->disarm();
    if (step.recover) step.recover();
    if (step.check) step.check();
    const Status again = step.run();
    INFO("retry: " << again.message());
    REQUIRE(again.is_ok());
    ++tally->where[step.name];
  }
  INFO("failed steps: " << failed_steps);
  REQUIRE(injector->fired);
  // An injected error is reported exactly once, by the step whose transfer it hit.
  REQUIRE(failures == (fault == Fault::kShort ? 0 : 1));
  REQUIRE_SAME(scenario->snapshot(), golden);
  REQUIRE(scenario->usage() == usage);
  ++tally->runs[fault];
  if (failures > 0) ++tally->failed[fault];
}

Tally run_campaign(const std::string& name, const Factory& factory, const Variant& v) {
  INFO("campaign " << name << " (" << variant_name(v) << ")");
  Tally tally;
  std::vector<unsigned char> golden;
  std::vector<uint64_t> usage;
  {
    auto injector = std::make_shared<Injector>();
    auto scenario = factory(v, injector);
    for (Step& step : scenario->steps()) {
      const Status s = step.run();
      INFO("clean run, step '" << step.name << "': " << s.message());
      REQUIRE(s.is_ok());
    }
    tally.points = injector->calls;
    golden = scenario->snapshot();
    usage = scenario->usage();
  }
  REQUIRE(tally.points > 0);
  // Counted after a whole run, so that threads started once per process (ThreadSanitizer's
  // background thread) are already there.
  const std::size_t fds = count_fds();
  const std::size_t threads = count_threads();
  for (uint64_t k = 1; k <= tally.points; ++k) {
    for (Fault fault : kFaults) {
      // The default run gives each transfer one of the faults, in turn (each fault hits every
      // third transfer, and every step of the scenario); the full campaign gives it all three.
      if (!full_campaign() && fault != kFaults[k % 3]) continue;
#if defined(__SANITIZE_THREAD__)
      // ThreadSanitizer slows each run ~10x: its default run takes every other transfer (the
      // release and ASan runs take them all; the soak's full sweeps run under TSan too).
      if (!full_campaign() && k % 2 == 0) continue;
#endif
      INFO("transfer " << k << " of " << tally.points << ": " << fault_name(fault));
      with_watchdog(120, name + " transfer " + std::to_string(k) + " " + fault_name(fault),
                    [&] { run_injected(factory, v, k, fault, golden, usage, &tally); });
    }
  }
  // Every runtime was destroyed whole: its files, io_uring and threads are gone.
  REQUIRE(count_fds() == fds);
  REQUIRE(count_threads() == threads);
  std::printf(
      "fault campaign %-11s (%s): %3llu transfers; ENOSPC %llu/%llu, EIO %llu/%llu "
      "failed cleanly and recovered, short %llu/%llu resumed; failures by step:",
      name.c_str(), variant_name(v).c_str(), static_cast<unsigned long long>(tally.points),
      static_cast<unsigned long long>(tally.failed[Fault::kEnospc]),
      static_cast<unsigned long long>(tally.runs[Fault::kEnospc]),
      static_cast<unsigned long long>(tally.failed[Fault::kEio]),
      static_cast<unsigned long long>(tally.runs[Fault::kEio]),
      static_cast<unsigned long long>(tally.runs[Fault::kShort] - tally.failed[Fault::kShort]),
      static_cast<unsigned long long>(tally.runs[Fault::kShort]));
  for (const auto& [step, n] : tally.where) {
    std::printf(" %s %llu;", step.c_str(), static_cast<unsigned long long>(n));
  }
  std::printf("\n");
  return tally;
}

template <typename S>
Factory factory() {
  return [](const Variant& v, std::shared_ptr<Injector> injector) -> std::unique_ptr<Scenario> {
    return std::make_unique<S>(v, std::move(injector));
  };
}

const Variant kAllVariants[] = {{IoEngineKind::kUring, false},
                                {IoEngineKind::kUring, true},
                                {IoEngineKind::kPosix, false},
                                {IoEngineKind::kPosix, true}};

// The default run gives each scenario one variant, so that together they use both engines and
// both DRAM paths; the full campaign runs each on all four.
std::vector<Variant> variants(Variant fallback) {
  const std::string mode = campaign_mode();
  if (mode.rfind("full:", 0) == 0) return {kAllVariants[std::stoul(mode.substr(5)) % 4]};
  if (full_campaign()) return {std::begin(kAllVariants), std::end(kAllVariants)};
  return {fallback};
}

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
