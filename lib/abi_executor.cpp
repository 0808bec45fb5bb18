// C ABI: layer graph, plan and executor.
#include <cmath>
#include <cstdio>

#include "lib/abi_support.h"
#include "lib/dlpack_export.h"

using namespace strata;
using namespace strata::abi;

namespace {

Status copy_handles(strata_tensor_t* const* handles, uint32_t count, const char* what,
                    std::vector<TensorId>* out) {
  if (count > 0 && handles == nullptr) {
    return error(Code::kInvalidArgument, what, " is NULL with a count of ", count);
  }
  for (uint32_t i = 0; i < count; ++i) {
    if (handles[i] == nullptr) return error(Code::kInvalidArgument, what, "[", i, "] is NULL");
    out->push_back(tensor_id(handles[i]));
  }
  return Status::ok();
}

Status check_phase(strata_phase_t phase) {
  if (phase != STRATA_PHASE_FORWARD && phase != STRATA_PHASE_BACKWARD) {
    return error(Code::kInvalidArgument, "unknown phase ", phase);
  }
  return Status::ok();
}

Status check_role(strata_view_role_t role) {
  if (role < STRATA_VIEW_WEIGHT || role > STRATA_VIEW_ACTIVATION) {
    return error(Code::kInvalidArgument, "unknown view role ", role);
  }
  return Status::ok();
}

}  // namespace

extern "C" {

STRATA_API strata_status_t strata_graph_create(strata_runtime_t* runtime,
                                               strata_graph_t** out_graph) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(require(out_graph, "out_graph"));
    *out_graph = new strata_graph{runtime->impl, {}};
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_graph_destroy(strata_graph_t* graph) {
  delete graph;
  return STRATA_OK;
}

STRATA_API strata_status_t strata_graph_add_layer(strata_graph_t* graph,
                                                  const strata_layer_desc_t* desc,
                                                  uint32_t* out_index) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(graph, "graph"));
    strata_layer_desc_t d{};
    STRATA_RETURN_IF_ERROR(read_struct(desc, &d));
    LayerSpec layer;
    if (d.name != nullptr) layer.name.assign(d.name, strnlen(d.name, STRATA_MAX_NAME_LENGTH));
    STRATA_RETURN_IF_ERROR(copy_handles(d.weights, d.weight_count, "weights", &layer.weights));
    STRATA_RETURN_IF_ERROR(copy_handles(d.grads, d.grad_count, "grads", &layer.grads));
    STRATA_RETURN_IF_ERROR(
        copy_handles(d.activations, d.activation_count, "activations", &layer.activations));
    STRATA_RETURN_IF_ERROR(copy_handles(d.optimizer_state, d.optimizer_state_count,
                                        "optimizer_state", &layer.optimizer_state));
    if (layer.weights.empty()) {
      return error(Code::kInvalidArgument, "layer ", graph->graph.layers.size(),
                   " declares no weights");
    }
    for (TensorId id : layer.weights) {
      TensorRecord r;
      STRATA_RETURN_IF_ERROR(graph->runtime->info(id, &r));
    }
    layer.forward_flops = d.forward_flops;
    layer.backward_flops = d.backward_flops;
    if (out_index != nullptr) *out_index = static_cast<uint32_t>(graph->graph.layers.size());
    graph->graph.layers.push_back(std::move(layer));
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_graph_add_resident(strata_graph_t* graph,
                                                     strata_tensor_t* tensor) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(graph, "graph"));
    STRATA_RETURN_IF_ERROR(require(tensor, "tensor"));
    TensorRecord r;
    STRATA_RETURN_IF_ERROR(graph->runtime->info(tensor_id(tensor), &r));
    graph->graph.residents.push_back(tensor_id(tensor));
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_plan_config_init(strata_plan_config_t* config) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(config, "config"));
    // The core's defaults, the only copy of them.
    const PlanConfig defaults;
    *config = strata_plan_config_t{};
    config->struct_size = STRATA_PLAN_CONFIG_STRUCT_SIZE;
    config->micro_batches = defaults.micro_batches;
    config->hbm_slot_budget_bytes = defaults.hbm_slot_budget;
    config->h2d_bytes_per_second = defaults.h2d_bytes_per_second;
    config->d2h_bytes_per_second = defaults.d2h_bytes_per_second;
    config->device_flops_per_second = defaults.device_flops_per_second;
    config->max_prefetch_depth = defaults.max_prefetch_depth;
    config->chunk_bytes = defaults.chunk_bytes;
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_plan_create(strata_graph_t* graph,
                                              const strata_plan_config_t* config,
                                              strata_plan_t** out_plan) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(graph, "graph"));
    STRATA_RETURN_IF_ERROR(require(out_plan, "out_plan"));
    strata_plan_config_t c{};
    (void)strata_plan_config_init(&c);
    if (config != nullptr) {
      STRATA_RETURN_IF_ERROR(read_struct(config, &c));
    }
    PlanConfig pc;
    pc.micro_batches = c.micro_batches == 0 ? 1 : c.micro_batches;
    pc.hbm_slot_budget = c.hbm_slot_budget_bytes;
    pc.h2d_bytes_per_second = c.h2d_bytes_per_second;
    pc.d2h_bytes_per_second = c.d2h_bytes_per_second;
    pc.device_flops_per_second = c.device_flops_per_second;
    pc.max_prefetch_depth = c.max_prefetch_depth;
    if (c.chunk_bytes != 0) pc.chunk_bytes = c.chunk_bytes;
    // `!(x >= 0)` also catches NaN, which every comparison with a plain `< 0` lets through.
    if (!(c.h2d_bytes_per_second >= 0) || !(c.d2h_bytes_per_second >= 0) ||
        !(c.device_flops_per_second >= 0) || std::isinf(c.h2d_bytes_per_second) ||
        std::isinf(c.d2h_bytes_per_second) || std::isinf(c.device_flops_per_second)) {
      return error(Code::kInvalidArgument,
                   "link speeds and device_flops_per_second must be finite and >= 0");
    }
    auto plan = std::make_unique<strata_plan>();
    plan->runtime = graph->runtime;
    STRATA_RETURN_IF_ERROR(make_plan(*graph->runtime, graph->graph, pc, &plan->plan));
    *out_plan = plan.release();
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_plan_destroy(strata_plan_t* plan) {
  delete plan;
  return STRATA_OK;
}

