// A small streamed bf16 model and the loops that train it (by hand, through an executor in
// AUTO or EXPLICIT update mode), shared by the optimizer's test files.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "support/device_views.h"

namespace strata_test {

inline constexpr uint64_t kMiB = 1ull << 20;

inline uint16_t to_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float from_bf16(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// The "framework's" grad: a function of the weights it was handed and of the step, so a stale
// or half-updated load shows up as different grads, and so as different weights later.
inline std::vector<uint16_t> grads_for(const std::vector<uint16_t>& w, int step, int layer,
                                       int micro) {
  std::vector<uint16_t> g(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) {
    const float x = 0.5f * from_bf16(w[i]) +
                    0.1f * std::sin(0.37f * static_cast<float>(i) + static_cast<float>(step) +
                                    0.5f * static_cast<float>(layer) + 0.25f * micro);
    g[i] = to_bf16(x);
  }
  return g;
}

struct OptimizerDeleter {
  void operator()(strata_optimizer_t* o) const { strata_optimizer_destroy(o); }
};
using OptimizerPtr = std::unique_ptr<strata_optimizer_t, OptimizerDeleter>;

// A small bf16 model: `layers` layers of two weights each, bf16 grads, in DRAM.
struct Model {
  RuntimePtr rt;
  std::vector<std::vector<strata_tensor_t*>> weights, grads;
  std::vector<int64_t> sizes{3000, 1100};
};

inline strata_tensor_t* register_tensor(strata_runtime_t* rt, const std::string& name, int64_t n,
                                        strata_dtype_t dtype, strata_role_t role,
                                        strata_tier_t tier = STRATA_TIER_DRAM) {
  const int64_t shape[1] = {n};
  const strata_tensor_desc_t d = desc(name.c_str(), shape, 1, tier, dtype, role);
  strata_tensor_t* t = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_register(rt, &d, &t));
  return t;
}

// weight_tier: where the weights live (NVMe needs an NVMe tier in `config`); grad_tier: where
// the grads do (DRAM, or HBM), in grad_dtype.
inline Model make_model(int layers, uint64_t seed, strata_device_backend_t backend,
                        std::vector<int64_t> sizes = {3000, 1100},
                        const strata_runtime_config_t* config = nullptr,
                        strata_tier_t weight_tier = STRATA_TIER_DRAM,
                        strata_tier_t grad_tier = STRATA_TIER_DRAM,
                        strata_dtype_t grad_dtype = STRATA_DTYPE_BF16) {
  Model m;
  m.sizes = std::move(sizes);
  m.rt = make_runtime(config != nullptr ? *config : config_for(backend, 64 * kMiB, 256 * kMiB));
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> dist(0.f, 0.5f);
  for (int l = 0; l < layers; ++l) {
    m.weights.emplace_back();
    m.grads.emplace_back();
    for (std::size_t k = 0; k < m.sizes.size(); ++k) {
      const std::string base = "layers." + std::to_string(l) + ".w" + std::to_string(k);
      strata_tensor_t* w = register_tensor(m.rt.get(), base, m.sizes[k], STRATA_DTYPE_BF16,
                                           STRATA_ROLE_WEIGHT, weight_tier);
      std::vector<uint16_t> init(static_cast<std::size_t>(m.sizes[k]));
      for (auto& x : init) x = to_bf16(dist(rng));
      STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), w, 0, init.data(), init.size() * 2));
      m.weights.back().push_back(w);
      m.grads.back().push_back(register_tensor(m.rt.get(), base + ".grad", m.sizes[k], grad_dtype,
                                               STRATA_ROLE_GRAD, grad_tier));
    }
  }
  return m;
}

