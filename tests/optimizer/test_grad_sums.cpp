// In-place gradient sums (STRATA_GRAD_SUM_IN_PLACE) against the accumulator path: a model
// whose grads are f32 HBM homes the "framework" adds each backward pass's grad into trains, reads
// and measures its grads bit for bit as the same model with bf16 DRAM grads written at each
// backward pass and summed in DRAM accumulators, through PyTorch's loop (3 steps of 3 backward
// passes) and its variants: zeroing inside a step after the backward load was issued, zeros and
// none, scales between and inside steps, writes inside a step, a checkpoint load after a failed
// step. And what differs, or is refused: an abort with a layer acquired, scales and accesses
// while a layer's backward pass runs, bad params.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>

#include "optimizer/optimizer_model.h"
#include "support/device_views.h"
#include "support/scratch_dir.h"

using namespace strata_test;

namespace {

constexpr int kLayers = 4;

// One of the two runs: `in_place` f32 HBM sums, else bf16 DRAM grads and DRAM accumulators.
struct Run {
  Model m;
  OptimizerPtr opt;
  Streamed st;
  bool in_place = false;
  strata_optimizer_t* o() const { return opt.get(); }
};

std::unique_ptr<Run> make_run(bool in_place, const std::vector<int64_t>& sizes,
                              strata_device_backend_t backend, uint64_t host_bps = 0) {
  auto r = std::make_unique<Run>();
  r->in_place = in_place;
  const strata_runtime_config_t config = config_for(backend, 64 * kMiB, 256 * kMiB, host_bps);
  r->m = make_model(kLayers, 42, backend, sizes, &config, STRATA_TIER_DRAM,
                    in_place ? STRATA_TIER_HBM : STRATA_TIER_DRAM,
                    in_place ? STRATA_DTYPE_F32 : STRATA_DTYPE_BF16);
  strata_optimizer_config_t c = adamw_config();
  c.update_mode = STRATA_UPDATE_EXPLICIT;
  r->opt = make_optimizer(r->m, c, STRATA_MASTER_SEPARATE,
                          in_place ? STRATA_GRAD_SUM_IN_PLACE : STRATA_GRAD_SUM_ACCUMULATOR);
  // Every layer in a slot of its own, loads issued two positions ahead: a step_begin issues
  // forward loads only, and after the forward pass the backward loads of layers 3, 2 and 1 are
  // issued, layer 0's not (on the host backend, whose fences are done when recorded).
  make_streamed(r->m, &r->st, 0, 2);
  STRATA_REQUIRE_OK(strata_optimizer_attach(r->opt.get(), r->st.ex));
  return r;
}

std::size_t count_of(const Run& r, std::size_t k) {
  return static_cast<std::size_t>(r.m.sizes[k]);
}

// The framework's grads of one layer in a backward pass, computed from the weights in the slot:
// the reference writes them into the bf16 buffers the load zeroed; the in-place run adds them,
// widened, to the fp32 sums (what torch's autograd does with p.grad).
void give_grads(Run& r, uint32_t l, const strata_layer_views_t& v, int s, int micro) {
  for (std::size_t k = 0; k < r.m.sizes.size(); ++k) {
    const std::size_t n = count_of(r, k);
    std::vector<uint16_t> w(n);
    view_to_host(w.data(), v.weights[k], n * 2);
    const auto g = grads_for(w, s, static_cast<int>(l), micro);
    if (!r.in_place) {
      host_to_view(v.grads[k], g.data(), n * 2);
      continue;
    }
    std::vector<float> sum(n);
    view_to_host(sum.data(), v.grads[k], n * 4);
    for (std::size_t i = 0; i < n; ++i) sum[i] += from_bf16(g[i]);
    host_to_view(v.grads[k], sum.data(), n * 4);
  }
}

// Where a test acts inside an executor step.
struct Hooks {
  std::function<void(Run&)> after_begin;    // before any backward load is issued
  std::function<void(Run&)> after_forward;  // layers 3, 2, 1's backward loads issued, not 0's
  int abort_at = -1;                        // abandon the step once this layer's grads are given
};

void pass(Run& r, int s, int micro, const Hooks& h = {}) {
  strata_executor_t* ex = r.st.ex;
  STRATA_REQUIRE_OK(strata_step_begin(ex));
  if (h.after_begin) h.after_begin(r);
  strata_layer_views_t v{};
  v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
  for (uint32_t l = 0; l < kLayers; ++l) {
    STRATA_REQUIRE_OK(strata_layer_acquire(ex, l, STRATA_PHASE_FORWARD, nullptr, 0, &v));
    STRATA_REQUIRE_OK(strata_layer_release(ex, l, STRATA_PHASE_FORWARD, nullptr));
  }
  if (h.after_forward) h.after_forward(r);
  for (uint32_t l = kLayers; l-- > 0;) {
    STRATA_REQUIRE_OK(strata_layer_acquire(ex, l, STRATA_PHASE_BACKWARD, nullptr, 0, &v));
    give_grads(r, l, v, s, micro);
    if (static_cast<int>(l) == h.abort_at) {
      STRATA_REQUIRE_OK(strata_step_abort(ex, nullptr));
      return;
    }
    STRATA_REQUIRE_OK(strata_layer_release(ex, l, STRATA_PHASE_BACKWARD, nullptr));
  }
  STRATA_REQUIRE_OK(strata_step_end(ex));
}

strata_grad_info_t info_of(Run& r, strata_tensor_t* w) {
  strata_grad_info_t info{};
  info.struct_size = STRATA_GRAD_INFO_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_optimizer_grad_info(r.o(), w, &info));
  return info;
}

