#include "runtime/stream/planner.h"

#include <algorithm>
#include <cstdio>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>

#include "common/align.h"
#include "common/json.h"
#include "runtime/memory/arena.h"
#include "runtime/runtime.h"

namespace strata {
namespace {

constexpr uint64_t kSlotAlignment = 256;
constexpr uint64_t kPage = 4096;

// Looks tensors up once for the whole plan: catches a tensor declared twice, and records each
// layer tensor's home tier for the plan's dump as it goes.
struct Lookup {
  Runtime& runtime;
  std::vector<std::pair<std::string, std::string>>& homes;
  std::set<TensorId> seen;
  Status get(TensorId id, const std::string& layer, const char* role, TensorRecord* out,
             bool record_home = true) {
    Status s = runtime.info(id, out);
    if (!s.is_ok()) {
      return error(Code::kNotFound, "layer '", layer, "': ", role, " handle ", id,
                   " is not a registered tensor");
    }
    if (!seen.insert(id).second) {
      return error(Code::kInvalidArgument, "tensor '", out->spec.name,
                   "' is declared twice in the graph (each tensor has one layer and one role)");
    }
    if (record_home) homes.emplace_back(out->spec.name, std::string(tier_name(out->tier)));
    return Status::ok();
  }
};

Status lay_out_layer(Lookup& lookup, const LayerSpec& spec, uint32_t index,
                     const PlanConfig& config, double flops, LayerPlan* out) {
  out->name = spec.name.empty() ? "layer." + std::to_string(index) : spec.name;
  if (spec.weights.empty()) {
    return error(Code::kInvalidArgument, "layer '", out->name, "' declares no weights");
  }
  std::vector<TensorRecord> weights;
  int on_nvme = 0;
  for (TensorId id : spec.weights) {
    TensorRecord r;
    STRATA_RETURN_IF_ERROR(lookup.get(id, out->name, "weight", &r));
    if (r.tier == Tier::kHbm) {
      return error(Code::kInvalidArgument, "layer '", out->name, "': weight '", r.spec.name,
                   "' lives in hbm; streamed weights live in dram or nvme (declare it resident, "
                   "or move it out first)");
    }
    on_nvme += r.tier == Tier::kNvme ? 1 : 0;
    out->weight_bytes += r.nbytes;
    weights.push_back(std::move(r));
  }
  if (on_nvme != 0 && on_nvme != static_cast<int>(weights.size())) {
    return error(Code::kInvalidArgument, "layer '", out->name,
                 "': its weights are split between dram and nvme; keep a layer's weights together");
  }
  out->weights_on_nvme = on_nvme != 0;

  // Weights laid out in DRAM back to back travel as one span, in chunks: fewer, larger copies.
  uint64_t cursor = 0;
  if (!out->weights_on_nvme) {
    auto sorted = weights;
    std::sort(sorted.begin(), sorted.end(),
              [](const TensorRecord& a, const TensorRecord& b) { return a.offset < b.offset; });
    uint64_t packed = 0;
    for (const auto& r : sorted) packed += align_up(std::max<uint64_t>(r.nbytes, 1), kPage);
    const uint64_t first = sorted.front().offset;
    const uint64_t span =
        sorted.back().offset + align_up(std::max<uint64_t>(sorted.back().nbytes, 1), kPage) - first;
    // Never one span across the DRAM arena's pinned part and its unpinned one (a weight that
    // fell back there: Runtime::dram_parts_for): CUDA refuses a copy whose host range spans a
    // registered and an unregistered range. Such a layer's weights go one copy each.
    const uint64_t boundary = lookup.runtime.dram_pinned_size();
    const bool one_part = (first < boundary) == (sorted.back().offset < boundary);
    if (one_part && span <= packed + packed / 8) {
      out->weights_as_span = true;
      out->span_dram_offset = first;
      out->span_bytes = span;
      for (const auto& r : weights) out->weights.push_back({r.id, r.offset - first, r.nbytes});
      cursor = align_up(span, kSlotAlignment);
    }
  }
  if (!out->weights_as_span) {
    for (const auto& r : weights) {
      out->weights.push_back({r.id, cursor, r.nbytes});
      cursor = align_up(cursor + std::max<uint64_t>(r.nbytes, 1), kSlotAlignment);
    }
  }
  for (TensorId id : spec.grads) {
    TensorRecord r;
    STRATA_RETURN_IF_ERROR(lookup.get(id, out->name, "grad", &r));
    // DRAM, or HBM: then the backward pass writes them there (no slot space, no copy out) and
    // the optimizer fetches them into DRAM when it reads them (2 bytes per bf16 parameter of
    // DRAM less; docs/optimizer.md, "Grads on the device").
    if (r.tier != Tier::kDram && r.tier != Tier::kHbm) {
      return error(Code::kInvalidArgument, "layer '", out->name, "': grad '", r.spec.name,
                   "' lives in ", tier_name(r.tier), "; grads stream out to dram or hbm homes");
    }
    if (r.tier == Tier::kHbm) {  // not copied out: no outbound bytes
      out->grads.push_back({r.id, 0, r.nbytes, true});
      continue;
    }
    out->grad_bytes += r.nbytes;
    out->grads.push_back({r.id, cursor, r.nbytes});
    cursor = align_up(cursor + std::max<uint64_t>(r.nbytes, 1), kSlotAlignment);
  }
  for (TensorId id : spec.activations) {
    TensorRecord r;
    STRATA_RETURN_IF_ERROR(lookup.get(id, out->name, "activation", &r));
    if (r.tier != Tier::kDram) {
      return error(Code::kInvalidArgument, "layer '", out->name, "': activation checkpoint '",
                   r.spec.name, "' lives in ", tier_name(r.tier),
                   "; checkpoints are parked in dram");
    }
    out->activations.push_back({r.id, cursor, r.nbytes});
    out->activation_bytes += r.nbytes;
    cursor = align_up(cursor + std::max<uint64_t>(r.nbytes, 1), kSlotAlignment);
  }
  for (TensorId id : spec.optimizer_state) {
    TensorRecord r;
    STRATA_RETURN_IF_ERROR(lookup.get(id, out->name, "optimizer state", &r));
  }
  out->footprint = std::max<uint64_t>(cursor, kSlotAlignment);
  const double m = static_cast<double>(config.micro_batches);
  if (flops > 0) {
    out->forward_seconds = spec.forward_flops * m / flops;
    out->backward_seconds = spec.backward_flops * m / flops;
  }
  return Status::ok();
}

std::string gb(double bytes_per_second) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(2) << bytes_per_second / 1e9;
  return o.str();
}

}  // namespace

