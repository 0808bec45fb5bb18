// The executor at one layer of the step: the framework's acquire (the layer's loads waited
// for on its stream), its views of the slot's tensors, and its release (the fence the slot is
// refilled after, and the grads and activations sent out). executor.cpp runs the step around it.
#include <algorithm>

#include "runtime/stream/executor.h"

namespace strata {
namespace {
// One of a layer's three per-role lists (slot tensors, readiness fences).
template <typename T>
const std::vector<T>& by_role(ViewRole role, const std::vector<T>& weights,
                              const std::vector<T>& grads, const std::vector<T>& activations) {
  return role == ViewRole::kWeight ? weights : role == ViewRole::kGrad ? grads : activations;
}
}  // namespace

Status Executor::check_position(uint32_t layer, Phase phase, const char* verb) const {
  if (layer >= plan_.layer_count) {
    return error(Code::kInvalidArgument, verb, " of layer ", layer, ": the graph declares ",
                 plan_.layer_count, " layers");
  }
  if (!in_step_) return error(Code::kInvalidState, verb, " outside a step: call step_begin first");
  if (cursor_ >= sequence_.size()) {
    return error(Code::kInvalidState, verb, " of layer ", layer, " (", phase_name(phase),
                 ") after every layer of the step has run: call step_end");
  }
  const StepPosition& expected = sequence_[cursor_];
  if (expected.layer != layer || expected.phase != phase) {
    return error(Code::kInvalidState, verb, " of layer ", layer, " (", phase_name(phase),
                 ") out of order: layer ", expected.layer, " (", phase_name(expected.phase),
                 ") is next (forward runs 0..", plan_.layer_count - 1,
                 ", then backward back to 0)");
  }
  return Status::ok();
}

Status Executor::acquire(uint32_t layer, Phase phase, void* stream, Wait wait, LayerViews* views) {
  std::vector<std::shared_ptr<DeviceFence>> waits;
  {
    std::lock_guard lock(mutex_);
    STRATA_RETURN_IF_ERROR(check_position(layer, phase, "acquire"));
    if (acquired_ || acquiring_) {
      return error(Code::kInvalidState, "acquire of layer ", layer, " (", phase_name(phase),
                   acquired_ ? ") while it is already acquired: release it first"
                             : ") while another acquire of it is waiting for its data");
    }
    STRATA_RETURN_IF_ERROR(issue_loads(static_cast<long>(cursor_)));
    Ready& ready = ready_[cursor_];
    if (schedule_[cursor_].reuse && phase == Phase::kBackward) {
      // The checkpoints in the slot are the ones the forward pass wrote: ready once its stream
      // got past the forward release (known only now, not when the load was issued).
      ready.activations = slots_[schedule_[cursor_].slot].activation_ready;
    }
    const LayerPlan& lp = plan_.layers[layer];
    unsigned char* base = slot_base(schedule_[cursor_].slot);
    views->weights.clear();
    views->grads.clear();
    views->activations.clear();
    for (const SlotTensor& t : lp.weights) views->weights.push_back(base + t.offset);
    if (phase == Phase::kBackward) {
      for (std::size_t i = 0; i < lp.grads.size(); ++i) {
        views->grads.push_back(grad_view(lp, homes_[layer], base, i));
      }
    }
    for (const SlotTensor& t : lp.activations) views->activations.push_back(base + t.offset);
    if (wait != Wait::kNone) {
      for (const auto* list : {&ready.weights, &ready.grads, &ready.activations}) {
        waits.insert(waits.end(), list->begin(), list->end());
      }
    }
    // Acquired only once the waits below succeed: a failed load (DATA_CORRUPTION, IO) leaves
    // the layer unacquired, so a retry waits again (and fails again) and a release is refused,
    // instead of the step going on with a slot whose weights never landed.
    acquiring_ = true;
  }
  Status waited = wait_for_layer(layer, phase, stream, wait, std::move(waits));
  std::lock_guard lock(mutex_);
  acquiring_ = false;
  if (waited.is_ok()) {
    acquired_ = true;
    // From here the framework adds into the grad views (an optimizer's in-place sums).
    if (phase == Phase::kBackward && hooks_) hooks_->on_backward_acquired(layer);
  }
  return waited;
}

Status Executor::wait_for_layer(uint32_t layer, Phase phase, void* stream, Wait wait,
                                std::vector<std::shared_ptr<DeviceFence>> waits) {
  // Duplicates (tensors sharing a chunk) cost one cudaStreamWaitEvent each: cheap, but skip.
  // Null: nothing to wait for (an in-place gradient sum kept as it is).
  waits.erase(std::remove(waits.begin(), waits.end(), nullptr), waits.end());
  std::sort(waits.begin(), waits.end());
  waits.erase(std::unique(waits.begin(), waits.end()), waits.end());
  Tracer& tracer = runtime_->tracer();
  const bool tracing = tracer.enabled();
  std::shared_ptr<DeviceFence> before;
  if (tracing) STRATA_RETURN_IF_ERROR(backend_->record_fence(stream, &before));
  for (const auto& f : waits) {
    STRATA_RETURN_IF_ERROR(wait == Wait::kHost ? f->host_wait() : f->enqueue_wait(stream));
  }
  if (tracing) {
    std::shared_ptr<DeviceFence> after;
    STRATA_RETURN_IF_ERROR(backend_->record_fence(stream, &after));
    std::lock_guard lock(mutex_);
    pending_waits_.push_back(PendingWait{
        layer_trace_record(TraceKind::kAcquire, layer, static_cast<int32_t>(phase), stream),
        std::move(before), std::move(after)});
  }
  return Status::ok();
}

Status Executor::check_acquired(uint32_t layer, Phase phase, const char* verb) const {
  STRATA_RETURN_IF_ERROR(check_position(layer, phase, verb));
  if (!acquired_) {
    return error(Code::kInvalidState, verb, " of layer ", layer, " before it was acquired");
  }
  return Status::ok();
}

Status Executor::view(uint32_t layer, Phase phase, ViewRole role, uint32_t index, void** data,
                      TensorId* tensor) {
  std::lock_guard lock(mutex_);
  STRATA_RETURN_IF_ERROR(check_acquired(layer, phase, "view"));
  if (role == ViewRole::kGrad && phase != Phase::kBackward) {
    return error(Code::kInvalidArgument, "grads of layer ", layer,
                 " have views in the backward pass only");
  }
  const LayerPlan& lp = plan_.layers[layer];
  const auto& list = by_role(role, lp.weights, lp.grads, lp.activations);
  if (index >= list.size()) {
    return error(Code::kInvalidArgument, "view: layer ", layer, " has ", list.size(),
                 " tensor(s) of that role, index ", index, " is out of range");
  }
  unsigned char* base = slot_base(schedule_[cursor_].slot);
  *data = role == ViewRole::kGrad ? grad_view(lp, homes_[layer], base, index)
                                  : base + list[index].offset;
  *tensor = list[index].id;
  return Status::ok();
}

unsigned char* Executor::grad_view(const LayerPlan& lp, const LayerHomes& homes,
                                   unsigned char* base, std::size_t index) const {
  return lp.grads[index].in_home ? homes.grads[index] : base + lp.grads[index].offset;
}

Status Executor::write_view(uint32_t layer, Phase phase, ViewRole role, uint32_t index,
                            const void* src, uint64_t bytes) {
  bool sum = false;  // the view is an optimizer's in-place gradient sum
  {
    std::lock_guard lock(mutex_);
    STRATA_RETURN_IF_ERROR(check_acquired(layer, phase, "write_view"));
    const std::vector<uint8_t>& sums = ready_[cursor_].grad_sums;
    sum = role == ViewRole::kGrad && index < sums.size() && sums[index] != 0;
  }
  void* dst = nullptr;
  TensorId id = 0;
  STRATA_RETURN_IF_ERROR(view(layer, phase, role, index, &dst, &id));
  TensorRecord r;
  STRATA_RETURN_IF_ERROR(runtime_->info(id, &r));
  if (sum) {
    return error(Code::kInvalidState, "write_view: grad '", r.spec.name, "' of layer ", layer,
                 " is an in-place gradient sum (STRATA_GRAD_SUM_IN_PLACE): the backward pass "
                 "adds to it, and a copy would replace the sum of the passes before; add into "
                 "the view instead (strata_layer_export_dlpack)");
  }
  if (bytes != r.nbytes) {
    return error(Code::kInvalidArgument, "write_view: tensor '", r.spec.name, "' is ", r.nbytes,
                 " bytes, not ", bytes);
  }
  return backend_->copy_sync(dst, src, bytes);
}

Status Executor::wait_tensor(uint32_t layer, Phase phase, ViewRole role, uint32_t index,
                             void* stream) {
  std::shared_ptr<DeviceFence> fence;
  {
    std::lock_guard lock(mutex_);
    STRATA_RETURN_IF_ERROR(check_acquired(layer, phase, "wait_tensor"));
    const Ready& ready = ready_[cursor_];
    const auto& list = by_role(role, ready.weights, ready.grads, ready.activations);
    if (index >= list.size()) {
      return error(Code::kInvalidArgument, "wait_tensor: layer ", layer, " has ", list.size(),
                   " tensor(s) of that role in this phase, index ", index, " is out of range");
    }
    fence = list[index];
  }
  // Null: the tensor needs no copy (an in-place gradient sum kept as it is).
  return fence ? fence->enqueue_wait(stream) : Status::ok();
}

Status Executor::release(uint32_t layer, Phase phase, void* stream) {
  std::lock_guard lock(mutex_);
  if (layer >= plan_.layer_count) {
    return error(Code::kInvalidArgument, "release of layer ", layer, ": the graph declares ",
                 plan_.layer_count, " layers");
  }
  if (!acquired_) {
    return error(Code::kInvalidState, "release of layer ", layer, " (", phase_name(phase),
                 ") without a matching acquire (released twice, or never acquired)");
  }
  STRATA_RETURN_IF_ERROR(check_position(layer, phase, "release"));
  Slot& slot = slots_[schedule_[cursor_].slot];
  unsigned char* base = slot_base(schedule_[cursor_].slot);
  std::shared_ptr<DeviceFence> consumer;
  STRATA_RETURN_IF_ERROR(backend_->record_fence(stream, &consumer));
  slot.consumer = consumer;
  const LayerPlan& lp = plan_.layers[layer];
  const LayerHomes& homes = homes_[layer];
  const bool backward = phase == Phase::kBackward;
  const auto& outgoing = backward ? lp.grads : lp.activations;
  const auto& destinations = backward ? homes.grads : homes.activations;
  std::vector<std::shared_ptr<DeviceFence>> landed;
  for (std::size_t i = 0; i < outgoing.size(); ++i) {
    if (outgoing[i].in_home) {
      // Written in its HBM home by the caller's stream: there once the stream gets here (no
      // copy, so nothing queues behind later layers' copies on the outbound queue).
      landed.push_back(consumer);
      home_grads_landed_ = consumer;
      continue;
    }
    std::shared_ptr<DeviceFence> f;
    STRATA_RETURN_IF_ERROR(queue_copy(CopyDirection::kDeviceToHost, destinations[i],
                                      base + outgoing[i].offset, outgoing[i].bytes, {consumer},
                                      &f));
    slot.outbound = f;
    stats_.bytes_out += outgoing[i].bytes;
    landed.push_back(std::move(f));
  }
  if (backward && hooks_) STRATA_RETURN_IF_ERROR(hooks_->on_grads_queued(layer, std::move(landed)));
  if (!backward && !outgoing.empty()) {
    activations_out_[layer] = slot.outbound;
    // Checkpoints written in the forward pass stay valid in the slot for a backward reuse.
    slot.activation_ready.assign(outgoing.size(), consumer);
  }
  acquired_ = false;
  ++cursor_;
  if (runtime_->tracer().enabled()) {  // the record is placed at step_end
    pending_waits_.push_back(PendingWait{
        layer_trace_record(TraceKind::kRelease, layer, static_cast<int32_t>(phase), stream),
        consumer, consumer});
  }
  return issue_loads();
}

}  // namespace strata
