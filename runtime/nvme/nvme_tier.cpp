#include "runtime/nvme/nvme_tier.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/crc32c.h"
#include "common/hex.h"
#include "common/spawn.h"

namespace strata {
namespace {

// Completion state of the pieces of one transfer; the worker waits on it piece by piece.
class PieceTracker {
 public:
  explicit PieceTracker(std::size_t n) : done_(n, false), status_(n) {}
  // Notifies under the lock: the tracker lives on the waiter's stack, and a waiter that saw
  // its piece done may return and destroy it the moment the lock is free.
  void complete(std::size_t i, Status s) {
    std::lock_guard lock(mutex_);
    status_[i] = std::move(s);
    done_[i] = true;
    cv_.notify_all();
  }
  Status wait(std::size_t i) {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return done_[i]; });
    return status_[i];
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<bool> done_;
  std::vector<Status> status_;
};

struct AlignedBuffer {
  explicit AlignedBuffer(uint64_t bytes) {
    if (posix_memalign(&ptr, NvmeTier::kAlignment, bytes) != 0) ptr = nullptr;
  }
  AlignedBuffer(AlignedBuffer&& other) noexcept : ptr(other.ptr) { other.ptr = nullptr; }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(AlignedBuffer&&) = delete;
  ~AlignedBuffer() { std::free(ptr); }
  unsigned char* data() const { return static_cast<unsigned char*>(ptr); }
  void* ptr = nullptr;
};

}  // namespace

// One direction's transfer thread: runs jobs in order; blocking waits are fine here.
class NvmeTier::Worker {
 public:
  ~Worker() { shutdown(); }

  // A thread the OS refuses is OUT_OF_MEMORY naming it (the tier's destructor stops the other).
  Status start(const char* what) {
    return spawn_thread(
        what, [this] { run(); }, &thread_);
  }

  void push(Job job) {
    {
      std::lock_guard lock(mutex_);
      if (!stopping_) {
        jobs_.push_back(std::move(job));
        cv_.notify_one();
        return;
      }
    }
    job.done(error(Code::kCancelled, "nvme transfer refused: the runtime is shutting down"));
  }

  std::size_t shutdown() {
    std::deque<Job> cancelled;
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return 0;
      stopping_ = true;
      cancelled.swap(jobs_);
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    for (Job& job : cancelled) {
      job.done(error(Code::kCancelled,
                     "nvme transfer cancelled: the runtime was destroyed before it started"));
    }
    return cancelled.size();
  }

 private:
  void run() {
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (stopping_) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      Status s = job.body();
      job.done(std::move(s));
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  std::thread thread_;
};

Status NvmeTier::check_io_options(const NvmeOptions& options) {
  if (options.block_size < kAlignment || options.block_size % kAlignment != 0 ||
      options.block_size > (1u << 30)) {
    return error(Code::kInvalidArgument, "io_block_size ", options.block_size,
                 " must be a multiple of 4096 between 4096 and 1 GiB");
  }
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    return error(Code::kInvalidArgument, "io_queue_depth ", options.queue_depth,
                 " must be between 1 and 4096");
  }
  return Status::ok();
}