STRATA_API strata_status_t strata_plan_get_info(strata_plan_t* plan, strata_plan_info_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(plan, "plan"));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    const Plan& p = plan->plan;
    strata_plan_info_t info{};
    info.layers = p.layer_count;
    info.micro_batches = p.config.micro_batches;
    info.slots = p.slots;
    info.forward_prefetch_depth = p.forward_depth;
    info.backward_prefetch_depth = p.backward_depth;
    info.all_layers_fit = p.all_layers_fit ? 1 : 0;
    info.slot_bytes = p.slot_bytes;
    info.resident_bytes = p.resident_bytes;
    info.h2d_bytes_per_second = p.h2d_bytes_per_second;
    info.d2h_bytes_per_second = p.d2h_bytes_per_second;
    info.predicted_step_seconds = p.prediction.step_seconds;
    info.predicted_h2d_seconds = p.prediction.h2d_busy;
    info.predicted_d2h_seconds = p.prediction.d2h_busy;
    info.predicted_nvme_seconds = p.prediction.nvme_busy;
    info.predicted_compute_seconds = p.prediction.compute_busy;
    info.predicted_gpu_wait_seconds = p.prediction.gpu_wait;
    std::snprintf(info.bottleneck, sizeof info.bottleneck, "%s", p.prediction.bottleneck.c_str());
    write_struct(out, info);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_plan_dump(strata_plan_t* plan, strata_plan_format_t format,
                                            char* buffer, size_t capacity, size_t* out_length) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(plan, "plan"));
    std::string text;
    if (format == STRATA_PLAN_FORMAT_JSON) {
      text = plan_to_json(plan->plan);
    } else if (format == STRATA_PLAN_FORMAT_TEXT) {
      text = plan_to_text(plan->plan);
    } else {
      return error(Code::kInvalidArgument, "unknown plan format ", format);
    }
    return copy_out_text(text, buffer, capacity, out_length);
  });
}

STRATA_API strata_status_t strata_executor_create(strata_plan_t* plan,
                                                  strata_executor_t** out_executor) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(plan, "plan"));
    STRATA_RETURN_IF_ERROR(require(out_executor, "out_executor"));
    auto executor = std::make_unique<strata_executor>();
    STRATA_RETURN_IF_ERROR(Executor::create(plan->runtime, plan->plan, &executor->impl));
    *out_executor = executor.release();
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_executor_destroy(strata_executor_t* executor) {
  delete executor;
  return STRATA_OK;
}

STRATA_API strata_status_t strata_step_begin(strata_executor_t* executor) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(executor, "executor"));
    return executor->impl->step_begin();
  });
}

STRATA_API strata_status_t strata_step_end(strata_executor_t* executor) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(executor, "executor"));
    return executor->impl->step_end();
  });
}

STRATA_API strata_status_t strata_step_abort(strata_executor_t* executor, void* stream) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(executor, "executor"));
    return executor->impl->step_abort(stream);
  });
}

