// NvmeTier: the storage tier. Files on one or more paths are striped into one logical address
// space (stripe unit = the I/O block size) managed by a 4 KiB-aligned extent arena. Transfers
// run on two worker threads, one per direction, so reads and writes overlap:
//   DRAM <-> NVMe  straight between the pinned DRAM arena (registered with io_uring) and disk;
//   HBM  <-> NVMe  pipelined through pinned bounce slots: while chunk i crosses PCIe, chunks
//                  i+1.. are being read from (or written to) disk, queue_depth of them at once.
// With checksums on, each piece (a stripe unit or less) gets a CRC-32C when written and is
// checked when read; a mismatch is STRATA_ERROR_DATA_CORRUPTION naming tensor and offset.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/device/device_backend.h"
#include "backends/memory/host_memory.h"
#include "backends/storage/storage_engine.h"
#include "backends/storage/storage_files.h"
#include "common/types.h"
#include "runtime/memory/arena.h"
#include "runtime/memory/checksums.h"
#include "runtime/memory/completion.h"

namespace strata {

struct NvmeOptions {
  std::vector<std::string> paths;
  uint64_t budget = 0;  // total over all paths
  IoEngineKind engine = IoEngineKind::kAuto;
  uint64_t block_size = 1 << 20;  // I/O size and stripe unit; a 4 KiB multiple
  unsigned queue_depth = 32;
  bool checksums = false;
  // DRAM <-> NVMe straight between the DRAM arena and disk (zero copy) instead of through the
  // pinned staging slots. See docs/architecture.md for why staging is the default.
  bool direct_dram = false;
  IoFaultHook fault_hook;  // tests only
};

class NvmeTier {
 public:
  static constexpr uint64_t kAlignment = 4096;
  using Done = std::function<void(Status)>;
  // Reports device copies the staged transfers make, for the runtime's link counters.
  using AccountCopy = std::function<void(Link, uint64_t bytes, uint64_t busy_ns)>;

  // io_block_size and io_queue_depth in range: checked at every runtime create, with an NVMe
  // tier or without one.
  static Status check_io_options(const NvmeOptions& options);

  // `dram` is the pinned DRAM arena (registered with io_uring as fixed buffers only with
  // options.direct_dram, the one mode that reads and writes it directly); staging buffers are
  // mapped and pinned here with `staging_memory`, and always registered.
  static Status create(const NvmeOptions& options, std::shared_ptr<DeviceBackend> device,
                       std::pair<void*, uint64_t> dram, const HostMemoryOptions& staging_memory,
                       AccountCopy account, std::unique_ptr<NvmeTier>* out,
                       IoRequestHook on_request = nullptr);
  ~NvmeTier();

  // The extent allocator over the logical space. The runtime guards it with its own mutex.
  Arena& extents() { return *extents_; }
  const std::string& engine_name() const { return engine_name_; }
  const std::string& engine_reason() const { return engine_reason_; }
  bool checksums() const { return options_.checksums; }
  IoCounters counters(IoOp op) { return engine_->counters(op); }
  void reset_counters() { engine_->reset_counters(); }

  // Asynchronous transfers of the extent [extent, extent + len) (len a 4 KiB multiple). The
  // host variants move all `len` bytes (the DRAM block is 4 KiB-rounded too); the device
  // variants move `nbytes` real bytes to or from `device` and pad the disk piece. Writes fill
  // *crcs (if checksums are on); reads check against it. `done` runs on a worker thread.
  // A write starts only once `gate` (if any) completes: the caller's stream has finished
  // producing the source.
  void write_from_host(std::string tensor, const unsigned char* src, uint64_t extent, uint64_t len,
                       std::shared_ptr<Checksums> crcs, Done done,
                       std::shared_ptr<Completion> gate = nullptr);
  void read_to_host(std::string tensor, unsigned char* dst, uint64_t extent, uint64_t len,
                    std::shared_ptr<const Checksums> crcs, Done done);
  void write_from_device(std::string tensor, const unsigned char* device, uint64_t nbytes,
                         uint64_t extent, uint64_t len, std::shared_ptr<Checksums> crcs, Done done,
                         std::shared_ptr<Completion> gate = nullptr);
  // `wait_for`: fences the transfer waits for on its worker thread before touching `device`
  // (the executor's slot must be free).
  void read_to_device(std::string tensor, unsigned char* device, uint64_t nbytes, uint64_t extent,
                      uint64_t len, std::shared_ptr<const Checksums> crcs, Done done,
                      std::vector<std::shared_ptr<DeviceFence>> wait_for = {});

  // Synchronous byte-range access for strata_tensor_read/write of an NVMe-resident tensor:
  // whole pieces are read (and checked), patched and written back (with a fresh checksum), up
  // to kRangeDepth pieces in flight. A
  // failed write leaves the bytes of its range unspecified (old, new or a mix, as a failed
  // pwrite does) and every other byte as it was; the tensor stays readable (see
  // resync_checksum), and writing the range again succeeds once the fault is gone.
  Status read_range(const std::string& tensor, uint64_t extent, uint64_t len, const Checksums* crcs,
                    uint64_t offset, void* dst, uint64_t bytes);
  // `data_end`: where the tensor's bytes end (its last piece is padded to the alignment): a
  // write that covers every data byte of a piece does not read it first, so a tensor whose
  // stored bytes are damaged can be rewritten whole.
  Status write_range(const std::string& tensor, uint64_t extent, uint64_t len, Checksums* crcs,
                     uint64_t offset, const void* src, uint64_t bytes, uint64_t data_end);

