// C ABI: tensors — registration, lookup, host I/O, moves, device views and DLPack export.
#include <cstdio>

#include "lib/abi_support.h"
#include "lib/dlpack_export.h"

using namespace strata;
using namespace strata::abi;

namespace {

Status runtime_and_tensor(strata_runtime_t* runtime, strata_tensor_t* tensor) {
  STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
  return require(tensor, "tensor");
}

}  // namespace

extern "C" {

STRATA_API strata_status_t strata_tensor_register(strata_runtime_t* runtime,
                                                  const strata_tensor_desc_t* desc,
                                                  strata_tensor_t** out_tensor) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    strata_tensor_desc_t d{};
    STRATA_RETURN_IF_ERROR(read_struct(desc, &d));
    STRATA_RETURN_IF_ERROR(require(d.name, "desc->name"));
    // Bounded read: a missing terminator must not run off into unrelated memory.
    const std::size_t name_length = strnlen(d.name, STRATA_MAX_NAME_LENGTH + 1);
    if (name_length > STRATA_MAX_NAME_LENGTH) {
      return error(Code::kInvalidArgument, "tensor name is longer than ", STRATA_MAX_NAME_LENGTH,
                   " bytes");
    }
    if (d.ndim < 0 || d.ndim > STRATA_MAX_NDIM) {
      return error(Code::kInvalidArgument, "tensor '", std::string(d.name, name_length), "': ndim ",
                   d.ndim, " out of range 0..", STRATA_MAX_NDIM);
    }
    if (d.ndim > 0 && d.shape == nullptr) {
      return error(Code::kInvalidArgument, "tensor '", std::string(d.name, name_length),
                   "': shape is NULL with ndim ", d.ndim);
    }
    TensorSpec spec;
    spec.name.assign(d.name, name_length);
    spec.dtype = static_cast<DType>(d.dtype);
    spec.shape.assign(d.shape, d.shape + d.ndim);
    spec.role = static_cast<Role>(d.role);
    spec.home = static_cast<Tier>(d.home_tier);
    TensorId id = 0;
    STRATA_RETURN_IF_ERROR(runtime->impl->register_tensor(std::move(spec), &id));
    if (out_tensor != nullptr) *out_tensor = tensor_handle(id);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_tensor_find(strata_runtime_t* runtime, const char* name,
                                              strata_tensor_t** out_tensor) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(require(name, "name"));
    STRATA_RETURN_IF_ERROR(require(out_tensor, "out_tensor"));
    TensorId id = 0;
    STRATA_RETURN_IF_ERROR(runtime->impl->find(
        std::string_view(name, strnlen(name, STRATA_MAX_NAME_LENGTH + 1)), &id));
    *out_tensor = tensor_handle(id);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_tensor_unregister(strata_runtime_t* runtime,
                                                    strata_tensor_t* tensor) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_and_tensor(runtime, tensor));
    return runtime->impl->unregister(tensor_id(tensor));
  });
}

STRATA_API strata_status_t strata_tensor_get_info(strata_runtime_t* runtime,
                                                  strata_tensor_t* tensor,
                                                  strata_tensor_info_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_and_tensor(runtime, tensor));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    TensorRecord t;
    STRATA_RETURN_IF_ERROR(runtime->impl->info(tensor_id(tensor), &t));
    strata_tensor_info_t info{};
    std::snprintf(info.name, sizeof info.name, "%s", t.spec.name.c_str());
    info.dtype = static_cast<strata_dtype_t>(t.spec.dtype);
    info.ndim = static_cast<int32_t>(t.spec.shape.size());
    for (std::size_t i = 0; i < t.spec.shape.size(); ++i) info.shape[i] = t.spec.shape[i];
    info.nbytes = t.nbytes;
    info.role = static_cast<strata_role_t>(t.spec.role);
    info.home_tier = static_cast<strata_tier_t>(t.spec.home);
    info.tier = static_cast<strata_tier_t>(t.tier);
    info.migrating = t.migrating ? 1 : 0;
    info.export_count = t.export_count;
    write_struct(out, info);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_tensor_tier(strata_runtime_t* runtime, strata_tensor_t* tensor,
                                              strata_tier_t* out_tier) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_and_tensor(runtime, tensor));
    STRATA_RETURN_IF_ERROR(require(out_tier, "out_tier"));
    TensorRecord t;
    STRATA_RETURN_IF_ERROR(runtime->impl->info(tensor_id(tensor), &t));
    if (t.migrating) {
      return error(Code::kBusy, "tensor '", t.spec.name,
                   "' is moving; its tier is known once the move's event completes");
    }
    *out_tier = static_cast<strata_tier_t>(t.tier);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_tensor_write(strata_runtime_t* runtime, strata_tensor_t* tensor,
                                               uint64_t offset, const void* src, uint64_t bytes) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_and_tensor(runtime, tensor));
    if (bytes > 0) STRATA_RETURN_IF_ERROR(require(src, "src"));
    return runtime->impl->write(tensor_id(tensor), offset, src, bytes);
  });
}

STRATA_API strata_status_t strata_tensor_read(strata_runtime_t* runtime, strata_tensor_t* tensor,
                                              uint64_t offset, void* dst, uint64_t bytes) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_and_tensor(runtime, tensor));
    if (bytes > 0) STRATA_RETURN_IF_ERROR(require(dst, "dst"));
    return runtime->impl->read(tensor_id(tensor), offset, dst, bytes);
  });
}

STRATA_API strata_status_t strata_tensor_move(strata_runtime_t* runtime, strata_tensor_t* tensor,
                                              strata_tier_t dst_tier, void* stream,
                                              strata_event_t** out_event) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_and_tensor(runtime, tensor));
    if (!valid_tier(dst_tier)) return error(Code::kInvalidArgument, "unknown tier ", dst_tier);
    // Allocate the event before starting the move, so a failed allocation starts nothing.
    auto event = std::make_unique<strata_event>();
    STRATA_RETURN_IF_ERROR(runtime->impl->move(tensor_id(tensor), static_cast<Tier>(dst_tier),
                                               stream, &event->completion));
    if (out_event != nullptr) *out_event = event.release();
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_tensor_data_pointer(strata_runtime_t* runtime,
                                                      strata_tensor_t* tensor, void** out_ptr) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_and_tensor(runtime, tensor));
    STRATA_RETURN_IF_ERROR(require(out_ptr, "out_ptr"));
    return runtime->impl->data_pointer(tensor_id(tensor), out_ptr);
  });
}

STRATA_API strata_status_t strata_tensor_export_dlpack(strata_runtime_t* runtime,
                                                       strata_tensor_t* tensor,
                                                       DLManagedTensorVersioned** out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_and_tensor(runtime, tensor));
    STRATA_RETURN_IF_ERROR(require(out, "out"));
    ExportLease lease;
    STRATA_RETURN_IF_ERROR(runtime->impl->export_lease(tensor_id(tensor), &lease));
    *out = make_dlpack(std::move(lease), runtime->impl->device());
    return Status::ok();
  });
}

}  // extern "C"
