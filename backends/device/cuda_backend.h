// The cuda backend: CUDA runtime API only (no kernels). One cudaMalloc arena per runtime, pinned
// host memory, one non-blocking copy stream per direction, per-copy events timed on the device
// and completed by one completion thread per stream.
#pragma once

#include <memory>

#include "backends/device/device_backend.h"

namespace strata {

// kNoDevice when no usable GPU is present (the CUDA error is in the message).
Status create_cuda_backend(const DeviceOptions& options, std::shared_ptr<DeviceBackend>* out);

}  // namespace strata