std::vector<float> read_grad(Run& r, uint32_t l, std::size_t k) {
  std::vector<float> v(count_of(r, k));
  STRATA_REQUIRE_OK(strata_optimizer_grad_read(r.o(), r.m.weights[l][k], v.data(), v.size()));
  return v;
}

// Every param's grad as both runs hold it: grad_info (measured first, before any read) and
// grad_read, bit for bit.
void require_same_grads(Run& ref, Run& sums) {
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (std::size_t k = 0; k < ref.m.sizes.size(); ++k) {
      INFO("layer " << l << " weight " << k);
      const strata_grad_info_t a = info_of(ref, ref.m.weights[l][k]);
      const strata_grad_info_t b = info_of(sums, sums.m.weights[l][k]);
      REQUIRE(a.has_grad == b.has_grad);
      REQUIRE(std::memcmp(&a.sum_squares, &b.sum_squares, sizeof(double)) == 0);
      REQUIRE(a.step == b.step);
      if (a.has_grad != 0) REQUIRE(read_grad(ref, l, k) == read_grad(sums, l, k));
    }
  }
}

void for_each_param(Run& r, const std::function<void(uint32_t, std::size_t, strata_tensor_t*)>& f) {
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (std::size_t k = 0; k < r.m.sizes.size(); ++k) f(l, k, r.m.weights[l][k]);
  }
}

void zero_all(Run& r, int keep_zeros) {
  for_each_param(r, [&](uint32_t, std::size_t, strata_tensor_t* w) {
    STRATA_REQUIRE_OK(strata_optimizer_grad_zero(r.o(), w, keep_zeros));
  });
}

void optimizer_step(Run& r, int s) {
  STRATA_REQUIRE_OK(strata_optimizer_set_group(r.o(), 0, 1e-2f / (1 + s), 0.1f));
  STRATA_REQUIRE_OK(strata_optimizer_set_group(r.o(), 1, 1e-2f / (1 + s), 0.f));
  STRATA_REQUIRE_OK(strata_optimizer_step(r.o()));
}

// A factor for every param, asserting it was taken.
void scale_all(Run& r, float factor, uint32_t first_layer = 0) {
  for_each_param(r, [&](uint32_t l, std::size_t, strata_tensor_t* w) {
    if (l >= first_layer) STRATA_REQUIRE_OK(strata_optimizer_grad_scale(r.o(), w, factor));
  });
}

// Values a framework writes back (torch's clamp_ on p.grad), most of them not a bf16.
void write_back(Run& r, uint32_t l, std::size_t k, float shift) {
  std::vector<float> v = read_grad(r, l, k);
  for (float& x : v) x = std::clamp(x, -0.3f, 0.25f) + shift;
  STRATA_REQUIRE_OK(strata_optimizer_grad_write(r.o(), r.m.weights[l][k], v.data(), v.size()));
}

