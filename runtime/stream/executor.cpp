// The executor's step: creation, step_begin / step_end / step_abort, the copies queued and their
// times for the trace. One layer's acquire, views and release are executor_layers.cpp; the
// loads, executor_loads.cpp.
#include "runtime/stream/executor.h"

#include <algorithm>

namespace strata {

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

}  // namespace strata