Prediction predict(const Plan& plan) {
  Prediction p;
  const auto sequence = step_sequence(plan.layer_count);
  const auto schedule = schedule_slots(sequence, plan.slots, plan.forward_depth);
  const std::size_t n = sequence.size();
  std::vector<double> compute_end(n, 0), outbound_end(n, 0);
  double h2d_free = 0, d2h_free = 0, previous_compute_end = 0;
  const double h2d = plan.h2d_bytes_per_second, d2h = plan.d2h_bytes_per_second;
  const double nvme = plan.nvme_read_bytes_per_second;
  for (std::size_t i = 0; i < n; ++i) {
    const LayerPlan& layer = plan.layers[sequence[i].layer];
    const bool backward = sequence[i].phase == Phase::kBackward;
    const ScheduledPosition& s = schedule[i];
    // Loading waits for the slot's previous user to finish computing and sending out.
    double ready = 0;
    if (s.previous_in_slot >= 0 && !s.reuse) {
      ready = std::max(compute_end[static_cast<std::size_t>(s.previous_in_slot)],
                       outbound_end[static_cast<std::size_t>(s.previous_in_slot)]);
    }
    double bytes_in = 0, nvme_seconds = 0;
    if (!s.reuse) {
      bytes_in +=
          static_cast<double>(layer.weights_as_span ? layer.span_bytes : layer.weight_bytes);
      if (backward) bytes_in += static_cast<double>(layer.activation_bytes);
      if (layer.weights_on_nvme && nvme > 0)
        nvme_seconds = static_cast<double>(layer.weight_bytes) / nvme;
    }
    const double in_seconds = h2d > 0 ? bytes_in / h2d : 0;
    // An NVMe-homed layer streams disk -> staging -> HBM, pipelined: the slower leg paces it.
    const double load_seconds = std::max(in_seconds, nvme_seconds);
    const double load_start = std::max(h2d_free, ready);
    const double load_end = load_start + load_seconds;
    h2d_free = load_end;
    p.h2d_busy += in_seconds;
    p.nvme_busy += nvme_seconds;
    const double compute = backward ? layer.backward_seconds : layer.forward_seconds;
    const double start = std::max(previous_compute_end, load_end);
    p.gpu_wait += start - previous_compute_end;
    compute_end[i] = start + compute;
    previous_compute_end = compute_end[i];
    p.compute_busy += compute;
    const double bytes_out =
        static_cast<double>(backward ? layer.grad_bytes : layer.activation_bytes);
    const double out_seconds = d2h > 0 ? bytes_out / d2h : 0;
    outbound_end[i] = std::max(d2h_free, compute_end[i]) + out_seconds;
    if (out_seconds > 0) d2h_free = outbound_end[i];
    p.d2h_busy += out_seconds;
  }
  p.step_seconds = std::max(previous_compute_end, d2h_free);
  const std::pair<double, const char*> busy[] = {
      {p.h2d_busy, "h2d"}, {p.d2h_busy, "d2h"}, {p.nvme_busy, "nvme"}, {p.compute_busy, "compute"}};
  p.bottleneck = std::max_element(std::begin(busy), std::end(busy), [](auto& a, auto& b) {
                   return a.first < b.first;
                 })->second;
  return p;
}