STRATA_API strata_status_t strata_layer_acquire(strata_executor_t* executor, uint32_t layer,
                                                strata_phase_t phase, void* stream, uint32_t flags,
                                                strata_layer_views_t* views) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(executor, "executor"));
    STRATA_RETURN_IF_ERROR(check_phase(phase));
    STRATA_RETURN_IF_ERROR(check_out_struct(views));
    if ((flags & ~(STRATA_ACQUIRE_NO_WAIT | STRATA_ACQUIRE_HOST_WAIT)) != 0) {
      return error(Code::kInvalidArgument, "unknown acquire flags ", flags);
    }
    if ((flags & STRATA_ACQUIRE_NO_WAIT) != 0 && (flags & STRATA_ACQUIRE_HOST_WAIT) != 0) {
      return error(Code::kInvalidArgument,
                   "acquire flags NO_WAIT and HOST_WAIT exclude each other");
    }
    const Executor::Wait wait = (flags & STRATA_ACQUIRE_NO_WAIT) != 0     ? Executor::Wait::kNone
                                : (flags & STRATA_ACQUIRE_HOST_WAIT) != 0 ? Executor::Wait::kHost
                                                                          : Executor::Wait::kStream;
    LayerViews v;
    STRATA_RETURN_IF_ERROR(
        executor->impl->acquire(layer, static_cast<Phase>(phase), stream, wait, &v));
    executor->views = std::move(v);
    strata_layer_views_t out{};
    out.weight_count = static_cast<uint32_t>(executor->views.weights.size());
    out.weights = executor->views.weights.data();
    out.grad_count = static_cast<uint32_t>(executor->views.grads.size());
    out.grads = executor->views.grads.empty() ? nullptr : executor->views.grads.data();
    out.activation_count = static_cast<uint32_t>(executor->views.activations.size());
    out.activations =
        executor->views.activations.empty() ? nullptr : executor->views.activations.data();
    write_struct(views, out);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_layer_wait_tensor(strata_executor_t* executor, uint32_t layer,
                                                    strata_phase_t phase, strata_view_role_t role,
                                                    uint32_t index, void* stream) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(executor, "executor"));
    STRATA_RETURN_IF_ERROR(check_phase(phase));
    STRATA_RETURN_IF_ERROR(check_role(role));
    return executor->impl->wait_tensor(layer, static_cast<Phase>(phase),
                                       static_cast<ViewRole>(role), index, stream);
  });
}

STRATA_API strata_status_t strata_layer_export_dlpack(strata_executor_t* executor, uint32_t layer,
                                                      strata_phase_t phase, strata_view_role_t role,
                                                      uint32_t index,
                                                      DLManagedTensorVersioned** out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(executor, "executor"));
    STRATA_RETURN_IF_ERROR(require(out, "out"));
    STRATA_RETURN_IF_ERROR(check_phase(phase));
    STRATA_RETURN_IF_ERROR(check_role(role));
    Executor& e = *executor->impl;
    ExportLease lease;
    TensorId id = 0;
    STRATA_RETURN_IF_ERROR(e.view(layer, static_cast<Phase>(phase), static_cast<ViewRole>(role),
                                  index, &lease.data, &id));
    TensorRecord r;
    STRATA_RETURN_IF_ERROR(e.runtime().info(id, &r));
    lease.tier = Tier::kHbm;
    lease.dtype = r.spec.dtype;
    lease.shape = r.spec.shape;
    *out = make_dlpack(std::move(lease), e.runtime().device());
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_layer_write_view(strata_executor_t* executor, uint32_t layer,
                                                   strata_phase_t phase, strata_view_role_t role,
                                                   uint32_t index, const void* src,
                                                   uint64_t bytes) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(executor, "executor"));
    STRATA_RETURN_IF_ERROR(require(src, "src"));
    STRATA_RETURN_IF_ERROR(check_phase(phase));
    STRATA_RETURN_IF_ERROR(check_role(role));
    return executor->impl->write_view(layer, static_cast<Phase>(phase), static_cast<ViewRole>(role),
                                      index, src, bytes);
  });
}

STRATA_API strata_status_t strata_layer_release(strata_executor_t* executor, uint32_t layer,
                                                strata_phase_t phase, void* stream) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(executor, "executor"));
    STRATA_RETURN_IF_ERROR(check_phase(phase));
    return executor->impl->release(layer, static_cast<Phase>(phase), stream);
  });
}

STRATA_API strata_status_t strata_executor_get_stats(strata_executor_t* executor,
                                                     strata_executor_stats_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(executor, "executor"));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    const ExecutorStats s = executor->impl->stats();
    strata_executor_stats_t stats{};
    stats.steps = s.steps;
    stats.loads = s.loads;
    stats.reused_loads = s.reused_loads;
    stats.bytes_in = s.bytes_in;
    stats.bytes_out = s.bytes_out;
    write_struct(out, stats);
    return Status::ok();
  });
}

}  // extern "C"
