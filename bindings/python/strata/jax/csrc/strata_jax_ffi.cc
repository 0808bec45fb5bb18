// strata_jax_ffi.cc: acquiring and releasing a streamed layer as XLA FFI custom calls, so a
// whole training step of strata.jax is one XLA program with no host synchronization per layer.
//
// Built by strata.jax._ffi (the system C++ compiler, jaxlib's FFI headers from
// jax.ffi.include_dir(), strata.h) into a small shared object that uses libstrata through its C
// ABI only, linked against the libstrata.so.1 the Python package loaded (same instance: the
// Python side checks that strata_version resolves to one address in both). It needs no CUDA
// toolkit: the CUDA handlers reach the driver (libcuda.so.1, already loaded by XLA) through a
// small shim opened at first use, as kvikio does.
//
// Ops (docs/python-reference.md, "The XLA FFI path"):
//   strata_acquire(token, dep) -> (token, weights...)    attributes: session, layer, phase
//     strata_layer_acquire on XLA's stream (CUDA: the stream waits device-side on Strata's
//     load events; host backend: NULL stream, the calling thread waits), then each weight is
//     copied from the layer's slot into the op's result buffer on that stream (XLA owns every
//     buffer of its program). Forward: the layer is released at once on the same stream (the
//     slot refills once the stream has passed the copies). Backward: the layer stays acquired
//     until strata_release.
//   strata_release(token, grads...) -> token             attributes: session
//     Copies each grad into the acquired backward layer's grad views on the stream, then
//     strata_layer_release on it: Strata records its event there, the D2H copies and the CPU
//     optimizer's update follow.
//   strata_begin(token) -> token                        attributes: session, mode
//     Begins the executor's step: a step the session left open (its program failed after its
//     begin) is abandoned first (strata_step_abort); the session's hook (the Python side:
//     the step's learning rates and weight decays, read by the optimizer at strata_step_begin)
//     runs; the layer cursors go back to the first layer; strata_step_begin. mode 1: a
//     forward-only step (evaluation), which strata_end abandons instead of ending.
//   strata_end(token) -> token                          attributes: session, mode
//     Ends the step (strata_step_end: blocks until the last grads have landed in DRAM) and
//     counts it; mode 1: strata_step_abort (nothing was released for the optimizer).
// With begin and end as ops, a whole training step needs no host call: a user's own jitted
// function can run the streamed blocks (docs/python-reference.md, "Inside your own jax.jit").
// `token` (a u32 scalar whose value means nothing) chains the ops so XLA keeps them in the
// executor's order; `dep` (the hidden state, or its grad) keeps an acquire after the previous
// block's compute, so XLA cannot hoist it (and hold every layer's weights at once). Both ops
// are registered with has_side_effect (never removed or merged).
//
// A session is a number baked into the compiled program as an attribute; the Python trainer
// binds it to its current executor (strata_jax_ffi_bind) and rebinds it when the executor is
// replaced, so the program is compiled once per trainer. layer = -1 takes the session's cursor
// (the next layer in step order), which a jax.lax.scan over the layers needs.
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "strata/strata.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// --- The CUDA driver, reached at run time (no toolkit at build time) ------------------------
using CUresult = int;
using CUcontext = void*;
using CUstream = void*;
using CUdeviceptr = unsigned long long;  // NOLINT: the driver's type

struct Driver {
  CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  // For strata_jax_ffi_copy_to_host only (its own error when missing):
  CUresult (*memcpy)(CUdeviceptr, CUdeviceptr, size_t) = nullptr;
  CUresult (*pointer_get_attribute)(void*, int, CUdeviceptr) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, int) = nullptr;
  CUresult (*primary_ctx_release)(int) = nullptr;
  CUresult (*stream_get_ctx)(CUstream, CUcontext*) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  std::string error;  // why it could not be loaded
};

