// HostBuffers: host memory a binding asks of the runtime beside its tensors (the block
// checkpoints it spills, the resident parameters' optimizer state it pages out, host replicas
// and staging), so that every host byte a run takes is the runtime's: made the way the DRAM
// arena is (one mapping per buffer, NUMA-placed on the device's node, faulted in by threads
// while the backend pins it: MemoryRegion::allocate_host; ordinary memory on the host backend)
// and counted with the arena against one host budget.
//
// The budget is the whole host budget: the DRAM arena (fixed at the runtime's creation) and the
// live buffers together. Until set_budget it is the arena alone, so a buffer needs a budget
// given room for it. A buffer is charged its bytes rounded up to the page (4 KiB: what the
// mapping takes). Besides the budget, a buffer must leave kReserveShare of the machine's memory
// available (below).
//
// Handles are ids from one process-wide counter, never reused: an id freed already, one of
// another runtime, or one never made is answered kNotFound, never a crash or another buffer.
//
// Thread-safe: one mutex guards the budget and the table; a buffer's mapping, fault-in and
// pinning run outside it (its bytes are reserved in the budget first), so threads allocate at
// once.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "backends/device/device_backend.h"
#include "backends/memory/host_memory.h"
#include "runtime/memory/memory_region.h"

namespace strata {

// Of the machine's memory (MemTotal), the share in percent a new host buffer must leave available
// (MemAvailable after it): the OS, the page cache the NVMe tier and the checkpoints' files
// read through, the framework's own host memory and other processes need room that no budget
// of ours counts; a pinned buffer that takes it makes the kernel reclaim or kill instead of
// the runtime refusing. 10%: strata.torch's rule for its spill buffers before the runtime
// owned them (HOST_RESERVE, 10%), kept. strata.h's STRATA_HOST_RESERVE_PERCENT mirrors it
// (lib/abi_mirrors.cpp checks).
inline constexpr uint64_t kHostReservePercent = 10;

// The machine figures a buffer is judged against (MemTotal and MemAvailable; 0: unknown).
struct MachineMemory {
  uint64_t total = 0;
  uint64_t available = 0;
  static MachineMemory now();
};

// The bytes of the machine's memory a buffer must leave available: kHostReservePercent of
// `total` (0 when unknown).
uint64_t host_reserve_bytes(uint64_t total);

// kOutOfMemory when a buffer of `bytes` would leave less than the reserve of `machine`'s memory
// available (nothing is refused when the figures are unknown). `what` names the buffer.
Status check_machine_room(uint64_t bytes, const MachineMemory& machine, std::string_view what);

struct HostBufferInfo {
  void* data = nullptr;
  uint64_t bytes = 0;    // as asked
  uint64_t charged = 0;  // counted against the budget: bytes rounded up to the page
  bool pinned = false;   // registered with the device (cuda); false on the host backend
  int numa_node = -1;    // the node its pages were bound to; -1 interleaved or unbound
};

struct HostBudgetUsage {
  uint64_t budget = 0;     // the whole host budget: the arena and the buffers
  uint64_t arena = 0;      // the DRAM arena's bytes
  uint64_t buffers = 0;    // charged to the live buffers (and to those being made)
  uint64_t count = 0;      // live buffers
  uint64_t room = 0;       // what one more buffer may be charged now: budget - arena - buffers
  uint64_t reserve = 0;    // machine memory a buffer must leave available
  uint64_t available = 0;  // the machine's MemAvailable now (0: unknown)
};

class HostBuffers {
 public:
  static constexpr uint64_t kPage = 4096;

  HostBuffers(std::shared_ptr<DeviceBackend> backend, HostMemoryOptions options,
              uint64_t arena_bytes);
  HostBuffers(const HostBuffers&) = delete;
  HostBuffers& operator=(const HostBuffers&) = delete;

  // The whole host budget (arena included). Below the arena: kInvalidArgument. Below what the
  // arena and the live buffers hold: accepted, nothing is taken back, new buffers are refused
  // until enough are freed.
  Status set_budget(uint64_t total);
  // A new buffer of `bytes` (> 0), every byte zero; *id its handle. kOutOfMemory when the budget
  // has no room (naming budget, arena, buffers and room) or the machine would keep less than
  // its reserve available; the backend's error if pinning fails.
  Status create(uint64_t bytes, std::string_view name, uint64_t* id);
  Status info(uint64_t id, HostBufferInfo* out);
  // Unmaps the buffer (unpinned first) and returns its charge to the budget.
  Status destroy(uint64_t id);
  HostBudgetUsage usage();

 private:
  struct Buffer {
    std::shared_ptr<MemoryRegion> region;
    uint64_t bytes = 0;
    uint64_t charged = 0;
    std::string name;
  };
  uint64_t room_locked() const;
  Status not_found(uint64_t id) const;

  const std::shared_ptr<DeviceBackend> backend_;
  const HostMemoryOptions options_;
  const uint64_t arena_;
  std::mutex mutex_;
  uint64_t budget_;                            // under mutex_
  uint64_t charged_ = 0;                       // under mutex_: live buffers' and those being made
  std::unordered_map<uint64_t, Buffer> live_;  // under mutex_
};

}  // namespace strata