Status NvmeTier::create(const NvmeOptions& options, std::shared_ptr<DeviceBackend> device,
                        std::pair<void*, uint64_t> dram, const HostMemoryOptions& staging_memory,
                        AccountCopy account, std::unique_ptr<NvmeTier>* out,
                        IoRequestHook on_request) {
  if (options.paths.empty()) return error(Code::kInvalidArgument, "no nvme paths given");
  STRATA_RETURN_IF_ERROR(check_io_options(options));
  std::unique_ptr<NvmeTier> tier(new NvmeTier());
  tier->options_ = options;
  tier->device_ = std::move(device);
  tier->account_ = std::move(account);
  const uint64_t n = options.paths.size();
  const uint64_t block = options.block_size;
  // Without `budget + block * n - 1`, which wraps for a budget near 2^64.
  const uint64_t stripes = options.budget / (block * n) + (options.budget % (block * n) != 0);
  tier->file_size_ = std::max<uint64_t>(stripes, 1) * block;
  STRATA_RETURN_IF_ERROR(open_storage_files(options.paths, tier->file_size_, &tier->files_));
  tier->extents_ = std::make_unique<Arena>("nvme", options.budget, kAlignment);

  // Bounce slots for the HBM <-> NVMe pipeline, pinned like the DRAM arena.
  tier->slots_ = options.queue_depth;
  tier->staging_bytes_ = 2ull * tier->slots_ * block;
  HostMemoryReport report;
  DeviceBackend* pinning = tier->device_.get();
  Status mapped = map_host_memory(
      tier->staging_bytes_, staging_memory, &tier->staging_, &report,
      [pinning](void* ptr, uint64_t bytes) { return pinning->pin_host(ptr, bytes); });
  if (!mapped.is_ok()) {
    tier->staging_ = nullptr;
    close_storage_files(&tier->files_);
    return mapped;
  }
  tier->to_disk_slots_ = static_cast<unsigned char*>(tier->staging_);
  tier->from_disk_slots_ = tier->to_disk_slots_ + static_cast<uint64_t>(tier->slots_) * block;

  StorageEngineOptions engine_options;
  engine_options.queue_depth = options.queue_depth;
  // Fixed buffers are what io_uring reads into and writes from: the staging slots always, the
  // DRAM arena only with direct_dram (by default DRAM <-> NVMe goes through the slots).
  // Registering pins every page again (the kernel's own pin, beside CUDA's): for the whole
  // arena that is a second pass over hundreds of GB at set-up, for buffers never used.
  engine_options.buffers = {{tier->staging_, tier->staging_bytes_}};
  if (options.direct_dram) engine_options.buffers.push_back(dram);
  engine_options.fault_hook = options.fault_hook;
  engine_options.on_request = std::move(on_request);
  Status engine = create_storage_engine(options.engine, tier->files_.files, engine_options,
                                        &tier->engine_, &tier->engine_reason_);
  if (!engine.is_ok()) {
    tier->device_->unpin_host(tier->staging_, tier->staging_bytes_);
    unmap_host_memory(tier->staging_, tier->staging_bytes_);
    tier->staging_ = nullptr;
    close_storage_files(&tier->files_);
    return engine;
  }
  tier->engine_name_ = tier->engine_->name();
  tier->to_disk_ = std::make_unique<Worker>();
  tier->from_disk_ = std::make_unique<Worker>();
  STRATA_RETURN_IF_ERROR(tier->to_disk_->start("an nvme write"));
  STRATA_RETURN_IF_ERROR(tier->from_disk_->start("an nvme read"));
  *out = std::move(tier);
  return Status::ok();
}

NvmeTier::~NvmeTier() {
  shutdown();
  if (staging_ != nullptr) {
    device_->unpin_host(staging_, staging_bytes_);
    unmap_host_memory(staging_, staging_bytes_);
  }
  close_storage_files(&files_);
}

std::size_t NvmeTier::shutdown() {
  std::size_t cancelled = 0;
  if (to_disk_) cancelled += to_disk_->shutdown();
  if (from_disk_) cancelled += from_disk_->shutdown();
  if (engine_) engine_->shutdown();
  return cancelled;
}

// Logical offset L lives in stripe L / B, which is on file (L / B) % N at ((L / B) / N) * B.
std::vector<NvmeTier::Piece> NvmeTier::pieces(uint64_t extent, uint64_t len) const {
  const uint64_t block = options_.block_size;
  const uint64_t n = files_.files.size();
  std::vector<Piece> out;
  for (uint64_t at = extent; at < extent + len;) {
    const uint64_t stripe = at / block;
    const uint64_t end = std::min(extent + len, (stripe + 1) * block);
    out.push_back(Piece{out.size(), at - extent, end - at, static_cast<int>(stripe % n),
                        (stripe / n) * block + at % block});
    at = end;
  }
  return out;
}

