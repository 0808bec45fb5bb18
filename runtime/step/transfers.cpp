// Transfers against compute (issue 53): a streamed block loads its weights for its forward and
// again for its backward pass, and computes its forward, its backward (twice the forward's
// products) and, recomputing, its forward again. A dense block of an 8B Llama at 16k tokens
// computes 29 TFLOP against 0.9 GB of loads (compute-bound on any PCIe link); a mixture-of-
// experts block routes each token through top_k of its n experts, so its compute is a fraction
// of its weights' (Qwen3-30B-A3B's shape: 8 of 128): at the same batch its loads take longer
// than its compute, and the step waits on the link. The plan judges each streamed block so from
// the FLOPs the binding gives (strata_step_block_t.active_flops) and the rates it measured, and
// uses the judgement where it chooses: a transfer-bound block gains nothing from keeping its
// activations (its recompute runs while its weights load), so kept activations go to the others.
//
// Residency cannot use it: resident blocks are the first ones (the binding runs its resident
// blocks before the chain of streamed ones, and the executor streams a contiguous chain of
// layers), so the plan keeps as many of the first blocks as fit and says, where the streamed
// ones are the transfer-bound ones, that their loads bound the step.
#include <iomanip>
#include <sstream>

#include "runtime/step/step_plan.h"

namespace strata::step {

uint64_t block_flops(const BlockProfile& b) {
  return b.active_flops != 0 ? b.active_flops : sat_mul(2, b.elements);
}

bool transfers_judged(const StepProfile& p) {
  return p.tokens != 0 && p.h2d_bytes_per_second > 0 && p.device_flops_per_second > 0 &&
         p.weight_bytes_per_param != 0;
}

double load_seconds(const StepProfile& p, const BlockProfile& b) {
  return static_cast<double>(kPassesLoaded) * static_cast<double>(b.elements) *
         static_cast<double>(p.weight_bytes_per_param) / p.h2d_bytes_per_second;
}

double compute_seconds(const StepProfile& p, const BlockProfile& b, Keep keep) {
  const double passes = keep == Keep::kRecompute ? kPassesRecomputing : kPassesKept;
  return passes * static_cast<double>(block_flops(b)) * static_cast<double>(p.tokens) /
         p.device_flops_per_second;
}

void judge_transfers(const StepProfile& p, StepPlan* plan) {
  if (!transfers_judged(p)) return;
  plan->transfers_judged = true;
  uint32_t bound = 0, streamed = 0, first = 0, resident_compute = 0;
  double load = 0, compute = 0;
  for (std::size_t i = 0; i < p.blocks.size(); ++i) {
    auto& b = plan->blocks[i];
    // Judged as the block runs by default: recomputing (a kept block computes less, so a block
    // bound recomputing is bound kept).
    const double l = load_seconds(p, p.blocks[i]);
    const double c = compute_seconds(p, p.blocks[i], Keep::kRecompute);
    if (b.residency == Residency::kResident) {
      resident_compute += l <= c;
      continue;
    }
    ++streamed;
    b.transfer_bound = l > c;
    if (b.transfer_bound && bound++ == 0) first = static_cast<uint32_t>(i), load = l, compute = c;
  }
  plan->transfer_bound_blocks = bound;
  std::ostringstream o;
  o << std::fixed << std::setprecision(2);
  o << "transfers: " << bound << " of " << streamed << " streamed blocks load their weights ("
    << kPassesLoaded << " passes at " << p.h2d_bytes_per_second / 1e9
    << " GB/s) slower than they compute at " << p.tokens << " tokens ("
    << p.device_flops_per_second / 1e12 << " TFLOP/s)";
  if (bound != 0) {
    const auto& b = p.blocks[first];
    o << "; block " << first << ": " << load * 1e3 << " ms of loads, " << compute * 1e3
      << " ms of compute, "
      << static_cast<double>(block_flops(b)) /
             static_cast<double>(b.elements * p.weight_bytes_per_param)
      << " FLOP a token per weight byte (a mixture-of-experts block computes only its routed "
         "experts' share); where kept activations are planned these keep none (their recompute "
         "runs while their weights load)";
    if (resident_compute != 0) {
      o << "; " << resident_compute
        << " resident blocks are compute-bound: resident blocks are the first ones (the "
           "binding runs them before the streamed chain), so the plan cannot keep the "
           "transfer-bound ones resident instead, and their loads bound the step";
    }
  }
  plan->reasons.push_back(o.str());
}

}  // namespace strata::step
