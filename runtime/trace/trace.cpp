#include "runtime/trace/trace.h"

#include <cstdio>
#include <fstream>
#include <map>
#include <new>
#include <set>

#include "common/clock.h"
#include "common/json.h"
#include "common/types.h"

namespace strata {
namespace {
std::atomic<uint64_t> next_tracer_id{1};

// The calling thread's rings, by tracer id. Ids are never reused, so the entry of a destroyed
// tracer never matches again (and is never dereferenced).
struct RingCache {
  uint64_t tracer = 0;
  void* ring = nullptr;
};
thread_local std::vector<RingCache> ring_cache;

const char* const kKindNames[kTraceKindCount] = {"migration",  "copy_h2d", "copy_d2h", "nvme_read",
                                                 "nvme_write", "acquire",  "release",  "optimizer"};

}  // namespace

const char* trace_kind_name(TraceKind kind) {
  const int i = static_cast<int>(kind);
  return i >= 0 && i < kTraceKindCount ? kKindNames[i] : "unknown";
}

// Single producer (its thread), single consumer (flush, under the tracer's mutex).
struct Tracer::Ring {
  explicit Ring(uint32_t capacity) : slots(capacity) {}
  std::vector<TraceRecord> slots;
  std::atomic<uint64_t> head{0};  // written by the producer
  std::atomic<uint64_t> tail{0};  // written by the consumer
  std::atomic<uint64_t> dropped{0};
};

Tracer::Tracer() : id_(next_tracer_id.fetch_add(1)) {}
Tracer::~Tracer() = default;

Status Tracer::start(uint32_t capacity) {
  if (capacity > kMaxRingCapacity) {
    return error(Code::kInvalidArgument, "ring_capacity ", capacity, " is over the limit of ",
                 kMaxRingCapacity, " records per thread");
  }
  std::lock_guard lock(mutex_);
  enabled_.store(false, std::memory_order_relaxed);
  capacity_ = capacity == 0 ? (1u << 16) : capacity;
  for (auto& r : rings_) {
    r->tail.store(r->head.load(std::memory_order_acquire), std::memory_order_release);
    r->dropped.store(0);
  }
  drained_.clear();
  counters_ = TraceCounters{};
  ringless_dropped_.store(0);
  origin_ns_.store(steady_ns());
  enabled_.store(true, std::memory_order_release);
  return Status::ok();
}

uint64_t Tracer::now() const {
  return static_cast<uint64_t>(steady_ns() - origin_ns_.load(std::memory_order_relaxed));
}

Tracer::Ring* Tracer::ring_for_this_thread() {
  for (const RingCache& c : ring_cache) {
    if (c.tracer == id_) return static_cast<Ring*>(c.ring);
  }
  Ring* ring = nullptr;
  try {
    std::lock_guard lock(mutex_);
    rings_.push_back(std::make_unique<Ring>(capacity_));
    ring = rings_.back().get();
  } catch (const std::bad_alloc&) {
    // No memory for this thread's ring: it records nothing (counted as dropped), and never
    // throws out of record() on a thread that cannot report it. rings_ is unchanged: a failed
    // push_back leaves the vector as it was.
  }
  try {
    ring_cache.push_back(RingCache{id_, ring});
  } catch (const std::bad_alloc&) {
  }
  return ring;
}

void Tracer::record(const TraceRecord& r) {
  if (!enabled()) return;
  Ring* ring = ring_for_this_thread();
  if (ring == nullptr) {
    ringless_dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const uint64_t head = ring->head.load(std::memory_order_relaxed);
  if (head - ring->tail.load(std::memory_order_acquire) >= ring->slots.size()) {
    ring->dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  ring->slots[head % ring->slots.size()] = r;
  ring->head.store(head + 1, std::memory_order_release);
}

void Tracer::record_transfer(TraceKind kind, uint64_t bytes, uint64_t busy_ns) {
  if (!enabled()) return;
  record_transfer(kind, bytes, busy_ns, now());
}

void Tracer::record_transfer(TraceKind kind, uint64_t bytes, uint64_t busy_ns, uint64_t end_ns) {
  if (!enabled()) return;
  TraceRecord r;
  r.kind = static_cast<int32_t>(kind);
  r.end_ns = end_ns;
  r.start_ns = end_ns > busy_ns ? end_ns - busy_ns : 0;
  r.bytes = bytes;
  record(r);
}

void Tracer::record_migration(uint64_t tensor, Tier src, Tier dst, uint64_t bytes,
                              uint64_t queued_ns) {
  if (!enabled()) return;
  TraceRecord r;
  r.kind = static_cast<int32_t>(TraceKind::kMigration);
  r.start_ns = r.queued_ns = queued_ns;
  r.end_ns = now();
  r.bytes = bytes;
  r.tensor = tensor;
  r.src_tier = static_cast<int32_t>(src);
  r.dst_tier = static_cast<int32_t>(dst);
  record(r);
}

TraceKind copy_trace_kind(Link link) {
  return link == Link::kH2D ? TraceKind::kCopyH2D : TraceKind::kCopyD2H;
}

TraceRecord layer_trace_record(TraceKind kind, uint32_t layer, int32_t phase, const void* stream) {
  TraceRecord r;
  r.kind = static_cast<int32_t>(kind);
  r.layer = static_cast<int32_t>(layer);
  r.phase = phase;
  r.stream = reinterpret_cast<uintptr_t>(stream);
  return r;
}

void TraceSpan::end(uint64_t bytes, int32_t layer, int32_t phase) {
  if (!tracer_.enabled()) return;
  TraceRecord r;
  r.kind = static_cast<int32_t>(kind_);
  r.start_ns = start_ns_;
  r.end_ns = tracer_.now();
  r.bytes = bytes;
  r.layer = layer;
  r.phase = phase;
  tracer_.record(r);
}

void Tracer::drain(std::vector<TraceRecord>* out) {
  for (auto& ring : rings_) {
    const uint64_t head = ring->head.load(std::memory_order_acquire);
    for (uint64_t i = ring->tail.load(std::memory_order_relaxed); i < head; ++i) {
      const TraceRecord& r = ring->slots[i % ring->slots.size()];
      out->push_back(r);
      const auto k = static_cast<std::size_t>(r.kind);
      if (k < kTraceKindCount) {
        counters_.records[k] += 1;
        counters_.bytes[k] += r.bytes;
      }
    }
    ring->tail.store(head, std::memory_order_release);
    counters_.dropped += ring->dropped.exchange(0);
  }
  counters_.dropped += ringless_dropped_.exchange(0);
}

TraceCounters Tracer::counters() {
  std::lock_guard lock(mutex_);
  drain(&drained_);
  return counters_;
}

Status Tracer::flush(const std::string& path,
                     const std::vector<std::pair<uint64_t, std::string>>& names) {
  std::lock_guard lock(mutex_);
  drain(&drained_);
  std::map<uint64_t, std::string> name_of(names.begin(), names.end());
  // Tracks (Chrome "threads"): one per link and kind, one per stream, one for migrations.
  std::map<std::string, int> tracks;
  auto track = [&](const std::string& name) {
    auto it = tracks.find(name);
    if (it != tracks.end()) return it->second;
    const int id = static_cast<int>(tracks.size()) + 1;
    tracks.emplace(name, id);
    return id;
  };
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp);
  if (!out) return error(Code::kIo, "cannot write trace file ", tmp);
  out << "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"dropped\": " << counters_.dropped
      << "}, \"traceEvents\": [\n";
  bool first = true;
  char buf[128];
  for (const TraceRecord& r : drained_) {
    const auto kind = static_cast<TraceKind>(r.kind);
    std::string track_name;
    switch (kind) {
      case TraceKind::kMigration:
        track_name = "migrations";
        break;
      case TraceKind::kCopyH2D:
        track_name = "link h2d";
        break;
      case TraceKind::kCopyD2H:
        track_name = "link d2h";
        break;
      case TraceKind::kNvmeRead:
        track_name = "link nvme_read";
        break;
      case TraceKind::kNvmeWrite:
        track_name = "link nvme_write";
        break;
      case TraceKind::kAcquire:
      case TraceKind::kRelease:
        std::snprintf(buf, sizeof buf, "stream 0x%llx", static_cast<unsigned long long>(r.stream));
        track_name = buf;
        break;
      case TraceKind::kOptimizer:
        track_name = "optimizer";
        break;
    }
    // Optimizer records carry their job in `phase` (0 accumulate, 1 norm, 2 update).
    const bool job = kind == TraceKind::kOptimizer;
    const char* phase_name = job ? (r.phase == 0   ? "accumulate"
                                    : r.phase == 1 ? "norm"
                                                   : "update")
                                 : (r.phase == 1 ? "backward" : "forward");
    std::string name = trace_kind_name(kind);
    if (job) name += std::string(" ") + phase_name;
    if (r.layer >= 0) {
      name += " layer " + std::to_string(r.layer);
      if (!job) name += r.phase == 1 ? " bwd" : " fwd";
    }
    auto tensor = name_of.find(r.tensor);
    if (tensor != name_of.end()) name += " " + tensor->second;
    const double ts = static_cast<double>(r.start_ns) / 1e3;
    const double dur = static_cast<double>(r.end_ns > r.start_ns ? r.end_ns - r.start_ns : 0) / 1e3;
    out << (first ? "" : ",\n") << "{\"name\": " << json_string(name) << ", \"cat\": \""
        << trace_kind_name(kind) << "\", \"ph\": \"X\", \"ts\": " << ts << ", \"dur\": " << dur
        << ", \"pid\": 1, \"tid\": " << track(track_name) << ", \"args\": {\"bytes\": " << r.bytes
        << ", \"wait_us\": " << static_cast<double>(r.wait_ns) / 1e3
        << ", \"queued_us\": " << static_cast<double>(r.queued_ns) / 1e3;
    if (r.src_tier >= 0) out << ", \"src\": \"" << tier_name(static_cast<Tier>(r.src_tier)) << "\"";
    if (r.dst_tier >= 0) out << ", \"dst\": \"" << tier_name(static_cast<Tier>(r.dst_tier)) << "\"";
    if (r.layer >= 0) out << ", \"layer\": " << r.layer << ", \"phase\": \"" << phase_name << "\"";
    out << "}}";
    first = false;
  }
  for (const auto& [name, id] : tracks) {
    out << (first ? "" : ",\n")
        << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": " << id
        << ", \"args\": {\"name\": " << json_string(name) << "}}";
    first = false;
  }
  out << (first ? "" : ",\n")
      << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 1, \"args\": {\"name\": "
         "\"strata\"}}";
  out << "\n]}\n";
  out.close();
  if (!out) return error(Code::kIo, "writing trace file ", tmp, " failed");
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return error(Code::kIo, "cannot rename ", tmp, " to ", path);
  }
  return Status::ok();
}

}  // namespace strata