const Driver& driver() {
  static const Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) {
      out.error = std::string("libcuda.so.1 cannot be opened: ") + dlerror();
      return out;
    }
    auto sym = [&](const char* name, auto* fn) {
      *reinterpret_cast<void**>(fn) = dlsym(lib, name);
      if (*fn == nullptr && out.error.empty()) out.error = std::string("libcuda lacks ") + name;
    };
    sym("cuMemcpyAsync", &out.memcpy_async);
    auto optional = [&](const char* name, auto* fn) {
      *reinterpret_cast<void**>(fn) = dlsym(lib, name);
    };
    optional("cuMemcpy", &out.memcpy);
    optional("cuPointerGetAttribute", &out.pointer_get_attribute);
    optional("cuDeviceGet", &out.device_get);
    optional("cuDevicePrimaryCtxRetain", &out.primary_ctx_retain);
    optional("cuDevicePrimaryCtxRelease_v2", &out.primary_ctx_release);
    sym("cuStreamGetCtx", &out.stream_get_ctx);
    sym("cuCtxGetCurrent", &out.ctx_get_current);
    sym("cuCtxSetCurrent", &out.ctx_set_current);
    sym("cuGetErrorString", &out.get_error_string);
    return out;
  }();
  return d;
}

std::string cu_message(const Driver& d, CUresult r) {
  const char* s = nullptr;
  if (d.get_error_string != nullptr) d.get_error_string(r, &s);
  return std::string(s != nullptr ? s : "unknown CUDA error") + " (" + std::to_string(r) + ")";
}

// Make the stream's context current on this thread (XLA's thunk thread usually has it already).
ffi::Error cuda_bind_context(CUstream stream) {
  const Driver& d = driver();
  if (!d.error.empty()) return ffi::Error::Internal("strata.jax ffi: " + d.error);
  CUcontext want = nullptr, have = nullptr;
  if (CUresult r = d.stream_get_ctx(stream, &want); r != 0) {
    return ffi::Error::Internal("strata.jax ffi: cuStreamGetCtx: " + cu_message(d, r));
  }
  d.ctx_get_current(&have);
  if (have != want) {
    if (CUresult r = d.ctx_set_current(want); r != 0) {
      return ffi::Error::Internal("strata.jax ffi: cuCtxSetCurrent: " + cu_message(d, r));
    }
  }
  return ffi::Error::Success();
}

// --- Sessions ----------------------------------------------------------------------------
struct Session {
  std::mutex mutex;
  strata_executor_t* executor = nullptr;
  uint32_t layers = 0;
  uint32_t leaves = 0;
  std::vector<uint64_t> bytes;  // layers x leaves: each weight's (and grad's) size
  uint32_t forward_next = 0;    // the cursor, for layer = -1
  uint32_t backward_next = 0;   // counts down from layers
  int64_t acquired = -1;        // the backward layer acquired (its grads go to release)
  std::vector<void*> grad_views;
  bool open = false;       // a step begun by the begin op and not yet ended or abandoned
  bool open_eval = false;  // the open step is forward-only
  uint64_t steps = 0;      // training steps the end op ended (the Python side's step count)
  uint64_t abandoned = 0;  // steps the begin op found open and abandoned
  // Called by the begin op before strata_step_begin with the step's number; nonzero fails the
  // op with the message it wrote (at most `capacity` bytes, NUL-terminated).
  int (*hook)(uint64_t session, uint64_t step, char* message, size_t capacity) = nullptr;
};

// Abandon the session's open step (lock held): the acquired layer is released on `stream`.
strata_status_t abandon(Session& s, void* stream) {
  s.open = false;
  s.acquired = -1;
  s.grad_views.clear();
  return strata_step_abort(s.executor, stream);
}

std::mutex g_sessions_mutex;
std::map<uint64_t, std::shared_ptr<Session>> g_sessions;
thread_local std::string g_error;

std::shared_ptr<Session> find(uint64_t id) {
  std::lock_guard lock(g_sessions_mutex);
  auto it = g_sessions.find(id);
  return it == g_sessions.end() ? nullptr : it->second;
}

