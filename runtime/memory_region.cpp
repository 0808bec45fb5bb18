#include "runtime/memory_region.h"

#include <chrono>

namespace strata {

Status MemoryRegion::allocate(std::shared_ptr<DeviceBackend> backend, Tier tier, uint64_t bytes,
                              std::shared_ptr<MemoryRegion>* out) {
  const auto start = std::chrono::steady_clock::now();
  void* base = nullptr;
  if (tier == Tier::kHbm) {
    STRATA_RETURN_IF_ERROR(backend->allocate_device(bytes, &base));
  } else if (tier == Tier::kDram) {
    STRATA_RETURN_IF_ERROR(backend->allocate_pinned_host(bytes, &base));
  } else {
    return error(Code::kUnsupported, "tier ", tier_name(tier), " has no memory region");
  }
  std::shared_ptr<MemoryRegion> region(new MemoryRegion(std::move(backend), tier, base, bytes));
  region->setup_seconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  *out = std::move(region);
  return Status::ok();
}

MemoryRegion::~MemoryRegion() {
  if (tier_ == Tier::kHbm) {
    backend_->free_device(base_, size_);
  } else {
    backend_->free_pinned_host(base_, size_);
  }
}

}  // namespace strata
