// Monotonic time, one definition for every layer: trace records, the storage engines' busy
// counters and the setup timings must read the same clock, or a trace mixes time bases.
#pragma once

#include <chrono>
#include <cstdint>

namespace strata {

// Nanoseconds on the steady clock, the time base of trace records and I/O counters.
inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Seconds elapsed since `start`, for the durations reported in stats and capabilities.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace strata
