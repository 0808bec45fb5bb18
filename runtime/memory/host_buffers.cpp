#include "runtime/memory/host_buffers.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>

#include "common/align.h"

namespace strata {
namespace {

// One counter for every runtime of the process: an id is never reused, and never another
// runtime's, so a stale or foreign handle cannot name a live buffer.
std::atomic<uint64_t> next_buffer_id{1};

std::string label(std::string_view name) {
  return name.empty() ? std::string("host buffer") : "host buffer '" + std::string(name) + "'";
}

}  // namespace

MachineMemory MachineMemory::now() {
  MachineMemory m;
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) m.total = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
  m.available = host_available_memory();
  return m;
}

uint64_t host_reserve_bytes(uint64_t total) {
  return total / 100 * kHostReservePercent;
}

Status check_machine_room(uint64_t bytes, const MachineMemory& machine, std::string_view what) {
  if (machine.total == 0 || machine.available == 0) return Status::ok();
  const uint64_t reserve = host_reserve_bytes(machine.total);
  if (machine.available >= reserve && bytes <= machine.available - reserve) return Status::ok();
  return error(Code::kOutOfMemory, label(what), ": ", bytes,
               " bytes would leave less than the reserve of ", reserve, " bytes (",
               kHostReservePercent, "% of the machine's ", machine.total,
               ") of host memory available: ", machine.available, " bytes are available now");
}

HostBuffers::HostBuffers(std::shared_ptr<DeviceBackend> backend, HostMemoryOptions options,
                         uint64_t arena_bytes)
    : backend_(std::move(backend)), options_(options), arena_(arena_bytes), budget_(arena_bytes) {}

Status HostBuffers::set_budget(uint64_t total) {
  if (total < arena_) {
    return error(Code::kInvalidArgument, "host budget of ", total,
                 " bytes is below the DRAM arena's ", arena_,
                 " bytes, which it includes (the arena and the host buffers together)");
  }
  std::lock_guard lock(mutex_);
  budget_ = total;
  return Status::ok();
}

uint64_t HostBuffers::room_locked() const {
  const uint64_t held = arena_ + charged_;
  return budget_ > held ? budget_ - held : 0;
}

Status HostBuffers::create(uint64_t bytes, std::string_view name, uint64_t* id) {
  if (bytes == 0) return error(Code::kInvalidArgument, label(name), " of 0 bytes");
  const uint64_t charged = align_up(bytes, kPage);
  if (charged == 0) {
    return error(Code::kInvalidArgument, label(name), " of ", bytes,
                 " bytes overflows when rounded up to the page");
  }
  {
    std::lock_guard lock(mutex_);
    const uint64_t room = room_locked();
    if (charged > room) {
      return error(Code::kOutOfMemory, label(name), ": ", charged,
                   " bytes (rounded up to 4 KiB) exceed the host budget's room: budget ", budget_,
                   " bytes, the DRAM arena ", arena_, ", host buffers ", charged_, " in ",
                   live_.size(), ", room ", room,
                   " (raise the host budget: strata_runtime_set_host_budget)");
    }
    charged_ += charged;  // reserved while the mapping is made, outside the lock
  }
  auto give_back = [&] {
    std::lock_guard lock(mutex_);
    charged_ -= charged;
  };
  Status machine = check_machine_room(charged, MachineMemory::now(), name);
  std::shared_ptr<MemoryRegion> region;
  if (machine.is_ok()) {
    HostMemoryOptions options = options_;
    // No more fault-in threads than chunks (host_memory.h): a checkpoint's buffer of a few
    // MiB is one chunk, and starting a thread per core for it costs more than the fault-in.
    const uint64_t chunks = (charged + kFaultChunkBytes - 1) / kFaultChunkBytes;
    const unsigned cores = options.threads != 0 ? options.threads : usable_cores();
    options.threads = static_cast<unsigned>(std::min<uint64_t>(cores, chunks));
    machine = MemoryRegion::allocate_host(backend_, charged, charged, options, &region);
  }
  if (!machine.is_ok()) {
    give_back();
    return machine;
  }
  const uint64_t handle = next_buffer_id.fetch_add(1);
  std::lock_guard lock(mutex_);
  live_.emplace(handle, Buffer{std::move(region), bytes, charged, std::string(name)});
  *id = handle;
  return Status::ok();
}

Status HostBuffers::not_found(uint64_t id) const {
  return error(Code::kNotFound, "host buffer handle ", id,
               " is not a live host buffer of this runtime (freed already, another runtime's, "
               "or never made)");
}

Status HostBuffers::info(uint64_t id, HostBufferInfo* out) {
  std::lock_guard lock(mutex_);
  auto found = live_.find(id);
  if (found == live_.end()) return not_found(id);
  const Buffer& b = found->second;
  out->data = b.region->base();
  out->bytes = b.bytes;
  out->charged = b.charged;
  out->pinned = backend_->description().kind == DeviceKind::kCuda;
  out->numa_node = b.region->host_report().node;
  return Status::ok();
}

Status HostBuffers::destroy(uint64_t id) {
  std::shared_ptr<MemoryRegion> region;
  uint64_t charged = 0;
  {
    std::lock_guard lock(mutex_);
    auto found = live_.find(id);
    if (found == live_.end()) return not_found(id);
    region = std::move(found->second.region);
    charged = found->second.charged;
    live_.erase(found);
  }
  // Unpinned and unmapped outside the lock, and only then is the room given back: a buffer made
  // meanwhile never finds the memory still taken.
  region.reset();
  std::lock_guard lock(mutex_);
  charged_ -= charged;
  return Status::ok();
}

HostBudgetUsage HostBuffers::usage() {
  const MachineMemory machine = MachineMemory::now();
  std::lock_guard lock(mutex_);
  HostBudgetUsage u;
  u.budget = budget_;
  u.arena = arena_;
  u.buffers = charged_;
  u.count = live_.size();
  u.room = room_locked();
  u.reserve = host_reserve_bytes(machine.total);
  u.available = machine.available;
  return u;
}

}  // namespace strata