Status make_plan(Runtime& runtime, const LayerGraph& graph, const PlanConfig& config, Plan* out) {
  if (graph.layers.empty()) return error(Code::kInvalidArgument, "the graph has no layers");
  if (config.micro_batches < 1) return error(Code::kInvalidArgument, "micro_batches must be >= 1");
  if (config.chunk_bytes < (4ull << 20)) {
    return error(Code::kInvalidArgument, "chunk_bytes ", config.chunk_bytes,
                 " is below 4 MiB, where PCIe copies stop reaching their peak");
  }
  Plan plan;
  plan.config = config;
  plan.layer_count = static_cast<uint32_t>(graph.layers.size());
  Lookup lookup{runtime, plan.homes, {}};
  uint64_t resident_to_bring = 0;
  for (TensorId id : graph.residents) {
    TensorRecord r;
    STRATA_RETURN_IF_ERROR(lookup.get(id, "(residents)", "resident", &r, false));
    plan.residents.push_back(id);
    plan.resident_bytes += r.nbytes;
    if (r.tier != Tier::kHbm) resident_to_bring += Arena::round_up(r.nbytes);
    plan.homes.emplace_back(r.spec.name, "hbm (resident)");
  }
  for (uint32_t i = 0; i < plan.layer_count; ++i) {
    LayerPlan layer;
    STRATA_RETURN_IF_ERROR(
        lay_out_layer(lookup, graph.layers[i], i, config, config.device_flops_per_second, &layer));
    plan.layers.push_back(std::move(layer));
  }

  // Slots: as many as the HBM left after the residents holds, at least two (one computing,
  // one loading), at most one per layer.
  const TierUsage hbm = runtime.tier_usage(Tier::kHbm);
  const uint64_t largest = hbm.largest_free;
  const uint64_t available = largest > resident_to_bring ? largest - resident_to_bring : 0;
  if (config.hbm_slot_budget > available) {
    return error(Code::kOutOfMemory, "hbm_slot_budget ", config.hbm_slot_budget, " exceeds the ",
                 available, " bytes of HBM left after ", plan.resident_bytes, " resident bytes");
  }
  const uint64_t budget = config.hbm_slot_budget != 0 ? config.hbm_slot_budget : available;
  const auto biggest = std::max_element(plan.layers.begin(), plan.layers.end(),
                                        [](auto& a, auto& b) { return a.footprint < b.footprint; });
  plan.slot_bytes = align_up(biggest->footprint, kSlotAlignment);
  const uint64_t fit = budget / plan.slot_bytes;
  if (fit < 2 && plan.layer_count > 1) {
    return error(Code::kOutOfMemory, "the largest layer ('", biggest->name, "') needs ",
                 plan.slot_bytes, " bytes of HBM per slot and streaming needs 2 slots (",
                 2 * plan.slot_bytes, " bytes), but only ", budget, " bytes are left for slots",
                 plan.resident_bytes ? " after the resident tensors" : "", ": short by ",
                 2 * plan.slot_bytes - budget, " bytes");
  }
  if (fit < 1) {
    return error(Code::kOutOfMemory, "layer '", biggest->name, "' needs ", plan.slot_bytes,
                 " bytes of HBM but only ", budget, " are left: short by ",
                 plan.slot_bytes - budget, " bytes");
  }
  plan.slots = static_cast<uint32_t>(std::min<uint64_t>(fit, plan.layer_count));
  plan.all_layers_fit = plan.slots == plan.layer_count;
  uint32_t depth = plan.slots > 1 ? plan.slots - 1 : 0;
  if (config.max_prefetch_depth != 0) depth = std::min(depth, config.max_prefetch_depth);
  if (depth == 0 && plan.layer_count == 1) depth = 1;  // one layer: its backward reuses its slot
  plan.forward_depth = plan.backward_depth = depth;

  // Link speeds: given, or measured now on this machine.
  plan.h2d_bytes_per_second = config.h2d_bytes_per_second;
  plan.d2h_bytes_per_second = config.d2h_bytes_per_second;
  if (plan.h2d_bytes_per_second <= 0 || plan.d2h_bytes_per_second <= 0) {
    double h2d = 0, d2h = 0;
    STRATA_RETURN_IF_ERROR(runtime.measure_links(&h2d, &d2h));
    if (plan.h2d_bytes_per_second <= 0) plan.h2d_bytes_per_second = h2d;
    if (plan.d2h_bytes_per_second <= 0) plan.d2h_bytes_per_second = d2h;
    plan.links_measured = true;
  }
  const bool any_nvme = std::any_of(plan.layers.begin(), plan.layers.end(),
                                    [](const LayerPlan& l) { return l.weights_on_nvme; });
  if (any_nvme) STRATA_RETURN_IF_ERROR(runtime.measure_nvme_read(&plan.nvme_read_bytes_per_second));
  plan.prediction = predict(plan);
  *out = std::move(plan);
  return Status::ok();
}

