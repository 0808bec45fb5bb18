// C ABI: the optimizer (checkpoints are abi_checkpoint.cpp).
#include <cmath>
#include <cstring>

#include "lib/abi_support.h"

using namespace strata;
using namespace strata::abi;

namespace {

OptimizerConfig to_core(const strata_optimizer_config_t& c) {
  OptimizerConfig o;
  o.kind = static_cast<OptimizerKind>(c.kind);
  o.lr = c.lr;
  o.weight_decay = c.weight_decay;
  o.beta1 = c.beta1;
  o.beta2 = c.beta2;
  o.eps = c.eps;
  o.momentum = c.momentum;
  o.dampening = c.dampening;
  o.nesterov = c.nesterov != 0;
  o.max_grad_norm = c.max_grad_norm;
  o.loss_scale = c.loss_scale;
  o.dynamic_loss_scale = c.dynamic_loss_scale != 0;
  o.growth_factor = c.growth_factor;
  o.backoff_factor = c.backoff_factor;
  o.growth_interval = c.growth_interval;
  o.accumulation_steps = c.accumulation_steps;
  o.threads = c.threads;
  o.explicit_updates = c.update_mode == STRATA_UPDATE_EXPLICIT;
  o.state_placement = static_cast<StatePlacement>(c.state_placement);
  o.nvme_staging_bytes = c.nvme_staging_bytes;
  return o;
}

// The C struct of a core config; with OptimizerConfig's defaults it is what
// strata_optimizer_config_init returns, so the C ABI and the core cannot disagree on them.
strata_optimizer_config_t from_core(const OptimizerConfig& o) {
  strata_optimizer_config_t c{};
  c.struct_size = STRATA_OPTIMIZER_CONFIG_STRUCT_SIZE;
  c.kind = static_cast<strata_optimizer_kind_t>(o.kind);
  c.lr = o.lr;
  c.weight_decay = o.weight_decay;
  c.beta1 = o.beta1;
  c.beta2 = o.beta2;
  c.eps = o.eps;
  c.momentum = o.momentum;
  c.dampening = o.dampening;
  c.nesterov = o.nesterov ? 1 : 0;
  c.max_grad_norm = o.max_grad_norm;
  c.loss_scale = o.loss_scale;
  c.dynamic_loss_scale = o.dynamic_loss_scale ? 1 : 0;
  c.growth_factor = o.growth_factor;
  c.backoff_factor = o.backoff_factor;
  c.growth_interval = o.growth_interval;
  c.accumulation_steps = o.accumulation_steps;
  c.threads = o.threads;
  c.update_mode = o.explicit_updates ? STRATA_UPDATE_EXPLICIT : STRATA_UPDATE_AUTO;
  c.state_placement = static_cast<uint32_t>(o.state_placement);
  c.nvme_staging_bytes = o.nvme_staging_bytes;
  return c;
}

// strata_optimizer_config_init writes the whole struct it knows, and 1.2's fields made the struct
// grow: programs linked against 1.0 or 1.1 have 80 bytes (1.1's size, which 1.0's padding made its
// sizeof too), so they keep an init that writes only those, the compat symbol
// strata_optimizer_config_init@STRATA_1.0; programs built against this header get the default,
// @@STRATA_1.2 (docs/abi.md, "*_config_init and growing structs").
constexpr std::size_t kOptimizerConfigAlign = alignof(strata_optimizer_config_t);
static_assert((kOptimizerConfigV1_0Size + kOptimizerConfigAlign - 1) / kOptimizerConfigAlign *
                      kOptimizerConfigAlign ==
                  kOptimizerConfigV1_1Size,
              "one compat init serves 1.0 and 1.1 only while their structs are equally large");
static_assert(sizeof(strata_optimizer_config_t) > kOptimizerConfigV1_1Size);

// Fill the first `bytes` bytes of *config with the defaults and set struct_size.
strata_status_t optimizer_config_init(strata_optimizer_kind_t kind,
                                      strata_optimizer_config_t* config, std::size_t bytes,
                                      std::size_t struct_size) {
  return guarded("strata_optimizer_config_init", [&] {
    STRATA_RETURN_IF_ERROR(require(config, "config"));
    if (!known_kind(kind)) {
      return error(Code::kInvalidArgument, "unknown optimizer kind ", kind);
    }
    const strata_optimizer_config_t c =
        from_core(OptimizerConfig{.kind = static_cast<OptimizerKind>(kind)});
    std::memcpy(static_cast<void*>(config), &c, bytes);
    config->struct_size = struct_size;
    return Status::ok();
  });
}

}  // namespace

