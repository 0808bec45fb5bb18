// The optimizer's side of checkpoints: a consistent point to save at, and counters restored
// on load (runtime/checkpoint/checkpoint.cpp reads and writes the files).
#include "runtime/optimizer/optimizer.h"

#include <algorithm>

namespace strata {

void Optimizer::drop_failed_step(std::unique_lock<std::mutex>& lock) {
  cv_.wait(lock, [&] { return running_ == 0 && io_in_flight_ == 0; });
  for (const Job& job : queue_) {
    if (job.read) {  // a grad_read waits for its job: dropped, it fails with the optimizer
      job.read->status = failure_;
      job.read->done = true;
    }
  }
  queue_.clear();
  std::fill(pending_.begin(), pending_.end(), 0);
  std::fill(landing_.begin(), landing_.end(), 0);
  grads_in_ = 0;
  micro_ = 0;
  final_micro_ = false;
  current_.reset();
  // Explicit mode: the held grads may not all have landed; none is held any more (an
  // in-place sum's home is then zero-filled by its next backward load, as a grad tensor's is).
  for (Param& p : params_) {
    p.hold = GradHold::kNone;
    p.grad_mult = 1.f;
    p.grad_sq = 0;
    p.measured = true;
    p.measuring = false;
    p.unknown = false;
  }
  std::fill(backward_.begin(), backward_.end(), Backward::kIdle);
  std::fill(aborted_adds_.begin(), aborted_adds_.end(), nullptr);  // waited by the abort
  cv_.notify_all();
}

Status Optimizer::quiesce_for_checkpoint(OptimizerCounters* counters, bool for_load) {
  std::unique_lock lock(mutex_);
  Status drained = drain(lock);  // no job running, no transfer in flight, failed or not
  if (!drained.is_ok() && !for_load) return drained;  // a failed optimizer's state: not saved
  if (config_.explicit_updates && in_executor_step_) {
    return error(Code::kInvalidState,
                 "checkpoint inside an executor step: save or load between steps");
  }
  if (!drained.is_ok()) {
    // Failed (a load that broke off, a staging transfer, grads that did not land): a load is
    // how it recovers (strata.h), so the failed step's work is dropped rather than run after
    // the load writes the state, and the next step starts from the loaded one.
    drop_failed_step(lock);
  } else if (micro_ != 0 ||
             (executor_ != nullptr && grads_in_ != 0 && grads_in_ < layers_with_params_)) {
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
      st.loaded = st.incoming = 0;
      st.in_use = false;
      st.status = Status::ok();
    }
    std::fill(slot_free_.begin(), slot_free_.end(), uint8_t{1});
  }
  return Status::ok();
}

}  // namespace strata
