// The link probes: the rates a plan uses when its config gives none, measured on this runtime's
// own memory (scratch blocks of its arenas, given back afterwards). Runtime's members, kept
// apart from the registry and the migration engine in runtime.cpp.
#include <algorithm>
#include <chrono>

#include "common/clock.h"
#include "runtime/runtime.h"

namespace strata {

namespace {
// Runs `n` copies of `bytes` in `direction` and returns the best device-timed rate.
Status time_copies(DeviceBackend& backend, CopyDirection direction, void* dst, const void* src,
                   uint64_t bytes, int n, double* rate) {
  double best = 0;
  for (int i = 0; i < n; ++i) {
    auto done = std::make_shared<Completion>();
    uint64_t busy = 0;
    CopyRequest r;
    r.direction = direction;
    r.dst = dst;
    r.src = src;
    r.bytes = bytes;
    r.on_complete = [done, &busy](CopyResult result) {
      busy = result.busy_ns;
      done->complete(std::move(result.status));
    };
    STRATA_RETURN_IF_ERROR(backend.submit_copy(std::move(r), nullptr));
    STRATA_RETURN_IF_ERROR(done->wait(-1));
    if (i > 0 && busy > 0)
      best = std::max(best, static_cast<double>(bytes) * 1e9 / static_cast<double>(busy));
  }
  *rate = best;
  return Status::ok();
}
}  // namespace

Status Runtime::measure_links(double* h2d, double* d2h) {
  uint64_t hbm_offset = 0, dram_offset = 0, bytes = 64ull << 20;
  {
    std::lock_guard lock(mutex_);
    bytes = std::min(
        {bytes, arena(Tier::kHbm)->largest_free() / 2, arena(Tier::kDram)->largest_free() / 2});
    bytes = bytes / NvmeTier::kAlignment * NvmeTier::kAlignment;
    if (bytes < NvmeTier::kAlignment) {
      return error(Code::kOutOfMemory,
                   "no free HBM or DRAM to measure the links with; give the "
                   "link speeds in the plan config instead");
    }
    STRATA_RETURN_IF_ERROR(arena(Tier::kHbm)->allocate(bytes, "link measurement", &hbm_offset));
    Status s = arena(Tier::kDram)->allocate(bytes, "link measurement", &dram_offset);
    if (!s.is_ok()) {
      (void)arena(Tier::kHbm)->free(hbm_offset);
      return s;
    }
  }
  unsigned char* device = tier_base(Tier::kHbm) + hbm_offset;
  unsigned char* host = tier_base(Tier::kDram) + dram_offset;
  Status s = time_copies(*backend_, CopyDirection::kHostToDevice, device, host, bytes, 4, h2d);
  if (s.is_ok())
    s = time_copies(*backend_, CopyDirection::kDeviceToHost, host, device, bytes, 4, d2h);
  std::lock_guard lock(mutex_);
  (void)arena(Tier::kHbm)->free(hbm_offset);
  (void)arena(Tier::kDram)->free(dram_offset);
  return s;
}

Status Runtime::measure_nvme_read(double* rate) {
  if (!nvme_) return error(Code::kUnsupported, "no nvme tier");
  // The buffer is in the DRAM part the optimizer's state lives in (the unpinned one if the
  // arena is split), as the state's NVMe staging slots are: that is where a split arena has its
  // room, the pinned part being sized for what the GPU's copies touch, with little slack (a
  // probe there would shrink to what is left, or fail).
  const DramPart dram = dram_parts_for(Role::kOptimizerState).preferred;
  uint64_t extent = 0, dram_offset = 0, bytes = 256ull << 20;
  {
    std::lock_guard lock(mutex_);
    bytes = std::min({bytes, nvme_->extents().largest_free(), dram.arena.largest_free()});
    bytes = bytes / NvmeTier::kAlignment * NvmeTier::kAlignment;
    if (bytes < NvmeTier::kAlignment) {
      return error(Code::kOutOfMemory, "no free NVMe or DRAM space to measure NVMe reads with");
    }
    STRATA_RETURN_IF_ERROR(nvme_->extents().allocate(bytes, "nvme measurement", &extent));
    Status s = dram.arena.allocate(bytes, "nvme measurement", &dram_offset);
    if (!s.is_ok()) {
      (void)nvme_->extents().free(extent);
      return s;
    }
  }
  auto done = std::make_shared<Completion>();
  const auto start = std::chrono::steady_clock::now();
  nvme_->read_to_host("(nvme measurement)", tier_base(Tier::kDram) + dram.base + dram_offset,
                      extent, bytes, nullptr, [done](Status st) { done->complete(std::move(st)); });
  Status s = done->wait(-1);
  const double seconds = seconds_since(start);
  *rate = seconds > 0 ? static_cast<double>(bytes) / seconds : 0;
  std::lock_guard lock(mutex_);
  (void)nvme_->extents().free(extent);
  (void)dram.arena.free(dram_offset);
  return s;
}

Status Runtime::measure_nvme(double* read, double* write, double* mixed) {
  if (!nvme_) return error(Code::kUnsupported, "no nvme tier");
  // Two regions of `span` bytes on the disk, moved through two DRAM buffers of `chunk` bytes
  // (a chunk at a time per buffer: each chunk's pieces are all in flight, and no two reads
  // land in one buffer at once): one region written, then read alone, then read while the
  // other is written. A virtual disk's first GiB can run well above what it sustains (1 GiB
  // probes read 1.5-2.7 GB/s on one machine within minutes, while steps moving 40 GB sustained
  // 2.0-2.1), so the span is 4 GiB where the tier has it, and DRAM holds only the chunks, in
  // the part the optimizer's state lives in (measure_nvme_read says why).
  const DramPart dram = dram_parts_for(Role::kOptimizerState).preferred;
  uint64_t extent = 0, dram_offset = 0, span = 4ull << 30, chunk = 256ull << 20;
  {
    std::lock_guard lock(mutex_);
    span = std::min(span, nvme_->extents().largest_free() / 2);
    chunk = std::min(chunk, dram.arena.largest_free() / 2);
    chunk = chunk / NvmeTier::kAlignment * NvmeTier::kAlignment;
    span = chunk == 0 ? 0 : span / chunk * chunk;
    if (chunk == 0 || span == 0) {
      return error(Code::kOutOfMemory, "no free NVMe or DRAM space to measure the disk with");
    }
    STRATA_RETURN_IF_ERROR(nvme_->extents().allocate(2 * span, "nvme measurement", &extent));
    Status s = dram.arena.allocate(2 * chunk, "nvme measurement", &dram_offset);
    if (!s.is_ok()) {
      (void)nvme_->extents().free(extent);
      return s;
    }
  }
  unsigned char* host = tier_base(Tier::kDram) + dram.base + dram_offset;
  // Chunk `at` of region `half`, written from (or read into) DRAM buffer `half`.
  auto submit = [&](bool writing, uint64_t half, uint64_t at,
                    std::vector<std::shared_ptr<Completion>>* out) {
    auto done = std::make_shared<Completion>();
    auto finish = [done](Status st) { done->complete(std::move(st)); };
    const uint64_t where = extent + half * span + at;
    if (writing) {
      nvme_->write_from_host("(nvme measurement)", host + half * chunk, where, chunk, nullptr,
                             finish);
    } else {
      nvme_->read_to_host("(nvme measurement)", host + half * chunk, where, chunk, nullptr, finish);
    }
    out->push_back(std::move(done));
  };
  auto wait_all = [](std::vector<std::shared_ptr<Completion>>& all) {
    Status first = Status::ok();
    for (auto& d : all) {
      Status s = d->wait(-1);
      if (first.is_ok() && !s.is_ok()) first = std::move(s);
    }
    all.clear();
    return first;
  };
  // One phase: for each chunk, the given (writing, half) transfers at once.
  auto phase = [&](std::initializer_list<std::pair<bool, uint64_t>> moves) {
    std::vector<std::shared_ptr<Completion>> pending;
    for (uint64_t at = 0; at < span; at += chunk) {
      for (auto [writing, half] : moves) submit(writing, half, at, &pending);
      STRATA_RETURN_IF_ERROR(wait_all(pending));
    }
    return Status::ok();
  };
  Status s = Status::ok();
  double t_write = 0, t_read = 0, t_both = 0;
  {
    auto start = std::chrono::steady_clock::now();
    // Both regions get written (the second one is read from in the mixed run).
    s = phase({{true, 0}, {true, 1}});
    t_write = seconds_since(start) / 2;
    if (s.is_ok()) {
      start = std::chrono::steady_clock::now();
      s = phase({{false, 0}});
      t_read = seconds_since(start);
    }
    if (s.is_ok()) {
      start = std::chrono::steady_clock::now();
      s = phase({{false, 1}, {true, 0}});
      t_both = seconds_since(start);
    }
  }
  if (s.is_ok()) {
    *write = t_write > 0 ? static_cast<double>(span) / t_write : 0;
    *read = t_read > 0 ? static_cast<double>(span) / t_read : 0;
    const double serial = t_read + t_write;
    *mixed = serial > 0 ? std::clamp(t_both / serial, 0.5, 1.0) : 1.0;
  }
  std::lock_guard lock(mutex_);
  (void)nvme_->extents().free(extent);
  (void)dram.arena.free(dram_offset);
  return s;
}

}  // namespace strata
