// In-place gradient sums when a device copy fails (the host backend's copy_fault, core API): a
// backward load that applies the factors pending on a layer's sums fails in the middle of the
// layer; every param of it keeps its grad (values and pending factors), and the step run again
// gives what it would have given.
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/optimizer/optimizer.h"
#include "runtime/runtime.h"
#include "runtime/stream/executor.h"
#include "runtime/stream/planner.h"
#include "support/core_support.h"

using namespace strata;

namespace {

constexpr std::size_t kN = 3000;

float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f = 0;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A grad of one backward pass: distinct per param and pass, exact in bf16 and in f32.
std::vector<uint16_t> grad_of(int param, int pass) {
  std::vector<uint16_t> g(kN);
  for (std::size_t i = 0; i < kN; ++i) {
    const int v = static_cast<int>((i * 7 + static_cast<std::size_t>(param) * 13) % 61) - 30;
    const float x = static_cast<float>(v) / 64.f + static_cast<float>(pass) * 0.5f;
    uint32_t u = 0;
    std::memcpy(&u, &x, sizeof u);
    g[i] = static_cast<uint16_t>(u >> 16);  // x has few mantissa bits: exact
  }
  return g;
}

struct Fixture {
  std::shared_ptr<Runtime> rt;
  std::shared_ptr<Optimizer> opt;
  std::unique_ptr<Executor> ex;
  // Layer 0: X, A, B in-place sums (f32 HBM), Y an accumulator param (bf16 DRAM grad);
  // layer 1: one in-place sum.
  std::vector<TensorId> weights, grads;
  std::shared_ptr<std::atomic<const void*>> fail_src =
      std::make_shared<std::atomic<const void*>>(nullptr);
  // A copy *into* the memory *fail_dst names fails (a write, not the read of it).
  std::shared_ptr<std::atomic<const void*>> fail_dst =
      std::make_shared<std::atomic<const void*>>(nullptr);

  TensorId add(const std::string& name, DType dtype, Role role, Tier home) {
    TensorSpec s;
    s.name = name;
    s.dtype = dtype;
    s.shape = {static_cast<int64_t>(kN)};
    s.role = role;
    s.home = home;
    TensorId id = 0;
    REQUIRE_OK(rt->register_tensor(s, &id));
    return id;
  }

  Fixture() {
    RuntimeOptions o;
    o.device.kind = DeviceKind::kHost;
    o.budgets = {16ull << 20, 64ull << 20, 0};
    o.dram.threads = 1;
    // A copy from or to the memory *fail_src names fails, as a device fault would.
    o.device.copy_fault = [f = fail_src, d = fail_dst](const void* dst, const void* src, uint64_t) {
      const void* bad = f->load();
      const void* bad_dst = d->load();
      return (bad != nullptr && (src == bad || dst == bad)) ||
                     (bad_dst != nullptr && dst == bad_dst)
                 ? error(Code::kBackend, "injected copy fault")
                 : Status::ok();
    };
    REQUIRE_OK(Runtime::create(o, &rt));
    OptimizerConfig c;
    c.kind = OptimizerKind::kSgd;
    c.lr = 0.1f;
    c.threads = 1;
    c.explicit_updates = true;
    REQUIRE_OK(Optimizer::create(rt, c, &opt));
    LayerGraph graph;
    const char* names[] = {"x", "a", "b", "y", "z"};
    for (int k = 0; k < 5; ++k) {
      const bool sum = k != 3;
      weights.push_back(add(names[k], DType::kBF16, Role::kWeight, Tier::kDram));
      grads.push_back(add(std::string(names[k]) + ".grad", sum ? DType::kF32 : DType::kBF16,
                          Role::kGrad, sum ? Tier::kHbm : Tier::kDram));
      REQUIRE_OK(opt->add_param(weights.back(), grads.back(), 0, MasterLayout::kSeparate,
                                sum ? GradSum::kInPlace : GradSum::kAccumulator));
      if (k == 0 || k == 4) graph.layers.emplace_back();
      graph.layers.back().weights.push_back(weights.back());
      graph.layers.back().grads.push_back(grads.back());
    }
    PlanConfig pc;
    pc.h2d_bytes_per_second = 1e10;
    pc.d2h_bytes_per_second = 1e10;
    pc.max_prefetch_depth = 1;
    Plan plan;
    REQUIRE_OK(make_plan(*rt, graph, pc, &plan));
    REQUIRE_OK(Executor::create(rt, plan, &ex));
    REQUIRE_OK(opt->attach(ex.get()));
  }
  ~Fixture() {
    (void)opt->detach();
    ex.reset();
  }

  const void* home(std::size_t k) {
    TensorRecord r;
    REQUIRE_OK(rt->info(grads[k], &r));
    return rt->tier_base(Tier::kHbm) + r.offset;
  }