// Every op's prologue: the session `id` names, bound to an executor, with the CUDA context of
// XLA's `stream` made current on this thread; or the error the op returns.
ffi::ErrorOr<std::shared_ptr<Session>> bound_session(uint64_t id, CUstream stream, bool cuda) {
  std::shared_ptr<Session> s = find(id);
  if (s == nullptr || s->executor == nullptr) {
    return ffi::Unexpected(
        ffi::Error::InvalidArgument("strata.jax ffi: session " + std::to_string(id) +
                                    " is not bound to an executor (the trainer is closed?)"));
  }
  if (cuda) {
    if (ffi::Error e = cuda_bind_context(stream); e.failure()) return ffi::Unexpected(e);
  }
  return s;
}

ffi::Error strata_error(const char* what, strata_status_t s, uint64_t layer) {
  return ffi::Error::Internal(std::string("strata.jax ffi: ") + what + " (layer " +
                              std::to_string(layer) + "): " + strata_status_string(s) + ": " +
                              strata_last_error_message());
}

// Copy `bytes` on `stream` (CUDA) or now (host: stream is NULL and memory is host memory).
ffi::Error copy(void* dst, const void* src, size_t bytes, CUstream stream, bool cuda) {
  if (bytes == 0) return ffi::Error::Success();
  if (!cuda) {
    std::memcpy(dst, src, bytes);
    return ffi::Error::Success();
  }
  const Driver& d = driver();
  if (CUresult r = d.memcpy_async(reinterpret_cast<CUdeviceptr>(dst),
                                  reinterpret_cast<CUdeviceptr>(src), bytes, stream);
      r != 0) {
    return ffi::Error::Internal("strata.jax ffi: cuMemcpyAsync: " + cu_message(d, r));
  }
  return ffi::Error::Success();
}

ffi::Error acquire(CUstream stream, bool cuda, uint64_t session, int64_t layer_attr, int32_t phase,
                   ffi::Result<ffi::AnyBuffer> /*token_out*/, ffi::RemainingRets weights) {
  auto bound = bound_session(session, stream, cuda);
  if (!bound.has_value()) return bound.error();
  const std::shared_ptr<Session>& s = *bound;
  std::lock_guard lock(s->mutex);
  if (phase != STRATA_PHASE_FORWARD && phase != STRATA_PHASE_BACKWARD) {
    return ffi::Error::InvalidArgument("strata.jax ffi: unknown phase");
  }
  const bool forward = phase == STRATA_PHASE_FORWARD;
  int64_t layer = layer_attr;
  if (layer < 0) layer = forward ? s->forward_next : int64_t(s->backward_next) - 1;
  if (layer < 0 || layer >= int64_t(s->layers)) {
    return ffi::Error::InvalidArgument("strata.jax ffi: layer " + std::to_string(layer) +
                                       " out of range (" + std::to_string(s->layers) +
                                       " layers; more acquires than layers in this step?)");
  }
  if (weights.size() != s->leaves) {
    return ffi::Error::InvalidArgument("strata.jax ffi: " + std::to_string(weights.size()) +
                                       " weight results for " + std::to_string(s->leaves) +
                                       " leaves");
  }
  strata_layer_views_t views;
  std::memset(&views, 0, sizeof views);
  views.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
  const auto l = static_cast<uint32_t>(layer);
  if (strata_status_t st = strata_layer_acquire(s->executor, l, phase, cuda ? stream : nullptr,
                                                STRATA_ACQUIRE_DEFAULT, &views);
      st != STRATA_OK) {
    ffi::Error e = strata_error("strata_layer_acquire", st, l);
    if (!s->open) {
      return ffi::Error::Internal(e.message() +
                                  " (no step is open: is the streamed model called more than "
                                  "once in one step, or outside its differentiated function?)");
    }
    return e;
  }
  ffi::Error failed = ffi::Error::Success();
  if (views.weight_count != s->leaves) {
    failed = ffi::Error::Internal("strata.jax ffi: the executor's layer has " +
                                  std::to_string(views.weight_count) + " weights, the trainer " +
                                  std::to_string(s->leaves));
  }
  for (uint32_t k = 0; k < s->leaves && !failed.failure(); ++k) {
    auto out = weights.get<ffi::AnyBuffer>(k);
    if (!out.has_value()) {
      failed = out.error();
      break;
    }
    ffi::AnyBuffer buf = **out;
    const uint64_t want = s->bytes[size_t(l) * s->leaves + k];
    if (buf.size_bytes() != want) {
      failed = ffi::Error::InvalidArgument(
          "strata.jax ffi: weight " + std::to_string(k) + " of layer " + std::to_string(l) +
          " is " + std::to_string(want) + " bytes, its result " + std::to_string(buf.size_bytes()));
      break;
    }
    failed = copy(buf.untyped_data(), views.weights[k], want, stream, cuda);
  }
  if (failed.failure()) {
    // Leave nothing acquired: the trainer aborts the step (strata_step_abort) after the error.
    return failed;
  }
  if (forward) {
    if (strata_status_t st = strata_layer_release(s->executor, l, phase, cuda ? stream : nullptr);
        st != STRATA_OK) {
      return strata_error("strata_layer_release", st, l);
    }
    s->forward_next = l + 1;
  } else {
    s->acquired = l;
    s->backward_next = l;
    s->grad_views.assign(views.grads, views.grads + views.grad_count);
  }
  return ffi::Error::Success();
}