// On the host backend every fence a load waits for is done when recorded, so which backward
// loads are issued when is exact (make_run): an in-place sum's grad_scale (by 1: no change) is
// refused from its layer's backward load on, which proves where a hook runs.
bool load_issued(Run& r, uint32_t l) {
  const strata_status_t s = strata_optimizer_grad_scale(r.o(), r.m.weights[l][0], 1.f);
  if (s == STRATA_OK) return false;
  REQUIRE_THAT(strata_last_error_message(), Catch::Contains("loaded and not yet released"));
  return true;
}
void require_window(Run& r, bool issued_for_layer_1) {
  if (!r.in_place || backend_under_test() != STRATA_DEVICE_BACKEND_HOST) return;
  REQUIRE(load_issued(r, 1) == issued_for_layer_1);
  REQUIRE(!load_issued(r, 0));
}

struct Variant {
  const char* name;
  std::vector<int64_t> sizes{3000, 1100};
  // Inside the pass (step s, backward pass micro) of either run; null: none.
  std::function<Hooks(int s, int micro)> hooks{};
  // Between passes, after both runs' grads were compared.
  std::function<void(Run&, int s, int micro)> between{};
  // After each step's strata_optimizer_step (default: zeroed to none).
  std::function<void(Run&, int s)> after_step{};
  bool throttled = false;  // host backend, a slow link: a queued zero fill lands late
};

void train_alike(const Variant& var) {
  const strata_device_backend_t backend =
      var.throttled ? STRATA_DEVICE_BACKEND_HOST : backend_under_test();
  const uint64_t bps = var.throttled ? 2'000'000 : 0;
  auto ref = make_run(false, var.sizes, backend);
  auto sums = make_run(true, var.sizes, backend, bps);
  for (int s = 0; s < 3; ++s) {
    for (int micro = 0; micro < 3; ++micro) {
      for (Run* r : {ref.get(), sums.get()})
        pass(*r, s, micro, var.hooks ? var.hooks(s, micro) : Hooks{});
      require_same_grads(*ref, *sums);
      if (var.between) {
        for (Run* r : {ref.get(), sums.get()}) var.between(*r, s, micro);
        require_same_grads(*ref, *sums);
      }
    }
    for (Run* r : {ref.get(), sums.get()}) {
      optimizer_step(*r, s);
      if (var.after_step) {
        var.after_step(*r, s);
      } else {
        zero_all(*r, 0);
      }
    }
    require_same_grads(*ref, *sums);
  }
  STRATA_REQUIRE_OK(strata_optimizer_synchronize(ref->o()));
  STRATA_REQUIRE_OK(strata_optimizer_synchronize(sums->o()));
  REQUIRE(snapshot(sums->m, sums->o()) == snapshot(ref->m, ref->o()));
  // No accumulator was ever made for a sum in place; the reference's accumulated in its own.
  strata_tensor_t* t = nullptr;
  REQUIRE(strata_tensor_find(sums->m.rt.get(), "layers.0.w0.grad_accum", &t) ==
          STRATA_ERROR_NOT_FOUND);
  REQUIRE(strata_optimizer_get_state(sums->o(), sums->m.weights[0][0], STRATA_STATE_GRAD_ACCUM,
                                     &t) == STRATA_ERROR_NOT_FOUND);
  STRATA_REQUIRE_OK(strata_tensor_find(ref->m.rt.get(), "layers.0.w0.grad_accum", &t));
}

}  // namespace