std::size_t NvmeTier::piece_count(uint64_t extent, uint64_t len) const {
  return pieces(extent, len).size();
}

Status NvmeTier::submit_io(IoOp op, const Piece& p, unsigned char* buf,
                           std::function<void(Status)> done) {
  IoRequest r;
  r.op = op;
  r.file = p.file;
  r.offset = p.file_offset;
  r.buf = buf;
  r.len = p.len;
  r.done = std::move(done);
  return engine_->submit(std::move(r));
}

Status NvmeTier::io_sync(IoOp op, const Piece& p, unsigned char* buf) {
  PieceTracker t(1);
  STRATA_RETURN_IF_ERROR(submit_io(op, p, buf, [&t](Status s) { t.complete(0, std::move(s)); }));
  return t.wait(0);
}

Status NvmeTier::copy_sync(CopyDirection dir, void* dst, const void* src, uint64_t bytes) {
  PieceTracker t(1);
  uint64_t busy = 0;
  CopyRequest c;
  c.direction = dir;
  c.dst = dst;
  c.src = src;
  c.bytes = bytes;
  c.on_complete = [&](CopyResult r) {
    busy = r.busy_ns;
    t.complete(0, std::move(r.status));
  };
  STRATA_RETURN_IF_ERROR(device_->submit_copy(std::move(c), nullptr));
  Status s = t.wait(0);
  if (s.is_ok()) {
    account_(dir == CopyDirection::kHostToDevice ? Link::kH2D : Link::kD2H, bytes, busy);
  }
  return s;
}

Status NvmeTier::verify(const std::string& tensor, const Piece& p, const unsigned char* data,
                        const Checksums* crcs) const {
  if (!options_.checksums || crcs == nullptr || !crcs->valid[p.index]) return Status::ok();
  const uint32_t actual = crc32c(data, p.len);
  const uint32_t expected = crcs->crc[p.index];
  if (actual == expected) return Status::ok();
  return error(Code::kDataCorruption, "tensor '", tensor, "': checksum mismatch in bytes [", p.rel,
               ", ", p.rel + p.len, ") read from ", files_.files[p.file].path, " at offset ",
               p.file_offset, ": stored crc32c 0x", hex8(expected), ", read 0x", hex8(actual));
}

Status NvmeTier::run_direct(IoOp op, const std::string& tensor, unsigned char* host,
                            uint64_t extent, uint64_t len, Checksums* written,
                            const Checksums* expected) {
  const bool write = op == IoOp::kWrite;
  const auto ps = pieces(extent, len);
  if (written != nullptr) written->reset(ps.size());
  PieceTracker t(ps.size());
  std::size_t issued = 0;
  Status first;
  for (const Piece& p : ps) {
    if (options_.checksums && written != nullptr)
      written->set(p.index, crc32c(host + p.rel, p.len));
    Status s = submit_io(op, p, host + p.rel,
                         [&t, i = p.index](Status r) { t.complete(i, std::move(r)); });
    if (!s.is_ok()) {
      first = s;
      break;
    }
    ++issued;
  }
  // Reads check each piece as it lands, while later pieces are still on their way.
  for (std::size_t i = 0; i < issued; ++i) {
    Status s = t.wait(i);
    if (s.is_ok() && !write) s = verify(tensor, ps[i], host + ps[i].rel, expected);
    if (first.is_ok() && !s.is_ok()) first = s;
  }
  return first;
}

