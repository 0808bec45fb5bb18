// Shared plumbing of the C ABI layer: the handle structs, the thread-local error message, the
// exception firewall and the struct_size rules. Every exported function goes through guarded(),
// so no C++ exception reaches a C caller.
#pragma once

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>

#include "lib/abi_struct_sizes.h"
#include "runtime/optimizer/optimizer.h"
#include "runtime/runtime.h"
#include "runtime/stream/executor.h"
#include "runtime/stream/planner.h"
#include "strata/strata.h"

struct strata_runtime {
  std::shared_ptr<strata::Runtime> impl;
};

struct strata_event {
  std::shared_ptr<strata::Completion> completion;
};

struct strata_graph {
  std::shared_ptr<strata::Runtime> runtime;
  strata::LayerGraph graph;
};

struct strata_plan {
  std::shared_ptr<strata::Runtime> runtime;
  strata::Plan plan;
};

struct strata_optimizer {
  std::shared_ptr<strata::Optimizer> impl;
};

struct strata_executor {
  std::unique_ptr<strata::Executor> impl;
  strata::LayerViews views;  // what the last acquire handed out (valid until its release)
};

namespace strata::abi {

// Copies `src` into a fixed char array of an output struct, truncated to fit and always
// NUL-terminated (the reader is C).
inline void copy_string(char* dst, std::size_t capacity, const std::string& src) {
  if (capacity == 0) return;
  const std::size_t n = std::min(capacity - 1, src.size());
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

void set_last_error(std::string message);
const char* last_error_c_str();

// Record `status` (prefixed with the function's name) and return its code.
strata_status_t report(const char* function, const Status& status);

template <typename... Args>
strata_status_t fail(const char* function, Code code, const Args&... args) {
  return report(function, error(code, args...));
}

// Run `body` (returning Status) behind the firewall: exceptions become statuses.
template <typename F>
strata_status_t guarded(const char* function, F&& body) noexcept {
  try {
    Status status = body();
    return status.is_ok() ? STRATA_OK : report(function, status);
  } catch (const std::bad_alloc&) {
    return fail(function, Code::kOutOfMemory, "host memory allocation failed");
  } catch (const std::exception& e) {
    return fail(function, Code::kInternal, "unexpected exception: ", e.what());
  } catch (...) {
    return fail(function, Code::kInternal, "unexpected non-standard exception");
  }
}

// The struct_size rule (abi_struct_sizes.h): one of T's released sizes, or at least this
// header's. Any other size ends inside a field or between releases: reading or writing up to it
// would cut a field in two, so it is refused, naming every size accepted.
template <typename T>
Status check_struct_size(const T* user) {
  using Sizes = StructSizes<T>;
  if (user == nullptr) return error(Code::kInvalidArgument, Sizes::kName, " pointer is NULL");
  if (accepted_struct_size<T>(user->struct_size)) return Status::ok();
  std::string accepted;
  for (const std::size_t s : Sizes::kAccepted) {
    accepted += std::to_string(s) + (s == Sizes::kCurrent ? " or more" : ", ");
  }
  return error(Code::kInvalidArgument, Sizes::kName, ".struct_size is ", user->struct_size,
               ", not a size of any release: accepted are ", accepted,
               " (set it to the STRATA_*_STRUCT_SIZE macro of the header you compiled against)");
}

// Read a caller's argument struct: checks its struct_size, copies only the bytes that size
// covers over `*out` (which holds the defaults for the rest).
template <typename T>
Status read_struct(const T* user, T* out) {
  STRATA_RETURN_IF_ERROR(check_struct_size(user));
  std::memcpy(static_cast<void*>(out), user, std::min(user->struct_size, sizeof(T)));
  out->struct_size = sizeof(T);
  return Status::ok();
}

// Validate an output struct the caller sized; write_struct() then fills what that size covers.
template <typename T>
Status check_out_struct(const T* user) {
  return check_struct_size(user);
}

template <typename T>
void write_struct(T* user, const T& value) {
  const std::size_t size = std::min(user->struct_size, sizeof(T));
  const std::size_t keep = user->struct_size;
  std::memcpy(static_cast<void*>(user), &value, size);
  user->struct_size = keep;
}

// A dump into the caller's buffer: *out_length (may be NULL) gets the length without the NUL;
// a NULL buffer only asks for it; one too small for the text and its NUL is refused.
inline Status copy_out_text(const std::string& text, char* buffer, std::size_t capacity,
                            std::size_t* out_length) {
  if (out_length != nullptr) *out_length = text.size();
  if (buffer == nullptr) return Status::ok();
  if (capacity <= text.size()) {
    return error(Code::kInvalidArgument, "buffer of ", capacity,
                 " bytes is too small: the dump needs ", text.size() + 1, " bytes with its NUL");
  }
  std::memcpy(buffer, text.c_str(), text.size() + 1);
  return Status::ok();
}

inline Status require(const void* ptr, const char* what) {
  return ptr == nullptr ? error(Code::kInvalidArgument, what, " is NULL") : Status::ok();
}

inline TensorId tensor_id(const strata_tensor_t* handle) {
  return static_cast<TensorId>(reinterpret_cast<uintptr_t>(handle));
}
inline strata_tensor_t* tensor_handle(TensorId id) {
  return reinterpret_cast<strata_tensor_t*>(static_cast<uintptr_t>(id));
}

}  // namespace strata::abi