  // A step's begin and forward pass.
  Status forward() {
    STRATA_RETURN_IF_ERROR(ex->step_begin());
    LayerViews v;
    for (uint32_t l = 0; l < 2; ++l) {
      STRATA_RETURN_IF_ERROR(ex->acquire(l, Phase::kForward, nullptr, Executor::Wait::kHost, &v));
      STRATA_RETURN_IF_ERROR(ex->release(l, Phase::kForward, nullptr));
    }
    return Status::ok();
  }

  // One step whose backward pass adds (in-place sums) or writes (the bf16 grad) pass `pass`'s
  // grads; the first error, the step then abandoned.
  Status step(int pass) {
    Status s = forward();
    if (s.is_ok()) s = backward(pass);
    if (!s.is_ok()) REQUIRE_OK(ex->step_abort(nullptr));
    return s;
  }

  // The backward pass of a step whose forward pass ran, and its end.
  Status backward(int pass) {
    LayerViews v;
    for (uint32_t l = 2; l-- > 0;) {
      STRATA_RETURN_IF_ERROR(ex->acquire(l, Phase::kBackward, nullptr, Executor::Wait::kHost, &v));
      for (std::size_t i = 0; i < v.grads.size(); ++i) {
        const int k = l == 0 ? static_cast<int>(i) : 4;
        const auto g = grad_of(k, pass);
        if (k == 3) {
          std::memcpy(v.grads[i], g.data(), kN * 2);
          continue;
        }
        auto* sum = static_cast<float*>(v.grads[i]);
        for (std::size_t e = 0; e < kN; ++e) sum[e] += bf16_value(g[e]);
      }
      STRATA_RETURN_IF_ERROR(ex->release(l, Phase::kBackward, nullptr));
    }
    return ex->step_end();
  }

  std::vector<float> read(std::size_t k) {
    std::vector<float> v(kN);
    REQUIRE_OK(opt->grad_read(weights[k], v.data(), kN));
    return v;
  }
};

std::vector<float> widened(const std::vector<uint16_t>& g, float m = 1.f) {
  std::vector<float> out(kN);
  for (std::size_t i = 0; i < kN; ++i) out[i] = bf16_value(g[i]) * m;
  return out;
}

// A stream's fence that is done when the test says so: the host backend's are done when
// recorded, so this stands for a framework's work still running on its stream.
class GateFence : public DeviceFence {
 public:
  void open() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    cv_.notify_all();
  }
  Status enqueue_wait(void*) override { return host_wait(); }
  Status host_wait() override {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return open_; });
    return Status::ok();
  }
  bool is_done() const override {
    std::lock_guard lock(mutex_);
    return open_;
  }
  Status elapsed_since(const DeviceFence&, uint64_t* ns) const override {
    *ns = 0;
    return Status::ok();
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool open_ = false;
};

}  // namespace

TEST_CASE("a factor that fails to apply at a backward load loses no grad of the layer",
          "[optimizer][grad_sum]") {
  Fixture f;
  REQUIRE_OK(f.step(0));
  // x zeroed to none (its home still holds pass 0's values), factors on a, b and y.
  REQUIRE_OK(f.opt->grad_zero(f.weights[0], false));
  REQUIRE_OK(f.opt->grad_scale(f.weights[1], 0.5f));
  REQUIRE_OK(f.opt->grad_scale(f.weights[2], 0.25f));
  REQUIRE_OK(f.opt->grad_scale(f.weights[3], 2.f));

  // Layer 0's backward load applies a's factor, then fails copying b's sum out.
  f.fail_src->store(f.home(2));
  const Status failed = f.step(1);
  REQUIRE(failed.code() == Code::kBackend);
  REQUIRE_THAT(failed.message(), Catch::Contains("injected copy fault"));
  f.fail_src->store(nullptr);

  // Every grad as it was: a's factor applied to its sum, b's still pending, x none, y scaled.
  REQUIRE(f.read(1) == widened(grad_of(1, 0), 0.5f));
  REQUIRE(f.read(2) == widened(grad_of(2, 0), 0.25f));
  REQUIRE(f.read(3) == widened(grad_of(3, 0), 2.f));
  std::vector<float> none(kN);
  REQUIRE(f.opt->grad_read(f.weights[0], none.data(), kN).code() == Code::kInvalidState);
  for (std::size_t k : {1, 2}) {
    GradInfo info;
    REQUIRE_OK(f.opt->grad_info(f.weights[k], &info));
    double squares = 0;
    for (float x : f.read(k)) squares += double{x} * x;
    REQUIRE(info.has_grad);
    REQUIRE(info.sum_squares == Approx(squares).epsilon(1e-6));
  }

  // Run again: x starts from zero (its old values are not kept), the rest add to their sums.
  REQUIRE_OK(f.step(1));
  auto sum = [](std::vector<float> a, const std::vector<float>& b) {
    for (std::size_t i = 0; i < a.size(); ++i) a[i] += b[i];
    return a;
  };
  REQUIRE(f.read(0) == widened(grad_of(0, 1)));
  REQUIRE(f.read(1) == sum(widened(grad_of(1, 0), 0.5f), widened(grad_of(1, 1))));
  REQUIRE(f.read(2) == sum(widened(grad_of(2, 0), 0.25f), widened(grad_of(2, 1))));
  REQUIRE(f.read(3) == sum(widened(grad_of(3, 0), 2.f), widened(grad_of(3, 1))));
  REQUIRE(f.read(4) == sum(widened(grad_of(4, 0)), widened(grad_of(4, 1))));
}

