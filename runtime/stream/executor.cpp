#include "runtime/stream/executor.h"

#include <algorithm>

namespace strata {
namespace {
const char* phase_name(Phase p) {
  return p == Phase::kForward ? "forward" : "backward";
}

// One of a layer's three per-role lists (slot tensors, readiness fences).
template <typename T>
const std::vector<T>& by_role(ViewRole role, const std::vector<T>& weights,
                              const std::vector<T>& grads, const std::vector<T>& activations) {
  return role == ViewRole::kWeight ? weights : role == ViewRole::kGrad ? grads : activations;
}
}  // namespace

Executor::Executor(std::shared_ptr<Runtime> runtime, Plan plan)
    : runtime_(std::move(runtime)), backend_(runtime_->backend()), plan_(std::move(plan)) {}

Status Executor::create(std::shared_ptr<Runtime> runtime, Plan plan,
                        std::unique_ptr<Executor>* out) {
  std::unique_ptr<Executor> e(new Executor(std::move(runtime), std::move(plan)));
  Runtime& rt = *e->runtime_;
  // Residents go to HBM (and stay: pinned like everything the executor touches).
  for (TensorId id : e->plan_.residents) {
    TensorRecord r;
    STRATA_RETURN_IF_ERROR(rt.info(id, &r));
    if (r.tier != Tier::kHbm) {
      std::shared_ptr<Completion> moved;
      STRATA_RETURN_IF_ERROR(rt.move(id, Tier::kHbm, nullptr, &moved));
      STRATA_RETURN_IF_ERROR(moved->wait(-1));
    }
  }
  auto pin = [&](TensorId id) -> Status {
    STRATA_RETURN_IF_ERROR(rt.pin_in_place(id, "executor"));
    e->pinned_.push_back(id);
    return Status::ok();
  };
  for (TensorId id : e->plan_.residents) STRATA_RETURN_IF_ERROR(pin(id));
  unsigned char* dram = rt.tier_base(Tier::kDram);
  for (const LayerPlan& layer : e->plan_.layers) {
    LayerHomes homes;
    for (const SlotTensor& t : layer.weights) {
      STRATA_RETURN_IF_ERROR(pin(t.id));
      TensorRecord r;
      STRATA_RETURN_IF_ERROR(rt.info(t.id, &r));
      if (r.tier == Tier::kNvme) {
        homes.nvme_weights.push_back(r);
      } else if (r.tier == Tier::kDram) {
        homes.weights.push_back(dram + r.offset);
      } else {
        return error(Code::kInvalidState, "weight '", r.spec.name, "' moved to ", tier_name(r.tier),
                     " after planning; plan again");
      }
    }
    if (layer.weights_as_span) homes.span = dram + layer.span_dram_offset;
    for (const auto* list : {&layer.grads, &layer.activations}) {
      const bool grads = list == &layer.grads;
      for (const SlotTensor& t : *list) {
        STRATA_RETURN_IF_ERROR(pin(t.id));
        TensorRecord r;
        STRATA_RETURN_IF_ERROR(rt.info(t.id, &r));
        // A grad planned in its HBM home (SlotTensor::in_home) is written there by the
        // backward pass; anything else is in DRAM.
        const Tier planned = t.in_home ? Tier::kHbm : Tier::kDram;
        if (r.tier != planned) {
          return error(Code::kInvalidState, "tensor '", r.spec.name, "' moved to ",
                       tier_name(r.tier), " after planning; plan again");
        }
        (grads ? homes.grads : homes.activations).push_back(rt.tier_base(planned) + r.offset);
      }
    }
    e->homes_.push_back(std::move(homes));
  }
  STRATA_RETURN_IF_ERROR(
      rt.reserve_hbm(e->plan_.slot_bytes * e->plan_.slots, "executor slots", &e->slots_offset_));
  e->slots_reserved_ = true;
  e->sequence_ = step_sequence(e->plan_.layer_count);
  e->schedule_ = schedule_slots(e->sequence_, e->plan_.slots, e->plan_.forward_depth);
  e->slots_.resize(e->plan_.slots);
  e->activations_out_.resize(e->plan_.layer_count);
  *out = std::move(e);
  return Status::ok();
}

Executor::~Executor() {
  // Copies may still target the slots or read the homes: let them land first.
  (void)wait_all_outstanding();
  if (in_step_) runtime_->note_step(false);
  if (hooks_) hooks_->on_executor_destroyed();
  if (slots_reserved_) runtime_->release_hbm(slots_offset_);
  for (TensorId id : pinned_) runtime_->unpin(id);
}

Status Executor::wait_all_outstanding() {
  std::lock_guard lock(mutex_);
  Status first;
  auto wait = [&](const std::shared_ptr<DeviceFence>& f) {
    if (!f) return;
    Status s = f->host_wait();
    if (first.is_ok() && !s.is_ok()) first = s;
  };
  for (Slot& s : slots_) {
    wait(s.consumer);
    wait(s.outbound);
    for (auto& f : s.weight_ready) wait(f);
    for (auto& f : s.activation_ready) wait(f);
  }
  for (Ready& r : ready_) {
    for (auto* list : {&r.weights, &r.grads, &r.activations}) {
      for (auto& f : *list) wait(f);
    }
  }
  for (auto& f : activations_out_) wait(f);
  return first;
}

ExecutorStats Executor::stats() {
  std::lock_guard lock(mutex_);
  return stats_;
}

unsigned char* Executor::slot_base(uint32_t slot) const {
  return runtime_->tier_base(Tier::kHbm) + slots_offset_ +
         static_cast<uint64_t>(slot) * plan_.slot_bytes;
}

Status Executor::step_begin() {
  std::lock_guard lock(mutex_);
  if (in_step_) {
    return error(Code::kInvalidState, "step_begin inside a step: call step_end first (",
                 sequence_.size() - cursor_, " layer passes of this step not yet run)");
  }
  in_step_ = true;
  runtime_->note_step(true);
  cursor_ = 0;
  issued_ = 0;
  ready_.assign(sequence_.size(), Ready{});
  // Weights may have changed since the last step (the optimizer updates them): nothing in a
  // slot counts as loaded any more.
  for (Slot& s : slots_) {
    s.weight_ready.clear();
    s.activation_ready.clear();
  }
  if (hooks_) {
    Status s = hooks_->on_step_begin();
    if (!s.is_ok()) {
      in_step_ = false;
      runtime_->note_step(false);
      return s;
    }
  }
  return issue_loads();
}

Status Executor::attach_hooks(std::shared_ptr<ExecutorHooks> hooks) {
  std::lock_guard lock(mutex_);
  if (in_step_) return error(Code::kInvalidState, "attach to an executor inside a step");
  if (hooks_) return error(Code::kBusy, "the executor already has an optimizer attached");
  hooks_ = std::move(hooks);
  return Status::ok();
}

Status Executor::detach_hooks(const ExecutorHooks* hooks) {
  std::lock_guard lock(mutex_);
  if (hooks_.get() != hooks) return Status::ok();
  if (in_step_) {
    return error(Code::kInvalidState,
                 "detach from an executor inside a step: call strata_step_end first");
  }
  hooks_.reset();
  return Status::ok();
}

Status Executor::step_end() {
  std::vector<std::shared_ptr<DeviceFence>> outbound;
  {
    std::lock_guard lock(mutex_);
    if (!in_step_) return error(Code::kInvalidState, "step_end without step_begin");
    if (acquired_ || acquiring_ || cursor_ != sequence_.size()) {
      const StepPosition& p = sequence_[std::min(cursor_, sequence_.size() - 1)];
      return error(Code::kInvalidState, "step_end before the step finished: layer ", p.layer, " (",
                   phase_name(p.phase), ") is ",
                   acquired_    ? "acquired and not released"
                   : acquiring_ ? "being acquired"
                                : "still to run");
    }
    for (Slot& s : slots_) {
      if (s.outbound) outbound.push_back(s.outbound);
    }
    if (home_grads_landed_) outbound.push_back(std::move(home_grads_landed_));
    in_step_ = false;
    runtime_->note_step(false);
    ++stats_.steps;
    if (hooks_) hooks_->on_step_end();
  }
  return finish_step(std::move(outbound));
}

Status Executor::finish_step(std::vector<std::shared_ptr<DeviceFence>> outbound,
                             std::vector<std::shared_ptr<DeviceFence>> abandoned) {
  // Grads must have landed in DRAM when the step ends: the optimizer reads them next. Every
  // fence is waited for even after one failed, so nothing of the step is still running when
  // this returns. Loads an aborted step abandons are waited for too (they write into slots),
  // but their errors are not the abort's: a load that failed (an NVMe read's IO error) was, or
  // would have been, reported by the acquire that needed it, and the next step loads afresh.
  Status first;
  for (auto& f : outbound) {
    Status s = f->host_wait();
    if (first.is_ok() && !s.is_ok()) first = std::move(s);
  }
  for (auto& f : abandoned) (void)f->host_wait();
  STRATA_RETURN_IF_ERROR(first);
  STRATA_RETURN_IF_ERROR(resolve_copies());
  return resolve_waits();
}

Status Executor::step_abort(void* stream) {
  std::vector<std::shared_ptr<DeviceFence>> outbound, abandoned;
  {
    std::lock_guard lock(mutex_);
    if (!in_step_) return Status::ok();
    if (acquiring_) {
      return error(Code::kInvalidState,
                   "step_abort while another thread is acquiring a layer: abort after it returns");
    }
    std::shared_ptr<DeviceFence> adds_done;  // the acquired layer's work on `stream`
    if (acquired_) {
      // The caller's stream may still be computing on the slot: the next load into it waits
      // for this point, exactly as after a release, but nothing leaves the slot.
      STRATA_RETURN_IF_ERROR(backend_->record_fence(stream, &adds_done));
      slots_[schedule_[cursor_].slot].consumer = adds_done;
      acquired_ = false;
    }
    for (Slot& s : slots_) {
      if (s.outbound) outbound.push_back(s.outbound);
      if (s.consumer) outbound.push_back(s.consumer);
      if (home_grads_landed_) outbound.push_back(std::move(home_grads_landed_));
      for (auto& f : s.weight_ready) abandoned.push_back(f);
      for (auto& f : s.activation_ready) abandoned.push_back(f);
    }
    // Loads issued for positions that will not run now.
    for (std::size_t p = cursor_; p < issued_ && p < ready_.size(); ++p) {
      for (const auto* list : {&ready_[p].weights, &ready_[p].grads, &ready_[p].activations}) {
        for (const auto& f : *list) {
          if (f) abandoned.push_back(f);  // null: an in-place sum kept, nothing queued
        }
      }
    }
    in_step_ = false;
    runtime_->note_step(false);
    cursor_ = sequence_.size();
    if (hooks_) hooks_->on_step_aborted(std::move(adds_done));
  }
  return finish_step(std::move(outbound), std::move(abandoned));
}

bool Executor::in_step() {
  std::lock_guard lock(mutex_);
  return in_step_;
}

int64_t Executor::planned_ns(uint64_t bytes, double bytes_per_second) {
  // A plan accepts any finite link speed >= 0: one of 1e-300 B/s makes this infinite, and
  // converting a double beyond int64's range is undefined behaviour (the fuzzer found it).
  // Durations are capped at 4e18 ns (127 years), which `end - d` and `busy` still hold.
  constexpr double kMaxNs = 4e18;
  const double ns = static_cast<double>(bytes) / bytes_per_second * 1e9;
  return ns >= 0 && ns < kMaxNs ? static_cast<int64_t>(ns) : static_cast<int64_t>(kMaxNs);
}

Status Executor::resolve_copies() {
  std::vector<PendingCopy> copies;
  {
    std::lock_guard lock(mutex_);
    copies.swap(pending_copies_);
  }
  if (copies.empty()) return Status::ok();
  // Each copy's duration comes from fences that exist anyway, not from start events (a timing
  // event per copy on the copy queues cost a compute-bound step 3.3% on the H200): a copy
  // starts when its queue finished the one before it and its dependencies were met, and ends
  // at its own fence. Times are read against an anchor recorded after everything completed.
  for (const PendingCopy& c : copies) STRATA_RETURN_IF_ERROR(c.end->host_wait());
  std::shared_ptr<DeviceFence> anchor;
  STRATA_RETURN_IF_ERROR(backend_->record_fence(nullptr, &anchor));
  STRATA_RETURN_IF_ERROR(anchor->host_wait());
  Tracer& tracer = runtime_->tracer();
  const uint64_t anchor_host = tracer.enabled() ? tracer.now() : 0;
  auto at = [&](const DeviceFence& f, int64_t* t) -> Status {  // ns relative to the anchor, <= 0
    uint64_t before = 0;
    STRATA_RETURN_IF_ERROR(anchor->elapsed_since(f, &before));
    *t = -static_cast<int64_t>(before);
    return Status::ok();
  };
  for (int dir = 0; dir < 2; ++dir) {
    const auto direction = static_cast<CopyDirection>(dir);
    const Link link = direction == CopyDirection::kHostToDevice ? Link::kH2D : Link::kD2H;
    const double rate = direction == CopyDirection::kHostToDevice ? plan_.h2d_bytes_per_second
                                                                  : plan_.d2h_bytes_per_second;
    bool have_previous = false;
    int64_t previous = 0;
    if (last_end_[dir]) {
      STRATA_RETURN_IF_ERROR(at(*last_end_[dir], &previous));
      have_previous = true;
    }
    for (const PendingCopy& c : copies) {
      if (c.direction != direction) continue;
      int64_t end = 0;
      STRATA_RETURN_IF_ERROR(at(*c.end, &end));
      bool known = have_previous;
      int64_t start = previous;
      for (const auto& dep : c.deps) {
        int64_t t = 0;
        STRATA_RETURN_IF_ERROR(at(*dep, &t));
        start = known ? std::max(start, t) : t;
        known = true;
      }
      if (!known) {  // the queue's very first copy: its duration at the planned link speed
        start = end - planned_ns(c.bytes, rate);
      }
      const uint64_t busy = end > start ? static_cast<uint64_t>(end - start) : 0;
      runtime_->account_counters(link, c.bytes, busy);
      tracer.record_transfer(
          copy_trace_kind(link), c.bytes, busy,
          static_cast<uint64_t>(std::max<int64_t>(0, static_cast<int64_t>(anchor_host) + end)));
      previous = end;
      have_previous = true;
      last_end_[dir] = c.end;
    }
  }
  return Status::ok();
}

Status Executor::resolve_waits() {
  std::vector<PendingWait> pending;
  {
    std::lock_guard lock(mutex_);
    pending.swap(pending_waits_);
  }
  if (pending.empty()) return Status::ok();
  // Acquires and releases go on the device timeline of their stream: the fences recorded
  // around the waits (acquire) and at the release, read against an anchor recorded last.
  for (PendingWait& p : pending) STRATA_RETURN_IF_ERROR(p.after->host_wait());
  std::shared_ptr<DeviceFence> anchor;
  STRATA_RETURN_IF_ERROR(backend_->record_fence(nullptr, &anchor));
  STRATA_RETURN_IF_ERROR(anchor->host_wait());
  Tracer& tracer = runtime_->tracer();
  const int64_t anchor_host = static_cast<int64_t>(tracer.now());
  auto host_time = [&](const DeviceFence& f, uint64_t* t) -> Status {
    uint64_t before = 0;
    STRATA_RETURN_IF_ERROR(anchor->elapsed_since(f, &before));
    *t = static_cast<uint64_t>(std::max<int64_t>(0, anchor_host - static_cast<int64_t>(before)));
    return Status::ok();
  };
  for (PendingWait& p : pending) {
    uint64_t start = 0, end = 0;
    STRATA_RETURN_IF_ERROR(host_time(*p.before, &start));
    STRATA_RETURN_IF_ERROR(host_time(*p.after, &end));
    p.record.start_ns = start;
    p.record.end_ns = std::max(start, end);
    if (p.record.kind == static_cast<int32_t>(TraceKind::kAcquire)) {
      STRATA_RETURN_IF_ERROR(p.after->elapsed_since(*p.before, &p.record.wait_ns));
    }
    tracer.record(p.record);
  }
  return Status::ok();
}

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

Status Executor::queue_copy(CopyDirection direction, unsigned char* dst, const unsigned char* src,
                            uint64_t bytes,
                            const std::vector<std::shared_ptr<DeviceFence>>& wait_for,
                            std::shared_ptr<DeviceFence>* last) {
  // One copy: a contiguous range of any size runs at the link's peak as a single transfer
  // (chunking exists to merge small tensors, not to split large ones).
  CopyRequest r;
  r.direction = direction;
  r.dst = dst;
  r.src = src;
  r.bytes = bytes;
  r.wait_for = wait_for;
  STRATA_RETURN_IF_ERROR(backend_->submit_copy(std::move(r), last));
  // Zero fills move no data over PCIe and are not counted on a link.
  if (src != nullptr) {
    pending_copies_.push_back(PendingCopy{direction, bytes, wait_for, *last});
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
