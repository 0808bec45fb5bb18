// Runtime: the core behind the C ABI. It owns the device backend, one arena per tier (each over
// a single start-up allocation), the tensor registry, and the migration engine: moves are
// submitted to the backend's per-direction copy queues and finished by their callbacks, which
// free the source block, update the registry and the link counters, and complete the event.
//
// Thread-safe: one mutex guards the registry and arenas; it is never held across a copy's data
// movement (synchronous reads and writes pin the tensor and copy outside the lock).
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "backends/device/device_backend.h"
#include "common/types.h"
#include "runtime/memory/arena.h"
#include "runtime/memory/completion.h"
#include "runtime/memory/host_buffers.h"
#include "runtime/memory/memory_region.h"
#include "runtime/memory/tensor_registry.h"
#include "runtime/nvme/nvme_tier.h"
#include "runtime/trace/trace.h"

namespace strata {

struct RuntimeOptions {
  DeviceOptions device;
  std::array<uint64_t, kTierCount> budgets{};  // 0 = the tier's default (NVMe: no tier)
  HostMemoryOptions dram;                      // NUMA placement and fault-in threads
  // The DRAM arena's pinned part from its start (rounded up to 4 KiB); 0 = all of it. The rest
  // is the unpinned arena, for the optimizer's state (Runtime::allocate_block).
  uint64_t dram_pinned = 0;
  NvmeOptions nvme;  // paths, engine, block size, queue depth...
};

struct LinkCounters {
  uint64_t bytes = 0;
  uint64_t transfers = 0;
  uint64_t busy_ns = 0;
};

struct TierUsage {
  uint64_t budget = 0;
  uint64_t used = 0;
  uint64_t largest_free = 0;
  uint64_t tensors = 0;
  // DRAM only: the pinned arena's budget and use, and the blocks of a role the GPU's copies
  // touch that went to the unpinned arena (Runtime::allocate_block) for want of pinned room.
  uint64_t pinned_budget = 0;
  uint64_t pinned_used = 0;
  uint64_t fallbacks = 0;
};

// What a DLPack export needs: the data, and a lease that keeps it in place and alive.
struct ExportLease {
  void* data = nullptr;
  Tier tier = Tier::kDram;
  bool pinned = false;  // DRAM: in the arena's pinned part (a DLPack export says kDLCUDAHost)
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  // Releases the lease when destroyed: the export count drops (if the runtime still exists)
  // and the memory region is let go.
  std::shared_ptr<void> keep_alive;
};

class Runtime : public std::enable_shared_from_this<Runtime> {
 public:
  static constexpr uint64_t kDefaultHostHbmBudget = 1ull << 30;
  static constexpr uint64_t kDefaultDramBudget = 1ull << 30;

  static Status create(const RuntimeOptions& options, std::shared_ptr<Runtime>* out);
  ~Runtime();

  // Stop the copy engines: waits for running copies, cancels queued ones. Returns how many were
  // cancelled. After it, no new work is accepted.
  std::size_t shutdown();

  const DeviceDescription& device() const { return backend_->description(); }
  const std::string& backend_reason() const { return backend_reason_; }
  int device_numa_node() const { return device_numa_node_; }
  bool tier_available(Tier tier) const { return arena(tier) != nullptr; }
  uint64_t tier_budget(Tier tier) const;
  // The DRAM arena's set-up: placement, fault-in and pinning times.
  const MemoryRegion& dram_region() const { return *regions_[static_cast<int>(Tier::kDram)]; }
  // The NVMe tier, if configured.
  const NvmeTier* nvme() const { return nvme_.get(); }
  // The host buffers a binding allocates beside its tensors, counted with the DRAM arena against
  // one host budget (host_buffers.h). Thread-safe on its own; freed with the runtime.
  HostBuffers& host_buffers() { return *host_buffers_; }

