// Layout sizes: what a streamed model's layout takes of each tier, computed by the rules the
// runtime allocates by. This file is the one copy of those rules: the optimizer sizes its state,
// its PLANNED placement's threshold and its grad fetch buffer with the functions below, and
// strata_layout_query (lib/abi_layout.cpp) returns what compute_layout() derives from them, so
// a framework (strata.torch, strata.jax, a C trainer) plans with the numbers the runtime will
// use instead of a copy that could drift.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "common/types.h"

namespace strata {

// The DRAM arena's block: every DRAM (and NVMe) allocation is a multiple of it.
inline constexpr uint64_t kLayoutPage = 4096;
// Each param's grads start on a cache line in the optimizer's fetch buffer.
inline constexpr uint64_t kGradFetchAlignment = 64;

// Bounds on a request (hostile input through the C ABI): with them no sum below can wrap
// (2^44 elements x 16 bytes and 2^24 tensors x 64 KiB stay far below 2^64).
inline constexpr std::size_t kMaxLayoutLayers = 16384;  // the placement's own limit
inline constexpr uint64_t kMaxLayoutElements = 1ull << 44;
inline constexpr uint64_t kMaxLayoutTensors = 1ull << 24;

// Bytes of optimizer state per trainable element: an fp32 master unless the weight is fp32 (a
// split master: its 2-byte low halves), and 4 bytes for each fp32 state tensor the kind keeps
// (optimizer.h's state_set: AdamW's and Adam's m and v, SGD's momentum buffer when momentum is
// on, Lion's m, Adagrad's sum). The optimizer allocates exactly this (add_param).
uint64_t state_bytes_per_element(bool exp_avg, bool exp_avg_sq, DType weight_dtype,
                                 bool split_master);

// What the PLANNED state placement counts a param's state of `state_bytes` as when it decides
// whether DRAM still holds it: page rounding and the state tensors' skews make the arena take a
// little more than the bytes (at most 3 tensors x (4 KiB rounding + a skew below 4 KiB)), and
// 1/64 more keeps the decision on the safe side. Never below what the state takes.
uint64_t planned_state_bytes(uint64_t state_bytes);

// What a param's fp32 gradient accumulator (`<w>.grad_accum`, explicit mode's sum of several
// backward passes; AUTO mode's with accumulation_steps > 1) takes of the DRAM arena: its arena
// block and a page (its skew). The optimizer places accumulators by this figure and the layout
// query reports their sum (accum_bytes), so a framework's budget and the runtime agree.
uint64_t accum_dram_bytes(uint64_t elements);
// The same accumulator on NVMe: its 4 KiB-rounded extent, which a staging slot also holds.
uint64_t accum_nvme_bytes(uint64_t elements);

// One param's span in the grad fetch buffer: its grads, rounded to kGradFetchAlignment.
uint64_t grad_fetch_span(uint64_t elements, std::size_t element_size);

// What a layout needs. Element counts per layer: trainable tensors get grads and state, frozen
// ones are weights only.
struct LayoutRequest {
  DType dtype = DType::kBF16;  // of the streamed weights and their grads
  bool adamw = true;           // two moments (AdamW, Adam); else one (Lion, Adagrad) or none
  bool momentum = false;       // not adamw: one moment (SGD's momentum buffer, Lion, Adagrad)
  bool split_master = false;   // bf16 weights: STRATA_MASTER_SPLIT
  bool grads_in_hbm = false;
  // GradSum::kInPlace (needs grads_in_hbm): the grads are fp32 (their HBM and fetch buffer),
  // with no accumulators.
  bool grad_sums_in_place = false;
  uint32_t staging_slots = 4;  // slots the default DRAM budget keeps room for
  uint64_t nvme_budget = 0;    // an NVMe budget to size placeable bytes for; 0 = the default
  std::vector<std::vector<uint64_t>> trainable, frozen;  // per layer; frozen may be empty
};

struct LayoutLayer {
  uint64_t weight_bytes = 0;    // trainable and frozen weights: arena blocks and a page each
  uint64_t grad_bytes = 0;      // DRAM grads: arena blocks and a page each; HBM: one fetch
  uint64_t grad_hbm_bytes = 0;  // HBM grads: what they take of HBM; 0 with grads in DRAM
  uint64_t state_bytes = 0;     // as the PLANNED placement counts it
  uint64_t update_elements = 0;
};

struct LayoutTotals {
  uint64_t weight_bytes = 0, grad_dram_bytes = 0, grad_hbm_bytes = 0, grad_fetch_bytes = 0;
  uint64_t state_bytes = 0, slot_bytes = 0, update_elements = 0, state_bytes_per_element = 0;
  uint64_t dram_bytes = 0, dram_margin_bytes = 0;
  uint64_t streaming_dram_bytes = 0, streaming_hbm_bytes = 0;
  uint64_t nvme_margin_bytes = 0, nvme_bytes = 0, nvme_placeable_bytes = 0;
  uint64_t accum_bytes = 0;  // every trainable tensor's accumulator in DRAM (accum_dram_bytes)
  // What the GPU's copies touch of dram_bytes (weights, DRAM grads or the fetch buffer) and the
  // margin: the DRAM arena's pinned part (RuntimeOptions::dram_pinned) for this layout.
  uint64_t dram_gpu_bytes = 0;
};

// Errors: kInvalidArgument (no layers or more than kMaxLayoutLayers, frozen given for another
// number of layers, a dtype the optimizer does not take, a split master of a non-bf16 weight,
// in-place sums with grads in DRAM, more than kMaxLayoutTensors tensors or kMaxLayoutElements
// elements in all).
Status compute_layout(const LayoutRequest& request, std::vector<LayoutLayer>* layers,
                      LayoutTotals* totals);

}  // namespace strata
