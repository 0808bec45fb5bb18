#include "runtime/memory/memory_region.h"

#include <chrono>

#include "common/clock.h"

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
  STRATA_RETURN_IF_ERROR(map_host_memory(bytes, options, &base, &report));
  const auto pin_start = std::chrono::steady_clock::now();
  Status pinned = backend->pin_host(base, bytes);
  if (!pinned.is_ok()) {
    unmap_host_memory(base, bytes);
    return pinned;
  }
  std::shared_ptr<MemoryRegion> region(
      new MemoryRegion(std::move(backend), Tier::kDram, base, bytes));
  region->host_report_ = std::move(report);
  region->pin_seconds_ = seconds_since(pin_start);
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