  // skew (DRAM only, a multiple of 64 below the arena's 4 KiB alignment): start the data that
  // far into its block. Arrays a kernel streams together at the same offset within a page
  // conflict in the caches (4K aliasing: the optimizer's update ran at under half speed);
  // giving each its own skew avoids that.
  // *zeroed (if given): the tensor's bytes are all zero, its block being DRAM that no tensor
  // held before (the arena is anonymous memory, zero until written, and nothing writes it
  // outside registered tensors' blocks). False for HBM and NVMe, whose memory is not cleared.
  Status register_tensor(TensorSpec spec, TensorId* id, uint64_t skew = 0, bool* zeroed = nullptr);
  Status find(std::string_view name, TensorId* id);
  Status unregister(TensorId id);
  Status info(TensorId id, TensorRecord* out);
  Status write(TensorId id, uint64_t offset, const void* src, uint64_t bytes);
  Status read(TensorId id, uint64_t offset, void* dst, uint64_t bytes);
  Status move(TensorId id, Tier dst, void* stream, std::shared_ptr<Completion>* completion);
  Status data_pointer(TensorId id, void** out);
  Status export_lease(TensorId id, ExportLease* out);

  TierUsage tier_usage(Tier tier);
  LinkCounters link_counters(Link link);
  void reset_link_counters();
  void synchronize();

  Tracer& tracer() { return tracer_; }
  // Names of all registered tensors, for trace files.
  std::vector<std::pair<uint64_t, std::string>> tensor_names();
  // Adds a completed copy to the link counters (and the trace, timed as ending now).
  void account(Link link, uint64_t bytes, uint64_t busy_ns);
  // The link counters only (for copies whose trace record the caller writes itself).
  void account_counters(Link link, uint64_t bytes, uint64_t busy_ns);

  // --- for the executor and planner ---
  const std::shared_ptr<DeviceBackend>& backend() const { return backend_; }
  NvmeTier* nvme_tier() { return nvme_.get(); }
  unsigned char* tier_base(Tier tier) const { return regions_[static_cast<int>(tier)]->base(); }
  // The DRAM arena's two parts over the one mapping: offsets below dram_pinned_size() are the
  // pinned arena's, the rest the unpinned one's. Which part a role's blocks go to is
  // dram_parts_for's rule. No block straddles the boundary: CUDA refuses a copy whose host
  // range spans a registered and an unregistered range.
  uint64_t dram_pinned_size() const { return dram_pinned_size_; }
  // The largest DRAM block a tensor of `role` gets in its preferred part, without falling back.
  uint64_t dram_largest_free_for(Role role);
  // Keeps a tensor where it is (moves and unregistration answer kBusy) while an executor
  // streams it; writes are still allowed (the optimizer updates masters in place).
  Status pin_in_place(TensorId id, const char* holder);
  void unpin(TensorId id);
  // A block of the HBM arena for the executor's slots, and its release.
  Status reserve_hbm(uint64_t bytes, const std::string& what, uint64_t* offset);
  void release_hbm(uint64_t offset);
  // The link probes (link_probe.cpp). Measures H2D and D2H with 64 MiB copies (or less, as the
  // arenas allow), device-timed; and NVMe reads of 256 MiB (or less) into DRAM, wall-timed.
  Status measure_links(double* h2d_bytes_per_second, double* d2h_bytes_per_second);
  Status measure_nvme_read(double* bytes_per_second);
  // The disk's read and write rates alone (bytes/s) and `mixed`: the time to read and write
  // the same bytes at once over the time to do them one after the other (0.5 .. 1).
  Status measure_nvme(double* read, double* write, double* mixed);
  // Executors of this runtime inside a step (step_begin .. step_end): their weights are being
  // streamed and updated, so checkpoints refuse to save or load (kInvalidState) until it is 0.
  void note_step(bool begun) { steps_in_progress_.fetch_add(begun ? 1 : -1); }
  int steps_in_progress() const { return steps_in_progress_.load(); }
  // Services that write registered tensors in the background after the call that asked for
  // it returned (an optimizer's updates): a checkpoint waits for all of them, whichever
  // optimizer it was given (none included), or it would save or load weights an update is
  // still writing. `wait` is called under the registry's own mutex, so remove_background_writer
  // (from the service's destructor) waits for a wait in progress; `wait` must not call back
  // into the registry.
  void add_background_writer(const void* key, std::function<void()> wait);
  void remove_background_writer(const void* key);
  void wait_for_background_writers();