Status NvmeTier::run_staged_write(const unsigned char* src, uint64_t nbytes, uint64_t extent,
                                  uint64_t len, Checksums* crcs, const CopyFn& copy_in) {
  const auto ps = pieces(extent, len);
  if (crcs != nullptr) crcs->reset(ps.size());
  PieceTracker t(ps.size());
  const uint64_t block = options_.block_size;
  std::size_t issued = 0;
  Status first;
  for (const Piece& p : ps) {
    // The slot is free once the write that used it last has finished.
    if (p.index >= slots_) {
      Status s = t.wait(p.index - slots_);
      if (!s.is_ok()) {
        first = s;
        break;
      }
    }
    unsigned char* slot = to_disk_slots_ + (p.index % slots_) * block;
    const uint64_t real = p.rel < nbytes ? std::min(p.len, nbytes - p.rel) : 0;
    if (real > 0) {
      Status s = copy_in(slot, src + p.rel, real);
      if (!s.is_ok()) {
        first = s;
        break;
      }
    }
    if (real < p.len) std::memset(slot + real, 0, p.len - real);  // deterministic padding
    if (options_.checksums && crcs != nullptr) crcs->set(p.index, crc32c(slot, p.len));
    Status s = submit_io(IoOp::kWrite, p, slot,
                         [&t, i = p.index](Status r) { t.complete(i, std::move(r)); });
    if (!s.is_ok()) {
      first = s;
      break;
    }
    issued = p.index + 1;
  }
  for (std::size_t i = 0; i < issued; ++i) {
    Status s = t.wait(i);
    if (first.is_ok() && !s.is_ok()) first = s;
  }
  return first;
}

Status NvmeTier::run_staged_read(const std::string& tensor, unsigned char* dst, uint64_t nbytes,
                                 uint64_t extent, uint64_t len, const Checksums* crcs,
                                 const CopyFn& copy_out) {
  const auto ps = pieces(extent, len);
  PieceTracker t(ps.size());
  const uint64_t block = options_.block_size;
  auto slot_of = [&](std::size_t i) { return from_disk_slots_ + (i % slots_) * block; };
  auto issue = [&](std::size_t i) {
    return submit_io(IoOp::kRead, ps[i], slot_of(i),
                     [&t, i](Status r) { t.complete(i, std::move(r)); });
  };
  std::size_t issued = 0;
  Status first;
  for (; issued < std::min<std::size_t>(slots_, ps.size()); ++issued) {
    first = issue(issued);
    if (!first.is_ok()) break;
  }
  for (std::size_t i = 0; i < issued; ++i) {
    Status s = t.wait(i);
    if (!first.is_ok()) continue;  // drain what is in flight, then report
    if (s.is_ok()) s = verify(tensor, ps[i], slot_of(i), crcs);
    const Piece& p = ps[i];
    const uint64_t real = p.rel < nbytes ? std::min(p.len, nbytes - p.rel) : 0;
    if (s.is_ok() && real > 0) s = copy_out(dst + p.rel, slot_of(i), real);
    if (s.is_ok() && issued < ps.size()) {  // this slot is free again: refill it
      s = issue(issued);
      if (s.is_ok()) ++issued;
    }
    if (!s.is_ok()) first = s;
  }
  return first;
}

Status NvmeTier::host_copy(void* dst, const void* src, uint64_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::ok();
}

void NvmeTier::write_from_host(std::string tensor, const unsigned char* src, uint64_t extent,
                               uint64_t len, std::shared_ptr<Checksums> crcs, Done done,
                               std::shared_ptr<Completion> gate) {
  to_disk_->push(Job{[=, this] {
                       if (gate) STRATA_RETURN_IF_ERROR(gate->wait(-1));
                       if (options_.direct_dram) {
                         return run_direct(IoOp::kWrite, tensor, const_cast<unsigned char*>(src),
                                           extent, len, crcs.get(), nullptr);
                       }
                       return run_staged_write(src, len, extent, len, crcs.get(), host_copy);
                     },
                     std::move(done)});
}

