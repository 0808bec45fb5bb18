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
                                   const HostMemoryOptions& options,
                                   std::shared_ptr<MemoryRegion>* out) {
  void* base = nullptr;
  HostMemoryReport report;
  // Pinned while it is faulted in (host_memory.h): one registration of the whole arena.
  STRATA_RETURN_IF_ERROR(map_host_memory(
      bytes, options, &base, &report,
      [&backend](void* ptr, uint64_t size) { return backend->pin_host(ptr, size); }));
  std::shared_ptr<MemoryRegion> region(
      new MemoryRegion(std::move(backend), Tier::kDram, base, bytes));
  region->host_report_ = std::move(report);
  *out = std::move(region);
  return Status::ok();
}

MemoryRegion::~MemoryRegion() {
  if (tier_ == Tier::kHbm) {
    backend_->free_device(base_, size_);
  } else {
    backend_->unpin_host(base_, size_);
    unmap_host_memory(base_, size_);
  }
}

}  // namespace strata
