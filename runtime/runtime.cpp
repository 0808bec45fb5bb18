#include "runtime/runtime.h"

#include "backends/topology/gpu_numa_node.h"

namespace strata {

Status Runtime::create(const RuntimeOptions& options, std::shared_ptr<Runtime>* out) {
  STRATA_RETURN_IF_ERROR(NvmeTier::check_io_options(options.nvme));
  const uint64_t nvme_budget = options.budgets[static_cast<int>(Tier::kNvme)];
  if (nvme_budget != 0 && options.nvme.paths.empty()) {
    return error(Code::kInvalidArgument, "nvme_budget_bytes is ", nvme_budget,
                 " but no nvme_paths were given");
  }
  if (nvme_budget == 0 && !options.nvme.paths.empty()) {
    return error(Code::kInvalidArgument, options.nvme.paths.size(),
                 " nvme path(s) given but nvme_budget_bytes is 0");
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
    hbm = device.kind == DeviceKind::kCuda ? device.free_memory / 2 : kDefaultHostHbmBudget;
  }
  if (device.kind == DeviceKind::kCuda && hbm > device.free_memory) {
    return error(Code::kOutOfMemory, "hbm_budget_bytes ", hbm, " exceeds the ", device.free_memory,
                 " bytes free on ", device.name);
  }
  uint64_t dram = options.budgets[static_cast<int>(Tier::kDram)];
  if (dram == 0) dram = kDefaultDramBudget;
  if (device.kind == DeviceKind::kHost) {
    // The simulated device's memory is host memory too: both arenas must fit in what the host
    // has, or a tensor touching the last pages is an OOM kill instead of an error now.
    const uint64_t available = host_available_memory();
    if (available != 0 && (hbm > available || dram > available - hbm)) {
      return error(Code::kOutOfMemory, "hbm_budget_bytes ", hbm, " (simulated in host memory) and ",
                   "dram_budget_bytes ", dram, " exceed the ", available,
                   " bytes of host memory available (MemAvailable)");
    }
  }

  // HBM: 256-byte blocks (CUDA's alignment). DRAM: 4 KiB blocks, so any block can go to and
  // from NVMe with O_DIRECT as it is.
  const uint64_t hbm_size = Arena::round_up(hbm, Arena::kDefaultAlignment);
  const uint64_t dram_size = Arena::round_up(dram, NvmeTier::kAlignment);
  if (hbm_size == 0 || dram_size == 0) {
    return error(Code::kInvalidArgument, "a tier budget overflows when rounded to its alignment");
  }
  // The pinned part of the DRAM arena (all of it by default): whole 4 KiB blocks, so the
  // boundary between the two arenas is a block boundary of both.
  uint64_t pinned = dram_size;
  if (options.dram_pinned != 0) {
    pinned = Arena::round_up(options.dram_pinned, NvmeTier::kAlignment);
    if (pinned == 0 || pinned > dram_size) {
      return error(Code::kInvalidArgument, "dram_pinned_bytes ", options.dram_pinned,
                   " (rounded up to 4 KiB) exceeds dram_budget_bytes ", dram,
                   " (the arena: ", dram_size, " bytes)");
    }
  }
  auto& regions = runtime->regions_;
  STRATA_RETURN_IF_ERROR(MemoryRegion::allocate_device(backend, hbm_size, &regions[0]));
  HostMemoryOptions dram_memory = options.dram;
  dram_memory.preferred_node = runtime->device_numa_node_;
  STRATA_RETURN_IF_ERROR(
      MemoryRegion::allocate_host(backend, dram_size, pinned, dram_memory, &regions[1]));
  runtime->arenas_[0] = std::make_unique<Arena>("hbm", hbm_size, Arena::kDefaultAlignment);
  runtime->arenas_[1] = std::make_unique<Arena>("dram", pinned, NvmeTier::kAlignment);
  runtime->dram_pinned_size_ = pinned;
  if (pinned < dram_size) {
    runtime->dram_unpinned_ =
        std::make_unique<Arena>("dram (unpinned)", dram_size - pinned, NvmeTier::kAlignment);
  }
  runtime->host_buffers_ = std::make_unique<HostBuffers>(backend, dram_memory, dram_size);

  if (nvme_budget != 0) {
    NvmeOptions nvme = options.nvme;
    nvme.budget = Arena::round_up(nvme_budget, NvmeTier::kAlignment);
    if (nvme.budget == 0) {
      return error(Code::kInvalidArgument, "nvme_budget_bytes ", nvme_budget,
                   " overflows when rounded to the 4 KiB alignment");
    }
    Runtime* raw = runtime.get();  // the tier is owned by the runtime and stopped before it
    STRATA_RETURN_IF_ERROR(NvmeTier::create(
        nvme, backend, {regions[1]->base(), regions[1]->size()}, dram_memory,
        [raw](Link link, uint64_t bytes, uint64_t busy) { raw->account(link, bytes, busy); },
        &runtime->nvme_,
        [raw](IoOp op, uint64_t bytes, uint64_t busy_ns) {
          raw->tracer().record_transfer(
              op == IoOp::kRead ? TraceKind::kNvmeRead : TraceKind::kNvmeWrite, bytes, busy_ns);
        }));
  }
  *out = std::move(runtime);
  return Status::ok();
}

Runtime::~Runtime() {
  shutdown();
}

void Runtime::add_background_writer(const void* key, std::function<void()> wait) {
  std::lock_guard lock(writers_mutex_);
  writers_.emplace_back(key, std::move(wait));
}

void Runtime::remove_background_writer(const void* key) {
  std::lock_guard lock(writers_mutex_);
  std::erase_if(writers_, [key](const auto& w) { return w.first == key; });
}

void Runtime::wait_for_background_writers() {
  std::lock_guard lock(writers_mutex_);
  for (const auto& w : writers_) w.second();
}

std::size_t Runtime::shutdown() {
  {
    std::lock_guard lock(mutex_);
    if (shut_down_) return 0;
    shut_down_ = true;
  }
  // Without the lock: cancelled and finishing transfers call back into finish_move. NVMe first:
  // its running transfers may still need the device's copy queues.
  std::size_t cancelled = nvme_ ? nvme_->shutdown() : 0;
  return cancelled + backend_->shutdown();
}

Arena* Runtime::arena(Tier tier) const {
  if (tier == Tier::kNvme) return nvme_ ? &nvme_->extents() : nullptr;
  return arenas_[static_cast<int>(tier)].get();
}

uint64_t Runtime::tier_budget(Tier tier) const {
  const Arena* a = arena(tier);
  if (a == nullptr) return 0;
  const bool split = tier == Tier::kDram && dram_unpinned_ != nullptr;
  return a->capacity() + (split ? dram_unpinned_->capacity() : 0);
}

Runtime::DramParts Runtime::dram_parts_for(Role role) const {
  Arena& pinned = *arenas_[static_cast<int>(Tier::kDram)];
  const DramPart pinned_part{pinned, 0, false};
  if (dram_unpinned_ == nullptr) return {pinned_part, std::nullopt};
  const DramPart unpinned_part{*dram_unpinned_, dram_pinned_size_, true};
  // The other part rather than a failure (a tier never fails while it has room): the
  // optimizer's state in the pinned part only costs pinned room, any other role in the
  // unpinned part has its transfers made as pageable copies, slower but correct.
  if (role == Role::kOptimizerState) return {unpinned_part, pinned_part};
  return {pinned_part, unpinned_part};
}

Status Runtime::allocate_block(Tier tier, Role role, uint64_t bytes, std::string_view what,
                               uint64_t* offset, bool* untouched) {
  if (tier != Tier::kDram) return arena(tier)->allocate(bytes, what, offset, untouched);
  // Each part keeps its own high-water mark (Arena::allocate's `untouched`): both lie over
  // memory that was zero when mapped, so either one's mark tells for its blocks.
  const DramParts parts = dram_parts_for(role);
  uint64_t at = 0;
  Status s = parts.preferred.arena.allocate(bytes, what, &at, untouched);
  if (s.is_ok()) {
    *offset = parts.preferred.base + at;
    return s;
  }
  if (s.code() != Code::kOutOfMemory || !parts.fallback) return s;
  const DramPart& fallback = *parts.fallback;
  Status t = fallback.arena.allocate(bytes, what, &at, untouched);
  if (!t.is_ok()) {
    return error(t.code(), "dram has no room for '", what, "' in its ", parts.preferred.name(),
                 " part (", s.message(), ") nor its ", fallback.name(), " part (", t.message(),
                 ")");
  }
  // Counted only where it costs: a block the GPU's copies touch in the unpinned part (its
  // transfers are pageable copies). State in the pinned part only takes pinned room.
  if (fallback.unpinned) ++dram_fallbacks_;
  *offset = fallback.base + at;
  return t;
}

uint64_t Runtime::dram_largest_free_for(Role role) {
  std::lock_guard lock(mutex_);
  return dram_parts_for(role).preferred.arena.largest_free();
}

Status Runtime::free_block(Tier tier, uint64_t offset) {
  if (tier == Tier::kDram && dram_unpinned_ != nullptr && offset >= dram_pinned_size_) {
    return dram_unpinned_->free(offset - dram_pinned_size_);
  }
  return arena(tier)->free(offset);
}

std::string Runtime::busy_reason(const TensorRecord& t) {
  if (t.migrating) return "a move of it is in flight";
  if (t.export_count > 0) return "DLPack exports of it are alive";
  if (t.executor_pins > 0) return "an executor or optimizer holds it in place (destroy them first)";
  return "a read or write of it is running";
}

Status Runtime::check_tier(Tier tier) const {
  if (!valid_tier(static_cast<int32_t>(tier))) {
    return error(Code::kInvalidArgument, "unknown tier ", static_cast<int32_t>(tier));
  }
  if (!tier_available(tier)) {
    return error(Code::kUnsupported, "the ", tier_name(tier),
                 " tier is not available in this runtime",
                 tier == Tier::kNvme ? " (configure nvme_paths and nvme_budget_bytes)" : "");
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
  return regions_[static_cast<int>(t.tier)]->base() + t.offset;  // HBM and DRAM only
}

Status Runtime::register_tensor(TensorSpec spec, TensorId* id, uint64_t skew, bool* zeroed) {
  uint64_t nbytes = 0;
  STRATA_RETURN_IF_ERROR(validate_spec(spec, &nbytes));
  STRATA_RETURN_IF_ERROR(check_tier(spec.home));
  if (skew != 0 && (spec.home != Tier::kDram || skew % 64 != 0 || skew >= 4096)) {
    return error(Code::kInternal, "skew ", skew, " for '", spec.name, "' in ",
                 tier_name(spec.home));
  }
  std::lock_guard lock(mutex_);
  if (shut_down_) return error(Code::kInvalidState, "the runtime is shutting down");
  if (registry_.find(spec.name) != nullptr) {
    return error(Code::kAlreadyExists, "a tensor named '", spec.name, "' is already registered");
  }
  const Tier home = spec.home;
  uint64_t offset = 0;
  bool untouched = false;
  STRATA_RETURN_IF_ERROR(
      allocate_block(home, spec.role, nbytes + skew, spec.name, &offset, &untouched));
  Status added = registry_.add(std::move(spec), nbytes, home, offset + skew, id);
  if (!added.is_ok()) {
    (void)free_block(home, offset);
    return added;
  }
  if (zeroed != nullptr) *zeroed = home == Tier::kDram && untouched;
  registry_.find(*id)->skew = skew;
  if (home == Tier::kNvme && nvme_->checksums()) {
    // Contents are undefined until written: each piece gets its checksum when first written.
    auto crcs = std::make_shared<Checksums>();
    crcs->reset(nvme_->piece_count(offset, Arena::round_up(nbytes, NvmeTier::kAlignment)));
    registry_.find(*id)->nvme_crcs = std::move(crcs);
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
    return error(Code::kBusy, "cannot unregister tensor '", t->spec.name, "': ", busy_reason(*t));
  }
  STRATA_RETURN_IF_ERROR(free_block(t->tier, t->offset - t->skew));
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
                        const std::function<Status(const TensorRecord&)>& copy) {
  TensorRecord snapshot;
  {
    std::lock_guard lock(mutex_);
    TensorRecord* t = nullptr;
    STRATA_RETURN_IF_ERROR(lookup(id, &t));
    if (t->migrating) {
      return error(Code::kBusy, "cannot ", verb, " tensor '", t->spec.name,
                   "': a move of it is in flight; wait on its event first");
    }
    if (offset > t->nbytes || bytes > t->nbytes - offset) {
      // offset + bytes may wrap: say it as a length, not as an end offset.
      return error(Code::kInvalidArgument, "cannot ", verb, " tensor '", t->spec.name, "': ", bytes,
                   " bytes at offset ", offset, " exceed its size of ", t->nbytes);
    }
    ++t->io_count;  // keeps it in place while the copy runs without the lock
    snapshot = *t;
  }
  Status status = bytes == 0 ? Status::ok() : copy(snapshot);
  {
    std::lock_guard lock(mutex_);
    --registry_.find(id)->io_count;  // pinned by io_count: it cannot have been removed
  }
  if (!status.is_ok()) {
    return error(status.code(), "cannot ", verb, " tensor '", snapshot.spec.name,
                 "': ", status.message());
  }
  return Status::ok();
}

Status Runtime::write(TensorId id, uint64_t offset, const void* src, uint64_t bytes) {
  return copy_io(id, offset, bytes, "write", [&](const TensorRecord& t) {
    if (t.tier == Tier::kNvme) {
      return nvme_->write_range(t.spec.name, t.offset,
                                Arena::round_up(t.nbytes, NvmeTier::kAlignment), t.nvme_crcs.get(),
                                offset, src, bytes, t.nbytes);
    }
    return backend_->copy_sync(address(t) + offset, src, bytes);
  });
}

Status Runtime::read(TensorId id, uint64_t offset, void* dst, uint64_t bytes) {
  return copy_io(id, offset, bytes, "read", [&](const TensorRecord& t) {
    if (t.tier == Tier::kNvme) {
      return nvme_->read_range(t.spec.name, t.offset,
                               Arena::round_up(t.nbytes, NvmeTier::kAlignment), t.nvme_crcs.get(),
                               offset, dst, bytes);
    }
    return backend_->copy_sync(dst, address(t) + offset, bytes);
  });
}

Status Runtime::data_pointer(TensorId id, void** out) {
  std::lock_guard lock(mutex_);
  TensorRecord* t = nullptr;
  STRATA_RETURN_IF_ERROR(lookup(id, &t));
  if (t->migrating) {
    return error(Code::kBusy, "tensor '", t->spec.name,
                 "' is moving; its address is known once the move's event completes");
  }
  if (t->tier == Tier::kNvme) {
    return error(Code::kInvalidState, "tensor '", t->spec.name,
                 "' is on nvme, which has no addressable memory; move it to dram or hbm first");
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
  if (t->tier == Tier::kNvme) {
    return error(Code::kInvalidState, "cannot export tensor '", t->spec.name,
                 "': it is on nvme; move it to dram or hbm first");
  }
  ++t->export_count;
  out->data = address(*t);
  out->tier = t->tier;
  out->pinned = t->tier == Tier::kDram && t->offset < dram_pinned_size_;
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
  const Arena* a = arena(tier);
  if (a == nullptr) return usage;
  usage.budget = a->capacity();
  usage.used = a->used();
  usage.largest_free = a->largest_free();
  usage.tensors = tensors_in_tier_[static_cast<int>(tier)];
  if (tier == Tier::kDram) {
    usage.pinned_budget = a->capacity();
    usage.pinned_used = a->used();
    usage.fallbacks = dram_fallbacks_;
    if (dram_unpinned_ != nullptr) {  // either part takes any role's block (dram_parts_for)
      usage.budget += dram_unpinned_->capacity();
      usage.used += dram_unpinned_->used();
      usage.largest_free = std::max(usage.largest_free, dram_unpinned_->largest_free());
    }
  }
  return usage;
}

LinkCounters Runtime::link_counters(Link link) {
  if (link == Link::kNvmeRead || link == Link::kNvmeWrite) {
    if (!nvme_) return {};
    // The engine counts time with any request in flight, which is the link's busy time.
    const IoCounters io = nvme_->counters(link == Link::kNvmeRead ? IoOp::kRead : IoOp::kWrite);
    return LinkCounters{io.bytes, io.requests, io.busy_ns};
  }
  std::lock_guard lock(mutex_);
  return links_[static_cast<int>(link)];
}

void Runtime::reset_link_counters() {
  if (nvme_) nvme_->reset_counters();
  std::lock_guard lock(mutex_);
  links_ = {};
}

void Runtime::synchronize() {
  std::unique_lock lock(mutex_);
  idle_cv_.wait(lock, [&] { return in_flight_ == 0; });
}

Status Runtime::pin_in_place(TensorId id, const char* holder) {
  std::lock_guard lock(mutex_);
  TensorRecord* t = nullptr;
  STRATA_RETURN_IF_ERROR(lookup(id, &t));
  if (t->migrating) {
    return error(Code::kBusy, holder, ": tensor '", t->spec.name,
                 "' is moving; wait for its move to finish");
  }
  ++t->executor_pins;
  return Status::ok();
}

void Runtime::unpin(TensorId id) {
  std::lock_guard lock(mutex_);
  if (TensorRecord* t = registry_.find(id)) --t->executor_pins;
}

Status Runtime::reserve_hbm(uint64_t bytes, const std::string& what, uint64_t* offset) {
  std::lock_guard lock(mutex_);
  return arena(Tier::kHbm)->allocate(bytes, what, offset);
}

void Runtime::release_hbm(uint64_t offset) {
  std::lock_guard lock(mutex_);
  (void)arena(Tier::kHbm)->free(offset);
}

std::vector<std::pair<uint64_t, std::string>> Runtime::tensor_names() {
  std::lock_guard lock(mutex_);
  std::vector<std::pair<uint64_t, std::string>> out;
  registry_.for_each([&](const TensorRecord& t) { out.emplace_back(t.id, t.spec.name); });
  return out;
}

}  // namespace strata