ffi::Error release(CUstream stream, bool cuda, uint64_t session,
                   ffi::Result<ffi::AnyBuffer> /*token_out*/, ffi::RemainingArgs grads) {
  auto bound = bound_session(session, stream, cuda);
  if (!bound.has_value()) return bound.error();
  const std::shared_ptr<Session>& s = *bound;
  std::lock_guard lock(s->mutex);
  if (s->acquired < 0) {
    return ffi::Error::Internal("strata.jax ffi: release without a backward acquire");
  }
  const auto l = static_cast<uint32_t>(s->acquired);
  if (grads.size() != s->grad_views.size()) {
    return ffi::Error::InvalidArgument("strata.jax ffi: " + std::to_string(grads.size()) +
                                       " grads for " + std::to_string(s->grad_views.size()) +
                                       " grad views of layer " + std::to_string(l));
  }
  for (size_t k = 0; k < grads.size(); ++k) {
    auto g = grads.get<ffi::AnyBuffer>(k);
    if (!g.has_value()) return g.error();
    const uint64_t want = s->bytes[size_t(l) * s->leaves + k];
    if (g->size_bytes() != want) {
      return ffi::Error::InvalidArgument(
          "strata.jax ffi: grad " + std::to_string(k) + " of layer " + std::to_string(l) + " is " +
          std::to_string(g->size_bytes()) + " bytes, its view " + std::to_string(want));
    }
    if (ffi::Error e = copy(s->grad_views[k], g->untyped_data(), want, stream, cuda); e.failure()) {
      return e;
    }
  }
  if (strata_status_t st =
          strata_layer_release(s->executor, l, STRATA_PHASE_BACKWARD, cuda ? stream : nullptr);
      st != STRATA_OK) {
    return strata_error("strata_layer_release", st, l);
  }
  s->acquired = -1;
  s->grad_views.clear();
  return ffi::Error::Success();
}

ffi::Error begin(CUstream stream, bool cuda, uint64_t session, int32_t mode) {
  auto bound = bound_session(session, stream, cuda);
  if (!bound.has_value()) return bound.error();
  const std::shared_ptr<Session>& s = *bound;
  std::lock_guard lock(s->mutex);
  if (s->open) {
    // The program that began it failed before its end (an error in any of its ops): the grads
    // it released were applied, the step is not counted (strata_step_abort's semantics).
    ++s->abandoned;
    if (strata_status_t st = abandon(*s, cuda ? stream : nullptr); st != STRATA_OK) {
      return strata_error("strata_step_abort of the step left open", st, 0);
    }
  }
  if (s->hook != nullptr && mode == 0) {
    char message[1024] = {0};
    if (s->hook(session, s->steps, message, sizeof message) != 0) {
      return ffi::Error::Internal(std::string("strata.jax ffi: the step's begin hook: ") + message);
    }
  }
  s->forward_next = 0;
  s->backward_next = s->layers;
  s->acquired = -1;
  s->grad_views.clear();
  if (strata_status_t st = strata_step_begin(s->executor); st != STRATA_OK) {
    return strata_error("strata_step_begin", st, 0);
  }
  s->open = true;
  s->open_eval = mode != 0;
  return ffi::Error::Success();
}

