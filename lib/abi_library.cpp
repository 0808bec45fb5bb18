// Library-wide functions: version, status and enum names, the thread-local error message.
#include <string>

#include "lib/abi_support.h"

namespace strata::abi {
namespace {
thread_local std::string last_error;
}  // namespace

void set_last_error(std::string message) {
  last_error = std::move(message);
}
const char* last_error_c_str() {
  return last_error.c_str();
}

strata_status_t report(const char* function, const Status& status) {
  try {
    set_last_error(std::string(function) + ": " + status.message());
  } catch (...) {
    // Out of memory while formatting the message: keep the code, lose the words.
  }
  return static_cast<strata_status_t>(status.code());
}

}  // namespace strata::abi

using namespace strata;

extern "C" {

STRATA_API uint32_t strata_version(void) {
  return STRATA_VERSION_NUMBER;
}

STRATA_API const char* strata_version_string(void) {
#define STRATA_STR2(x) #x
#define STRATA_STR(x) STRATA_STR2(x)
  return STRATA_STR(STRATA_VERSION_MAJOR) "." STRATA_STR(STRATA_VERSION_MINOR) "." STRATA_STR(
      STRATA_VERSION_PATCH);
}

STRATA_API const char* strata_status_string(strata_status_t status) {
  switch (status) {
    case STRATA_OK:
      return "STRATA_OK";
    case STRATA_ERROR_INVALID_ARGUMENT:
      return "STRATA_ERROR_INVALID_ARGUMENT";
    case STRATA_ERROR_OUT_OF_MEMORY:
      return "STRATA_ERROR_OUT_OF_MEMORY";
    case STRATA_ERROR_NOT_FOUND:
      return "STRATA_ERROR_NOT_FOUND";
    case STRATA_ERROR_ALREADY_EXISTS:
      return "STRATA_ERROR_ALREADY_EXISTS";
    case STRATA_ERROR_BUSY:
      return "STRATA_ERROR_BUSY";
    case STRATA_ERROR_NOT_READY:
      return "STRATA_ERROR_NOT_READY";
    case STRATA_ERROR_UNSUPPORTED:
      return "STRATA_ERROR_UNSUPPORTED";
    case STRATA_ERROR_NO_DEVICE:
      return "STRATA_ERROR_NO_DEVICE";
    case STRATA_ERROR_BACKEND:
      return "STRATA_ERROR_BACKEND";
    case STRATA_ERROR_IO:
      return "STRATA_ERROR_IO";
    case STRATA_ERROR_DATA_CORRUPTION:
      return "STRATA_ERROR_DATA_CORRUPTION";
    case STRATA_ERROR_CANCELLED:
      return "STRATA_ERROR_CANCELLED";
    case STRATA_ERROR_TIMEOUT:
      return "STRATA_ERROR_TIMEOUT";
    case STRATA_ERROR_INVALID_STATE:
      return "STRATA_ERROR_INVALID_STATE";
    case STRATA_ERROR_INTERNAL:
      return "STRATA_ERROR_INTERNAL";
    default:
      return "STRATA_UNKNOWN_STATUS";
  }
}

STRATA_API const char* strata_last_error_message(void) {
  return abi::last_error_c_str();
}

STRATA_API const char* strata_tier_name(strata_tier_t tier) {
  return tier_name(static_cast<Tier>(tier)).data();
}
STRATA_API const char* strata_dtype_name(strata_dtype_t dtype) {
  return dtype_name(static_cast<DType>(dtype)).data();
}
STRATA_API const char* strata_role_name(strata_role_t role) {
  return role_name(static_cast<Role>(role)).data();
}
STRATA_API const char* strata_link_name(strata_link_t link) {
  return link_name(static_cast<Link>(link)).data();
}
STRATA_API const char* strata_device_backend_name(strata_device_backend_t backend) {
  switch (backend) {
    case STRATA_DEVICE_BACKEND_AUTO:
      return "auto";
    case STRATA_DEVICE_BACKEND_CUDA:
      return "cuda";
    case STRATA_DEVICE_BACKEND_HOST:
      return "host";
    default:
      return "unknown";
  }
}
STRATA_API size_t strata_dtype_size(strata_dtype_t dtype) {
  return dtype_size(static_cast<DType>(dtype));
}

}  // extern "C"
