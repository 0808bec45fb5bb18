// The optimizer's side of checkpoints: a consistent point to save at, and counters restored
// on load (runtime/checkpoint/checkpoint.cpp reads and writes the files).
#include "runtime/optimizer/optimizer.h"

#include <algorithm>

namespace strata {

Status Optimizer::quiesce_for_checkpoint(OptimizerCounters* counters) {
  STRATA_RETURN_IF_ERROR(synchronize());
  std::lock_guard lock(mutex_);
  if (config_.explicit_updates && in_executor_step_) {
    return error(Code::kInvalidState,
                 "checkpoint inside an executor step: save or load between steps");
  }
  if (micro_ != 0 || (executor_ != nullptr && grads_in_ != 0 && grads_in_ < layers_with_params_)) {
    return error(Code::kInvalidState, "checkpoint in the middle of an optimizer step (", micro_,
                 " of ", config_.accumulation_steps,
                 " accumulation steps done): save or load after the step's last micro-step");
  }
  *counters = counters_;
  return Status::ok();
}

Status Optimizer::restore_counters(const OptimizerCounters& counters,
                                   const std::vector<uint64_t>& param_steps) {
  std::lock_guard lock(mutex_);
  counters_ = counters;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    params_[i].t = i < param_steps.size() ? param_steps[i] : counters.step;
  }
  micro_ = 0;
  failure_ = Status::ok();
  // A failure may have left staged layers behind (the checkpoint's caller synchronized, so no
  // transfer is in flight): every layer's state is on NVMe again, every slot free.
  if (io_in_flight_ == 0) {
    for (LayerStage& st : stages_) {
      st.phase = StagePhase::kIdle;
      st.slot = -1;
      st.outstanding = 0;
      st.status = Status::ok();
    }
    std::fill(slot_free_.begin(), slot_free_.end(), uint8_t{1});
  }
  return Status::ok();
}

}  // namespace strata
