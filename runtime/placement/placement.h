// Placement: where a streamed model's training state lives, chosen by predicted step time.
//
// A framework declares, per layer, the bytes of each role (the streamed weights, their grads,
// the optimizer state) and the update's size, plus the DRAM and NVMe budgets and the measured
// rates of every resource a step uses. The placement tries each way of splitting the state
// and the weights between DRAM and NVMe that the budgets allow, predicts the step of each
// with a simulation of the executor and the optimizer together (the loads and grads on PCIe,
// the compute, the CPU updates, the disk's reads and writes, the staging slots), and keeps
// the fastest. Nothing is allocated: the caller registers its tensors where the placement says.
//
// Which layers spill: always the last ones. Their grads land first in the backward pass and
// their weights are needed last by the next forward pass, so their disk traffic has the most
// time to hide; the optimizer's PLANNED state placement fills DRAM in forward order for the
// same reason, so a placement is realized by the DRAM budget it leaves for state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace strata {

// Bounds on a request (hostile input through the C ABI): each simulation is O(layers log
// layers), and byte sums over every layer must not wrap.
constexpr std::size_t kMaxPlacementLayers = 16384;
constexpr uint64_t kMaxLayerBytes = 1ull << 44;  // 3 roles x 16384 layers x 2^44 < 2^64
constexpr uint32_t kMaxStagingSlots = 4;         // the optimizer's own limit
constexpr uint32_t kMaxPrefetchDepth = 1024;
constexpr double kMaxSeconds = 1e9;  // a layer's pass, or the rest of a step
// A layer's grad tier (the C ABI's STRATA_TIER_HBM and STRATA_TIER_DRAM).
constexpr int kGradsInHbm = 0;
constexpr int kGradsInDram = 1;

struct PlacementLayer {
  std::string name;
  uint64_t weight_bytes = 0;  // streamed working copy, loaded for both passes
  // Grads in DRAM: what the backward pass sends there. In HBM: what each read of them copies
  // to DRAM (the optimizer's fetch buffer, the size of the largest such layer's grads).
  uint64_t grad_bytes = 0;
  uint64_t state_bytes = 0;      // optimizer state (fp32 master, moments); 0: frozen layer
  uint64_t update_elements = 0;  // elements one update of this layer touches
  double forward_seconds = 0;    // device time of the forward pass; 0 = not counted
  double backward_seconds = 0;   // of the backward pass, recomputation included
  // -1: the placement chooses; else the tier the caller fixed (1 = DRAM, 2 = NVMe).
  int weight_tier = -1;
  int state_tier = -1;
  int grad_tier = 1;  // 1 = DRAM, 0 = HBM (the caller's choice: the placement never moves grads)
};

struct PlacementRates {
  double h2d = 0, d2h = 0;               // bytes/s; 0 = not counted
  double nvme_read = 0, nvme_write = 0;  // bytes/s, each alone; 0 = not counted
  // Time to read and write the same bytes at once over the time to do them one after the
  // other (1: the disk serializes them, 0.5: it overlaps them fully).
  double nvme_mixed = 1;
  double update_elements = 0;  // elements/s the CPU update runs at; 0 = not counted
};

struct PlacementRequest {
  std::vector<PlacementLayer> layers;  // forward order
  uint64_t dram_budget = 0, nvme_budget = 0;
  uint32_t staging_slots = 0;       // 0 = choose, up to max_staging_slots
  uint32_t max_staging_slots = 4;   // what the optimizer stages at once at most
  uint32_t prefetch_depth = 1;      // layers loaded ahead of the compute (HBM slots - 1)
  double other_device_seconds = 0;  // per step outside the layers (embedding, head, loss)
  // The update of a layer waits for the whole backward pass (clipping, or a framework's
  // explicit optimizer step) rather than for its own grads only.
  bool updates_after_backward = true;
  PlacementRates rates;
};

struct StepPrediction {
  double step_seconds = 0;  // steady state: from one step's end to the next one's
  // Busy time of each resource in one step.
  double h2d = 0, d2h = 0, nvme_read = 0, nvme_write = 0, update = 0, compute = 0;
  double gpu_wait = 0;  // the compute idle in one step (waiting for loads or updates)
  // The CPU idle from the backward pass's end to the last update's end: updates waiting for
  // their state from NVMe.
  double update_wait = 0;
  std::string bottleneck;  // "compute", "h2d", "d2h", "nvme" or "update"
};

struct LayerHome {
  bool weights_on_nvme = false;
  bool state_on_nvme = false;
  // Of a layer whose state the placement chose to spill: what stays in DRAM anyway. The
  // optimizer's PLANNED placement fills the DRAM a placement leaves over param by param in
  // forward order, so the first spilled layers stage less than their whole state.
  uint64_t state_in_dram = 0;
};

struct Placement {
  std::vector<LayerHome> homes;
  uint32_t staging_slots = 0;
  uint64_t slot_bytes = 0;        // one staging slot: the largest layer's staged state and weights
  uint64_t grad_fetch_bytes = 0;  // DRAM HBM-homed grads are read through (in dram_bytes)
  uint64_t dram_bytes = 0, nvme_bytes = 0;
  uint32_t candidates = 0;  // placements simulated
  PlacementRates rates;
  StepPrediction prediction;
  std::vector<std::string> names;
  std::vector<bool> grads_in_hbm;  // per layer, as the request declared
};

// The step `homes` with `slots` staging slots would take (no budget check).
StepPrediction predict_step(const PlacementRequest& request, const std::vector<LayerHome>& homes,
                            uint32_t slots);

// Chooses homes and a staging slot count under the budgets, fastest predicted step first, then
// the fewest bytes on NVMe. Errors: kInvalidArgument (no layers, a fixed tier that is not DRAM
// or NVMe, a home fixed on NVMe without an NVMe budget, sizes, rates or times out of bounds),
// kOutOfMemory (nothing fits: the message says what DRAM, or else NVMe, needs at least).
Status choose_placement(const PlacementRequest& request, Placement* out);

std::string placement_to_json(const Placement& placement);
std::string placement_to_text(const Placement& placement);

}  // namespace strata