  // Pieces of a byte-range access in flight at once (at most queue_depth): one at a time, a
  // range access runs at the disk's queue-depth-1 rate (it writes NVMe-homed optimizer state's
  // initial values and checkpoint loads into NVMe tensors).
  static constexpr std::size_t kRangeDepth = 8;

  // Number of pieces (and checksums) of an extent of `len` bytes at `extent`.
  std::size_t piece_count(uint64_t extent, uint64_t len) const;

  // Waits for running transfers, cancels queued ones (their `done` gets kCancelled), stops the
  // engine. Returns how many were cancelled.
  std::size_t shutdown();

 private:
  struct Piece {
    std::size_t index;
    uint64_t rel;  // offset within the extent
    uint64_t len;
    int file;
    uint64_t file_offset;
  };
  struct Job {
    std::function<Status()> body;
    Done done;
  };
  class Worker;

  NvmeTier() = default;
  std::vector<Piece> pieces(uint64_t extent, uint64_t len) const;
  // The pieces of [extent, extent + len) that bytes [offset, offset + bytes) touch.
  std::vector<Piece> range_pieces(uint64_t extent, uint64_t len, uint64_t offset,
                                  uint64_t bytes) const;
  // The pipeline of read_range and write_range: for each piece of `todo` in order, fill(i, buf)
  // prepares its buffer and the piece is submitted; settle(i, buf, status) runs once it
  // completed, in order, at most kRangeDepth (and queue_depth) pieces in flight. The first
  // failure (of fill, a submit or settle) stops submitting; every submitted piece is settled.
  using RangeFill = std::function<Status(std::size_t, unsigned char*)>;
  using RangeSettle = std::function<Status(std::size_t, unsigned char*, Status)>;
  Status run_range(IoOp op, const std::vector<Piece>& todo, const RangeFill& fill,
                   const RangeSettle& settle);
  Status submit_io(IoOp op, const Piece& p, unsigned char* buf, std::function<void(Status)> done);
  Status io_sync(IoOp op, const Piece& p, unsigned char* buf);
  Status copy_sync(CopyDirection dir, void* dst, const void* src, uint64_t bytes);
  Status verify(const std::string& tensor, const Piece& p, const unsigned char* data,
                const Checksums* crcs) const;
  // After a failed write of piece `p` (write_range): its checksum again describes what the disk
  // holds, read back into `buf` (block_size bytes).
  void resync_checksum(const Piece& p, Checksums* crcs, unsigned char* buf);

  // Copies between a staging slot and the transfer's other end (device or host memory).
  using CopyFn = std::function<Status(void* dst, const void* src, uint64_t bytes)>;
  static Status host_copy(void* dst, const void* src, uint64_t bytes);

  // Direct: O_DIRECT straight between host memory and disk, all pieces queued at once.
  // A write fills *written (if any); a read checks each piece against *expected (if any).
  Status run_direct(IoOp op, const std::string& tensor, unsigned char* host, uint64_t extent,
                    uint64_t len, Checksums* written, const Checksums* expected);
  // Staged: through the pinned slots; piece i crosses `copy` while pieces i+1.. are on disk.
  Status run_staged_write(const unsigned char* src, uint64_t nbytes, uint64_t extent, uint64_t len,
                          Checksums* crcs, const CopyFn& copy_in);
  Status run_staged_read(const std::string& tensor, unsigned char* dst, uint64_t nbytes,
                         uint64_t extent, uint64_t len, const Checksums* crcs,
                         const CopyFn& copy_out);

  NvmeOptions options_;
  std::shared_ptr<DeviceBackend> device_;
  AccountCopy account_;
  StorageFileSet files_;
  std::unique_ptr<StorageEngine> engine_;
  std::string engine_name_;
  std::string engine_reason_;
  std::unique_ptr<Arena> extents_;
  uint64_t file_size_ = 0;
  // Pinned bounce slots, queue_depth of block_size per direction.
  unsigned slots_ = 0;
  void* staging_ = nullptr;
  uint64_t staging_bytes_ = 0;
  unsigned char* to_disk_slots_ = nullptr;
  unsigned char* from_disk_slots_ = nullptr;
  // strata_tensor_read/write of NVMe tensors: a write (read-modify-write of pieces, then their
  // checksums) excludes every other range access; reads share. Without it a read could see a
  // piece half-rewritten, or the new bytes with the old checksum: a false DATA_CORRUPTION.
  std::shared_mutex range_mutex_;
  std::unique_ptr<Worker> to_disk_;
  std::unique_ptr<Worker> from_disk_;
};

}  // namespace strata
