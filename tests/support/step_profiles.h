// What the step plan's unit cases (unit/test_step_plan*.cpp) share: sizes in GiB, and the profile
// of streamed blocks whose checkpoints are planned that several of them start from.
#pragma once

#include <cstdint>

#include "runtime/step/step_plan.h"

namespace strata::step::testing {

inline constexpr uint64_t GB = uint64_t{1} << 30;

inline uint64_t gb(double n) {
  return static_cast<uint64_t>(n * static_cast<double>(GB));
}

// `blocks` streamed blocks of 1000 parameters that recompute, their checkpoints (`checkpoint`
// bytes each) planned on a device of `device` bytes, all free, at `tokens` tokens; each block's
// backward saves `saved` bytes (measured), and `in_use` bytes are held beside them.
inline StepProfile streamed_checkpoints(uint32_t blocks, uint64_t device, uint64_t tokens,
                                        uint64_t checkpoint, uint64_t saved, uint64_t in_use) {
  StepProfile p;
  p.blocks.assign(blocks, BlockProfile{1000, 0, 0, 0, Residency::kStreamed, Keep::kRecompute});
  p.plan_checkpoints = true;
  p.device_total = p.device_free = device;
  p.tokens = tokens;
  p.checkpoint_bytes = checkpoint;
  p.block_saved_measured = true;
  p.block_saved_bytes = saved;
  p.in_use = in_use;
  return p;
}

}  // namespace strata::step::testing
