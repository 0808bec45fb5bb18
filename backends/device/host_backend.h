// The host backend: a simulated device for machines without a GPU. Its "device memory" is host
// memory; each copy direction is an in-order queue served by its own worker thread, so copies
// are asynchronous, ordered and overlapping exactly as on CUDA's two copy streams. An optional
// bandwidth limit per direction makes copies slow on purpose, so tests can catch code that
// forgets to wait.
#pragma once

#include <memory>

#include "backends/device/device_backend.h"

namespace strata {

Status create_host_backend(const DeviceOptions& options, std::shared_ptr<DeviceBackend>* out);

}  // namespace strata