extern "C" {

// strata_optimizer_config_init@@STRATA_1.2, the default.
STRATA_API strata_status_t strata_optimizer_config_init_v1_2(strata_optimizer_kind_t kind,
                                                             strata_optimizer_config_t* config) {
  return optimizer_config_init(kind, config, sizeof *config, STRATA_OPTIMIZER_CONFIG_STRUCT_SIZE);
}

// strata_optimizer_config_init@STRATA_1.0, for programs linked against 1.0 or 1.1.
STRATA_API strata_status_t strata_optimizer_config_init_v1_0(strata_optimizer_kind_t kind,
                                                             strata_optimizer_config_t* config) {
  return optimizer_config_init(kind, config, kOptimizerConfigV1_1Size, kOptimizerConfigV1_1Size);
}

STRATA_API strata_status_t strata_optimizer_create(strata_runtime_t* runtime,
                                                   const strata_optimizer_config_t* config,
                                                   strata_optimizer_t** out_optimizer) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(require(out_optimizer, "out_optimizer"));
    strata_optimizer_config_t c{};
    (void)strata_optimizer_config_init_v1_2(STRATA_OPTIMIZER_ADAMW, &c);
    if (config != nullptr) {
      // A 1.0 caller's config ends at `threads`; the fields after it keep their defaults.
      STRATA_RETURN_IF_ERROR(read_struct(config, &c));
    }
    if (c.update_mode != STRATA_UPDATE_AUTO && c.update_mode != STRATA_UPDATE_EXPLICIT) {
      return error(Code::kInvalidArgument, "optimizer config: unknown update_mode ", c.update_mode);
    }
    if (c.state_placement > STRATA_STATE_PLACEMENT_NVME) {
      return error(Code::kInvalidArgument, "optimizer config: unknown state_placement ",
                   c.state_placement, " (STRATA_STATE_PLACEMENT_DRAM, _PLANNED or _NVME)");
    }
    std::shared_ptr<Optimizer> o;
    STRATA_RETURN_IF_ERROR(Optimizer::create(runtime->impl, to_core(c), &o));
    *out_optimizer = new strata_optimizer{std::move(o)};
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_optimizer_destroy(strata_optimizer_t* optimizer) {
  return guarded(__func__, [&] {
    if (optimizer == nullptr) return Status::ok();
    STRATA_RETURN_IF_ERROR(optimizer->impl->detach());
    delete optimizer;
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_optimizer_add_param(strata_optimizer_t* optimizer,
                                                      const strata_param_desc_t* desc) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    strata_param_desc_t d{};  // a 1.0/1.1-sized desc: master_layout SEPARATE (0), and so on
    STRATA_RETURN_IF_ERROR(read_struct(desc, &d));
    STRATA_RETURN_IF_ERROR(require(d.weight, "desc->weight"));
    STRATA_RETURN_IF_ERROR(require(d.grad, "desc->grad"));
    // A 1.4-sized desc ends before grad_sum: STRATA_GRAD_SUM_ACCUMULATOR (0), as before.
    return optimizer->impl->add_param(tensor_id(d.weight), tensor_id(d.grad), d.group,
                                      static_cast<MasterLayout>(d.master_layout),
                                      static_cast<GradSum>(d.grad_sum));
  });
}

STRATA_API strata_status_t strata_optimizer_set_group(strata_optimizer_t* optimizer, uint32_t group,
                                                      float lr, float weight_decay) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    return optimizer->impl->set_group(group, lr, weight_decay);
  });
}

namespace {
strata_group_hyperparams_t to_c(const GroupHyperparams& g) {
  strata_group_hyperparams_t h{};
  h.struct_size = sizeof h;
  h.lr = g.lr;
  h.weight_decay = g.weight_decay;
  h.beta1 = g.beta1;
  h.beta2 = g.beta2;
  h.eps = g.eps;
  return h;
}
}  // namespace

STRATA_API strata_status_t strata_optimizer_get_group(strata_optimizer_t* optimizer, uint32_t group,
                                                      strata_group_hyperparams_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    GroupHyperparams g;
    STRATA_RETURN_IF_ERROR(optimizer->impl->group_hyperparams(group, &g));
    write_struct(out, to_c(g));
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_optimizer_set_group_hyperparams(
    strata_optimizer_t* optimizer, uint32_t group, const strata_group_hyperparams_t* hyperparams) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    // Fields the caller's struct does not cover keep the group's current values.
    GroupHyperparams current;
    STRATA_RETURN_IF_ERROR(optimizer->impl->group_hyperparams(group, &current));
    strata_group_hyperparams_t h = to_c(current);
    STRATA_RETURN_IF_ERROR(read_struct(hyperparams, &h));
    return optimizer->impl->set_group_hyperparams(
        group, GroupHyperparams{h.lr, h.weight_decay, h.beta1, h.beta2, h.eps});
  });
}

STRATA_API strata_status_t strata_optimizer_attach(strata_optimizer_t* optimizer,
                                                   strata_executor_t* executor) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(require(executor, "executor"));
    return optimizer->impl->attach(executor->impl.get());
  });
}

STRATA_API strata_status_t strata_optimizer_step(strata_optimizer_t* optimizer) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    return optimizer->impl->step();
  });
}

STRATA_API strata_status_t strata_optimizer_synchronize(strata_optimizer_t* optimizer) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    return optimizer->impl->synchronize();
  });
}

