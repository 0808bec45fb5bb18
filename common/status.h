// Status: the error currency of the C++ core. Every fallible core function returns one; the C ABI
// layer turns it into a strata_status_t plus the thread-local message. The core never throws for
// bad input, so nothing has to unwind across the ABI.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

namespace strata {

// Values mirror the STRATA_* status codes of strata.h (lib/abi_mirrors.cpp static_asserts each).
enum class Code : int32_t {
  kOk = 0,
  kInvalidArgument = 1,
  kOutOfMemory = 2,
  kNotFound = 3,
  kAlreadyExists = 4,
  kBusy = 5,
  kNotReady = 6,
  kUnsupported = 7,
  kNoDevice = 8,
  kBackend = 9,
  kIo = 10,
  kDataCorruption = 11,
  kCancelled = 12,
  kTimeout = 13,
  kInvalidState = 14,
  kInternal = 15,
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }

  bool is_ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// Concatenate anything streamable into one string: the messages name tensors and numbers.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

template <typename... Args>
Status error(Code code, const Args&... args) {
  return Status(code, str_cat(args...));
}

#define STRATA_RETURN_IF_ERROR(expr)                    \
  do {                                                  \
    ::strata::Status strata_status_ = (expr);           \
    if (!strata_status_.is_ok()) return strata_status_; \
  } while (0)

}  // namespace strata