inline OptimizerPtr make_optimizer(Model& m, const strata_optimizer_config_t& c,
                                   uint32_t master_layout = STRATA_MASTER_SEPARATE,
                                   uint32_t grad_sum = STRATA_GRAD_SUM_ACCUMULATOR) {
  strata_optimizer_t* o = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), &c, &o));
  OptimizerPtr opt(o);
  for (std::size_t l = 0; l < m.weights.size(); ++l) {
    for (std::size_t k = 0; k < m.weights[l].size(); ++k) {
      strata_param_desc_t p{};
      p.struct_size = STRATA_PARAM_DESC_STRUCT_SIZE;
      p.weight = m.weights[l][k];
      p.grad = m.grads[l][k];
      p.group = k == 1 ? 1 : 0;  // the second weight of each layer: no weight decay
      p.master_layout = master_layout;
      p.grad_sum = grad_sum;
      STRATA_REQUIRE_OK(strata_optimizer_add_param(opt.get(), &p));
    }
  }
  STRATA_REQUIRE_OK(strata_optimizer_set_group(opt.get(), 1, c.lr, 0.f));
  return opt;
}

inline std::vector<uint16_t> read_bf16(strata_runtime_t* rt, strata_tensor_t* t, int64_t n) {
  std::vector<uint16_t> v(static_cast<std::size_t>(n));
  STRATA_REQUIRE_OK(strata_tensor_read(rt, t, 0, v.data(), v.size() * 2));
  return v;
}

// Every weight's bf16 values, layer by layer.
inline std::vector<std::vector<uint16_t>> bf16_weights(Model& m) {
  std::vector<std::vector<uint16_t>> out;
  for (auto& layer : m.weights) {
    for (std::size_t k = 0; k < layer.size(); ++k) {
      out.push_back(read_bf16(m.rt.get(), layer[k], m.sizes[k]));
    }
  }
  return out;
}

// Every byte of the weights and the optimizer's state.
inline std::vector<std::vector<unsigned char>> snapshot(Model& m, strata_optimizer_t* opt) {
  std::vector<std::vector<unsigned char>> out;
  for (std::size_t l = 0; l < m.weights.size(); ++l) {
    for (std::size_t k = 0; k < m.weights[l].size(); ++k) {
      strata_tensor_t* w = m.weights[l][k];
      std::vector<strata_tensor_t*> ts{w};
      for (strata_state_kind_t kind : {STRATA_STATE_MASTER, STRATA_STATE_MASTER_LOW,
                                       STRATA_STATE_EXP_AVG, STRATA_STATE_EXP_AVG_SQ}) {
        strata_tensor_t* s = nullptr;
        if (strata_optimizer_get_state(opt, w, kind, &s) == STRATA_OK) ts.push_back(s);
      }
      for (strata_tensor_t* t : ts) {
        strata_tensor_info_t info{};
        info.struct_size = STRATA_TENSOR_INFO_STRUCT_SIZE;
        STRATA_REQUIRE_OK(strata_tensor_get_info(m.rt.get(), t, &info));
        std::vector<unsigned char> bytes(info.nbytes);
        STRATA_REQUIRE_OK(strata_tensor_read(m.rt.get(), t, 0, bytes.data(), bytes.size()));
        out.push_back(std::move(bytes));
      }
    }
  }
  return out;
}

// Steps by hand: grads from the DRAM weights, written to the grad tensors, then step().
inline void run_manual(Model& m, strata_optimizer_t* opt, int first_step, int steps,
                       int micro_batches) {
  for (int s = first_step; s < first_step + steps; ++s) {
    STRATA_REQUIRE_OK(strata_optimizer_set_group(opt, 0, 1e-2f / (1 + s), 0.1f));
    STRATA_REQUIRE_OK(strata_optimizer_set_group(opt, 1, 1e-2f / (1 + s), 0.f));
    for (int micro = 0; micro < micro_batches; ++micro) {
      for (std::size_t l = 0; l < m.weights.size(); ++l) {
        for (std::size_t k = 0; k < m.weights[l].size(); ++k) {
          const auto w = read_bf16(m.rt.get(), m.weights[l][k], m.sizes[k]);
          const auto g = grads_for(w, s, static_cast<int>(l), micro);
          STRATA_REQUIRE_OK(
              strata_tensor_write(m.rt.get(), m.grads[l][k], 0, g.data(), g.size() * 2));
        }
      }
      STRATA_REQUIRE_OK(strata_optimizer_step(opt));
    }
  }
}

