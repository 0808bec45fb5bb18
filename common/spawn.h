// Starting threads without exceptions. std::thread's constructor throws std::system_error when
// the OS refuses a thread (a pids cgroup or RLIMIT_NPROC reached, no memory for a stack); code
// that starts several threads must then stop the ones already running before it unwinds, or a
// joinable std::thread is destroyed (std::terminate) and workers wait on a condition variable
// that is gone. spawn_thread() turns the refusal into a Status naming `what` and the errno, and
// carries a test seam that makes chosen spawns fail as the OS would.
#pragma once

#include <functional>
#include <thread>

#include "common/status.h"

namespace strata {

// Starts `body` on *out. On failure *out stays non-joinable and the status is kOutOfMemory
// ("cannot start <what> thread: <strerror> (errno N)").
Status spawn_thread(const char* what, std::function<void()> body, std::thread* out);

// Test seam: while set, each spawn_thread() calls `refuse` first and fails with EAGAIN when it
// returns true. Pass an empty function to clear. Not for production use.
void set_spawn_thread_fault(std::function<bool()> refuse);

}  // namespace strata