std::string plan_to_json(const Plan& plan) {
  std::ostringstream o;
  o << std::setprecision(6);
  const Prediction& p = plan.prediction;
  o << "{\"layers\": " << plan.layer_count << ", \"micro_batches\": " << plan.config.micro_batches
    << ", \"slots\": " << plan.slots << ", \"slot_bytes\": " << plan.slot_bytes
    << ", \"prefetch_depth\": {\"forward\": " << plan.forward_depth
    << ", \"backward\": " << plan.backward_depth << "}"
    << ", \"all_layers_fit\": " << (plan.all_layers_fit ? "true" : "false")
    << ", \"resident_bytes\": " << plan.resident_bytes
    << ", \"links\": {\"h2d_gbps\": " << plan.h2d_bytes_per_second / 1e9
    << ", \"d2h_gbps\": " << plan.d2h_bytes_per_second / 1e9
    << ", \"nvme_read_gbps\": " << plan.nvme_read_bytes_per_second / 1e9
    << ", \"measured\": " << (plan.links_measured ? "true" : "false") << "}"
    << ", \"predicted\": {\"step_seconds\": " << p.step_seconds
    << ", \"bottleneck\": " << json_string(p.bottleneck) << ", \"h2d_busy_seconds\": " << p.h2d_busy
    << ", \"d2h_busy_seconds\": " << p.d2h_busy << ", \"nvme_busy_seconds\": " << p.nvme_busy
    << ", \"compute_seconds\": " << p.compute_busy << ", \"gpu_wait_seconds\": " << p.gpu_wait
    << "}, \"layer_plans\": [";
  for (std::size_t i = 0; i < plan.layers.size(); ++i) {
    const LayerPlan& l = plan.layers[i];
    o << (i ? ", " : "") << "{\"name\": " << json_string(l.name)
      << ", \"weight_bytes\": " << l.weight_bytes << ", \"grad_bytes\": " << l.grad_bytes
      << ", \"activation_bytes\": " << l.activation_bytes << ", \"footprint\": " << l.footprint
      << ", \"weights_home\": \"" << (l.weights_on_nvme ? "nvme" : "dram") << "\""
      << ", \"weights_as_span\": " << (l.weights_as_span ? "true" : "false")
      << ", \"forward_seconds\": " << l.forward_seconds
      << ", \"backward_seconds\": " << l.backward_seconds << "}";
  }
  o << "], \"homes\": {";
  for (std::size_t i = 0; i < plan.homes.size(); ++i) {
    o << (i ? ", " : "") << json_string(plan.homes[i].first) << ": "
      << json_string(plan.homes[i].second);
  }
  o << "}}";
  return o.str();
}

