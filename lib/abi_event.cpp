// C ABI: events.
#include "lib/abi_support.h"

using namespace strata;
using namespace strata::abi;

extern "C" {

STRATA_API strata_status_t strata_event_query(strata_event_t* event) {
  if (event == nullptr) return fail(__func__, Code::kInvalidArgument, "event is NULL");
  try {
    Status s = event->completion->query();
    if (s.code() == Code::kNotReady) return STRATA_ERROR_NOT_READY;  // not a failure: no message
    return s.is_ok() ? STRATA_OK : report(__func__, s);
  } catch (...) {
    return fail(__func__, Code::kOutOfMemory, "host memory allocation failed");
  }
}

STRATA_API strata_status_t strata_event_wait(strata_event_t* event, int64_t timeout_ms) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(event, "event"));
    return event->completion->wait(timeout_ms);
  });
}

STRATA_API strata_status_t strata_event_stream_wait(strata_event_t* event, void* stream) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(event, "event"));
    return event->completion->enqueue_wait(stream);
  });
}

STRATA_API strata_status_t strata_event_destroy(strata_event_t* event) {
  delete event;
  return STRATA_OK;
}

}  // extern "C"
