// C ABI: checkpoints (runtime/checkpoint/ does the work).
#include "lib/abi_support.h"
#include "runtime/checkpoint/checkpoint.h"

using namespace strata;
using namespace strata::abi;

extern "C" {

STRATA_API strata_status_t strata_checkpoint_save(strata_runtime_t* runtime,
                                                  strata_optimizer_t* optimizer, const char* path) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(require(path, "path"));
    if (*path == '\0') return error(Code::kInvalidArgument, "path is empty");
    return save_checkpoint(*runtime->impl, optimizer != nullptr ? optimizer->impl.get() : nullptr,
                           path);
  });
}

STRATA_API strata_status_t strata_checkpoint_load(strata_runtime_t* runtime,
                                                  strata_optimizer_t* optimizer, const char* path) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(require(path, "path"));
    if (*path == '\0') return error(Code::kInvalidArgument, "path is empty");
    return load_checkpoint(*runtime->impl, optimizer != nullptr ? optimizer->impl.get() : nullptr,
                           path);
  });
}

}  // extern "C"
