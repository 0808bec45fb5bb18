// A stand-in for a framework's compute in strata-bench stream: on CUDA a kernel that keeps the
// stream busy for a given time; on the host backend, the calling thread sleeps that long.
#pragma once

#include <cstdint>

namespace strata_bench {

// Queues `nanoseconds` of busy work on `stream` (cuda) or sleeps (host). Returns false if the
// kernel could not be launched.
bool busy_compute(bool cuda, void* stream, uint64_t nanoseconds);

// Timing on a stream: a pair of markers whose elapsed time is read after the stream finished.
struct StreamTimer {
  void* start = nullptr;
  void* end = nullptr;
};
bool timer_create(bool cuda, StreamTimer* t);
void timer_destroy(bool cuda, StreamTimer* t);
void timer_mark(bool cuda, void* stream, void* marker);
double timer_seconds(bool cuda, const StreamTimer& t);  // after the stream is synchronized
void* stream_create(bool cuda);
void stream_destroy(bool cuda, void* stream);
void stream_synchronize(bool cuda, void* stream);

}  // namespace strata_bench