void NvmeTier::read_to_host(std::string tensor, unsigned char* dst, uint64_t extent, uint64_t len,
                            std::shared_ptr<const Checksums> crcs, Done done) {
  from_disk_->push(
      Job{[=, this] {
            if (options_.direct_dram) {
              return run_direct(IoOp::kRead, tensor, dst, extent, len, nullptr, crcs.get());
            }
            return run_staged_read(tensor, dst, len, extent, len, crcs.get(), host_copy);
          },
          std::move(done)});
}

void NvmeTier::write_from_device(std::string tensor, const unsigned char* device, uint64_t nbytes,
                                 uint64_t extent, uint64_t len, std::shared_ptr<Checksums> crcs,
                                 Done done, std::shared_ptr<Completion> gate) {
  (void)tensor;
  to_disk_->push(Job{[=, this] {
                       if (gate) STRATA_RETURN_IF_ERROR(gate->wait(-1));
                       return run_staged_write(device, nbytes, extent, len, crcs.get(),
                                               [this](void* d, const void* s, uint64_t n) {
                                                 return copy_sync(CopyDirection::kDeviceToHost, d,
                                                                  s, n);
                                               });
                     },
                     std::move(done)});
}

void NvmeTier::read_to_device(std::string tensor, unsigned char* device, uint64_t nbytes,
                              uint64_t extent, uint64_t len, std::shared_ptr<const Checksums> crcs,
                              Done done, std::vector<std::shared_ptr<DeviceFence>> wait_for) {
  from_disk_->push(Job{[=, this] {
                         for (const auto& fence : wait_for)
                           STRATA_RETURN_IF_ERROR(fence->host_wait());
                         return run_staged_read(tensor, device, nbytes, extent, len, crcs.get(),
                                                [this](void* d, const void* s, uint64_t n) {
                                                  return copy_sync(CopyDirection::kHostToDevice, d,
                                                                   s, n);
                                                });
                       },
                       std::move(done)});
}

std::vector<NvmeTier::Piece> NvmeTier::range_pieces(uint64_t extent, uint64_t len, uint64_t offset,
                                                    uint64_t bytes) const {
  std::vector<Piece> out;
  for (const Piece& p : pieces(extent, len)) {
    if (p.rel + p.len > offset && p.rel < offset + bytes) out.push_back(p);
  }
  return out;
}

Status NvmeTier::run_range(IoOp op, const std::vector<Piece>& todo, const RangeFill& fill,
                           const RangeSettle& settle) {
  const std::size_t depth = std::min<std::size_t>({kRangeDepth, options_.queue_depth, todo.size()});
  std::vector<AlignedBuffer> bufs;
  bufs.reserve(depth);
  for (std::size_t k = 0; k < depth; ++k) {
    bufs.emplace_back(options_.block_size);
    if (bufs.back().data() == nullptr) {
      return error(Code::kOutOfMemory, "no memory for a ", op == IoOp::kRead ? "read" : "write",
                   " buffer");
    }
  }
  PieceTracker t(todo.size());
  Status first;
  // Piece i's buffer serves piece i + depth once piece i is settled.
  auto settle_piece = [&](std::size_t i) {
    Status s = settle(i, bufs[i % depth].data(), t.wait(i));
    if (first.is_ok() && !s.is_ok()) first = std::move(s);
  };
  std::size_t submitted = 0, settled = 0;
  for (std::size_t i = 0; i < todo.size(); ++i) {
    if (i >= depth) settle_piece(settled++);
    if (!first.is_ok()) break;
    unsigned char* b = bufs[i % depth].data();
    Status s = fill(i, b);
    if (s.is_ok()) {
      s = submit_io(op, todo[i], b, [&t, i](Status st) { t.complete(i, std::move(st)); });
    }
    if (!s.is_ok()) {
      first = std::move(s);
      break;
    }
    submitted = i + 1;
  }
  // Every submitted piece is waited for: its buffer and the tracker live on this stack.
  while (settled < submitted) settle_piece(settled++);
  return first;
}

