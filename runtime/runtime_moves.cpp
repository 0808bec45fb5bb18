// The Runtime's migrations: a move between tiers submitted to the backend's copy queues or the
// NVMe tier (start_transfer), finished by its callback (finish_move: the source block freed, the
// registry updated, the completion completed), and the link counters each transfer adds to.
// runtime.cpp holds the rest of the Runtime: creation, the arenas, the registry, exports.
#include "runtime/runtime.h"

namespace strata {

Status Runtime::move(TensorId id, Tier dst, void* stream, std::shared_ptr<Completion>* completion) {
  STRATA_RETURN_IF_ERROR(check_tier(dst));
  std::lock_guard lock(mutex_);
  if (shut_down_) return error(Code::kInvalidState, "the runtime is shutting down");
  TensorRecord* t = nullptr;
  STRATA_RETURN_IF_ERROR(lookup(id, &t));
  if (t->pinned_in_place()) {
    return error(Code::kBusy, "cannot move tensor '", t->spec.name, "': ", busy_reason(*t));
  }
  if (t->tier == dst) {
    *completion = Completion::finished(Status::ok());
    return Status::ok();
  }
  uint64_t dst_offset = 0;
  // Into DRAM, the tensor's role's part again (dram_parts_for).
  STRATA_RETURN_IF_ERROR(allocate_block(dst, t->spec.role, t->nbytes, t->spec.name, &dst_offset));

  auto done = std::make_shared<Completion>();
  const uint64_t queued = tracer_.enabled() ? tracer_.now() : 0;
  FinishMove finish = [this, id, dst, dst_offset, done, queued](Status s,
                                                                std::shared_ptr<Checksums> crcs) {
    finish_move(id, dst, dst_offset, std::move(s), std::move(crcs), done, queued);
  };
  std::shared_ptr<DeviceFence> fence;
  Status started = start_transfer(*t, dst, dst_offset, stream, std::move(finish), &fence);
  if (!started.is_ok()) {
    (void)free_block(dst, dst_offset);
    return error(started.code(), "cannot move tensor '", t->spec.name, "' to ", tier_name(dst),
                 ": ", started.message());
  }
  t->migrating = true;
  ++in_flight_;
  done->set_fence(std::move(fence));
  *completion = std::move(done);
  return Status::ok();
}

Status Runtime::start_transfer(const TensorRecord& t, Tier dst, uint64_t dst_offset, void* stream,
                               FinishMove finish, std::shared_ptr<DeviceFence>* fence) {
  const Tier src = t.tier;
  if (src != Tier::kNvme && dst != Tier::kNvme) {  // HBM <-> DRAM: one device copy
    const bool to_device = dst == Tier::kHbm;
    const Link link = to_device ? Link::kH2D : Link::kD2H;
    CopyRequest request;
    request.direction = to_device ? CopyDirection::kHostToDevice : CopyDirection::kDeviceToHost;
    request.dst = regions_[static_cast<int>(dst)]->base() + dst_offset;
    request.src = address(t);
    request.bytes = t.nbytes;
    request.after_stream = stream;
    request.on_complete = [this, link, bytes = t.nbytes, finish](CopyResult result) {
      if (result.status.is_ok()) account(link, bytes, result.busy_ns);
      finish(std::move(result.status), nullptr);
    };
    return backend_->submit_copy(std::move(request), fence);
  }

  const uint64_t len = Arena::round_up(t.nbytes, NvmeTier::kAlignment);
  if (dst == Tier::kNvme) {
    // The caller's stream may still be writing the source: a no-op copy queued after it on
    // the D2H queue opens the gate the transfer waits on (and orders the staged D2H copies).
    std::shared_ptr<Completion> gate;
    if (stream != nullptr) {
      gate = std::make_shared<Completion>();
      CopyRequest barrier;
      barrier.direction = CopyDirection::kDeviceToHost;
      barrier.dst = regions_[static_cast<int>(Tier::kDram)]->base();
      barrier.src = barrier.dst;
      barrier.bytes = 0;
      barrier.after_stream = stream;
      barrier.on_complete = [gate](CopyResult r) { gate->complete(std::move(r.status)); };
      STRATA_RETURN_IF_ERROR(backend_->submit_copy(std::move(barrier), nullptr));
    }
    auto crcs = nvme_->checksums() ? std::make_shared<Checksums>() : nullptr;
    auto done = [finish, crcs](Status s) { finish(std::move(s), crcs); };
    if (src == Tier::kDram) {
      nvme_->write_from_host(t.spec.name, address(t), dst_offset, len, crcs, std::move(done), gate);
    } else {
      nvme_->write_from_device(t.spec.name, address(t), t.nbytes, dst_offset, len, crcs,
                               std::move(done), gate);
    }
    return Status::ok();
  }

  // From NVMe. There is no single device event to hand out: a stream wait on the event
  // blocks the calling thread instead (see strata_event_stream_wait).
  unsigned char* target = regions_[static_cast<int>(dst)]->base() + dst_offset;
  auto done = [finish](Status s) { finish(std::move(s), nullptr); };
  if (dst == Tier::kDram) {
    nvme_->read_to_host(t.spec.name, target, t.offset, len, t.nvme_crcs, std::move(done));
  } else {
    nvme_->read_to_device(t.spec.name, target, t.nbytes, t.offset, len, t.nvme_crcs,
                          std::move(done));
  }
  return Status::ok();
}

void Runtime::finish_move(TensorId id, Tier dst, uint64_t dst_offset, Status status,
                          std::shared_ptr<Checksums> crcs,
                          const std::shared_ptr<Completion>& completion, uint64_t queued_ns) {
  Status outcome = status;
  {
    std::lock_guard lock(mutex_);
    TensorRecord* t = registry_.find(id);  // present: a migrating tensor cannot be unregistered
    if (status.is_ok()) tracer_.record_migration(id, t->tier, dst, t->nbytes, queued_ns);
    if (status.is_ok()) {
      // The data has landed: only now is the source given up.
      (void)free_block(t->tier, t->offset - t->skew);
      t->skew = 0;
      --tensors_in_tier_[static_cast<int>(t->tier)];
      ++tensors_in_tier_[static_cast<int>(dst)];
      t->tier = dst;
      t->offset = dst_offset;
      t->nvme_crcs = dst == Tier::kNvme ? std::move(crcs) : nullptr;
    } else {
      // The source copy is untouched; drop the reservation and report.
      (void)free_block(dst, dst_offset);
      outcome = error(status.code(), "move of tensor '", t->spec.name, "' to ", tier_name(dst),
                      " failed: ", status.message());
    }
    t->migrating = false;
    --in_flight_;
  }
  idle_cv_.notify_all();
  completion->complete(std::move(outcome));
}

void Runtime::account(Link link, uint64_t bytes, uint64_t busy_ns) {
  if (link == Link::kH2D || link == Link::kD2H) {
    tracer_.record_transfer(copy_trace_kind(link), bytes, busy_ns);
  }
  account_counters(link, bytes, busy_ns);
}

void Runtime::account_counters(Link link, uint64_t bytes, uint64_t busy_ns) {
  std::lock_guard lock(mutex_);
  LinkCounters& c = links_[static_cast<int>(link)];
  c.bytes += bytes;
  c.transfers += 1;
  c.busy_ns += busy_ns;
}

}  // namespace strata