TEST_CASE("a failed zero fill or write of an in-place sum keeps it held, its values unknown",
          "[optimizer][grad_sum]") {
  Fixture f;
  REQUIRE_OK(f.step(0));
  // grad_write through the H2D queue: refused by the fault, the grad still held with a NaN
  // sum of squares (clipping and a loss scaler see it), then written again.
  std::vector<float> values(kN, 0.25f);
  f.fail_src->store(values.data());
  const Status s = f.opt->grad_write(f.weights[1], values.data(), kN);
  REQUIRE(s.code() == Code::kBackend);
  REQUIRE_THAT(s.message(), Catch::Contains("writing an in-place gradient sum"));
  GradInfo info;
  REQUIRE_OK(f.opt->grad_info(f.weights[1], &info));
  REQUIRE(info.has_grad);
  REQUIRE(std::isnan(info.sum_squares));
  f.fail_src->store(nullptr);
  REQUIRE_OK(f.opt->grad_write(f.weights[1], values.data(), kN));
  REQUIRE(f.read(1) == values);
  REQUIRE_OK(f.opt->grad_info(f.weights[1], &info));
  REQUIRE(info.sum_squares == Approx(0.0625 * kN));
}

TEST_CASE("an in-place sum is measured once after it changes, and a failed zero keeps it held",
          "[optimizer][grad_sum]") {
  Fixture f;
  REQUIRE_OK(f.step(0));
  // Unmeasured after its landing: grad_info copies the sum out (and fails with that copy).
  f.fail_src->store(f.home(1));
  GradInfo info;
  REQUIRE(f.opt->grad_info(f.weights[1], &info).code() == Code::kBackend);
  f.fail_src->store(nullptr);
  REQUIRE_OK(f.opt->grad_info(f.weights[1], &info));
  const double measured = info.sum_squares;
  // Measured: kept, no copy (the fault would fail one), a factor applied to the figure.
  f.fail_src->store(f.home(1));
  REQUIRE_OK(f.opt->grad_info(f.weights[1], &info));
  REQUIRE(info.sum_squares == measured);
  REQUIRE_OK(f.opt->grad_scale(f.weights[1], 2.f));
  REQUIRE_OK(f.opt->grad_info(f.weights[1], &info));
  REQUIRE(info.sum_squares == 4 * measured);
  f.fail_src->store(nullptr);
  // grad_read measures on its way: grad_info needs no copy after it.
  REQUIRE_OK(f.step(1));
  (void)f.read(2);
  f.fail_src->store(f.home(2));
  REQUIRE_OK(f.opt->grad_info(f.weights[2], &info));
  double squares = 0;
  for (float x : widened(grad_of(2, 0))) squares += double{x} * x;
  REQUIRE(info.sum_squares > squares);  // the sum of both passes, not the first's figure
  f.fail_src->store(nullptr);

  // Zeroed between its backward load (which kept it) and the acquire: the zero fill fails; the
  // grad is still held, with unknown values (NaN), and the framework's adds go on from there.
  REQUIRE_OK(f.forward());
  f.fail_src->store(f.home(1));
  const Status s = f.opt->grad_zero(f.weights[1], true);
  REQUIRE(s.code() == Code::kBackend);
  REQUIRE_THAT(s.message(), Catch::Contains("zeroing an in-place gradient sum"));
  f.fail_src->store(nullptr);
  REQUIRE_OK(f.opt->grad_info(f.weights[1], &info));
  REQUIRE(info.has_grad);
  REQUIRE(std::isnan(info.sum_squares));
  // Zeroed again, now it can be: the backward pass adds to zeros.
  REQUIRE_OK(f.opt->grad_zero(f.weights[1], true));
  REQUIRE_OK(f.backward(2));
  REQUIRE(f.read(1) == widened(grad_of(1, 2)));
}