struct Streamed {
  strata_graph_t* graph = nullptr;
  strata_plan_t* plan = nullptr;
  strata_executor_t* ex = nullptr;
  ~Streamed() {
    strata_executor_destroy(ex);
    strata_plan_destroy(plan);
    strata_graph_destroy(graph);
  }
};

// max_depth: the plan's max_prefetch_depth (0: as deep as the slots allow).
inline void make_streamed(Model& m, Streamed* st, uint64_t slot_budget, uint32_t max_depth = 0) {
  STRATA_REQUIRE_OK(strata_graph_create(m.rt.get(), &st->graph));
  for (std::size_t l = 0; l < m.weights.size(); ++l) {
    strata_layer_desc_t d{};
    d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
    d.weights = m.weights[l].data();
    d.weight_count = static_cast<uint32_t>(m.weights[l].size());
    d.grads = m.grads[l].data();
    d.grad_count = static_cast<uint32_t>(m.grads[l].size());
    STRATA_REQUIRE_OK(strata_graph_add_layer(st->graph, &d, nullptr));
  }
  strata_plan_config_t pc;
  STRATA_REQUIRE_OK(strata_plan_config_init(&pc));
  pc.hbm_slot_budget_bytes = slot_budget;
  pc.max_prefetch_depth = max_depth;
  pc.h2d_bytes_per_second = 1e9;
  pc.d2h_bytes_per_second = 1e9;
  STRATA_REQUIRE_OK(strata_plan_create(st->graph, &pc, &st->plan));
  STRATA_REQUIRE_OK(strata_executor_create(st->plan, &st->ex));
}

// make_streamed with every slot the budget allows, and `o` attached to its executor.
inline void attach_streamed(Model& m, strata_optimizer_t* o, Streamed* st) {
  make_streamed(m, st, 0);
  STRATA_REQUIRE_OK(strata_optimizer_attach(o, st->ex));
}

inline strata_optimizer_stats_t stats_of(strata_optimizer_t* o) {
  strata_optimizer_stats_t s{};
  s.struct_size = STRATA_OPTIMIZER_STATS_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_optimizer_get_stats(o, &s));
  return s;
}

// One executor step: forward, then backward with grads_for() written into the grad views;
// `stop_after` (0..) abandons the step after that many layer passes.
inline void streamed_pass(Model& m, strata_executor_t* ex, int s, int micro, int stop_after = -1) {
  const auto layers = static_cast<uint32_t>(m.weights.size());
  STRATA_REQUIRE_OK(strata_step_begin(ex));
  strata_layer_views_t v{};
  v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
  int passes = 0;
  for (uint32_t l = 0; l < layers; ++l, ++passes) {
    if (passes == stop_after) {
      STRATA_REQUIRE_OK(strata_step_abort(ex, nullptr));
      return;
    }
    STRATA_REQUIRE_OK(strata_layer_acquire(ex, l, STRATA_PHASE_FORWARD, nullptr, 0, &v));
    STRATA_REQUIRE_OK(strata_layer_release(ex, l, STRATA_PHASE_FORWARD, nullptr));
  }
  for (uint32_t l = layers; l-- > 0; ++passes) {
    STRATA_REQUIRE_OK(strata_layer_acquire(ex, l, STRATA_PHASE_BACKWARD, nullptr, 0, &v));
    if (passes == stop_after) {  // abandoned while a layer is acquired
      STRATA_REQUIRE_OK(strata_step_abort(ex, nullptr));
      return;
    }
    for (std::size_t k = 0; k < m.sizes.size(); ++k) {
      std::vector<uint16_t> w(static_cast<std::size_t>(m.sizes[k]));
      view_to_host(w.data(), v.weights[k], w.size() * 2);
      const auto g = grads_for(w, s, static_cast<int>(l), micro);
      host_to_view(v.grads[k], g.data(), g.size() * 2);
    }
    STRATA_REQUIRE_OK(strata_layer_release(ex, l, STRATA_PHASE_BACKWARD, nullptr));
  }
  STRATA_REQUIRE_OK(strata_step_end(ex));
}

