// MemoryRegion: one start-up allocation backing a tier (the HBM arena, the pinned DRAM arena).
// Shared ownership lets DLPack exports keep the memory they point into alive after the runtime
// itself is destroyed; the last owner gives the memory back to the backend.
#pragma once

#include <cstdint>
#include <memory>

#include "backends/device/device_backend.h"
#include "runtime/types.h"

namespace strata {

class MemoryRegion {
 public:
  static Status allocate(std::shared_ptr<DeviceBackend> backend, Tier tier, uint64_t bytes,
                         std::shared_ptr<MemoryRegion>* out);
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  unsigned char* base() const { return static_cast<unsigned char*>(base_); }
  uint64_t size() const { return size_; }
  // Seconds the allocation took (pinning dominates on cuda).
  double setup_seconds() const { return setup_seconds_; }

 private:
  MemoryRegion(std::shared_ptr<DeviceBackend> backend, Tier tier, void* base, uint64_t size)
      : backend_(std::move(backend)), tier_(tier), base_(base), size_(size) {}

  std::shared_ptr<DeviceBackend> backend_;
  Tier tier_;
  void* base_;
  uint64_t size_;
  double setup_seconds_ = 0;
};

}  // namespace strata
