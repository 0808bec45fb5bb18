#include "runtime/memory/memory_region.h"

namespace strata {

Status MemoryRegion::allocate_device(std::shared_ptr<DeviceBackend> backend, uint64_t bytes,
                                     std::shared_ptr<MemoryRegion>* out) {
  void* base = nullptr;
  STRATA_RETURN_IF_ERROR(backend->allocate_device(bytes, &base));
  out->reset(new MemoryRegion(std::move(backend), Tier::kHbm, base, bytes));
  return Status::ok();
}

Status MemoryRegion::allocate_host(std::shared_ptr<DeviceBackend> backend, uint64_t bytes,
                                   uint64_t pinned, const HostMemoryOptions& options,
                                   std::shared_ptr<MemoryRegion>* out) {
  if (pinned > bytes) {
    return error(Code::kInternal, "pinning ", pinned, " bytes of a ", bytes, "-byte arena");
  }
  void* base = nullptr;
  HostMemoryReport report;
  // Pinned while it is faulted in (host_memory.h): one registration of the arena's first
  // `pinned` bytes (the pinned arena's; the fault-in covers the whole mapping). The fault-in
  // runs from the start upwards, so the registration walks pages already resident.
  STRATA_RETURN_IF_ERROR(map_host_memory(
      bytes, options, &base, &report,
      [&backend, pinned](void* ptr, uint64_t) { return backend->pin_host(ptr, pinned); }));
  std::shared_ptr<MemoryRegion> region(
      new MemoryRegion(std::move(backend), Tier::kDram, base, bytes));
  region->pinned_ = pinned;
  region->host_report_ = std::move(report);
  *out = std::move(region);
  return Status::ok();
}

MemoryRegion::~MemoryRegion() {
  if (tier_ == Tier::kHbm) {
    backend_->free_device(base_, size_);
  } else {
    backend_->unpin_host(base_, pinned_);
    unmap_host_memory(base_, size_);
  }
}

}  // namespace strata