std::string plan_to_text(const Plan& plan) {
  std::ostringstream o;
  const Prediction& p = plan.prediction;
  o << "Strata plan: " << plan.layer_count << " layers, " << plan.config.micro_batches
    << " micro-batch(es) per step\n";
  o << "  HBM: " << plan.slots << " slots of " << plan.slot_bytes << " bytes"
    << (plan.all_layers_fit ? " (every layer has its own slot)" : "") << ", " << plan.resident_bytes
    << " resident bytes in " << plan.residents.size() << " tensor(s)\n";
  o << "  prefetch depth: forward " << plan.forward_depth << ", backward " << plan.backward_depth
    << "\n";
  o << "  links" << (plan.links_measured ? " (measured)" : " (given)") << ": h2d "
    << gb(plan.h2d_bytes_per_second) << " GB/s, d2h " << gb(plan.d2h_bytes_per_second) << " GB/s";
  if (plan.nvme_read_bytes_per_second > 0)
    o << ", nvme read " << gb(plan.nvme_read_bytes_per_second) << " GB/s";
  o << "\n  predicted step: " << std::fixed << std::setprecision(6) << p.step_seconds
    << " s, bottleneck " << p.bottleneck << " (busy: h2d " << p.h2d_busy << " s, d2h " << p.d2h_busy
    << " s, nvme " << p.nvme_busy << " s, compute " << p.compute_busy << " s; compute waits "
    << p.gpu_wait << " s)\n";
  o << "  layer                          weights        grads  activations  home  span\n";
  for (const LayerPlan& l : plan.layers) {
    char line[256];
    std::snprintf(line, sizeof line, "  %-28s %12llu %12llu %12llu  %-5s %s\n", l.name.c_str(),
                  static_cast<unsigned long long>(l.weight_bytes),
                  static_cast<unsigned long long>(l.grad_bytes),
                  static_cast<unsigned long long>(l.activation_bytes),
                  l.weights_on_nvme ? "nvme" : "dram", l.weights_as_span ? "yes" : "no");
    o << line;
  }
  return o.str();
}

}  // namespace strata
