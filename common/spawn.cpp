#include "common/spawn.h"

#include <cerrno>
#include <cstring>
#include <mutex>
#include <system_error>

namespace strata {
namespace {

std::mutex fault_mutex;
std::function<bool()> fault;

}  // namespace

void set_spawn_thread_fault(std::function<bool()> refuse) {
  std::lock_guard lock(fault_mutex);
  fault = std::move(refuse);
}

Status spawn_thread(const char* what, std::function<void()> body, std::thread* out) {
  int err = 0;
  {
    std::lock_guard lock(fault_mutex);
    if (fault && fault()) err = EAGAIN;
  }
  if (err == 0) {
    try {
      *out = std::thread(std::move(body));
      return Status::ok();
    } catch (const std::system_error& e) {
      err = e.code().value();
    }
  }
  return error(Code::kOutOfMemory, "cannot start ", what, " thread: ", std::strerror(err),
               " (errno ", err, ")");
}

}  // namespace strata
