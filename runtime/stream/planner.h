// Planner: turns a declared LayerGraph, the tier budgets and the link speeds into an explicit,
// dumpable Plan: what stays resident in HBM, the slot size and count, the prefetch depth in each
// pass, where every tensor lives, each layer's layout inside a slot, and a predicted step time
// with its bottleneck, from a simulation of exactly the schedule the executor runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "runtime/stream/layer_graph.h"

namespace strata {

class Runtime;

struct PlanConfig {
  uint32_t micro_batches = 1;
  // HBM for slots; 0 = all of the HBM arena left once the residents are in.
  uint64_t hbm_slot_budget = 0;
  // Link speeds in bytes/s; 0 = measure at planning time.
  double h2d_bytes_per_second = 0;
  double d2h_bytes_per_second = 0;
  // Device arithmetic rate in FLOP/s for the prediction; 0 = compute unknown (predicted as 0).
  double device_flops_per_second = 0;
  // Upper bound on the prefetch depth; 0 = as deep as the slots allow.
  uint32_t max_prefetch_depth = 0;
  // Smallest transfer: a layer's small weights are merged into copies of at least this many
  // bytes (>= 4 MiB, where PCIe reaches its peak); larger tensors travel whole.
  uint64_t chunk_bytes = 16ull << 20;
};

// Where one of a layer's tensors sits inside a slot.
struct SlotTensor {
  TensorId id = 0;
  uint64_t offset = 0;  // in the slot
  uint64_t bytes = 0;
  // A grad homed in HBM: its view is its home, not slot space (offset unused), so nothing is
  // copied out at release and the optimizer reads it from there.
  bool in_home = false;
};

struct LayerPlan {
  std::string name;
  std::vector<SlotTensor> weights, grads, activations;
  // Weights that sit at the same relative offsets in DRAM travel as one span [span_src,
  // span_src + span_bytes) of the DRAM arena, copied in chunks; otherwise one copy per tensor.
  bool weights_as_span = false;
  uint64_t span_dram_offset = 0;
  uint64_t span_bytes = 0;
  bool weights_on_nvme = false;
  // grad_bytes: the grads copied out to DRAM (not those in their HBM homes).
  uint64_t weight_bytes = 0, grad_bytes = 0, activation_bytes = 0;
  uint64_t footprint = 0;                            // slot bytes this layer needs
  double forward_seconds = 0, backward_seconds = 0;  // per step (all micro-batches)
};

struct Prediction {
  double step_seconds = 0;
  double h2d_busy = 0, d2h_busy = 0, nvme_busy = 0, compute_busy = 0;
  double gpu_wait = 0;  // compute idle waiting for data
  std::string bottleneck;
};

struct Plan {
  PlanConfig config;
  uint32_t layer_count = 0;
  std::vector<LayerPlan> layers;
  std::vector<TensorId> residents;
  uint64_t resident_bytes = 0;
  uint64_t slot_bytes = 0;
  uint32_t slots = 0;
  uint32_t forward_depth = 0, backward_depth = 0;
  bool all_layers_fit = false;  // every layer has its own slot: loads never wait for a slot
  double h2d_bytes_per_second = 0, d2h_bytes_per_second = 0, nvme_read_bytes_per_second = 0;
  bool links_measured = false;
  std::vector<std::pair<std::string, std::string>> homes;  // tensor name -> tier
  Prediction prediction;
};

// Plans `graph` on `runtime`. Errors: kInvalidArgument (a tensor in two roles, a weight that is
// not in DRAM or NVMe, a grad or activation not in DRAM, ...), kOutOfMemory when the budgets
// cannot work, saying what does not fit and by how much.
Status make_plan(Runtime& runtime, const LayerGraph& graph, const PlanConfig& config, Plan* out);

// Re-times the plan's schedule (make_plan calls it; exposed for tests and tools).
Prediction predict(const Plan& plan);

std::string plan_to_json(const Plan& plan);
std::string plan_to_text(const Plan& plan);

}  // namespace strata
