// C ABI: placement (where a streamed model's training state should live).
#include <cmath>

#include "lib/abi_support.h"
#include "runtime/optimizer/update_probe.h"
#include "runtime/placement/placement.h"

using namespace strata;
using namespace strata::abi;

static_assert(STRATA_TIER_HBM == kGradsInHbm && STRATA_TIER_DRAM == kGradsInDram);

struct strata_placement {
  Placement placement;
};

namespace {

// Rates the request leaves at 0, measured on `runtime` (each where the tier it needs exists).
Status measure_missing(Runtime& runtime, PlacementRates* r, bool any_nvme_possible) {
  if (r->h2d <= 0 || r->d2h <= 0) {
    double h2d = 0, d2h = 0;
    STRATA_RETURN_IF_ERROR(runtime.measure_links(&h2d, &d2h));
    if (r->h2d <= 0) r->h2d = h2d;
    if (r->d2h <= 0) r->d2h = d2h;
  }
  if (any_nvme_possible && (r->nvme_read <= 0 || r->nvme_write <= 0 || r->nvme_mixed <= 0)) {
    double read = 0, write = 0, mixed = 1;
    STRATA_RETURN_IF_ERROR(runtime.measure_nvme(&read, &write, &mixed));
    if (r->nvme_read <= 0) r->nvme_read = read;
    if (r->nvme_write <= 0) r->nvme_write = write;
    if (r->nvme_mixed <= 0) r->nvme_mixed = mixed;
  }
  if (r->update_elements <= 0) {
    STRATA_RETURN_IF_ERROR(optim::measure_update_rate(runtime, &r->update_elements));
  }
  return Status::ok();
}

bool finite_nonnegative(double v) {
  return v >= 0 && !std::isinf(v);
}

}  // namespace

extern "C" {

STRATA_API strata_status_t strata_placement_request_init(strata_placement_request_t* request) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(request, "request"));
    const PlacementRequest defaults;
    *request = strata_placement_request_t{};
    request->struct_size = STRATA_PLACEMENT_REQUEST_STRUCT_SIZE;
    request->max_staging_slots = defaults.max_staging_slots;
    request->prefetch_depth = defaults.prefetch_depth;
    request->updates_after_backward = defaults.updates_after_backward ? 1 : 0;
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_placement_layer_init(strata_placement_layer_t* layer) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(layer, "layer"));
    *layer = strata_placement_layer_t{};
    layer->struct_size = STRATA_PLACEMENT_LAYER_STRUCT_SIZE;
    layer->weight_tier = STRATA_HOME_CHOOSE;
    layer->state_tier = STRATA_HOME_CHOOSE;
    layer->grad_tier = STRATA_TIER_DRAM;
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_placement_create(strata_runtime_t* runtime,
                                                   const strata_placement_request_t* request,
                                                   strata_placement_t** out_placement) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(out_placement, "out_placement"));
    strata_placement_request_t q{};
    (void)strata_placement_request_init(&q);
    STRATA_RETURN_IF_ERROR(read_struct(request, &q));
    if (q.layer_count > 0 && q.layers == nullptr) {
      return error(Code::kInvalidArgument, "layers is NULL with a layer_count of ", q.layer_count);
    }
    if (q.layer_count > kMaxPlacementLayers) {  // before copying any of them
      return error(Code::kInvalidArgument, "the placement request has ", q.layer_count,
                   " layers; at most ", kMaxPlacementLayers, " are simulated");
    }
    PlacementRequest r;
    for (uint32_t i = 0; i < q.layer_count; ++i) {
      strata_placement_layer_t l{};
      (void)strata_placement_layer_init(&l);
      if (q.layers[i] == nullptr) return error(Code::kInvalidArgument, "layers[", i, "] is NULL");
      STRATA_RETURN_IF_ERROR(read_struct(q.layers[i], &l));
      PlacementLayer layer;
      if (l.name != nullptr) layer.name.assign(l.name, strnlen(l.name, STRATA_MAX_NAME_LENGTH));
      layer.weight_bytes = l.weight_bytes;
      layer.grad_bytes = l.grad_bytes;
      layer.state_bytes = l.state_bytes;
      layer.update_elements = l.update_elements;
      layer.forward_seconds = l.forward_seconds;
      layer.backward_seconds = l.backward_seconds;
      layer.weight_tier = l.weight_tier;
      layer.state_tier = l.state_tier;
      layer.grad_tier = l.grad_tier;
      r.layers.push_back(std::move(layer));
    }
    r.staging_slots = q.staging_slots;
    r.max_staging_slots = q.max_staging_slots == 0 ? 4 : q.max_staging_slots;
    r.prefetch_depth = q.prefetch_depth == 0 ? 1 : q.prefetch_depth;
    r.other_device_seconds = q.other_device_seconds;
    r.updates_after_backward = q.updates_after_backward != 0;
    r.rates = {q.h2d_bytes_per_second,        q.d2h_bytes_per_second, q.nvme_read_bytes_per_second,
               q.nvme_write_bytes_per_second, q.nvme_mixed,           q.update_elements_per_second};
    for (double v : {q.h2d_bytes_per_second, q.d2h_bytes_per_second, q.nvme_read_bytes_per_second,
                     q.nvme_write_bytes_per_second, q.nvme_mixed, q.update_elements_per_second,
                     q.other_device_seconds}) {
      if (!finite_nonnegative(v)) {
        return error(Code::kInvalidArgument,
                     "placement rates and other_device_seconds must be finite and >= 0");
      }
    }
    r.dram_budget = q.dram_budget_bytes;
    r.nvme_budget = q.nvme_budget_bytes;
    if (runtime != nullptr) {
      Runtime& rt = *runtime->impl;
      const bool nvme = rt.tier_available(Tier::kNvme);
      if (r.dram_budget == 0) r.dram_budget = rt.tier_usage(Tier::kDram).largest_free;
      if (!nvme) {
        r.nvme_budget = 0;  // nothing can spill to a tier the runtime does not have
      } else if (r.nvme_budget == 0) {
        const TierUsage u = rt.tier_usage(Tier::kNvme);
        r.nvme_budget = u.budget - u.used;
      }
      // A request that is invalid, or that no placement fits, is refused before any
      // measurement costs time (a choice with the rates not counted decides that).
      Placement dry;
      STRATA_RETURN_IF_ERROR(choose_placement(r, &dry));
      STRATA_RETURN_IF_ERROR(measure_missing(rt, &r.rates, nvme && r.nvme_budget > 0));
    }
    if (r.rates.nvme_mixed == 0) r.rates.nvme_mixed = 1;
    auto placement = std::make_unique<strata_placement>();
    STRATA_RETURN_IF_ERROR(choose_placement(r, &placement->placement));
    *out_placement = placement.release();
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_placement_destroy(strata_placement_t* placement) {
  delete placement;
  return STRATA_OK;
}