ffi::Error end(CUstream stream, bool cuda, uint64_t session, int32_t mode) {
  auto bound = bound_session(session, stream, cuda);
  if (!bound.has_value()) return bound.error();
  const std::shared_ptr<Session>& s = *bound;
  std::lock_guard lock(s->mutex);
  if (!s->open || s->open_eval != (mode != 0)) {
    return ffi::Error::Internal(
        "strata.jax ffi: step end without its begin (is the streamed model called more than once "
        "in one step?)");
  }
  if (mode != 0) {
    if (strata_status_t st = abandon(*s, cuda ? stream : nullptr); st != STRATA_OK) {
      return strata_error("strata_step_abort (the end of a forward-only step)", st, 0);
    }
    return ffi::Error::Success();
  }
  strata_status_t st = strata_step_end(s->executor);
  if (st != STRATA_OK) {
    ffi::Error e = strata_error("strata_step_end", st, 0);
    (void)abandon(*s, cuda ? stream : nullptr);
    return e;
  }
  s->open = false;
  ++s->steps;
  return ffi::Error::Success();
}

// The bound signatures: the operands (token, dep / token) only order the ops.
ffi::Error acquire_host(ffi::AnyBuffer, ffi::AnyBuffer, uint64_t session, int64_t layer,
                        int32_t phase, ffi::Result<ffi::AnyBuffer> token,
                        ffi::RemainingRets weights) {
  return acquire(nullptr, false, session, layer, phase, token, weights);
}
ffi::Error acquire_cuda(void* stream, ffi::AnyBuffer, ffi::AnyBuffer, uint64_t session,
                        int64_t layer, int32_t phase, ffi::Result<ffi::AnyBuffer> token,
                        ffi::RemainingRets weights) {
  return acquire(stream, true, session, layer, phase, token, weights);
}
ffi::Error begin_host(ffi::AnyBuffer, uint64_t session, int32_t mode, ffi::Result<ffi::AnyBuffer>) {
  return begin(nullptr, false, session, mode);
}
ffi::Error begin_cuda(void* stream, ffi::AnyBuffer, uint64_t session, int32_t mode,
                      ffi::Result<ffi::AnyBuffer>) {
  return begin(stream, true, session, mode);
}
ffi::Error end_host(ffi::AnyBuffer, uint64_t session, int32_t mode, ffi::Result<ffi::AnyBuffer>) {
  return end(nullptr, false, session, mode);
}
ffi::Error end_cuda(void* stream, ffi::AnyBuffer, uint64_t session, int32_t mode,
                    ffi::Result<ffi::AnyBuffer>) {
  return end(stream, true, session, mode);
}
ffi::Error release_host(ffi::AnyBuffer, uint64_t session, ffi::Result<ffi::AnyBuffer> token,
                        ffi::RemainingArgs grads) {
  return release(nullptr, false, session, token, grads);
}
ffi::Error release_cuda(void* stream, ffi::AnyBuffer, uint64_t session,
                        ffi::Result<ffi::AnyBuffer> token, ffi::RemainingArgs grads) {
  return release(stream, true, session, token, grads);
}

}  // namespace

#define STRATA_EXPORT extern "C" __attribute__((visibility("default")))

// Operands of the acquire: token, dep (both only order the op). Of the release: token, then
// the grads (RemainingArgs). Results: the token, then the weights. The handler symbols are the
// library's exports (it is built with -fvisibility=hidden), taken by jax.ffi.pycapsule.
#pragma GCC visibility push(default)
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataJaxAcquireHost, acquire_host,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .Arg<ffi::AnyBuffer>()  // dep
                                  .Attr<uint64_t>("session")
                                  .Attr<int64_t>("layer")
                                  .Attr<int32_t>("phase")
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets(),
                              {});
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataJaxAcquireCuda, acquire_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<uint64_t>("session")
                                  .Attr<int64_t>("layer")
                                  .Attr<int32_t>("phase")
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets(),
                              {});
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataJaxReleaseHost, release_host,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .Attr<uint64_t>("session")
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingArgs(),
                              {});
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataJaxReleaseCuda, release_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<uint64_t>("session")
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingArgs(),
                              {});
