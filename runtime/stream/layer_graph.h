// LayerGraph: what a framework declares about its model. Layers come in forward order, each
// with its tensors by role: weights (streamed to HBM for both passes), grads (HBM buffers the
// backward pass fills, streamed out to their DRAM homes), activation checkpoints (written in
// the forward pass, parked in DRAM, brought back for the backward pass). Resident tensors stay
// in HBM for the whole step (embedding, head). Compute per layer and micro-batch, if given,
// lets the planner predict the step time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/memory/tensor_registry.h"

namespace strata {

enum class Phase : int32_t { kForward = 0, kBackward = 1 };
// "forward" or "backward", as the executor's errors name a pass.
inline const char* phase_name(Phase p) {
  return p == Phase::kForward ? "forward" : "backward";
}

struct LayerSpec {
  std::string name;
  std::vector<TensorId> weights;
  std::vector<TensorId> grads;
  std::vector<TensorId> activations;
  std::vector<TensorId> optimizer_state;  // placement only: never streamed to HBM
  double forward_flops = 0;               // per micro-batch
  double backward_flops = 0;              // per micro-batch, recomputation included
};

struct LayerGraph {
  std::vector<LayerSpec> layers;
  std::vector<TensorId> residents;
};

// One position of a step: the executor's sequence is forward 0..L-1, then backward L-1..0.
struct StepPosition {
  Phase phase;
  uint32_t layer;
};
std::vector<StepPosition> step_sequence(uint32_t layers);

// The slot schedule of a step, shared by the executor (which follows it) and the planner's
// predictor (which times it). Loads are issued in sequence order, at most `depth` positions
// ahead of the one being computed; a position whose layer still sits in a slot from its
// previous use reuses it (the forward/backward turnaround) instead of loading again.
struct ScheduledPosition {
  uint32_t slot = 0;
  bool reuse = false;         // weights (and activations) already in the slot
  int previous_in_slot = -1;  // the position that used the slot before, -1 if none
};
std::vector<ScheduledPosition> schedule_slots(const std::vector<StepPosition>& sequence,
                                              uint32_t slots, uint32_t depth);

}  // namespace strata
