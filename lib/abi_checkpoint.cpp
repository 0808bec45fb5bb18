// C ABI: checkpoints (runtime/checkpoint/ does the work).
#include "lib/abi_support.h"
#include "runtime/checkpoint/atomic_directory.h"
#include "runtime/checkpoint/checkpoint.h"

using namespace strata;
using namespace strata::abi;

// A path argument: given and not empty (outside extern "C": it returns a C++ Status).
namespace {

Status require_path(const char* path, const char* what) {
  STRATA_RETURN_IF_ERROR(require(path, what));
  return *path == '\0' ? error(Code::kInvalidArgument, what, " is empty") : Status::ok();
}

}  // namespace

extern "C" {

STRATA_API strata_status_t strata_checkpoint_save(strata_runtime_t* runtime,
                                                  strata_optimizer_t* optimizer, const char* path) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(require_path(path, "path"));
    return save_checkpoint(*runtime->impl, optimizer != nullptr ? optimizer->impl.get() : nullptr,
                           path);
  });
}

STRATA_API strata_status_t strata_checkpoint_load(strata_runtime_t* runtime,
                                                  strata_optimizer_t* optimizer, const char* path) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(require_path(path, "path"));
    return load_checkpoint(*runtime->impl, optimizer != nullptr ? optimizer->impl.get() : nullptr,
                           path);
  });
}

// -- Atomic directories (since 1.5): runtime/checkpoint/atomic_directory for frameworks --------

STRATA_API strata_status_t strata_atomic_dir_staging(const char* path, char* buffer,
                                                     size_t capacity, size_t* out_length) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require_path(path, "path"));
    std::string staging;
    STRATA_RETURN_IF_ERROR(atomic_staging_path(path, &staging));
    return copy_out_text(staging, buffer, capacity, out_length);
  });
}

STRATA_API strata_status_t strata_atomic_dir_begin(const char* path) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require_path(path, "path"));
    std::string staging;
    return begin_atomic_directory(path, &staging);
  });
}

STRATA_API strata_status_t strata_atomic_dir_commit(const char* path) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require_path(path, "path"));
    std::string staging;
    STRATA_RETURN_IF_ERROR(atomic_staging_path(path, &staging));
    return commit_atomic_directory(staging, path);
  });
}

STRATA_API strata_status_t strata_atomic_dir_resolve(const char* path, char* buffer,
                                                     size_t capacity, size_t* out_length) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require_path(path, "path"));
    std::string existing;
    STRATA_RETURN_IF_ERROR(resolve_atomic_directory(path, &existing));
    return copy_out_text(existing, buffer, capacity, out_length);
  });
}

}  // extern "C"