#define STRATA_STEP_HANDLER(name, fn, ...)                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, fn,                              \
                                ffi::Ffi::Bind() __VA_ARGS__           \
                                    .Arg<ffi::AnyBuffer>() /* token */ \
                                    .Attr<uint64_t>("session")         \
                                    .Attr<int32_t>("mode")             \
                                    .Ret<ffi::AnyBuffer>(),            \
                                {});
STRATA_STEP_HANDLER(StrataJaxBeginHost, begin_host)
STRATA_STEP_HANDLER(StrataJaxBeginCuda, begin_cuda, .Ctx<ffi::PlatformStream<void*>>())
STRATA_STEP_HANDLER(StrataJaxEndHost, end_host)
STRATA_STEP_HANDLER(StrataJaxEndCuda, end_cuda, .Ctx<ffi::PlatformStream<void*>>())
#undef STRATA_STEP_HANDLER
#pragma GCC visibility pop

// --- The C entry points the Python side calls through ctypes ----------------------------
// Each returns 0 on success, -1 with strata_jax_ffi_error() set otherwise. Thread-safe.

// The address of strata_version as this library resolved it: the Python side compares it with
// its own, so both use one libstrata instance (one set of executors).
STRATA_EXPORT void* strata_jax_ffi_strata_version_address() {
  return reinterpret_cast<void*>(&strata_version);
}

STRATA_EXPORT const char* strata_jax_ffi_error() {
  return g_error.c_str();
}

// Bind `session` to `executor` (borrowed; rebinding replaces it) with `layers` x `leaves`
// weight sizes in bytes (`bytes`, borrowed, row-major). Resets the cursor.
STRATA_EXPORT int strata_jax_ffi_bind(uint64_t session, strata_executor_t* executor,
                                      uint32_t layers, uint32_t leaves, const uint64_t* bytes) {
  if (executor == nullptr || layers == 0 || leaves == 0 || bytes == nullptr) {
    g_error = "strata_jax_ffi_bind: NULL executor or sizes, or no layers or leaves";
    return -1;
  }
  std::shared_ptr<Session> s;
  {
    std::lock_guard lock(g_sessions_mutex);
    auto& slot = g_sessions[session];
    if (slot == nullptr) slot = std::make_shared<Session>();
    s = slot;
  }
  std::lock_guard lock(s->mutex);
  s->executor = executor;
  s->layers = layers;
  s->leaves = leaves;
  s->bytes.assign(bytes, bytes + size_t(layers) * leaves);
  s->forward_next = 0;
  s->backward_next = layers;
  s->acquired = -1;
  s->grad_views.clear();
  s->open = false;  // a new executor has no step running
  return 0;
}

// The begin op's hook (NULL: none); see Session::hook.
STRATA_EXPORT int strata_jax_ffi_set_hook(uint64_t session,
                                          int (*hook)(uint64_t, uint64_t, char*, size_t)) {
  std::shared_ptr<Session> s = find(session);
  if (s == nullptr) {
    g_error = "strata_jax_ffi_set_hook: unknown session " + std::to_string(session);
    return -1;
  }
  std::lock_guard lock(s->mutex);
  s->hook = hook;
  return 0;
}

// The session's counts: *steps ended by the end op, *abandoned steps, *open (1 while a step
// begun by the begin op has neither ended nor been abandoned). Any pointer may be NULL.
STRATA_EXPORT int strata_jax_ffi_state(uint64_t session, uint64_t* steps, uint64_t* abandoned,
                                       int* open) {
  std::shared_ptr<Session> s = find(session);
  if (s == nullptr) {
    g_error = "strata_jax_ffi_state: unknown session " + std::to_string(session);
    return -1;
  }
  std::lock_guard lock(s->mutex);
  if (steps != nullptr) *steps = s->steps;
  if (abandoned != nullptr) *abandoned = s->abandoned;
  if (open != nullptr) *open = s->open ? 1 : 0;
  return 0;
}

