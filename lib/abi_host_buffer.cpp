// The host buffers and the one host budget (since 1.5): strata_runtime_set_host_budget,
// strata_runtime_host_usage, strata_host_buffer_*. The core is runtime/memory/host_buffers.h.
#include "lib/abi_support.h"

using namespace strata;
using namespace strata::abi;

namespace {

uint64_t buffer_id(const strata_host_buffer_t* handle) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(handle));
}

strata_host_buffer_t* buffer_handle(uint64_t id) {
  return reinterpret_cast<strata_host_buffer_t*>(static_cast<uintptr_t>(id));
}

}  // namespace

extern "C" {

STRATA_API strata_status_t strata_runtime_set_host_budget(strata_runtime_t* runtime,
                                                          uint64_t budget_bytes) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    return runtime->impl->host_buffers().set_budget(budget_bytes);
  });
}

STRATA_API strata_status_t strata_runtime_host_usage(strata_runtime_t* runtime,
                                                     strata_host_usage_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    const HostBudgetUsage u = runtime->impl->host_buffers().usage();
    strata_host_usage_t usage{};
    usage.budget_bytes = u.budget;
    usage.arena_bytes = u.arena;
    usage.buffer_bytes = u.buffers;
    usage.buffer_count = u.count;
    usage.room_bytes = u.room;
    usage.reserve_bytes = u.reserve;
    usage.available_bytes = u.available;
    write_struct(out, usage);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_host_buffer_create(strata_runtime_t* runtime,
                                                     const strata_host_buffer_desc_t* desc,
                                                     strata_host_buffer_t** out_buffer) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(require(out_buffer, "out_buffer"));
    strata_host_buffer_desc_t d{};
    STRATA_RETURN_IF_ERROR(read_struct(desc, &d));
    uint64_t id = 0;
    STRATA_RETURN_IF_ERROR(runtime->impl->host_buffers().create(
        d.bytes, d.name != nullptr ? std::string_view(d.name) : std::string_view(), &id));
    *out_buffer = buffer_handle(id);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_host_buffer_get_info(strata_runtime_t* runtime,
                                                       const strata_host_buffer_t* buffer,
                                                       strata_host_buffer_info_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    HostBufferInfo b;
    STRATA_RETURN_IF_ERROR(runtime->impl->host_buffers().info(buffer_id(buffer), &b));
    strata_host_buffer_info_t info{};
    info.data = b.data;
    info.bytes = b.bytes;
    info.charged_bytes = b.charged;
    info.pinned = b.pinned ? 1 : 0;
    info.numa_node = b.numa_node;
    write_struct(out, info);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_host_buffer_free(strata_runtime_t* runtime,
                                                   strata_host_buffer_t* buffer) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    return runtime->impl->host_buffers().destroy(buffer_id(buffer));
  });
}

}  // extern "C"
