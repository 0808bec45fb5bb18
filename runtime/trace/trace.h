// Tracer: tier-traffic tracing. Off by default; when on, each thread appends fixed-size
// records to its own single-producer ring (no lock, no allocation on the hot path: one relaxed
// load when off, a few stores when on). A full ring drops records and counts the drops rather
// than block the I/O or copy path. flush() drains every ring into a Chrome trace / Perfetto
// JSON file with one track per link, per stream and for migrations.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/types.h"

namespace strata {

enum class TraceKind : int32_t {
  kMigration = 0,  // a tensor moved between tiers (queued -> end)
  kCopyH2D = 1,    // a device copy on the H2D queue
  kCopyD2H = 2,
  kNvmeRead = 3,  // one storage request
  kNvmeWrite = 4,
  kAcquire = 5,  // a layer acquire: wait_ns = how long the stream (or thread) waited
  kRelease = 6,
  kOptimizer = 7,
};
inline constexpr int kTraceKindCount = 8;

struct TraceRecord {
  uint64_t start_ns = 0;  // since the trace started
  uint64_t end_ns = 0;
  uint64_t queued_ns = 0;  // when it was asked for (migrations)
  uint64_t bytes = 0;
  uint64_t tensor = 0;  // tensor id, 0 if none
  uint64_t stream = 0;  // the caller's stream (acquire/release)
  uint64_t wait_ns = 0;
  int32_t kind = 0;
  int32_t src_tier = -1, dst_tier = -1;
  int32_t layer = -1;
  int32_t phase = -1;
};

struct TraceCounters {
  uint64_t records[kTraceKindCount] = {};
  uint64_t bytes[kTraceKindCount] = {};
  uint64_t dropped = 0;
};

class Tracer {
 public:
  Tracer();
  ~Tracer();

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  // Records per thread at most: a ring is allocated per recording thread (a copy engine's, an
  // I/O worker's), so a hostile capacity would throw bad_alloc on a thread that cannot report it.
  static constexpr uint32_t kMaxRingCapacity = 1u << 20;

  // Starts a fresh trace: rings of `capacity` records per thread (0 = 65536); earlier records
  // are dropped. kInvalidArgument above kMaxRingCapacity. A thread whose ring cannot be
  // allocated drops its records (counted as dropped) instead of throwing.
  Status start(uint32_t capacity);
  void stop() { enabled_.store(false, std::memory_order_relaxed); }
  // Nanoseconds since start(), for timestamps.
  uint64_t now() const;
  void record(const TraceRecord& r);
  // What the recording sites write, each filled the same way wherever it is written (no-ops
  // while tracing is off). A transfer its engine timed (a device copy, a storage request):
  // busy_ns long, ending at end_ns (now when left out); a start before the trace's is 0.
  void record_transfer(TraceKind kind, uint64_t bytes, uint64_t busy_ns);
  void record_transfer(TraceKind kind, uint64_t bytes, uint64_t busy_ns, uint64_t end_ns);
  // A tensor's move from tier src to dst, from queued_ns (when it was asked for) until now.
  void record_migration(uint64_t tensor, Tier src, Tier dst, uint64_t bytes, uint64_t queued_ns);
  TraceCounters counters();
  // Writes every record so far as Chrome trace JSON to `path` (atomically: temp + rename),
  // with `names` mapping tensor ids to names. kIo on failure.
  Status flush(const std::string& path, const std::vector<std::pair<uint64_t, std::string>>& names);

 private:
  struct Ring;
  Ring* ring_for_this_thread();
  void drain(std::vector<TraceRecord>* out);

  const uint64_t id_;
  std::atomic<bool> enabled_{false};
  std::atomic<int64_t> origin_ns_{0};
  uint32_t capacity_ = 1 << 16;
  std::mutex mutex_;  // guards rings_ (creation and flush), never the append path
  std::vector<std::unique_ptr<Ring>> rings_;
  std::vector<TraceRecord> drained_;
  TraceCounters counters_;                     // of drained records
  std::atomic<uint64_t> ringless_dropped_{0};  // records of threads that have no ring
};

const char* trace_kind_name(TraceKind kind);

// The kind of a device copy's record: kCopyH2D on Link::kH2D, kCopyD2H otherwise.
TraceKind copy_trace_kind(Link link);

// An acquire or release of `layer` in `phase` on `stream`, whose times are filled in later, when
// the executor places it on the device timeline.
TraceRecord layer_trace_record(TraceKind kind, uint32_t layer, int32_t phase, const void* stream);

// A span of work on the calling thread (the optimizer's slices), from construction to end().
class TraceSpan {
 public:
  TraceSpan(Tracer& tracer, TraceKind kind)
      : tracer_(tracer), kind_(kind), start_ns_(tracer.enabled() ? tracer.now() : 0) {}
  // Whether end() records: lets a caller skip computing what it would record.
  bool tracing() const { return tracer_.enabled(); }
  // Records the span, ending now (a no-op while tracing is off).
  void end(uint64_t bytes, int32_t layer, int32_t phase);

 private:
  Tracer& tracer_;
  TraceKind kind_;
  uint64_t start_ns_;
};

}  // namespace strata
