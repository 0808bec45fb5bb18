// MemoryRegion: one start-up allocation backing a tier (the HBM arena, the pinned DRAM arena).
// Shared ownership lets DLPack exports keep the memory they point into alive after the runtime
// itself is destroyed; the last owner gives the memory back.
#pragma once

#include <cstdint>
#include <memory>

#include "backends/device/device_backend.h"
#include "backends/memory/host_memory.h"
#include "common/types.h"

namespace strata {

class MemoryRegion {
 public:
  // The HBM arena: one device allocation.
  static Status allocate_device(std::shared_ptr<DeviceBackend> backend, uint64_t bytes,
                                std::shared_ptr<MemoryRegion>* out);
  // The DRAM arena: host memory mapped, NUMA-placed and faulted in, its first `pinned` bytes
  // (at most `bytes`, a multiple of the page size) pinned by the backend while it is faulted in;
  // the rest is resident but never registered.
  static Status allocate_host(std::shared_ptr<DeviceBackend> backend, uint64_t bytes,
                              uint64_t pinned, const HostMemoryOptions& options,
                              std::shared_ptr<MemoryRegion>* out);
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  unsigned char* base() const { return static_cast<unsigned char*>(base_); }
  uint64_t size() const { return size_; }
  // How the DRAM arena was set up (empty for HBM).
  const HostMemoryReport& host_report() const { return host_report_; }
  // Seconds pinning the DRAM arena added after its fault-in ended (0 for HBM): the arena's
  // set-up took host_report().fault_seconds + pin_seconds().
  double pin_seconds() const { return host_report_.pin_seconds; }
  // The bytes registered with the device from base(): size() unless the DRAM arena was asked to
  // pin less (0 for HBM).
  uint64_t pinned_bytes() const { return pinned_; }

 private:
  MemoryRegion(std::shared_ptr<DeviceBackend> backend, Tier tier, void* base, uint64_t size)
      : backend_(std::move(backend)), tier_(tier), base_(base), size_(size) {}

  std::shared_ptr<DeviceBackend> backend_;
  Tier tier_;
  void* base_;
  uint64_t size_;
  uint64_t pinned_ = 0;
  HostMemoryReport host_report_;
};

}  // namespace strata