 private:
  explicit Runtime(std::shared_ptr<DeviceBackend> backend) : backend_(std::move(backend)) {}

  Arena* arena(Tier tier) const;  // DRAM: the pinned arena
  // One part of the DRAM arena: its arena, the offset of its first byte from the tier's base,
  // and whether it is the unpinned part.
  struct DramPart {
    Arena& arena;
    uint64_t base;
    bool unpinned;
    const char* name() const { return unpinned ? "unpinned" : "pinned"; }
  };
  struct DramParts {
    DramPart preferred;
    std::optional<DramPart> fallback;  // none when the arena is not split
  };
  // The one rule for where a tensor of `role` lives in DRAM: the part its blocks go to first,
  // and the part they fall back to when that one is full. The optimizer's state (read and
  // written by the CPU's update only) prefers the unpinned part, every other role (what the
  // GPU's copies read or write) the pinned one. With no unpinned part (dram_pinned_bytes 0 or
  // the whole budget), every role is in the one pinned arena, with no fallback. Fixed at
  // create, so callable without mutex_ (the arenas themselves are used under it).
  DramParts dram_parts_for(Role role) const;
  // A block of `tier` for a tensor of `role` (DRAM: in dram_parts_for's preferred part, else
  // its fallback; a block falling back into the unpinned part is counted in dram_fallbacks_),
  // its offset from the tier's base; and its release. Under mutex_.
  Status allocate_block(Tier tier, Role role, uint64_t bytes, std::string_view what,
                        uint64_t* offset, bool* untouched = nullptr);
  Status free_block(Tier tier, uint64_t offset);
  static std::string busy_reason(const TensorRecord& t);
  Status check_tier(Tier tier) const;
  Status lookup(TensorId id, TensorRecord** out);  // under mutex_
  unsigned char* address(const TensorRecord& t) const;
  // Synchronous copy between host memory and the tensor, with the tensor pinned in place.
  Status copy_io(TensorId id, uint64_t offset, uint64_t bytes, const char* verb,
                 const std::function<Status(const TensorRecord&)>& copy);
  // Starts the transfer of a move whose destination is reserved; `finish` runs once.
  using FinishMove = std::function<void(Status, std::shared_ptr<Checksums>)>;
  Status start_transfer(const TensorRecord& t, Tier dst, uint64_t dst_offset, void* stream,
                        FinishMove finish, std::shared_ptr<DeviceFence>* fence);
  void finish_move(TensorId id, Tier dst, uint64_t dst_offset, Status status,
                   std::shared_ptr<Checksums> crcs, const std::shared_ptr<Completion>& completion,
                   uint64_t queued_ns);
  void release_export(TensorId id);

  std::shared_ptr<DeviceBackend> backend_;
  Tracer tracer_;  // before the tiers: their threads record into it until they stop
  std::string backend_reason_;
  int device_numa_node_ = -1;
  std::array<std::shared_ptr<MemoryRegion>, kTierCount> regions_;
  std::array<std::unique_ptr<Arena>, 2> arenas_;  // HBM and DRAM; NVMe's is the tier's own
  // The DRAM arena's unpinned part, its offsets from dram_pinned_size_ (null when all pinned).
  std::unique_ptr<Arena> dram_unpinned_;
  uint64_t dram_pinned_size_ = 0;
  uint64_t dram_fallbacks_ = 0;  // under mutex_
  std::unique_ptr<NvmeTier> nvme_;
  std::unique_ptr<HostBuffers> host_buffers_;  // the arena's size is its budget until set

  std::mutex mutex_;
  std::condition_variable idle_cv_;  // signalled when in_flight_ drops
  TensorRegistry registry_;
  std::array<uint64_t, kTierCount> tensors_in_tier_{};
  std::size_t in_flight_ = 0;
  bool shut_down_ = false;
  std::array<LinkCounters, kLinkCount> links_{};
  std::atomic<int> steps_in_progress_{0};
  std::mutex writers_mutex_;  // not mutex_: a wait takes as long as the updates it waits for
  std::vector<std::pair<const void*, std::function<void()>>> writers_;
};

}  // namespace strata