Status NvmeTier::read_range(const std::string& tensor, uint64_t extent, uint64_t len,
                            const Checksums* crcs, uint64_t offset, void* dst, uint64_t bytes) {
  std::shared_lock lock(range_mutex_);
  const std::vector<Piece> todo = range_pieces(extent, len, offset, bytes);
  auto* out = static_cast<unsigned char*>(dst);
  return run_range(
      IoOp::kRead, todo, [](std::size_t, unsigned char*) { return Status::ok(); },
      [&](std::size_t i, unsigned char* b, Status s) {
        const Piece& p = todo[i];
        STRATA_RETURN_IF_ERROR(s);
        STRATA_RETURN_IF_ERROR(verify(tensor, p, b, crcs));
        const uint64_t from = std::max(offset, p.rel);
        const uint64_t to = std::min(offset + bytes, p.rel + p.len);
        std::memcpy(out + (from - offset), b + (from - p.rel), to - from);
        return Status::ok();
      });
}

Status NvmeTier::write_range(const std::string& tensor, uint64_t extent, uint64_t len,
                             Checksums* crcs, uint64_t offset, const void* src, uint64_t bytes,
                             uint64_t data_end) {
  std::unique_lock lock(range_mutex_);
  const std::vector<Piece> todo = range_pieces(extent, len, offset, bytes);
  const auto* in = static_cast<const unsigned char*>(src);
  std::vector<uint32_t> crc_of(todo.size(), 0);
  return run_range(
      IoOp::kWrite, todo,
      [&](std::size_t i, unsigned char* b) {
        const Piece& p = todo[i];
        const uint64_t from = std::max(offset, p.rel);
        const uint64_t to = std::min(offset + bytes, p.rel + p.len);
        // The piece's data bytes (the last piece's tail is alignment padding, nobody's data).
        const uint64_t data_to = std::max(std::min(p.rel + p.len, data_end), p.rel);
        if (from != p.rel || to < data_to) {  // partial piece: read, check, patch
          STRATA_RETURN_IF_ERROR(io_sync(IoOp::kRead, p, b));
          STRATA_RETURN_IF_ERROR(verify(tensor, p, b, crcs));
        } else if (to < p.rel + p.len) {
          std::memset(b + (to - p.rel), 0, p.rel + p.len - to);  // the padding, not read
        }
        std::memcpy(b + (from - p.rel), in + (from - offset), to - from);
        crc_of[i] = options_.checksums ? crc32c(b, p.len) : 0;
        return Status::ok();
      },
      // Written: the new checksum; failed: what the disk holds, read back into the piece's
      // buffer (no later piece uses it before run_range returns).
      [&](std::size_t i, unsigned char* b, Status s) {
        if (!s.is_ok()) {
          resync_checksum(todo[i], crcs, b);
          return s;
        }
        if (options_.checksums && crcs != nullptr) crcs->set(todo[i].index, crc_of[i]);
        return Status::ok();
      });
}

void NvmeTier::resync_checksum(const Piece& p, Checksums* crcs, unsigned char* buf) {
  if (!options_.checksums || crcs == nullptr) return;
  // A write that failed may still have reached the disk, whole (EIO reported after the data
  // landed) or in part (some sectors): the piece holds its old bytes, the new ones, or a mix of
  // the two inside the written range. Keeping the old checksum would make every later read of
  // the tensor, and every partial write (which reads the piece first), fail as DATA_CORRUPTION
  // although nothing rotted, so a retry of the write could never succeed. Read back what is
  // there and checksum that. If the piece cannot be read either, its checksum stays: reads then
  // report the mismatch (or the I/O error) rather than bytes nobody checked.
  if (io_sync(IoOp::kRead, p, buf).is_ok()) crcs->set(p.index, crc32c(buf, p.len));
}

}  // namespace strata
