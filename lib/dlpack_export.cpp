#include "lib/dlpack_export.h"

#include <vector>

namespace strata::abi {
namespace {

// Everything the managed tensor points at lives here, freed by the deleter.
struct ExportContext {
  DLManagedTensorVersioned managed{};
  std::vector<int64_t> shape;
  ExportLease lease;
};

DLDataType dl_dtype(DType dtype) {
  const auto bits = static_cast<uint8_t>(dtype_size(dtype) * 8);
  switch (dtype) {
    case DType::kF32:
    case DType::kF16:
    case DType::kF64:
      return {kDLFloat, bits, 1};
    case DType::kBF16:
      return {kDLBfloat, bits, 1};
    case DType::kI8:
    case DType::kI16:
    case DType::kI32:
    case DType::kI64:
      return {kDLInt, bits, 1};
    case DType::kU8:
      return {kDLUInt, bits, 1};
    case DType::kBool:
      return {kDLBool, 8, 1};
  }
  return {kDLOpaqueHandle, bits, 1};
}

void delete_export(DLManagedTensorVersioned* self) {
  delete static_cast<ExportContext*>(self->manager_ctx);
}

}  // namespace

DLManagedTensorVersioned* make_dlpack(ExportLease lease, const DeviceDescription& device) {
  auto* ctx = new ExportContext();
  ctx->lease = std::move(lease);
  ctx->shape = ctx->lease.shape;
  DLManagedTensorVersioned& m = ctx->managed;
  m.version = DLPackVersion{DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
  m.manager_ctx = ctx;
  m.deleter = delete_export;
  m.flags = 0;
  DLTensor& t = m.dl_tensor;
  t.data = ctx->lease.data;
  const bool cuda = device.kind == DeviceKind::kCuda;
  if (!cuda) {
    t.device = DLDevice{kDLCPU, 0};  // the host backend's "device" memory is host memory
  } else if (ctx->lease.tier == Tier::kHbm) {
    t.device = DLDevice{kDLCUDA, device.ordinal};
  } else if (ctx->lease.pinned) {
    t.device = DLDevice{kDLCUDAHost, 0};
  } else {
    t.device = DLDevice{kDLCPU, 0};  // the DRAM arena's unpinned part: plain host memory
  }
  t.ndim = static_cast<int32_t>(ctx->shape.size());
  t.dtype = dl_dtype(ctx->lease.dtype);
  t.shape = ctx->shape.empty() ? nullptr : ctx->shape.data();
  t.strides = nullptr;  // compact row-major
  t.byte_offset = 0;
  return &m;
}

}  // namespace strata::abi