STRATA_API strata_status_t strata_optimizer_grad_info(strata_optimizer_t* optimizer,
                                                      strata_tensor_t* weight,
                                                      strata_grad_info_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(require(weight, "weight"));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    GradInfo info;
    STRATA_RETURN_IF_ERROR(optimizer->impl->grad_info(tensor_id(weight), &info));
    strata_grad_info_t v{};
    v.has_grad = info.has_grad ? 1 : 0;
    v.sum_squares = info.sum_squares;
    v.step = info.step;
    write_struct(out, v);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_optimizer_grad_read(strata_optimizer_t* optimizer,
                                                      strata_tensor_t* weight, float* dst,
                                                      uint64_t count) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(require(weight, "weight"));
    STRATA_RETURN_IF_ERROR(require(dst, "dst"));
    return optimizer->impl->grad_read(tensor_id(weight), dst, count);
  });
}

STRATA_API strata_status_t strata_optimizer_grad_write(strata_optimizer_t* optimizer,
                                                       strata_tensor_t* weight, const float* src,
                                                       uint64_t count) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(require(weight, "weight"));
    STRATA_RETURN_IF_ERROR(require(src, "src"));
    return optimizer->impl->grad_write(tensor_id(weight), src, count);
  });
}

STRATA_API strata_status_t strata_optimizer_grad_scale(strata_optimizer_t* optimizer,
                                                       strata_tensor_t* weight, float factor) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(require(weight, "weight"));
    return optimizer->impl->grad_scale(tensor_id(weight), factor);
  });
}

STRATA_API strata_status_t strata_optimizer_grad_zero(strata_optimizer_t* optimizer,
                                                      strata_tensor_t* weight, int32_t keep_zeros) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(require(weight, "weight"));
    return optimizer->impl->grad_zero(tensor_id(weight), keep_zeros != 0);
  });
}

STRATA_API strata_status_t strata_optimizer_set_param_step(strata_optimizer_t* optimizer,
                                                           strata_tensor_t* weight, uint64_t step) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(require(weight, "weight"));
    return optimizer->impl->set_param_step(tensor_id(weight), step);
  });
}

STRATA_API strata_status_t strata_optimizer_get_state(strata_optimizer_t* optimizer,
                                                      strata_tensor_t* weight,
                                                      strata_state_kind_t kind,
                                                      strata_tensor_t** out_tensor) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(require(weight, "weight"));
    STRATA_RETURN_IF_ERROR(require(out_tensor, "out_tensor"));
    if (kind < STRATA_STATE_MASTER || kind > STRATA_STATE_MASTER_LOW) {
      return error(Code::kInvalidArgument, "unknown state kind ", kind);
    }
    TensorId id = 0;
    STRATA_RETURN_IF_ERROR(
        optimizer->impl->state_tensor(tensor_id(weight), static_cast<StateKind>(kind), &id));
    *out_tensor = tensor_handle(id);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_optimizer_master_read(strata_optimizer_t* optimizer,
                                                        strata_tensor_t* weight, float* dst,
                                                        uint64_t count) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(require(weight, "weight"));
    STRATA_RETURN_IF_ERROR(require(dst, "dst"));
    return optimizer->impl->master_read(tensor_id(weight), dst, count);
  });
}

STRATA_API strata_status_t strata_optimizer_master_write(strata_optimizer_t* optimizer,
                                                         strata_tensor_t* weight, const float* src,
                                                         uint64_t count) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(require(weight, "weight"));
    STRATA_RETURN_IF_ERROR(require(src, "src"));
    return optimizer->impl->master_write(tensor_id(weight), src, count);
  });
}

STRATA_API strata_status_t strata_optimizer_get_stats(strata_optimizer_t* optimizer,
                                                      strata_optimizer_stats_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(optimizer, "optimizer"));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    const OptimizerStats s = optimizer->impl->stats();
    strata_optimizer_stats_t v{};
    v.step = s.step;
    v.skipped_steps = s.skipped_steps;
    v.micro_step = s.micro_step;
    v.last_grad_norm = s.last_grad_norm;
    v.loss_scale = s.loss_scale;
    v.params = s.params;
    v.elements = s.elements;
    v.state_bytes = s.state_bytes;
    v.update_seconds = s.update_seconds;
    v.threads = s.threads;
    copy_string(v.isa, sizeof v.isa, s.isa);
    copy_string(v.binding, sizeof v.binding, s.binding);
    v.nvme_state_bytes = s.nvme_state_bytes;
    v.nvme_state_params = s.nvme_state_params;
    v.nvme_state_layers = s.nvme_state_layers;
    v.staging_bytes = s.staging_bytes;
    v.staging_slots = s.staging_slots;
    v.nvme_read_bytes = s.nvme_read_bytes;
    v.nvme_write_bytes = s.nvme_write_bytes;
    v.stage_wait_seconds = s.stage_wait_seconds;
    write_struct(out, v);
    return Status::ok();
  });
}

}  // extern "C"

// The two definitions of strata_optimizer_config_init: their names stay local (lib/strata.map's
// `local: *`), the versioned aliases are exported.
asm(".symver strata_optimizer_config_init_v1_2, strata_optimizer_config_init@@STRATA_1.2");
asm(".symver strata_optimizer_config_init_v1_0, strata_optimizer_config_init@STRATA_1.0");