TEST_CASE("in-place sums are measured by pool jobs through the fetch buffer, every layer's at once",
          "[optimizer][grad_sum]") {
  Fixture f;
  REQUIRE_OK(f.step(0));
  REQUIRE_OK(f.opt->synchronize());  // the landings done: the link counts only what follows
  f.rt->reset_link_counters();
  // One grad_info measures all four sums (both layers): the jobs' copies into the fetch buffer
  // are counted on the D2H link (a synchronous copy of the caller's, copy_sync, is not).
  GradInfo info;
  REQUIRE_OK(f.opt->grad_info(f.weights[1], &info));
  REQUIRE_OK(f.opt->synchronize());  // layer 1's job may still run
  const uint64_t sums = 4 * kN * sizeof(float);
  REQUIRE(f.rt->link_counters(Link::kD2H).bytes == sums);
  // The others were measured with it: no copy more.
  for (std::size_t k : {0, 2, 4}) REQUIRE_OK(f.opt->grad_info(f.weights[k], &info));
  REQUIRE(f.rt->link_counters(Link::kD2H).bytes == sums);
  // grad_read: one job copies the sum through the buffer into the caller's, scaled.
  REQUIRE_OK(f.opt->grad_scale(f.weights[4], 0.5f));
  REQUIRE(f.read(4) == widened(grad_of(4, 0), 0.5f));
  REQUIRE(f.rt->link_counters(Link::kD2H).bytes == sums + kN * sizeof(float));
}

TEST_CASE("after an abort with a layer acquired, its sums are read only once its adds are done",
          "[optimizer][grad_sum]") {
  Fixture f;
  REQUIRE_OK(f.step(0));
  GradInfo info;
  REQUIRE_OK(f.opt->grad_info(f.weights[4], &info));  // pass 0's figure, measured
  const double before = info.sum_squares;
  // The next step's backward pass acquires layer 1 and adds; the abort's hook comes with the
  // framework's work still running (the gate), as strata_step_abort calls it before it waits.
  REQUIRE_OK(f.forward());
  LayerViews v;
  REQUIRE_OK(f.ex->acquire(1, Phase::kBackward, nullptr, Executor::Wait::kHost, &v));
  auto* sum = static_cast<float*>(v.grads[0]);
  auto gate = std::make_shared<GateFence>();
  f.opt->on_step_aborted(gate);
  Status asked;
  GradInfo seen;
  std::thread other([&] { asked = f.opt->grad_info(f.weights[4], &seen); });
  // The adds land after the hook: another thread's grad_info must not have measured before.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto g = grad_of(4, 1);
  for (std::size_t e = 0; e < kN; ++e) sum[e] += bf16_value(g[e]);
  gate->open();
  other.join();
  REQUIRE_OK(asked);
  double squares = 0;
  for (float x : f.read(4)) squares += double{x} * x;
  REQUIRE(seen.sum_squares != before);
  REQUIRE(seen.sum_squares == Approx(squares).epsilon(1e-9));
  REQUIRE_OK(f.ex->step_abort(nullptr));  // the executor's side of the abort
}

TEST_CASE("a factor whose write-back fails leaves the sum unknown until it is zeroed",
          "[optimizer][grad_sum]") {
  Fixture f;
  REQUIRE_OK(f.step(0));
  REQUIRE_OK(f.opt->grad_scale(f.weights[2], 0.25f));
  // Layer 0's backward load copies b's sum out, scales it, and its write back is refused.
  f.fail_dst->store(f.home(2));
  const Status failed = f.step(1);
  REQUIRE(failed.code() == Code::kBackend);
  REQUIRE_THAT(failed.message(), Catch::Contains("writing an in-place gradient sum"));
  f.fail_dst->store(nullptr);
  GradInfo info;
  REQUIRE_OK(f.opt->grad_info(f.weights[2], &info));
  REQUIRE(info.has_grad);
  REQUIRE(std::isnan(info.sum_squares));
  // The step again: the framework adds to b's unknown values, and the landing does not make
  // them known (an earlier version measured them afresh, a finite norm without the factor).
  REQUIRE_OK(f.step(1));
  REQUIRE_OK(f.opt->grad_info(f.weights[2], &info));
  REQUIRE(std::isnan(info.sum_squares));
  // The others are as they would be: a's sum of both passes, measured.
  REQUIRE_OK(f.opt->grad_info(f.weights[1], &info));
  REQUIRE(std::isfinite(info.sum_squares));
  // Zeroed: known again, from the next backward pass on.
  REQUIRE_OK(f.opt->grad_zero(f.weights[2], false));
  REQUIRE_OK(f.step(2));
  REQUIRE(f.read(2) == widened(grad_of(2, 2)));
  REQUIRE_OK(f.opt->grad_info(f.weights[2], &info));
  REQUIRE(std::isfinite(info.sum_squares));
}