TEST_CASE("in-place sums train, read and measure as DRAM accumulators, bit for bit",
          "[optimizer][grad_sum]") {
  const std::vector<Variant> variants{
      Variant{"zeroed to none after each step"},
      // Tasks of 65536 elements: the sums are measured per task, as a landing measures them.
      Variant{"zeroed to none, large params", {300000, 70000}},
      Variant{"zeros and none: steps with zero grads, then skipped params",
              {3000, 1100},
              nullptr,
              nullptr,
              [](Run& r, int s) {
                zero_all(r, 1);
                if (s != 1) return;
                optimizer_step(r, s);  // zeros: a decay-only update of every param
                for_each_param(r, [&](uint32_t l, std::size_t, strata_tensor_t* w) {
                  STRATA_REQUIRE_OK(strata_optimizer_grad_zero(r.o(), w, l % 2));
                });
                optimizer_step(r, s);  // the params zeroed to none are skipped
              }},
      Variant{"zeroed inside a step after the backward loads were issued",
              {3000, 1100},
              [](int s, int micro) {
                Hooks h;
                if (s == 1 && micro == 1) {
                  h.after_forward = [](Run& r) {
                    require_window(r, true);
                    for_each_param(r, [&](uint32_t l, std::size_t, strata_tensor_t* w) {
                      STRATA_REQUIRE_OK(strata_optimizer_grad_zero(r.o(), w, l % 2));
                    });
                  };
                }
                return h;
              }},
      Variant{"scaled between backward passes and inside a step before the loads",
              {300000, 70000},
              [](int s, int micro) {
                Hooks h;
                if (micro == 2) {
                  // Inside the step, before any backward load: applied to the sum at the load,
                  // before this pass adds to it (a factor dropped at the landing shows here).
                  h.after_begin = [](Run& r) {
                    require_window(r, false);
                    scale_all(r, 0.75f);
                  };
                }
                if (s == 2 && micro == 1) {
                  // After the forward pass only layer 0's load is still to come.
                  h.after_forward = [](Run& r) {
                    require_window(r, true);
                    for_each_param(r, [&](uint32_t l, std::size_t, strata_tensor_t* w) {
                      if (l == 0) STRATA_REQUIRE_OK(strata_optimizer_grad_scale(r.o(), w, 2.5f));
                    });
                  };
                }
                return h;
              },
              [](Run& r, int s, int micro) {
                if (micro == 0) scale_all(r, 0.5f);
                if (micro == 1 && s != 1) scale_all(r, 3.f, 2);
                if (micro == 2) scale_all(r, 0.125f);  // into the update, lazily
              }},
      Variant{"written inside a step, before and after the backward loads",
              {3000, 1100},
              [](int s, int micro) {
                Hooks h;
                if (micro == 0) return h;  // zeroed to none: nothing to write into
                h.after_begin = [s](Run& r) {
                  if (s == 1) write_back(r, 0, 0, 1e-3f);
                };
                h.after_forward = [s](Run& r) {
                  require_window(r, true);
                  for (uint32_t l = 0; l < kLayers; ++l) write_back(r, l, 1, 2e-3f * (s + 1));
                };
                return h;
              }},
      // Zeroed to zeros between passes: the next load zero-fills the sum on the H2D queue behind
      // that step's weight loads, slowed to 2 MB/s; the writes after the forward pass must land
      // after those fills, not be erased by them.
      Variant{"written over zeros whose zero fill is still queued (a slow link)",
              {3000, 1100},
              [](int, int micro) {
                Hooks h;
                if (micro != 1) return h;
                h.after_forward = [](Run& r) {
                  for (uint32_t l = 0; l < kLayers; ++l) write_back(r, l, 0, 5e-3f);
                };
                return h;
              },
              [](Run& r, int, int micro) {
                if (micro == 0) zero_all(r, 1);
              },
              nullptr,
              true},
  };
  for (const Variant& var : variants) {
    DYNAMIC_SECTION(var.name) {
      train_alike(var);
    }
  }
}

