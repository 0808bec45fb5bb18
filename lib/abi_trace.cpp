// C ABI: tracing.
#include "lib/abi_support.h"

using namespace strata;
using namespace strata::abi;

extern "C" {

STRATA_API strata_status_t strata_trace_start(strata_runtime_t* runtime,
                                              const strata_trace_config_t* config) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    strata_trace_config_t c{};
    c.struct_size = STRATA_TRACE_CONFIG_STRUCT_SIZE;  // ring_capacity 0: the default
    if (config != nullptr) {
      STRATA_RETURN_IF_ERROR(read_struct(config, &c));
    }
    return runtime->impl->tracer().start(c.ring_capacity);
  });
}

STRATA_API strata_status_t strata_trace_stop(strata_runtime_t* runtime) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    runtime->impl->tracer().stop();
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_trace_flush(strata_runtime_t* runtime, const char* path) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(require(path, "path"));
    return runtime->impl->tracer().flush(path, runtime->impl->tensor_names());
  });
}

STRATA_API strata_status_t strata_trace_get_counters(strata_runtime_t* runtime,
                                                     strata_trace_counters_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(runtime, "runtime"));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    const TraceCounters c = runtime->impl->tracer().counters();
    strata_trace_counters_t t{};
    for (int i = 0; i < kTraceKindCount; ++i) {
      t.records[i] = c.records[i];
      t.bytes[i] = c.bytes[i];
    }
    t.dropped = c.dropped;
    write_struct(out, t);
    return Status::ok();
  });
}

}  // extern "C"