// Set the count of ended steps (a loaded checkpoint's).
STRATA_EXPORT int strata_jax_ffi_set_steps(uint64_t session, uint64_t steps) {
  std::shared_ptr<Session> s = find(session);
  if (s == nullptr) {
    g_error = "strata_jax_ffi_set_steps: unknown session " + std::to_string(session);
    return -1;
  }
  std::lock_guard lock(s->mutex);
  s->steps = steps;
  return 0;
}

// From the host: abandon the step left open by a program that failed (no-op without one).
// *abandoned (may be NULL) is set to 1 when there was one.
STRATA_EXPORT int strata_jax_ffi_abandon(uint64_t session, int* abandoned) {
  std::shared_ptr<Session> s = find(session);
  if (s == nullptr) {
    g_error = "strata_jax_ffi_abandon: unknown session " + std::to_string(session);
    return -1;
  }
  std::lock_guard lock(s->mutex);
  if (abandoned != nullptr) *abandoned = s->open ? 1 : 0;
  if (!s->open) return 0;
  ++s->abandoned;
  if (strata_status_t st = abandon(*s, nullptr); st != STRATA_OK) {
    g_error = std::string("strata_step_abort: ") + strata_status_string(st) + ": " +
              strata_last_error_message();
    return -1;
  }
  return 0;
}

// Copy `bytes` from device memory `src` to host memory `dst` (pinned: a DMA at the link's
// rate) with the driver, synchronously, in the primary context of the device that holds `src`
// (XLA's context): how setup writes values computed on the GPU straight into Strata's DRAM.
STRATA_EXPORT int strata_jax_ffi_copy_to_host(void* dst, const void* src, uint64_t bytes) {
  const Driver& d = driver();
  if (!d.error.empty()) {
    g_error = d.error;
    return -1;
  }
  if (d.memcpy == nullptr || d.pointer_get_attribute == nullptr || d.device_get == nullptr ||
      d.primary_ctx_retain == nullptr || d.primary_ctx_release == nullptr) {
    g_error = "libcuda lacks cuMemcpy, cuPointerGetAttribute or the primary-context calls";
    return -1;
  }
  constexpr int kPointerAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
  int ordinal = -1, device = 0;
  if (CUresult r = d.pointer_get_attribute(&ordinal, kPointerAttributeDeviceOrdinal,
                                           reinterpret_cast<CUdeviceptr>(src));
      r != 0) {
    g_error = "cuPointerGetAttribute(DEVICE_ORDINAL): " + cu_message(d, r);
    return -1;
  }
  if (CUresult r = d.device_get(&device, ordinal); r != 0) {
    g_error = "cuDeviceGet: " + cu_message(d, r);
    return -1;
  }
  CUcontext ctx = nullptr, have = nullptr;
  if (CUresult r = d.primary_ctx_retain(&ctx, device); r != 0) {
    g_error = "cuDevicePrimaryCtxRetain: " + cu_message(d, r);
    return -1;
  }
  d.ctx_get_current(&have);
  CUresult r = have == ctx ? 0 : d.ctx_set_current(ctx);
  if (r != 0) {
    g_error = "cuCtxSetCurrent: " + cu_message(d, r);
  } else if (r = d.memcpy(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src),
                          bytes);
             r != 0) {
    g_error = "cuMemcpy: " + cu_message(d, r);
  }
  if (have != ctx) d.ctx_set_current(have);
  d.primary_ctx_release(device);
  return r == 0 ? 0 : -1;
}

// Forget the session (a compiled program that still names it fails cleanly).
STRATA_EXPORT int strata_jax_ffi_unbind(uint64_t session) {
  std::lock_guard lock(g_sessions_mutex);
  g_sessions.erase(session);
  return 0;
}