STRATA_API strata_status_t strata_placement_get_info(strata_placement_t* placement,
                                                     strata_placement_info_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(placement, "placement"));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    const Placement& p = placement->placement;
    strata_placement_info_t info{};
    info.layers = static_cast<uint32_t>(p.homes.size());
    info.staging_slots = p.staging_slots;
    for (const LayerHome& h : p.homes) {
      info.state_nvme_layers += h.state_on_nvme ? 1 : 0;
      info.weight_nvme_layers += h.weights_on_nvme ? 1 : 0;
    }
    info.candidates = p.candidates;
    info.slot_bytes = p.slot_bytes;
    info.grad_fetch_bytes = p.grad_fetch_bytes;
    info.dram_bytes = p.dram_bytes;
    info.nvme_bytes = p.nvme_bytes;
    info.h2d_bytes_per_second = p.rates.h2d;
    info.d2h_bytes_per_second = p.rates.d2h;
    info.nvme_read_bytes_per_second = p.rates.nvme_read;
    info.nvme_write_bytes_per_second = p.rates.nvme_write;
    info.nvme_mixed = p.rates.nvme_mixed;
    info.update_elements_per_second = p.rates.update_elements;
    const StepPrediction& s = p.prediction;
    info.predicted_step_seconds = s.step_seconds;
    info.predicted_compute_seconds = s.compute;
    info.predicted_h2d_seconds = s.h2d;
    info.predicted_d2h_seconds = s.d2h;
    info.predicted_nvme_read_seconds = s.nvme_read;
    info.predicted_nvme_write_seconds = s.nvme_write;
    info.predicted_update_seconds = s.update;
    info.predicted_gpu_wait_seconds = s.gpu_wait;
    info.predicted_update_wait_seconds = s.update_wait;
    copy_string(info.bottleneck, sizeof info.bottleneck, s.bottleneck);
    write_struct(out, info);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_placement_get_layer(strata_placement_t* placement, uint32_t index,
                                                      int32_t* weight_tier, int32_t* state_tier) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(placement, "placement"));
    const auto& homes = placement->placement.homes;
    if (index >= homes.size()) {
      return error(Code::kInvalidArgument, "layer index ", index, " is out of range (",
                   homes.size(), " layers)");
    }
    if (weight_tier != nullptr)
      *weight_tier = homes[index].weights_on_nvme ? STRATA_TIER_NVME : STRATA_TIER_DRAM;
    if (state_tier != nullptr)
      *state_tier = homes[index].state_on_nvme ? STRATA_TIER_NVME : STRATA_TIER_DRAM;
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_placement_dump(strata_placement_t* placement,
                                                 strata_plan_format_t format, char* buffer,
                                                 size_t capacity, size_t* out_length) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(placement, "placement"));
    std::string text;
    if (format == STRATA_PLAN_FORMAT_JSON) {
      text = placement_to_json(placement->placement);
    } else if (format == STRATA_PLAN_FORMAT_TEXT) {
      text = placement_to_text(placement->placement);
    } else {
      return error(Code::kInvalidArgument, "unknown placement format ", format);
    }
    return copy_out_text(text, buffer, capacity, out_length);
  });
}

}  // extern "C"
