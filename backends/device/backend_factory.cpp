#include "backends/device/device_backend.h"
#include "backends/device/host_backend.h"
#ifdef STRATA_WITH_CUDA
#include "backends/device/cuda_backend.h"
#endif

namespace strata {

bool cuda_backend_compiled() {
#ifdef STRATA_WITH_CUDA
  return true;
#else
  return false;
#endif
}

Status create_device_backend(const DeviceOptions& options, std::shared_ptr<DeviceBackend>* out,
                             std::string* reason) {
  switch (options.kind) {
    case DeviceKind::kHost:
      *reason = "host: asked for by the config";
      return create_host_backend(options, out);
    case DeviceKind::kCuda:
#ifdef STRATA_WITH_CUDA
      *reason = "cuda: asked for by the config";
      return create_cuda_backend(options, out);
#else
      return error(Code::kUnsupported,
                   "the cuda backend was asked for but this build of Strata has no CUDA support "
                   "(configure with a CUDA toolkit and STRATA_WITH_CUDA=ON)");
#endif
    case DeviceKind::kAuto: {
#ifdef STRATA_WITH_CUDA
      if (options.host_link_bytes_per_second == 0 && !options.copy_fault) {
        Status cuda = create_cuda_backend(options, out);
        if (cuda.is_ok()) {
          *reason = "auto: found a CUDA device";
          return cuda;
        }
        if (cuda.code() != Code::kNoDevice) return cuda;  // a GPU exists but failed: say so
        *reason = "auto: " + cuda.message() + "; using the host backend";
      } else {
        *reason = "auto: host_link_bytes_per_second set, which only the host backend honours";
      }
#else
      *reason = "auto: built without CUDA; using the host backend";
#endif
      return create_host_backend(options, out);
    }
  }
  return error(Code::kInvalidArgument, "unknown device backend ", static_cast<int>(options.kind));
}

}  // namespace strata