TEST_CASE("in-place sums: a checkpoint load after a failed step drops them, as accumulators",
          "[optimizer][grad_sum][checkpoint]") {
  // Each run: a step, a checkpoint, two backward passes (sums held), a load that fails half way
  // (the optimizer's file damaged: the optimizer fails), then a load of the good checkpoint,
  // which drops the held grads: the homes still hold the old sums, and the next backward load
  // must zero-fill them as the grad tensors are. Then two more steps.
  std::vector<std::vector<std::vector<unsigned char>>> results;
  std::vector<std::vector<std::vector<float>>> reads;
  for (bool in_place : {false, true}) {
    ScratchDir scratch;
    const std::string good = scratch.file("good"), bad = scratch.file("bad");
    auto r = make_run(in_place, {3000, 1100}, backend_under_test());
    for (int micro = 0; micro < 3; ++micro) pass(*r, 0, micro);
    optimizer_step(*r, 0);
    zero_all(*r, 0);
    STRATA_REQUIRE_OK(strata_optimizer_synchronize(r->o()));
    STRATA_REQUIRE_OK(strata_checkpoint_save(r->m.rt.get(), r->o(), good.c_str()));
    std::filesystem::copy(good, bad, std::filesystem::copy_options::recursive);
    {
      std::fstream f(bad + "/optimizer.safetensors",
                     std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(-100, std::ios::end);
      char b = 0;
      f.read(&b, 1);
      b = static_cast<char>(b ^ 0x10);
      f.seekp(-100, std::ios::end);
      f.write(&b, 1);
    }
    pass(*r, 1, 0);
    pass(*r, 1, 1);
    REQUIRE(info_of(*r, r->m.weights[2][0]).has_grad == 1);
    STRATA_REQUIRE_ERROR(strata_checkpoint_load(r->m.rt.get(), r->o(), bad.c_str()),
                         STRATA_ERROR_DATA_CORRUPTION, "optimizer.safetensors");
    STRATA_REQUIRE_OK(strata_checkpoint_load(r->m.rt.get(), r->o(), good.c_str()));
    REQUIRE(info_of(*r, r->m.weights[2][0]).has_grad == 0);
    std::vector<std::vector<float>> got;
    for (int s = 1; s < 3; ++s) {
      for (int micro = 0; micro < 2; ++micro) pass(*r, s, micro);
      got.push_back(read_grad(*r, 2, 0));
      optimizer_step(*r, s);
      zero_all(*r, 0);
    }
    STRATA_REQUIRE_OK(strata_optimizer_synchronize(r->o()));
    results.push_back(snapshot(r->m, r->o()));
    reads.push_back(std::move(got));
  }
  REQUIRE(reads[1] == reads[0]);
  REQUIRE(results[1] == results[0]);
}

TEST_CASE("in-place sums: an abort with a layer acquired keeps its adds, measured anew",
          "[optimizer][grad_sum]") {
  auto ref = make_run(false, {3000, 1100}, backend_under_test());
  auto sums = make_run(true, {3000, 1100}, backend_under_test());
  // Held none: the adds made before the abort are dropped (the next load zero-fills), as the
  // reference drops the acquired layer's slot buffer.
  for (Run* r : {ref.get(), sums.get()}) {
    Hooks h;
    h.abort_at = 2;
    pass(*r, 0, 0, h);
  }
  for (Run* r : {ref.get(), sums.get()}) {
    REQUIRE(info_of(*r, r->m.weights[2][0]).has_grad == 0);
    REQUIRE(info_of(*r, r->m.weights[3][0]).has_grad == 1);
  }
  require_same_grads(*ref, *sums);
  for (Run* r : {ref.get(), sums.get()}) pass(*r, 0, 1);
  require_same_grads(*ref, *sums);  // measured: the figures are now cached

  // Held sums: what the framework added before the abort stays in them (it cannot be taken
  // out); grad_info measures the sum again instead of the figure cached before the pass.
  const std::vector<float> before = read_grad(*sums, 2, 0);
  const double cached = info_of(*sums, sums->m.weights[2][0]).sum_squares;
  Hooks h;
  h.abort_at = 2;
  pass(*sums, 0, 2, h);
  pass(*ref, 0, 2, h);
  const std::vector<float> after = read_grad(*sums, 2, 0);
  REQUIRE(after != before);
  double squares = 0;
  for (float x : after) squares += double{x} * x;
  const strata_grad_info_t info = info_of(*sums, sums->m.weights[2][0]);
  REQUIRE(info.has_grad == 1);
  REQUIRE(info.sum_squares != cached);
  REQUIRE(info.sum_squares == Approx(squares).epsilon(1e-6));
  // grad_info first, then grad_read: the same state either way (a fresh measurement).
  strata_tensor_t* w21 = sums->m.weights[2][1];
  const strata_grad_info_t info21 = info_of(*sums, w21);
  squares = 0;
  for (float x : read_grad(*sums, 2, 1)) squares += double{x} * x;
  REQUIRE(info21.sum_squares == Approx(squares).epsilon(1e-6));
  // The layers whose backward pass was released hold what the reference holds.
  for (uint32_t l : {3u}) {
    for (std::size_t k = 0; k < 2; ++k) REQUIRE(read_grad(*sums, l, k) == read_grad(*ref, l, k));
  }
  for (uint32_t l : {0u, 1u}) {
    for (std::size_t k = 0; k < 2; ++k) REQUIRE(read_grad(*sums, l, k) == read_grad(*ref, l, k));
  }
}

TEST_CASE("in-place sums: what a layer's backward pass in flight refuses, and why",
          "[optimizer][grad_sum]") {
  auto r = make_run(true, {3000, 1100}, STRATA_DEVICE_BACKEND_HOST);
  strata_tensor_t* w3 = r->m.weights[3][0];
  pass(*r, 0, 0);
  const std::vector<float> held = read_grad(*r, 3, 0);
  const std::size_t n = held.size();
  std::vector<float> values(n, 0.5f);

  // Loaded (after the forward pass, host backend: layer 3's load is issued) and not released:
  // a factor would have to apply to the sum and not to what the pass adds. Refused, the grad
  // unchanged: the landing adds to the unscaled sum.
  Hooks h;
  h.after_forward = [&](Run& run) {
    STRATA_REQUIRE_ERROR(strata_optimizer_grad_scale(run.o(), w3, 0.5f), STRATA_ERROR_INVALID_STATE,
                         "loaded and not yet released");
  };
  pass(*r, 0, 1, h);
  const std::vector<float> g2 = [&] {
    std::vector<uint16_t> w = read_bf16(r->m.rt.get(), w3, r->m.sizes[0]);
    const auto g = grads_for(w, 0, 3, 1);
    std::vector<float> out(n);
    for (std::size_t i = 0; i < n; ++i) out[i] = held[i] + from_bf16(g[i]);
    return out;
  }();
  REQUIRE(read_grad(*r, 3, 0) == g2);

  // Acquired for its backward pass: the framework's adds are in flight.
  strata_executor_t* ex = r->st.ex;
  STRATA_REQUIRE_OK(strata_step_begin(ex));
  strata_layer_views_t v{};
  v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
  for (uint32_t l = 0; l < kLayers; ++l) {
    STRATA_REQUIRE_OK(strata_layer_acquire(ex, l, STRATA_PHASE_FORWARD, nullptr, 0, &v));
    STRATA_REQUIRE_OK(strata_layer_release(ex, l, STRATA_PHASE_FORWARD, nullptr));
  }
  STRATA_REQUIRE_OK(strata_layer_acquire(ex, 3, STRATA_PHASE_BACKWARD, nullptr, 0, &v));
  strata_grad_info_t info{};
  info.struct_size = STRATA_GRAD_INFO_STRUCT_SIZE;
  const char* why = "acquired for its backward pass";
  STRATA_REQUIRE_ERROR(strata_optimizer_grad_info(r->o(), w3, &info), STRATA_ERROR_INVALID_STATE,
                       why);
  STRATA_REQUIRE_ERROR(strata_optimizer_grad_read(r->o(), w3, values.data(), n),
                       STRATA_ERROR_INVALID_STATE, why);
  STRATA_REQUIRE_ERROR(strata_optimizer_grad_write(r->o(), w3, values.data(), n),
                       STRATA_ERROR_INVALID_STATE, why);
  STRATA_REQUIRE_ERROR(strata_optimizer_grad_zero(r->o(), w3, 0), STRATA_ERROR_INVALID_STATE, why);
  STRATA_REQUIRE_ERROR(strata_optimizer_grad_scale(r->o(), w3, 2.f), STRATA_ERROR_INVALID_STATE,
                       why);
  // A copy over the sum would drop it: the view is added to, never written.
  STRATA_REQUIRE_ERROR(strata_layer_write_view(ex, 3, STRATA_PHASE_BACKWARD, STRATA_VIEW_GRAD, 0,
                                               values.data(), n * sizeof(float)),
                       STRATA_ERROR_INVALID_STATE, "in-place gradient sum");
  // Another layer's sums are not in flight.
  STRATA_REQUIRE_OK(strata_optimizer_grad_info(r->o(), r->m.weights[0][0], &info));
  STRATA_REQUIRE_OK(strata_layer_release(ex, 3, STRATA_PHASE_BACKWARD, nullptr));
  STRATA_REQUIRE_OK(strata_optimizer_grad_info(r->o(), w3, &info));
  REQUIRE(info.has_grad == 1);
  STRATA_REQUIRE_OK(strata_step_abort(ex, nullptr));
  REQUIRE(read_grad(*r, 3, 0) == g2);  // nothing was added: the view was left alone
}

TEST_CASE("in-place sums: grad_write stores fp32 exactly, where a bf16 grad tensor rounds",
          "[optimizer][grad_sum]") {
  auto ref = make_run(false, {3000, 1100}, backend_under_test());
  auto sums = make_run(true, {3000, 1100}, backend_under_test());
  std::vector<float> values(3000);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.01f * (i % 13) + 1e-4f;
  for (Run* r : {ref.get(), sums.get()}) {
    pass(*r, 0, 0);  // one backward pass: the reference holds it in the bf16 grad tensor
    STRATA_REQUIRE_OK(
        strata_optimizer_grad_write(r->o(), r->m.weights[1][0], values.data(), values.size()));
  }
  REQUIRE(read_grad(*sums, 1, 0) == values);
  std::vector<float> rounded(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) rounded[i] = from_bf16(to_bf16(values[i]));
  REQUIRE(read_grad(*ref, 1, 0) == rounded);
  REQUIRE(rounded != values);
}

TEST_CASE("in-place sums: params that cannot be one are refused by name", "[optimizer][grad_sum]") {
  Model m = make_model(1, 3, backend_under_test(), {3000, 1100}, nullptr, STRATA_TIER_DRAM,
                       STRATA_TIER_HBM, STRATA_DTYPE_BF16);
  strata_optimizer_config_t c = adamw_config();
  c.update_mode = STRATA_UPDATE_EXPLICIT;
  strata_optimizer_t* o = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), &c, &o));
  OptimizerPtr opt(o);
  strata_tensor_t* f32_dram = register_tensor(m.rt.get(), "f32.dram.grad", 3000, STRATA_DTYPE_F32,
                                              STRATA_ROLE_GRAD, STRATA_TIER_DRAM);
  strata_tensor_t* f32_hbm = register_tensor(m.rt.get(), "f32.hbm.grad", 1100, STRATA_DTYPE_F32,
                                             STRATA_ROLE_GRAD, STRATA_TIER_HBM);
  strata_param_desc_t p{};
  p.struct_size = STRATA_PARAM_DESC_STRUCT_SIZE;
  p.weight = m.weights[0][0];
  p.grad_sum = STRATA_GRAD_SUM_IN_PLACE;
  p.grad = m.grads[0][0];  // bf16 in HBM
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(o, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "'layers.0.w0.grad' is bf16 in hbm: an in-place gradient sum");
  p.grad = f32_dram;
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(o, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "'f32.dram.grad' is f32 in dram");
  p.grad = register_tensor(m.rt.get(), "f32.hbm.grad.0", 3000, STRATA_DTYPE_F32, STRATA_ROLE_GRAD,
                           STRATA_TIER_HBM);
  p.grad_sum = 2;
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(o, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "unknown grad_sum 2");
  // A 1.4 caller's desc ends before grad_sum: whatever lies beyond is not read (an accumulator).
  p.grad = m.grads[0][0];
  p.grad_sum = STRATA_GRAD_SUM_IN_PLACE;
  p.struct_size = offsetof(strata_param_desc_t, grad_sum);
  STRATA_REQUIRE_OK(strata_optimizer_add_param(o, &p));
  p.struct_size = STRATA_PARAM_DESC_STRUCT_SIZE;
  p.weight = m.weights[0][1];
  p.grad = f32_hbm;
  STRATA_REQUIRE_OK(strata_optimizer_add_param(o, &p));

  // AUTO mode sums in its own accumulators.
  strata_optimizer_config_t a = adamw_config();
  STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), &a, &o));
  OptimizerPtr auto_opt(o);
  strata_tensor_t* w =
      register_tensor(m.rt.get(), "w.extra", 3000, STRATA_DTYPE_BF16, STRATA_ROLE_WEIGHT);
  strata_tensor_t* g = register_tensor(m.rt.get(), "w.extra.grad", 3000, STRATA_DTYPE_F32,
                                       STRATA_ROLE_GRAD, STRATA_TIER_HBM);
  p.weight = w;
  p.grad = g;
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(o, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "needs update_mode STRATA_UPDATE_EXPLICIT");
}
