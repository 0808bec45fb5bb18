// Wraps an export lease into a DLManagedTensorVersioned whose deleter ends the lease.
#pragma once

#include "runtime/runtime.h"
#include "strata/strata.h"

namespace strata::abi {

// Ownership of the result passes to the caller (DLPack's consumer), who calls its deleter.
DLManagedTensorVersioned* make_dlpack(ExportLease lease, const DeviceDescription& device);

}  // namespace strata::abi