// Steps through the executor: grads from the weights in the slot, written into the grad views.
inline void run_streamed(Model& m, strata_optimizer_t* opt, strata_executor_t* ex, int first_step,
                         int steps, int micro_batches) {
  for (int s = first_step; s < first_step + steps; ++s) {
    for (int micro = 0; micro < micro_batches; ++micro) {
      if (micro == micro_batches - 1 || micro == 0) {
        STRATA_REQUIRE_OK(strata_optimizer_set_group(opt, 0, 1e-2f / (1 + s), 0.1f));
        STRATA_REQUIRE_OK(strata_optimizer_set_group(opt, 1, 1e-2f / (1 + s), 0.f));
      }
      streamed_pass(m, ex, s, micro);
    }
  }
  STRATA_REQUIRE_OK(strata_optimizer_synchronize(opt));
}

// PyTorch's loop in explicit mode: micro_batches backward passes, step(), zero_grad().
// One explicit step's passes, then strata_optimizer_step: its updates queued, not waited for.
inline void queue_explicit_step(Model& m, strata_optimizer_t* opt, strata_executor_t* ex, int s,
                                int micro_batches = 1) {
  for (int micro = 0; micro < micro_batches; ++micro) streamed_pass(m, ex, s, micro);
  STRATA_REQUIRE_OK(strata_optimizer_set_group(opt, 0, 1e-2f / (1 + s), 0.1f));
  STRATA_REQUIRE_OK(strata_optimizer_set_group(opt, 1, 1e-2f / (1 + s), 0.f));
  STRATA_REQUIRE_OK(strata_optimizer_step(opt));
}

inline void run_explicit(Model& m, strata_optimizer_t* opt, strata_executor_t* ex, int first_step,
                         int steps, int micro_batches) {
  for (int s = first_step; s < first_step + steps; ++s) {
    queue_explicit_step(m, opt, ex, s, micro_batches);
    for (auto& layer : m.weights) {
      for (strata_tensor_t* w : layer) STRATA_REQUIRE_OK(strata_optimizer_grad_zero(opt, w, 0));
    }
  }
  STRATA_REQUIRE_OK(strata_optimizer_synchronize(opt));
}

inline strata_optimizer_config_t adamw_config() {
  strata_optimizer_config_t c;
  strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, &c);
  c.threads = 2;
  return c;
}

inline float max_relative_difference(const std::vector<std::vector<unsigned char>>& a,
                                     const std::vector<std::vector<unsigned char>>& b) {
  // Compares fp32 state tensors (every second and later tensor of a param); bf16 weights are
  // compared through their masters.
  float worst = 0;
  REQUIRE(a.size() == b.size());
  for (std::size_t t = 0; t < a.size(); ++t) {
    REQUIRE(a[t].size() == b[t].size());
    if (t % 4 == 0) continue;  // the bf16 weight
    const auto* x = reinterpret_cast<const float*>(a[t].data());
    const auto* y = reinterpret_cast<const float*>(b[t].data());
    float scale = 0;
    for (std::size_t i = 0; i < a[t].size() / 4; ++i) scale = std::max(scale, std::abs(y[i]));
    for (std::size_t i = 0; i < a[t].size() / 4; ++i) {
      worst = std::max(worst, std::abs(x[i] - y[i]) / std::max(scale, 1e-30f));
    }
  }
  return worst;
}

}  // namespace strata_test
