#include "runtime/runtime.h"

#include <cstring>

#include "backends/topology/gpu_numa_node.h"

namespace strata {

Status Runtime::create(const RuntimeOptions& options, std::shared_ptr<Runtime>* out) {
  if (options.budgets[static_cast<int>(Tier::kNvme)] != 0) {
    return error(Code::kUnsupported,
                 "nvme_budget_bytes must be 0: the NVMe tier is not available in this build");
  }
  std::shared_ptr<DeviceBackend> backend;
  std::string reason;
  STRATA_RETURN_IF_ERROR(create_device_backend(options.device, &backend, &reason));

  std::shared_ptr<Runtime> runtime(new Runtime(backend));
  runtime->backend_reason_ = std::move(reason);
  const DeviceDescription& device = backend->description();
  if (device.kind == DeviceKind::kCuda) {
    runtime->device_numa_node_ = numa_node_of_pci_device(device.pci_bus_id);
  }

  uint64_t hbm = options.budgets[static_cast<int>(Tier::kHbm)];
  if (hbm == 0) {
    hbm = device.kind == DeviceKind::kCuda
              ? device.free_memory / 2 / Arena::kAlignment * Arena::kAlignment
              : kDefaultHostHbmBudget;
  }
  if (device.kind == DeviceKind::kCuda && hbm > device.free_memory) {
    return error(Code::kOutOfMemory, "hbm_budget_bytes ", hbm, " exceeds the ", device.free_memory,
                 " bytes free on ", device.name);
  }
  uint64_t dram = options.budgets[static_cast<int>(Tier::kDram)];
  if (dram == 0) dram = kDefaultDramBudget;

  const std::array<std::pair<Tier, uint64_t>, 2> tiers = {{{Tier::kHbm, hbm}, {Tier::kDram, dram}}};
  for (const auto& [tier, budget] : tiers) {
    const uint64_t size = Arena::round_up(budget);
    if (size == 0) return error(Code::kInvalidArgument, tier_name(tier), " budget overflows");
    const int i = static_cast<int>(tier);
    STRATA_RETURN_IF_ERROR(MemoryRegion::allocate(backend, tier, size, &runtime->regions_[i]));
    runtime->arenas_[i] = std::make_unique<Arena>(tier_name(tier), size);
  }
  *out = std::move(runtime);
  return Status::ok();
}

Runtime::~Runtime() {
  shutdown();
}

std::size_t Runtime::shutdown() {
  {
    std::lock_guard lock(mutex_);
    if (shut_down_) return 0;
    shut_down_ = true;
  }
  // Without the lock: cancelled and finishing copies call back into finish_move.
  return backend_->shutdown();
}

uint64_t Runtime::tier_budget(Tier tier) const {
  const auto& arena = arenas_[static_cast<int>(tier)];
  return arena ? arena->capacity() : 0;
}

double Runtime::tier_setup_seconds(Tier tier) const {
  const auto& region = regions_[static_cast<int>(tier)];
  return region ? region->setup_seconds() : 0.0;
}

Status Runtime::check_tier(Tier tier) const {
  if (!valid_tier(static_cast<int32_t>(tier))) {
    return error(Code::kInvalidArgument, "unknown tier ", static_cast<int32_t>(tier));
  }
  if (!tier_available(tier)) {
    return error(Code::kUnsupported, "the ", tier_name(tier),
                 " tier is not available in this runtime");
  }
  return Status::ok();
}

Status Runtime::lookup(TensorId id, TensorRecord** out) {
  TensorRecord* t = registry_.find(id);
  if (t == nullptr) {
    return error(Code::kNotFound, "no tensor with handle ", id,
                 " in this runtime (unregistered, or from another runtime)");
  }
  *out = t;
  return Status::ok();
}

unsigned char* Runtime::address(const TensorRecord& t) const {
  return regions_[static_cast<int>(t.tier)]->base() + t.offset;
}

Status Runtime::register_tensor(TensorSpec spec, TensorId* id) {
  uint64_t nbytes = 0;
  STRATA_RETURN_IF_ERROR(validate_spec(spec, &nbytes));
  STRATA_RETURN_IF_ERROR(check_tier(spec.home));
  std::lock_guard lock(mutex_);
  if (shut_down_) return error(Code::kInvalidState, "the runtime is shutting down");
  if (registry_.find(spec.name) != nullptr) {
    return error(Code::kAlreadyExists, "a tensor named '", spec.name, "' is already registered");
  }
  const Tier home = spec.home;
  Arena& arena = *arenas_[static_cast<int>(home)];
  uint64_t offset = 0;
  STRATA_RETURN_IF_ERROR(arena.allocate(nbytes, spec.name, &offset));
  Status added = registry_.add(std::move(spec), nbytes, home, offset, id);
  if (!added.is_ok()) {
    (void)arena.free(offset);
    return added;
  }
  ++tensors_in_tier_[static_cast<int>(home)];
  return Status::ok();
}

Status Runtime::find(std::string_view name, TensorId* id) {
  std::lock_guard lock(mutex_);
  const TensorRecord* t = registry_.find(name);
  if (t == nullptr) return error(Code::kNotFound, "no tensor named '", name, "'");
  *id = t->id;
  return Status::ok();
}

Status Runtime::unregister(TensorId id) {
  std::lock_guard lock(mutex_);
  TensorRecord* t = nullptr;
  STRATA_RETURN_IF_ERROR(lookup(id, &t));
  if (t->pinned_in_place()) {
    return error(Code::kBusy, "cannot unregister tensor '", t->spec.name, "': ",
                 t->migrating          ? "a move of it is in flight"
                 : t->export_count > 0 ? "DLPack exports of it are alive"
                                       : "a read or write of it is running");
  }
  STRATA_RETURN_IF_ERROR(arenas_[static_cast<int>(t->tier)]->free(t->offset));
  --tensors_in_tier_[static_cast<int>(t->tier)];
  return registry_.remove(id);
}

Status Runtime::info(TensorId id, TensorRecord* out) {
  std::lock_guard lock(mutex_);
  TensorRecord* t = nullptr;
  STRATA_RETURN_IF_ERROR(lookup(id, &t));
  *out = *t;
  return Status::ok();
}

Status Runtime::copy_io(TensorId id, uint64_t offset, uint64_t bytes, const char* verb,
                        const std::function<Status(unsigned char*)>& copy) {
  unsigned char* data = nullptr;
  std::string name;
  {
    std::lock_guard lock(mutex_);
    TensorRecord* t = nullptr;
    STRATA_RETURN_IF_ERROR(lookup(id, &t));
    if (t->migrating) {
      return error(Code::kBusy, "cannot ", verb, " tensor '", t->spec.name,
                   "': a move of it is in flight; wait on its event first");
    }
    if (offset > t->nbytes || bytes > t->nbytes - offset) {
      return error(Code::kInvalidArgument, "cannot ", verb, " tensor '", t->spec.name, "': bytes [",
                   offset, ", ", offset + bytes, ") exceed its size of ", t->nbytes);
    }
    ++t->io_count;
    data = address(*t) + offset;
    name = t->spec.name;
  }
  Status status = bytes == 0 ? Status::ok() : copy(data);
  {
    std::lock_guard lock(mutex_);
    --registry_.find(id)->io_count;  // pinned by io_count: it cannot have been removed
  }
  if (!status.is_ok()) {
    return error(status.code(), "cannot ", verb, " tensor '", name, "': ", status.message());
  }
  return Status::ok();
}

Status Runtime::write(TensorId id, uint64_t offset, const void* src, uint64_t bytes) {
  return copy_io(id, offset, bytes, "write",
                 [&](unsigned char* data) { return backend_->copy_sync(data, src, bytes); });
}

Status Runtime::read(TensorId id, uint64_t offset, void* dst, uint64_t bytes) {
  return copy_io(id, offset, bytes, "read",
                 [&](unsigned char* data) { return backend_->copy_sync(dst, data, bytes); });
}

Status Runtime::move(TensorId id, Tier dst, void* stream, std::shared_ptr<Completion>* completion) {
  STRATA_RETURN_IF_ERROR(check_tier(dst));
  std::lock_guard lock(mutex_);
  if (shut_down_) return error(Code::kInvalidState, "the runtime is shutting down");
  TensorRecord* t = nullptr;
  STRATA_RETURN_IF_ERROR(lookup(id, &t));
  if (t->pinned_in_place()) {
    return error(Code::kBusy, "cannot move tensor '", t->spec.name, "': ",
                 t->migrating          ? "a move of it is already in flight"
                 : t->export_count > 0 ? "DLPack exports of it are alive"
                                       : "a read or write of it is running");
  }
  if (t->tier == dst) {
    *completion = Completion::finished(Status::ok());
    return Status::ok();
  }
  uint64_t dst_offset = 0;
  Arena& dst_arena = *arenas_[static_cast<int>(dst)];
  STRATA_RETURN_IF_ERROR(dst_arena.allocate(t->nbytes, t->spec.name, &dst_offset));

  const bool to_device = dst == Tier::kHbm;
  const Link link = to_device ? Link::kH2D : Link::kD2H;
  auto done = std::make_shared<Completion>();
  CopyRequest request;
  request.direction = to_device ? CopyDirection::kHostToDevice : CopyDirection::kDeviceToHost;
  request.dst = regions_[static_cast<int>(dst)]->base() + dst_offset;
  request.src = address(*t);
  request.bytes = t->nbytes;
  request.after_stream = stream;
  request.on_complete = [this, id, dst, dst_offset, link, done](CopyResult result) {
    finish_move(id, dst, dst_offset, link, result, done);
  };
  std::shared_ptr<DeviceFence> fence;
  Status submitted = backend_->submit_copy(std::move(request), &fence);
  if (!submitted.is_ok()) {
    (void)dst_arena.free(dst_offset);
    return error(submitted.code(), "cannot move tensor '", t->spec.name, "' to ", tier_name(dst),
                 ": ", submitted.message());
  }
  t->migrating = true;
  ++in_flight_;
  done->set_fence(std::move(fence));
  *completion = std::move(done);
  return Status::ok();
}

void Runtime::finish_move(TensorId id, Tier dst, uint64_t dst_offset, Link link,
                          const CopyResult& result, const std::shared_ptr<Completion>& completion) {
  Status outcome = result.status;
  {
    std::lock_guard lock(mutex_);
    TensorRecord* t = registry_.find(id);  // present: a migrating tensor cannot be unregistered
    if (result.status.is_ok()) {
      // The data has landed: only now is the source given up.
      (void)arenas_[static_cast<int>(t->tier)]->free(t->offset);
      --tensors_in_tier_[static_cast<int>(t->tier)];
      ++tensors_in_tier_[static_cast<int>(dst)];
      t->tier = dst;
      t->offset = dst_offset;
      LinkCounters& c = links_[static_cast<int>(link)];
      c.bytes += t->nbytes;
      c.transfers += 1;
      c.busy_ns += result.busy_ns;
    } else {
      // The source copy is untouched; drop the reservation and report.
      (void)arenas_[static_cast<int>(dst)]->free(dst_offset);
      outcome = error(result.status.code(), "move of tensor '", t->spec.name, "' to ",
                      tier_name(dst), " failed: ", result.status.message());
    }
    t->migrating = false;
    --in_flight_;
  }
  idle_cv_.notify_all();
  completion->complete(std::move(outcome));
}

Status Runtime::data_pointer(TensorId id, void** out) {
  std::lock_guard lock(mutex_);
  TensorRecord* t = nullptr;
  STRATA_RETURN_IF_ERROR(lookup(id, &t));
  if (t->migrating) {
    return error(Code::kBusy, "tensor '", t->spec.name,
                 "' is moving; its address is known once the move's event completes");
  }
  *out = address(*t);
  return Status::ok();
}

Status Runtime::export_lease(TensorId id, ExportLease* out) {
  std::lock_guard lock(mutex_);
  TensorRecord* t = nullptr;
  STRATA_RETURN_IF_ERROR(lookup(id, &t));
  if (t->migrating) {
    return error(Code::kBusy, "cannot export tensor '", t->spec.name,
                 "': a move of it is in flight");
  }
  ++t->export_count;
  out->data = address(*t);
  out->tier = t->tier;
  out->dtype = t->spec.dtype;
  out->shape = t->spec.shape;
  // The lease holds the memory region (so the data outlives the runtime) and, weakly, the
  // runtime (so the export count drops only if the runtime is still there).
  std::weak_ptr<Runtime> weak = weak_from_this();
  auto region = regions_[static_cast<int>(t->tier)];
  out->keep_alive = std::shared_ptr<void>(nullptr, [weak, region, id](void*) mutable {
    if (auto runtime = weak.lock()) runtime->release_export(id);
    region.reset();
  });
  return Status::ok();
}

void Runtime::release_export(TensorId id) {
  std::lock_guard lock(mutex_);
  if (TensorRecord* t = registry_.find(id)) --t->export_count;
}

TierUsage Runtime::tier_usage(Tier tier) {
  std::lock_guard lock(mutex_);
  TierUsage usage;
  const auto& arena = arenas_[static_cast<int>(tier)];
  if (!arena) return usage;
  usage.budget = arena->capacity();
  usage.used = arena->used();
  usage.largest_free = arena->largest_free();
  usage.tensors = tensors_in_tier_[static_cast<int>(tier)];
  return usage;
}

LinkCounters Runtime::link_counters(Link link) {
  std::lock_guard lock(mutex_);
  return links_[static_cast<int>(link)];
}

void Runtime::reset_link_counters() {
  std::lock_guard lock(mutex_);
  links_ = {};
}

void Runtime::synchronize() {
  std::unique_lock lock(mutex_);
  idle_cv_.wait(lock, [&] { return in_flight_ == 0; });
}

}  // namespace strata
