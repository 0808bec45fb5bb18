/*
 * strata.h — the stable C ABI of Strata, a memory-tiering runtime for training models larger
 * than GPU memory on one GPU.
 *
 * This is the only public header. It compiles as C99 and as C++.
 *
 * Conventions (they hold for every function below unless its comment says otherwise):
 *   - Functions return strata_status_t. STRATA_OK (0) is success; on any other value the
 *     calling thread's strata_last_error_message() says what went wrong (the tensor name, the
 *     numbers, the errno or CUDA error). Output parameters are written only on success.
 *   - No C++ exception, abort or assert crosses this boundary for bad input.
 *   - Every argument struct starts with `size_t struct_size`. Set it to the matching
 *     STRATA_*_STRUCT_SIZE macro of the header you compiled against. The library reads only the
 *     fields your size covers (later fields take their documented defaults). It accepts the size
 *     that macro had in any release, or any size at least its own; every other size (one ending
 *     inside a field or between two releases' sizes) is STRATA_ERROR_INVALID_ARGUMENT. Fields are
 *     only ever appended, never reordered or removed.
 *   - Pointer parameters say whether they are borrowed (read during the call only), transferred
 *     (ownership passes) or valid until a stated event.
 *   - Thread-safety: a runtime may be used from any number of threads at once; every function
 *     taking a strata_runtime_t* is thread-safe unless its comment says otherwise. Destroying an
 *     object while another thread still uses it is undefined, as in every C API.
 *   - Streams cross the ABI as opaque `void*`: a cudaStream_t on the cuda backend (NULL means
 *     the legacy default stream), ignored (pass NULL) on the host backend.
 *
 * Versioning (docs/abi.md has the whole rules): STRATA_VERSION_* are the header's version,
 * strata_version() the library's. The ABI is stable within a major version (the SONAME carries
 * it). A minor version only appends: functions (declared STRATA_API_SINCE(major, minor), their
 * symbols in that release's version node STRATA_<major>.<minor> of lib/strata.map), status
 * codes and enum values, and fields at the end of argument structs (with the struct's
 * STRATA_*_STRUCT_SIZE moved to the new last field). A program built against this header runs
 * on any library of the same major version and a minor version at least as new; against an
 * older library, a new function fails to resolve at load time rather than misbehaving.
 * Fields documented as "diagnostic" (reasons, placements: text for people) keep their place,
 * but their wording may change in any release: show or log them, never parse them.
 *
 * Experimental declarations (none in this release) sit at the end of this header between
 * `#ifdef STRATA_EXPERIMENTAL` and its closing `#endif`, visible only to programs
 * that define STRATA_EXPERIMENTAL before including it (zstd's ZSTD_STATIC_LINKING_ONLY). They are
 * for diagnostics likely to change; any release, even a patch, may change or remove them, and
 * their symbols live in the version node STRATA_EXPERIMENTAL, never in a STRATA_<major>.<minor>
 * one. A program using them must check strata_version() == STRATA_VERSION_NUMBER at start-up.
 * Nothing outside that section refers to it; a declaration graduates by moving out of it in a
 * minor release (then STRATA_API_SINCE that release, in its node).
 */
#ifndef STRATA_STRATA_H_
#define STRATA_STRATA_H_

#include <stddef.h>
#include <stdint.h>

/* ---------------------------------------------------------------------------------------------
 * Export and version macros
 * ------------------------------------------------------------------------------------------- */
#if defined(STRATA_BUILDING_LIBRARY) && defined(__GNUC__)
#define STRATA_API __attribute__((visibility("default")))
#else
#define STRATA_API
#endif
/* Marks a function added in ABI major.minor after 1.0 (plain STRATA_API: since 1.0), as GLib's
 * GLIB_AVAILABLE_IN_*: the test exported_symbols checks that its symbol sits in the version node
 * STRATA_<major>.<minor> of lib/strata.map. */
#define STRATA_API_SINCE(major, minor) STRATA_API

#define STRATA_VERSION_MAJOR 1
#define STRATA_VERSION_MINOR 5
#define STRATA_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, as zstd does: comparable with < and >. */
#define STRATA_VERSION_NUMBER \
  (STRATA_VERSION_MAJOR * 10000 + STRATA_VERSION_MINOR * 100 + STRATA_VERSION_PATCH)

/* Size of an argument struct up to and including its last field: what STRATA_*_STRUCT_SIZE
 * expand to. A field appended in a minor version moves its struct's macro to the new field; a
 * program built against an older header keeps passing the older, smaller size, which the
 * library accepts. The build of strata_layout_probe (generated from this header by
 * tests/abi/gen_layout_probe.py) static_asserts every macro against the last field of its
 * struct, and the test abi_layout compares the Python bindings' layout of every struct with it. */
#define STRATA_STRUCT_SIZE(type, last_field) \
  (offsetof(type, last_field) + sizeof(((type*)0)->last_field))

/* ---------------------------------------------------------------------------------------------
 * DLPack v1 declarations
 *
 * Tensors leave Strata as DLManagedTensorVersioned. If the including program already included
 * its own <dlpack/dlpack.h> (v1.0 or later) that one is used; otherwise these declarations,
 * written from the DLPack v1.0 specification, stand in and define its include guard so a later
 * #include <dlpack/dlpack.h> is skipped rather than conflicting.
 * ------------------------------------------------------------------------------------------- */
#if !defined(DLPACK_DLPACK_H_)
#define DLPACK_DLPACK_H_
#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 0
#ifdef __cplusplus
#define DLPACK_EXTERN_C extern "C"
#else
#define DLPACK_EXTERN_C
#endif
#define DLPACK_DLL

#ifdef __cplusplus
extern "C" {
#endif
typedef struct {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

typedef enum {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13,
  kDLOneAPI = 14,
  kDLWebGPU = 15,
  kDLHexagon = 16,
  kDLMAIA = 17
} DLDeviceType;

typedef struct {
  DLDeviceType device_type;
  int32_t device_id;
} DLDevice;

typedef enum {
  kDLInt = 0U,
  kDLUInt = 1U,
  kDLFloat = 2U,
  kDLOpaqueHandle = 3U,
  kDLBfloat = 4U,
  kDLComplex = 5U,
  kDLBool = 6U
} DLDataTypeCode;

typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
} DLTensor;

#define DLPACK_FLAG_BITMASK_READ_ONLY (1UL << 0UL)
#define DLPACK_FLAG_BITMASK_IS_COPIED (1UL << 1UL)

typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;
#ifdef __cplusplus
}
#endif
#elif !defined(DLPACK_MAJOR_VERSION) || DLPACK_MAJOR_VERSION < 1
#error \
    "strata.h needs DLPack >= 1.0 (DLManagedTensorVersioned); the dlpack.h included first is older"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Status codes. Values are fixed forever; new codes are only appended.
 * ------------------------------------------------------------------------------------------- */
typedef int32_t strata_status_t;
#define STRATA_OK 0
#define STRATA_ERROR_INVALID_ARGUMENT 1 /* NULL pointer, bad enum, size or struct_size */
#define STRATA_ERROR_OUT_OF_MEMORY 2    /* a tier's budget or arena cannot hold the request */
#define STRATA_ERROR_NOT_FOUND 3        /* unknown tensor name or stale handle */
#define STRATA_ERROR_ALREADY_EXISTS 4   /* a tensor of that name is registered already */
#define STRATA_ERROR_BUSY 5             /* the tensor is migrating or has live exports */
#define STRATA_ERROR_NOT_READY 6        /* an event's work has not finished yet (not a failure) */
#define STRATA_ERROR_UNSUPPORTED 7      /* the backend or build lacks the feature */
#define STRATA_ERROR_NO_DEVICE 8        /* the cuda backend was asked for and no usable GPU */
#define STRATA_ERROR_BACKEND 9          /* the device runtime (CUDA) reported an error */
#define STRATA_ERROR_IO 10              /* a storage read or write failed (errno in message) */
#define STRATA_ERROR_DATA_CORRUPTION 11 /* a checksum did not match */
#define STRATA_ERROR_CANCELLED 12       /* work was dropped because its runtime was destroyed */
#define STRATA_ERROR_TIMEOUT 13         /* a wait with a timeout ran out */
#define STRATA_ERROR_INVALID_STATE 14   /* the call is not allowed in the object's current state */
#define STRATA_ERROR_INTERNAL 15        /* a bug in Strata: please report the message */

/* ---------------------------------------------------------------------------------------------
 * Enumerations (int32 on the wire; values fixed forever)
 * ------------------------------------------------------------------------------------------- */
typedef int32_t strata_device_backend_t;
#define STRATA_DEVICE_BACKEND_AUTO 0 /* cuda where a usable GPU is present, host otherwise */
#define STRATA_DEVICE_BACKEND_CUDA 1 /* CUDA runtime: HBM arena, pinned DRAM, copy streams */
#define STRATA_DEVICE_BACKEND_HOST 2 /* simulated device in host memory, copies on threads */

typedef int32_t strata_tier_t;
#define STRATA_TIER_HBM 0  /* device memory (host memory on the host backend) */
#define STRATA_TIER_DRAM 1 /* pinned host memory */
#define STRATA_TIER_NVME 2 /* files on NVMe (or any O_DIRECT-capable file system) */
#define STRATA_TIER_COUNT 3

typedef int32_t strata_dtype_t;
#define STRATA_DTYPE_F32 0
#define STRATA_DTYPE_F16 1
#define STRATA_DTYPE_BF16 2
#define STRATA_DTYPE_F64 3
#define STRATA_DTYPE_I8 4
#define STRATA_DTYPE_U8 5
#define STRATA_DTYPE_I16 6
#define STRATA_DTYPE_I32 7
#define STRATA_DTYPE_I64 8
#define STRATA_DTYPE_BOOL 9
#define STRATA_DTYPE_COUNT 10

typedef int32_t strata_role_t;
#define STRATA_ROLE_WEIGHT 0
#define STRATA_ROLE_GRAD 1
#define STRATA_ROLE_OPTIMIZER_STATE 2
#define STRATA_ROLE_ACTIVATION 3
#define STRATA_ROLE_OTHER 4
#define STRATA_ROLE_COUNT 5

/* A link is one direction of data movement between two tiers. */
typedef int32_t strata_link_t;
#define STRATA_LINK_H2D 0        /* DRAM -> HBM */
#define STRATA_LINK_D2H 1        /* HBM -> DRAM */
#define STRATA_LINK_NVME_READ 2  /* NVMe -> host memory (DRAM or a staging buffer) */
#define STRATA_LINK_NVME_WRITE 3 /* host memory -> NVMe */
#define STRATA_LINK_COUNT 4

typedef int32_t strata_io_engine_t;
#define STRATA_IO_ENGINE_AUTO 0  /* io_uring where the kernel allows it, posix otherwise */
#define STRATA_IO_ENGINE_URING 1 /* io_uring only; create fails if the kernel refuses it */
#define STRATA_IO_ENGINE_POSIX 2 /* pread/pwrite on a thread pool */

typedef int32_t strata_numa_policy_t;
#define STRATA_NUMA_AUTO 0       /* the GPU's NUMA node (found with hwloc); local if unknown */
#define STRATA_NUMA_NODE 1       /* the node in dram_numa_node */
#define STRATA_NUMA_INTERLEAVE 2 /* pages spread over all nodes */

/* ---------------------------------------------------------------------------------------------
 * Opaque handles
 * ------------------------------------------------------------------------------------------- */
typedef struct strata_runtime strata_runtime_t;
/* A tensor handle names one registered tensor of one runtime. It is never dereferenced by the
 * library: a handle whose tensor was unregistered, or that belongs to another runtime, is
 * answered with STRATA_ERROR_NOT_FOUND, never a crash. */
typedef struct strata_tensor strata_tensor_t;
typedef struct strata_event strata_event_t;
/* A host buffer handle (since 1.5) names one live host buffer of one runtime, like a tensor
 * handle: never dereferenced; one freed already, another runtime's or never made is answered
 * with STRATA_ERROR_NOT_FOUND. Handles are never reused within a process. */
typedef struct strata_host_buffer strata_host_buffer_t;

/* ---------------------------------------------------------------------------------------------
 * Library
 * ------------------------------------------------------------------------------------------- */

/* The library's version as STRATA_VERSION_NUMBER computes it. Thread-safe; never fails. */
STRATA_API uint32_t strata_version(void);

/* The library's version as "MAJOR.MINOR.PATCH". The string is static (never free it).
 * Thread-safe; never fails. */
STRATA_API const char* strata_version_string(void);

/* A short constant name for a status code ("STRATA_ERROR_BUSY"); "STRATA_UNKNOWN_STATUS" for a
 * value this library does not know. The string is static. Thread-safe; never fails. */
STRATA_API const char* strata_status_string(strata_status_t status);

/* The message of the last failing call made on this thread, "" if none has failed. The
 * string is owned by the library and valid until this thread's next strata_ call. A successful
 * call does not clear it. Thread-safe (each thread has its own); never fails. */
STRATA_API const char* strata_last_error_message(void);

/* Names of enum values ("hbm", "dram", "nvme"; "cuda", "host"; "f32", ...; "weight", ...;
 * "h2d", ...), static strings; "unknown" for a value out of range. Thread-safe; never fail. */
STRATA_API const char* strata_tier_name(strata_tier_t tier);
STRATA_API const char* strata_device_backend_name(strata_device_backend_t backend);
STRATA_API const char* strata_dtype_name(strata_dtype_t dtype);
STRATA_API const char* strata_role_name(strata_role_t role);
STRATA_API const char* strata_link_name(strata_link_t link);

/* Bytes per element of a dtype (BOOL is 1), 0 for an unknown dtype. Thread-safe. */
STRATA_API size_t strata_dtype_size(strata_dtype_t dtype);

/* ---------------------------------------------------------------------------------------------
 * Runtime
 * ------------------------------------------------------------------------------------------- */

typedef struct strata_runtime_config {
  size_t struct_size; /* STRATA_RUNTIME_CONFIG_STRUCT_SIZE */
  /* Which device backend. AUTO picks cuda when a usable GPU is present and host otherwise;
   * strata_runtime_capabilities() says which was chosen and why. */
  strata_device_backend_t device_backend;
  /* CUDA device ordinal (0 = first GPU). Must be 0 on the host backend. */
  int32_t device_ordinal;
  /* HBM tier budget: one device allocation of this size is made at start-up and all HBM
   * tensors are sub-allocated from it; never allocated on the hot path. 0 = the default:
   * half the GPU's free memory on cuda, 1 GiB on host. On host the simulated HBM is host
   * memory: HBM and DRAM budgets together beyond the host's available memory fail at create
   * with STRATA_ERROR_OUT_OF_MEMORY. */
  uint64_t hbm_budget_bytes;
  /* DRAM tier budget: one host arena of this size, made resident and pinned (all of it, or
   * the part dram_pinned_bytes says) once at start-up, a hard cap: tensors beyond it fail with
   * STRATA_ERROR_OUT_OF_MEMORY, and a budget larger than the host's available memory fails at
   * create, never with an OOM kill. 0 = 1 GiB. */
  uint64_t dram_budget_bytes;
  /* NVMe tier budget over all nvme_paths together, rounded up to 4 KiB (a budget that
   * overflows when rounded is INVALID_ARGUMENT); 0 = no NVMe tier. */
  uint64_t nvme_budget_bytes;
  /* Host backend only: simulated link bandwidth per direction in bytes per second, so tests
   * can make copies slow. 0 = unlimited (memcpy speed). Must be 0 on cuda. */
  uint64_t host_link_bytes_per_second;
  /* Where the DRAM arena's pages live (see strata_numa_policy_t), and the node for
   * STRATA_NUMA_NODE. */
  strata_numa_policy_t dram_numa_policy;
  int32_t dram_numa_node;
  /* Threads that fault the DRAM arena in at start-up, while it is pinned; 0 = one per core the
   * calling process may run on (its CPU affinity; since 1.4; at most 16 before). At most 1024 (or
   * one per page) are used; where the OS refuses a thread, the calling thread faults in that
   * thread's share itself. */
  uint32_t dram_fault_threads;
  /* NVMe tier backing files, one per path, striped. Each is created if absent (and then
   * removed at destroy), opened with O_DIRECT, locked (flock, exclusive, while the runtime
   * lives) and preallocated to its share of nvme_budget_bytes. Two paths naming one file (same
   * inode) are INVALID_ARGUMENT; a file another runtime holds is STRATA_ERROR_BUSY. The array
   * and strings are borrowed: copied during create. */
  const char* const* nvme_paths;
  uint32_t nvme_path_count;
  strata_io_engine_t io_engine;
  /* Bytes per storage request and stripe unit: a multiple of 4096; 0 = 1 MiB. */
  uint32_t io_block_size;
  /* Storage requests in flight (and pinned staging slots per direction); 0 = 32. */
  uint32_t io_queue_depth;
  /* 1 (the default strata_runtime_config_init sets): a CRC-32C of every piece written to
   * NVMe, checked on every read (STRATA_ERROR_DATA_CORRUPTION on a mismatch). 0: none. */
  int32_t nvme_checksums;
  /* 0 (default): DRAM <-> NVMe transfers go through the pinned staging slots, a copy on the
   * host, pipelined with the disk. 1: O_DIRECT straight into and out of the DRAM arena, no
   * copy. Staging is the default because on the virtualized GPU servers we measured, direct
   * reads into a large arena were much slower than staged ones (docs/benchmarks/native.md has the
   * numbers); on bare-metal NVMe, direct may be faster: measure with
   * strata-bench io --dram-direct. */
  int32_t io_dram_direct;
  /* Since 1.5 (a 1.4 caller's struct_size ends before it: 0, everything pinned). How much of
   * the DRAM arena is pinned (registered with the device for DMA). 0 (the default): all of it,
   * as before 1.5. Otherwise the first dram_pinned_bytes, rounded up to the arena's 4 KiB
   * alignment, of the one mapping are registered and the rest is faulted in (same threads, NUMA
   * placement and huge pages) but never registered: the arena's set-up is then bound by the
   * fault-in rather than by the driver's registration. The arena is two arenas over the mapping,
   * the pinned one below (no tensor straddles the boundary: CUDA refuses a copy spanning a
   * registered and an unregistered range). A DRAM tensor of role STRATA_ROLE_OPTIMIZER_STATE
   * (read and written by the CPU's update only) goes to the unpinned arena, every other role to
   * the pinned one; registration and moves into DRAM use the other arena when the preferred
   * one has no room (a tier never fails while it has room; a transfer from the unpinned arena
   * is then a pageable copy, slower but correct; each such block of a role other than
   * optimizer state is counted in strata_tier_usage_t's dram_fallbacks). Size it with
   * strata_layout_totals_t.dram_gpu_bytes. A value above the (rounded) dram_budget_bytes is
   * INVALID_ARGUMENT naming both; equal to it is everything pinned.
   * strata_capabilities_t.dram_pinned_bytes reports what was registered. */
  uint64_t dram_pinned_bytes;
} strata_runtime_config_t;
#define STRATA_RUNTIME_CONFIG_STRUCT_SIZE \
  STRATA_STRUCT_SIZE(strata_runtime_config_t, dram_pinned_bytes)

/* Fill *config with defaults (AUTO backend, ordinal 0, default budgets) and set its
 * struct_size to STRATA_RUNTIME_CONFIG_STRUCT_SIZE. config: borrowed.
 * Errors: INVALID_ARGUMENT if config is NULL. Thread-safe. */
STRATA_API strata_status_t strata_runtime_config_init(strata_runtime_config_t* config);

/* Create a runtime: pick the device backend, make the HBM arena and the DRAM arena (pinned:
 * all of it, or its first dram_pinned_bytes) of the configured budgets, start the copy engines.
 * This is the slow call (it pins memory); nothing later allocates device or pinned memory.
 * config: borrowed; NULL means all defaults. out_runtime: on success receives a new runtime,
 * owned by the caller, released with strata_runtime_destroy().
 * Errors: INVALID_ARGUMENT (NULL out_runtime, bad struct_size, unknown backend, negative or
 * out-of-range ordinal or NUMA node, a field that does not apply to the chosen backend, NVMe
 * paths without a budget or the reverse, a bad block size or queue depth, dram_pinned_bytes
 * above the DRAM budget), NO_DEVICE (cuda asked for and no usable GPU, the CUDA error in the
 * message), OUT_OF_MEMORY (a budget that cannot be allocated or pinned, or exceeds available
 * host memory; or a copy, NVMe transfer or storage engine thread the OS refuses to start: the
 * thread and errno in the message), IO (an NVMe path cannot be opened with O_DIRECT or
 * preallocated: path and errno in the message), UNSUPPORTED (io_engine URING where the kernel
 * refuses io_uring). Thread-safe. */
STRATA_API strata_status_t strata_runtime_create(const strata_runtime_config_t* config,
                                                 strata_runtime_t** out_runtime);

/* Destroy a runtime and everything it owns. NULL is accepted (returns STRATA_OK).
 * Transfers already running are waited for; transfers queued but not started are cancelled,
 * their events complete with STRATA_ERROR_CANCELLED and their tensors' data is simply freed
 * with the runtime. DLPack exports still alive stay valid: the memory they point into is
 * released only when the last exporter's deleter has run. Events outlive the runtime and must
 * still be destroyed by their owner. Tensor handles become invalid.
 * Returns STRATA_OK, or STRATA_ERROR_CANCELLED (with the count in the message) if queued
 * transfers had to be cancelled; the runtime is destroyed either way.
 * Not thread-safe with respect to other calls on the same runtime: no other thread may be
 * inside a call on it. */
STRATA_API strata_status_t strata_runtime_destroy(strata_runtime_t* runtime);

typedef struct strata_capabilities {
  size_t struct_size;                     /* caller sets STRATA_CAPABILITIES_STRUCT_SIZE */
  strata_device_backend_t device_backend; /* the backend in use (never AUTO) */
  int32_t device_ordinal;
  int32_t cuda_compiled;                      /* 1 if this build has the cuda backend */
  int32_t cuda_available;                     /* 1 if a usable GPU was found at create time */
  int32_t tiers_available[STRATA_TIER_COUNT]; /* 1 per tier this runtime can hold tensors in */
  uint64_t tier_budget_bytes[STRATA_TIER_COUNT];
  /* NUMA node closest to the GPU (found with hwloc); -1 if unknown or not applicable. */
  int32_t device_numa_node;
  /* The GPU's name ("NVIDIA H200"), "host (simulated device)" on the host backend. */
  char device_name[128];
  /* Diagnostic: why this backend was chosen, e.g. "auto: no CUDA device (cudaErrorNoDevice)". */
  char backend_reason[256];
  /* The DRAM arena: where its pages were placed (diagnostic: "node 0 (the GPU's)"), the node
   * (-1 if interleaved or unbound), whether huge pages were granted, how long start-up took to
   * fault it in (with dram_fault_threads threads), and how much longer pinning took: since 1.4
   * pinning runs beside the fault-in, so dram_pin_seconds is what it added after the fault-in
   * ended (often 0) and their sum is the arena's whole set-up. */
  char dram_placement[64];
  int32_t dram_numa_node;
  int32_t dram_huge_pages;
  uint32_t dram_fault_threads;
  double dram_fault_seconds;
  double dram_pin_seconds;
  /* The storage engine of the NVMe tier ("io_uring", "posix"; "" without one) and why
   * (diagnostic). */
  char io_engine[16];
  char io_engine_reason[256];
  /* Since 1.5 (not written for a 1.4 caller's struct_size): the bytes of the DRAM arena
   * registered with the device, from its start: the whole arena unless dram_pinned_bytes asked
   * for less (rounded up to 4 KiB). dram_pin_seconds is the time pinning this part added. */
  uint64_t dram_pinned_bytes;
} strata_capabilities_t;
#define STRATA_CAPABILITIES_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_capabilities_t, dram_pinned_bytes)

/* Describe the runtime. runtime: borrowed. out: borrowed; the caller sets out->struct_size and
 * the library fills the fields that size covers.
 * Errors: INVALID_ARGUMENT (NULL runtime or out, bad struct_size). Thread-safe. */
STRATA_API strata_status_t strata_runtime_capabilities(strata_runtime_t* runtime,
                                                       strata_capabilities_t* out);

typedef struct strata_tier_usage {
  size_t struct_size;          /* caller sets STRATA_TIER_USAGE_STRUCT_SIZE */
  uint64_t budget_bytes;       /* the tier's capacity */
  uint64_t used_bytes;         /* allocated to tensors, alignment padding included */
  uint64_t largest_free_bytes; /* the largest single allocation that would succeed now */
  uint64_t tensor_count;       /* tensors whose data lives in this tier now */
  /* Since 1.5 (not written for a 1.4 caller's struct_size); DRAM only, 0 for the other tiers.
   * The pinned arena's part of budget_bytes and used_bytes (with strata_runtime_config_t's
   * dram_pinned_bytes at 0, all of them), and how many DRAM blocks (registrations and moves in)
   * of a role the GPU's copies touch (every role but optimizer state) went to the unpinned
   * arena because the pinned one had no room: their transfers are pageable copies, slower.
   * Optimizer state placed in the pinned arena for want of unpinned room is not counted (it
   * only takes pinned room). Cumulative over the runtime's life. */
  uint64_t pinned_budget_bytes;
  uint64_t pinned_used_bytes;
  uint64_t dram_fallbacks;
} strata_tier_usage_t;
#define STRATA_TIER_USAGE_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_tier_usage_t, dram_fallbacks)

/* How full a tier is. runtime, out: borrowed. Errors: INVALID_ARGUMENT (NULL, bad tier, bad
 * struct_size). A tier that is not available reports zeros. Thread-safe. */
STRATA_API strata_status_t strata_runtime_tier_usage(strata_runtime_t* runtime, strata_tier_t tier,
                                                     strata_tier_usage_t* out);

typedef struct strata_link_stats {
  size_t struct_size; /* caller sets STRATA_LINK_STATS_STRUCT_SIZE */
  uint64_t bytes;     /* payload bytes moved over the link since create (or the last reset) */
  uint64_t transfers; /* completed transfers */
  uint64_t busy_ns;   /* time the link had at least one transfer running, in nanoseconds */
} strata_link_stats_t;
#define STRATA_LINK_STATS_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_link_stats_t, busy_ns)

/* Counters of one link. bytes / busy_ns is the link's achieved bandwidth while busy.
 * runtime, out: borrowed. Errors: INVALID_ARGUMENT (NULL, unknown link, bad struct_size).
 * Thread-safe; counts only completed transfers (an executor's copies are counted when their
 * step ends, at strata_step_end). */
STRATA_API strata_status_t strata_runtime_link_stats(strata_runtime_t* runtime, strata_link_t link,
                                                     strata_link_stats_t* out);

/* Reset every link's counters to zero. Errors: INVALID_ARGUMENT (NULL). Thread-safe. */
STRATA_API strata_status_t strata_runtime_reset_stats(strata_runtime_t* runtime);

/* Block until every transfer submitted so far has finished (successfully or not).
 * Errors: INVALID_ARGUMENT (NULL). Thread-safe. */
STRATA_API strata_status_t strata_runtime_synchronize(strata_runtime_t* runtime);

/* ---------------------------------------------------------------------------------------------
 * Host buffers (since 1.5): host memory a binding needs beside its tensors (activation
 * checkpoints it moves off the device, optimizer state it pages out, host replicas, staging),
 * allocated by the runtime so that every host byte of a run is under one budget.
 *
 * The host budget is the DRAM arena (dram_budget_bytes, made at creation) and the live host
 * buffers together: one figure, set with strata_runtime_set_host_budget (until then it is the
 * arena's size, and no buffer has room). A buffer is its own mapping, made the way the arena is:
 * placed on the device's NUMA node (dram_numa_policy), faulted in by several threads while the
 * backend pins it (page-locked for asynchronous copies on the cuda backend; ordinary memory on
 * the host backend, counted the same way). Each buffer is charged its size rounded up to 4 KiB.
 * Besides the budget, a buffer must leave STRATA_HOST_RESERVE_PERCENT of the machine's memory
 * (MemTotal) available (MemAvailable): room for the OS, the page cache and the framework that
 * no budget counts.
 * ------------------------------------------------------------------------------------------- */

/* The share of the machine's memory a new host buffer must leave available, in percent. */
#define STRATA_HOST_RESERVE_PERCENT 10

/* Set the runtime's whole host budget: the DRAM arena and the host buffers together (bytes).
 * A budget below what the arena and the live buffers hold now is accepted: nothing is taken
 * back, and new buffers are refused until enough are freed.
 * Errors: INVALID_ARGUMENT (NULL runtime, a budget below the DRAM arena's bytes, which it
 * includes). Thread-safe. */
STRATA_API_SINCE(1, 5)
strata_status_t strata_runtime_set_host_budget(strata_runtime_t* runtime, uint64_t budget_bytes);

typedef struct strata_host_usage {
  size_t struct_size;       /* caller sets STRATA_HOST_USAGE_STRUCT_SIZE */
  uint64_t budget_bytes;    /* the whole host budget: the DRAM arena and the host buffers */
  uint64_t arena_bytes;     /* the DRAM arena's (its pinned and unpinned parts) */
  uint64_t buffer_bytes;    /* charged to the live host buffers (and to those being made) */
  uint64_t buffer_count;    /* live host buffers */
  uint64_t room_bytes;      /* what one more buffer may be charged now: budget - arena - buffers,
                               0 when nothing is left */
  uint64_t reserve_bytes;   /* machine memory a new buffer must leave available (0: unknown) */
  uint64_t available_bytes; /* the machine's available memory now (MemAvailable; 0: unknown) */
} strata_host_usage_t;
#define STRATA_HOST_USAGE_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_host_usage_t, available_bytes)

/* The host budget and what holds it. runtime, out: borrowed.
 * Errors: INVALID_ARGUMENT (NULL, bad struct_size). Thread-safe. */
STRATA_API_SINCE(1, 5)
strata_status_t strata_runtime_host_usage(strata_runtime_t* runtime, strata_host_usage_t* out);

typedef struct strata_host_buffer_desc {
  size_t struct_size; /* STRATA_HOST_BUFFER_DESC_STRUCT_SIZE */
  uint64_t bytes;     /* > 0 */
  /* For error messages ("host buffer 'checkpoint 3'"); NULL or "" for none. Borrowed: copied
   * during the call. */
  const char* name;
} strata_host_buffer_desc_t;
#define STRATA_HOST_BUFFER_DESC_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_host_buffer_desc_t, name)

/* Allocate a host buffer of desc->bytes, every byte zero, charged against the host budget.
 * Slow like the arena's set-up (it maps, places, faults in and pins): allocate once and reuse.
 * runtime, desc: borrowed. out_buffer: receives the handle, owned by the caller, released with
 * strata_host_buffer_free (or with the runtime: strata_runtime_destroy frees the buffers still
 * live, and their memory with them).
 * Errors: INVALID_ARGUMENT (NULL, bad struct_size, 0 bytes), OUT_OF_MEMORY (the host budget's
 * room is smaller than the buffer's charge, the message naming the budget, the arena, the
 * buffers and the room; or the buffer would leave less than STRATA_HOST_RESERVE_PERCENT of the
 * machine's memory available, the message naming the reserve and what is available; or the
 * mapping failed), and the backend's error if pinning fails (OUT_OF_MEMORY on cuda). Nothing is
 * charged on failure. Thread-safe: threads may allocate and free at once. */
STRATA_API_SINCE(1, 5)
strata_status_t strata_host_buffer_create(strata_runtime_t* runtime,
                                          const strata_host_buffer_desc_t* desc,
                                          strata_host_buffer_t** out_buffer);

typedef struct strata_host_buffer_info {
  size_t struct_size;     /* caller sets STRATA_HOST_BUFFER_INFO_STRUCT_SIZE */
  void* data;             /* its first byte (page-aligned); valid until the buffer is freed */
  uint64_t bytes;         /* as asked */
  uint64_t charged_bytes; /* counted against the host budget: bytes rounded up to 4 KiB */
  uint32_t pinned;        /* 1: page-locked for the device's copies (cuda); 0 on the host backend */
  int32_t numa_node;      /* the node its pages were bound to; -1 interleaved or unbound */
} strata_host_buffer_info_t;
#define STRATA_HOST_BUFFER_INFO_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_host_buffer_info_t, numa_node)

/* Where a host buffer is and what it takes. runtime, out: borrowed.
 * Errors: INVALID_ARGUMENT (NULL runtime or out, bad struct_size), NOT_FOUND (not a live buffer
 * of this runtime: freed already, another runtime's, or never made). Thread-safe. */
STRATA_API_SINCE(1, 5)
strata_status_t strata_host_buffer_get_info(strata_runtime_t* runtime,
                                            const strata_host_buffer_t* buffer,
                                            strata_host_buffer_info_t* out);

/* Free a host buffer: unpinned and unmapped, its charge returned to the host budget. The caller
 * makes sure nothing reads or writes it any more (no copy in flight on any stream).
 * Errors: INVALID_ARGUMENT (NULL runtime), NOT_FOUND (not a live buffer of this runtime: freed
 * already, another runtime's, or never made; nothing happens). Thread-safe. */
STRATA_API_SINCE(1, 5)
strata_status_t strata_host_buffer_free(strata_runtime_t* runtime, strata_host_buffer_t* buffer);

/* ---------------------------------------------------------------------------------------------
 * Tensors
 * ------------------------------------------------------------------------------------------- */

#define STRATA_MAX_NDIM 8
#define STRATA_MAX_NAME_LENGTH 255

typedef struct strata_tensor_desc {
  size_t struct_size; /* STRATA_TENSOR_DESC_STRUCT_SIZE */
  /* Unique name within the runtime, 1..STRATA_MAX_NAME_LENGTH bytes, NUL-terminated, valid
   * UTF-8 and not "__metadata__" (so every tensor can be checkpointed as safetensors).
   * Borrowed: copied during the call. */
  const char* name;
  strata_dtype_t dtype;
  int32_t ndim;         /* 0..STRATA_MAX_NDIM; 0 is a scalar */
  const int64_t* shape; /* ndim entries, each >= 0; borrowed; may be NULL when ndim == 0 */
  strata_role_t role;
  strata_tier_t home_tier; /* where the tensor's memory is allocated at registration */
} strata_tensor_desc_t;
#define STRATA_TENSOR_DESC_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_tensor_desc_t, home_tier)

/* Register a tensor and allocate its memory (row-major, contiguous, 256-byte aligned) in its
 * home tier. The contents are undefined until written.
 * runtime, desc: borrowed. out_tensor: receives the handle; may be NULL if the caller will
 * look the tensor up by name. The handle stays valid until strata_tensor_unregister() or
 * strata_runtime_destroy().
 * Errors: INVALID_ARGUMENT (NULL, bad struct_size, empty or too long name, unknown dtype, role
 * or tier, ndim out of range, a negative dimension, a byte size that overflows),
 * ALREADY_EXISTS (the name is taken), OUT_OF_MEMORY (the home tier cannot hold it: the
 * message has the requested, free and largest-free bytes), UNSUPPORTED (a home tier this
 * runtime does not have, e.g. NVMe without nvme_paths). Thread-safe. */
STRATA_API strata_status_t strata_tensor_register(strata_runtime_t* runtime,
                                                  const strata_tensor_desc_t* desc,
                                                  strata_tensor_t** out_tensor);

/* Find a registered tensor by name. runtime, name: borrowed. out_tensor: receives the handle.
 * Errors: INVALID_ARGUMENT (NULL), NOT_FOUND (no tensor of that name). Thread-safe. */
STRATA_API strata_status_t strata_tensor_find(strata_runtime_t* runtime, const char* name,
                                              strata_tensor_t** out_tensor);

/* Unregister a tensor and free its memory. The handle becomes invalid.
 * Errors: INVALID_ARGUMENT (NULL runtime or tensor), NOT_FOUND (stale handle), BUSY (a
 * migration of it is in flight, or DLPack exports of it are alive). Thread-safe. */
STRATA_API strata_status_t strata_tensor_unregister(strata_runtime_t* runtime,
                                                    strata_tensor_t* tensor);

typedef struct strata_tensor_info {
  size_t struct_size; /* caller sets STRATA_TENSOR_INFO_STRUCT_SIZE */
  char name[STRATA_MAX_NAME_LENGTH + 1];
  strata_dtype_t dtype;
  int32_t ndim;
  int64_t shape[STRATA_MAX_NDIM];
  uint64_t nbytes; /* element count times dtype size */
  strata_role_t role;
  strata_tier_t home_tier;
  strata_tier_t tier;   /* where the data lives now (the destination once a move completes) */
  int32_t migrating;    /* 1 while a move of it is in flight */
  int32_t export_count; /* live DLPack exports */
} strata_tensor_info_t;
#define STRATA_TENSOR_INFO_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_tensor_info_t, export_count)

/* Describe a tensor. runtime, tensor, out: borrowed.
 * Errors: INVALID_ARGUMENT (NULL, bad struct_size), NOT_FOUND (stale handle). Thread-safe. */
STRATA_API strata_status_t strata_tensor_get_info(strata_runtime_t* runtime,
                                                  strata_tensor_t* tensor,
                                                  strata_tensor_info_t* out);

/* The tier the tensor's data lives in now. Errors: INVALID_ARGUMENT (NULL), NOT_FOUND,
 * BUSY (a move is in flight: the tier is about to change; wait on its event). Thread-safe. */
STRATA_API strata_status_t strata_tensor_tier(strata_runtime_t* runtime, strata_tensor_t* tensor,
                                              strata_tier_t* out_tier);

/* Copy `bytes` bytes from host memory `src` into the tensor at byte `offset`, whatever tier it
 * is in (on NVMe, the pieces touched are read, patched and written back with new checksums;
 * a piece the range covers to its end or to the tensor's end is not read).
 * Synchronous: when it returns the data is in place. src: borrowed, any host memory.
 * Errors: INVALID_ARGUMENT (NULL, offset + bytes beyond the tensor), NOT_FOUND, BUSY (a move
 * is in flight), BACKEND (the copy failed: CUDA error in the message), IO, DATA_CORRUPTION (a
 * piece it had to read failed its checksum; writing the whole tensor repairs it).
 * After an IO error on NVMe the bytes of [offset, offset + bytes) are unspecified (each holds
 * its old or its new value, as after a failed pwrite), the rest of the tensor is unchanged and
 * stays readable, and writing the range again succeeds once the fault is gone.
 * Thread-safe; concurrent writes to overlapping bytes of one tensor race as plain memory
 * would. */
STRATA_API strata_status_t strata_tensor_write(strata_runtime_t* runtime, strata_tensor_t* tensor,
                                               uint64_t offset, const void* src, uint64_t bytes);

/* Copy `bytes` bytes of the tensor from byte `offset` into host memory `dst`. Synchronous.
 * dst: borrowed. Errors and thread-safety as strata_tensor_write. */
STRATA_API strata_status_t strata_tensor_read(strata_runtime_t* runtime, strata_tensor_t* tensor,
                                              uint64_t offset, void* dst, uint64_t bytes);

/* Move a tensor to another tier asynchronously. The copy is ordered after all work already
 * submitted to `stream` (so the caller's kernels that write the tensor finish first); the
 * calling thread does not block. Space in the destination tier is reserved before this
 * returns; the source copy is freed only once the data has landed, so a failed copy loses
 * nothing (the tensor stays where it was and the event reports the error).
 * Moving to the tier it is in completes at once. While the move is in flight the tensor
 * cannot be read, written, moved, exported or unregistered (BUSY). Moves between HBM and NVMe
 * are pipelined through pinned staging buffers; moves out of NVMe check checksums (if on) and
 * fail with DATA_CORRUPTION naming the tensor and the offset, leaving the tensor on NVMe.
 * stream: borrowed, see the stream convention above. out_event: receives a new event owned
 * by the caller (destroy it with strata_event_destroy); may be NULL to fire and forget.
 * Errors: INVALID_ARGUMENT (NULL runtime or tensor, unknown tier), NOT_FOUND, BUSY (already
 * moving, or DLPack exports alive), OUT_OF_MEMORY (the destination cannot hold it, with the
 * numbers), UNSUPPORTED (a tier this runtime does not have), BACKEND. Thread-safe. */
STRATA_API strata_status_t strata_tensor_move(strata_runtime_t* runtime, strata_tensor_t* tensor,
                                              strata_tier_t dst_tier, void* stream,
                                              strata_event_t** out_event);

/* The address of the tensor's data in its current tier: a device pointer for HBM on cuda, a
 * pinned host pointer for DRAM. The pointer is borrowed and valid until the tensor is moved or
 * unregistered or the runtime destroyed; it does not keep the tensor in place (use a DLPack
 * export for that). Errors: INVALID_ARGUMENT (NULL), NOT_FOUND, BUSY (a move is in flight),
 * INVALID_STATE (the tensor is on NVMe, which has no address). Thread-safe. */
STRATA_API strata_status_t strata_tensor_data_pointer(strata_runtime_t* runtime,
                                                      strata_tensor_t* tensor, void** out_ptr);

/* Export the tensor as DLPack (contiguous, strides NULL). Device kDLCUDA for HBM on cuda,
 * kDLCUDAHost for DRAM on cuda, kDLCPU on the host backend. The export keeps the tensor in
 * place: while any export is alive the tensor cannot be moved or unregistered (BUSY), and its
 * memory outlives even strata_runtime_destroy() until the deleter runs.
 * out: receives a DLManagedTensorVersioned whose ownership passes to the caller, who must call
 * (*out)->deleter(*out) exactly once (any thread, also after the runtime is destroyed).
 * Errors: INVALID_ARGUMENT (NULL), NOT_FOUND, BUSY (a move is in flight), INVALID_STATE (the
 * tensor is on NVMe). Thread-safe. */
STRATA_API strata_status_t strata_tensor_export_dlpack(strata_runtime_t* runtime,
                                                       strata_tensor_t* tensor,
                                                       DLManagedTensorVersioned** out);

/* ---------------------------------------------------------------------------------------------
 * Events: completion of asynchronous work (a move)
 * ------------------------------------------------------------------------------------------- */

/* STRATA_OK if the work finished successfully, STRATA_ERROR_NOT_READY if it is still running
 * (no message is set for that), or the work's own error status (with its message) if it
 * failed. Errors: INVALID_ARGUMENT (NULL). Thread-safe; never blocks. */
STRATA_API strata_status_t strata_event_query(strata_event_t* event);

/* Block the calling thread until the work finished, at most timeout_ms milliseconds
 * (a negative value, or one of 100 years or more such as INT64_MAX, waits without limit).
 * Returns as strata_event_query, or
 * STRATA_ERROR_TIMEOUT if the time ran out first. Thread-safe; any number of threads may wait
 * on one event. */
STRATA_API strata_status_t strata_event_wait(strata_event_t* event, int64_t timeout_ms);

/* Make `stream` wait for the event's work without blocking the calling thread (cuda:
 * cudaStreamWaitEvent). On the host backend, where streams are not used, and for moves out of
 * NVMe (which end in several staged copies), it waits on the calling thread like
 * strata_event_wait. stream: borrowed.
 * Errors: INVALID_ARGUMENT (NULL event), BACKEND, or the work's own error if it has already
 * failed. Thread-safe. */
STRATA_API strata_status_t strata_event_stream_wait(strata_event_t* event, void* stream);

/* Destroy an event; NULL is accepted. Destroying an event does not cancel its work, and it may
 * outlive its runtime. Not thread-safe with respect to other calls on the same event. */
STRATA_API strata_status_t strata_event_destroy(strata_event_t* event);

/* ---------------------------------------------------------------------------------------------
 * Layer graph, plan, executor: streaming a model through HBM
 *
 * A framework declares its layers (forward order) and their tensors by role, plans, then runs
 * each step as:
 *   strata_step_begin
 *   for layer in 0..L-1:  strata_layer_acquire(FORWARD)  -> views; compute; strata_layer_release
 *   for layer in L-1..0:  strata_layer_acquire(BACKWARD) -> views; compute; strata_layer_release
 *   strata_step_end
 * Micro-batches are layer-major: run all of a step's micro-batches between one acquire and its
 * release, so weights cross PCIe once per step; grad buffers start at zero and accumulate
 * (except an optimizer's in-place gradient sums, STRATA_GRAD_SUM_IN_PLACE: zeroed only when the
 * param holds no grad, else holding the running sum the framework adds to).
 * ------------------------------------------------------------------------------------------- */
typedef struct strata_graph strata_graph_t;
typedef struct strata_plan strata_plan_t;
typedef struct strata_executor strata_executor_t;

typedef int32_t strata_phase_t;
#define STRATA_PHASE_FORWARD 0
#define STRATA_PHASE_BACKWARD 1

typedef int32_t strata_view_role_t;
#define STRATA_VIEW_WEIGHT 0
#define STRATA_VIEW_GRAD 1
#define STRATA_VIEW_ACTIVATION 2

typedef int32_t strata_plan_format_t;
#define STRATA_PLAN_FORMAT_JSON 0
#define STRATA_PLAN_FORMAT_TEXT 1

/* Create an empty graph over `runtime`'s tensors. out_graph: owned by the caller, released with
 * strata_graph_destroy(); it keeps the runtime's core alive but must be destroyed before the
 * runtime handle is. Errors: INVALID_ARGUMENT (NULL). Thread-safe. */
STRATA_API strata_status_t strata_graph_create(strata_runtime_t* runtime,
                                               strata_graph_t** out_graph);

/* Destroy a graph; NULL is accepted. Plans made from it are independent of it. */
STRATA_API strata_status_t strata_graph_destroy(strata_graph_t* graph);

typedef struct strata_layer_desc {
  size_t struct_size; /* STRATA_LAYER_DESC_STRUCT_SIZE */
  const char* name;   /* borrowed (copied); NULL = "layer.N" */
  /* Tensor handle arrays, borrowed (copied during the call). Weights (required, in DRAM or all
   * on NVMe) are streamed into HBM for both passes; grads (in DRAM) are HBM buffers the
   * backward pass fills, sent to the grad tensors afterwards (since 1.2 a grad may live in HBM:
   * then its view is the grad tensor itself, zeroed at the backward load, unless it is an
   * in-place gradient sum of an attached optimizer, STRATA_GRAD_SUM_IN_PLACE, which is zeroed
   * only when its param holds no grad); activation checkpoints
   * (in DRAM) are HBM buffers the forward pass fills, parked in the tensors and brought back for
   * the backward pass; optimizer state is declared for placement only. A tensor may appear once in
   * the whole graph. */
  strata_tensor_t* const* weights;
  uint32_t weight_count;
  strata_tensor_t* const* grads;
  uint32_t grad_count;
  strata_tensor_t* const* activations;
  uint32_t activation_count;
  strata_tensor_t* const* optimizer_state;
  uint32_t optimizer_state_count;
  /* Work per micro-batch, for the planner's prediction (0 = unknown). */
  double forward_flops;
  double backward_flops;
} strata_layer_desc_t;
#define STRATA_LAYER_DESC_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_layer_desc_t, backward_flops)

/* Append a layer (layers are declared in forward order). out_index: receives its index; may
 * be NULL. Errors: INVALID_ARGUMENT (NULL, bad struct_size, no weights, a NULL array with a
 * nonzero count), NOT_FOUND (a stale tensor handle). Not thread-safe for one graph. */
STRATA_API strata_status_t strata_graph_add_layer(strata_graph_t* graph,
                                                  const strata_layer_desc_t* desc,
                                                  uint32_t* out_index);

/* Declare a tensor that stays in HBM for the whole step (embedding, final norm, head). The
 * executor moves it to HBM if it is elsewhere. Errors: INVALID_ARGUMENT (NULL), NOT_FOUND.
 * Not thread-safe for one graph. */
STRATA_API strata_status_t strata_graph_add_resident(strata_graph_t* graph,
                                                     strata_tensor_t* tensor);

typedef struct strata_plan_config {
  size_t struct_size;     /* STRATA_PLAN_CONFIG_STRUCT_SIZE */
  uint32_t micro_batches; /* per step, run layer-major; 0 = 1 */
  /* HBM for streaming slots; 0 = all the HBM arena has left after the resident tensors. */
  uint64_t hbm_slot_budget_bytes;
  /* Link speeds in bytes/s for the prediction; 0 = measure them now (a few 64 MiB copies).
   * These and device_flops_per_second must be finite and >= 0 (NaN is INVALID_ARGUMENT). */
  double h2d_bytes_per_second;
  double d2h_bytes_per_second;
  /* Achieved device FLOP/s for the prediction; 0 = compute unknown (predicted as free). */
  double device_flops_per_second;
  uint32_t max_prefetch_depth; /* 0 = as deep as the slots allow */
  /* Smallest transfer: a layer's small weights merge into copies of at least this size
   * (>= 4 MiB, where PCIe reaches its peak; larger tensors travel whole); 0 = 16 MiB. */
  uint64_t chunk_bytes;
} strata_plan_config_t;
#define STRATA_PLAN_CONFIG_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_plan_config_t, chunk_bytes)

/* Defaults, and struct_size set. Errors: INVALID_ARGUMENT (NULL). Thread-safe. */
STRATA_API strata_status_t strata_plan_config_init(strata_plan_config_t* config);

/* Plan the graph: slot size and count (at least two, one per layer at most), prefetch depth
 * per pass, each layer's layout in a slot, where each tensor lives, and a predicted step time
 * with its bottleneck (h2d, d2h, nvme or compute) from a simulation of the executor's
 * schedule. config: borrowed; NULL = defaults. out_plan: owned by the caller.
 * Errors: INVALID_ARGUMENT (NULL, empty graph, bad config, a tensor declared twice or in the
 * wrong tier), NOT_FOUND, OUT_OF_MEMORY (the budgets cannot work: the message says what does
 * not fit and by how much). Thread-safe with respect to other graphs. */
STRATA_API strata_status_t strata_plan_create(strata_graph_t* graph,
                                              const strata_plan_config_t* config,
                                              strata_plan_t** out_plan);

/* Destroy a plan; NULL is accepted. Executors made from it keep their own copy. */
STRATA_API strata_status_t strata_plan_destroy(strata_plan_t* plan);

typedef struct strata_plan_info {
  size_t struct_size; /* caller sets STRATA_PLAN_INFO_STRUCT_SIZE */
  uint32_t layers;
  uint32_t micro_batches;
  uint32_t slots;
  uint32_t forward_prefetch_depth;
  uint32_t backward_prefetch_depth;
  int32_t all_layers_fit; /* 1: every layer has its own slot */
  uint64_t slot_bytes;
  uint64_t resident_bytes;
  double h2d_bytes_per_second;
  double d2h_bytes_per_second;
  double predicted_step_seconds;
  double predicted_h2d_seconds; /* busy time of each resource in one step */
  double predicted_d2h_seconds;
  double predicted_nvme_seconds;
  double predicted_compute_seconds;
  double predicted_gpu_wait_seconds; /* compute idle, waiting for data */
  char bottleneck[16];               /* "h2d", "d2h", "nvme" or "compute" */
} strata_plan_info_t;
#define STRATA_PLAN_INFO_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_plan_info_t, bottleneck)

/* The plan's numbers. Errors: INVALID_ARGUMENT (NULL, bad struct_size). Thread-safe. */
STRATA_API strata_status_t strata_plan_get_info(strata_plan_t* plan, strata_plan_info_t* out);

/* The whole plan as JSON or readable text, NUL-terminated into `buffer` (borrowed, `capacity`
 * bytes). *out_length (may be NULL) receives the length without the NUL; call with buffer NULL
 * to learn it. Errors: INVALID_ARGUMENT (NULL plan, unknown format, a buffer too small: the
 * message gives the size needed). Thread-safe. */
STRATA_API strata_status_t strata_plan_dump(strata_plan_t* plan, strata_plan_format_t format,
                                            char* buffer, size_t capacity, size_t* out_length);

/* Start executing `plan`: reserve its slots in HBM, move resident tensors to HBM, and pin
 * every tensor of the graph in place (moving or unregistering them answers BUSY until the
 * executor is destroyed; writing them stays allowed, which is how an optimizer updates
 * weights between steps). out_executor: owned by the caller; destroy it before the runtime.
 * Errors: INVALID_ARGUMENT (NULL), OUT_OF_MEMORY (the HBM the plan counted on is gone),
 * INVALID_STATE (a tensor moved since planning), BUSY. Thread-safe. */
STRATA_API strata_status_t strata_executor_create(strata_plan_t* plan,
                                                  strata_executor_t** out_executor);

/* Destroy an executor (NULL accepted): waits for its transfers, frees the slots, unpins the
 * tensors. Not thread-safe with respect to other calls on the same executor. */
STRATA_API strata_status_t strata_executor_destroy(strata_executor_t* executor);

/* Begin a step: loads for the first layers start at once. Weights are reloaded each step
 * (the optimizer may have changed them). A backward load it issues may wait for a device round
 * trip of an in-place gradient sum holding a factor (STRATA_GRAD_SUM_IN_PLACE) and fail with
 * BACKEND after the step has begun: the load is tried again by the next acquire, or
 * strata_step_abort. Errors: INVALID_ARGUMENT (NULL), INVALID_STATE (a step is already
 * running), BACKEND (since 1.5, as just said). Thread-safe. */
STRATA_API strata_status_t strata_step_begin(strata_executor_t* executor);

/* End a step: every layer must have been acquired and released in both passes. Blocks until
 * the step's grads and checkpoints have landed in DRAM. Errors: INVALID_ARGUMENT,
 * INVALID_STATE (layers still to run: the message names the next one), BACKEND, IO. */
STRATA_API strata_status_t strata_step_end(strata_executor_t* executor);

typedef struct strata_layer_views {
  size_t struct_size; /* caller sets STRATA_LAYER_VIEWS_STRUCT_SIZE */
  /* Device addresses in the layer's slot, in declared order, valid until the matching
   * release: weights (both passes), grads (backward only, zeroed at the start of the backward
   * pass, except in-place gradient sums holding a grad, STRATA_GRAD_SUM_IN_PLACE, which keep it
   * for the framework to add to; count 0 in forward), activation checkpoints (forward: buffers to
   * fill; backward: restored). The arrays are owned by the executor. */
  uint32_t weight_count;
  void* const* weights;
  uint32_t grad_count;
  void* const* grads;
  uint32_t activation_count;
  void* const* activations;
} strata_layer_views_t;
#define STRATA_LAYER_VIEWS_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_layer_views_t, activations)

#define STRATA_ACQUIRE_DEFAULT 0u
/* Do not make the stream wait for the whole layer: call strata_layer_wait_tensor before using
 * each tensor, so compute starts on the first tensor while the rest land. */
#define STRATA_ACQUIRE_NO_WAIT 1u
/* Block the calling thread until the layer's data is in HBM instead of making `stream` wait:
 * for frameworks whose streams Strata cannot see (JAX/XLA). Not with STRATA_ACQUIRE_NO_WAIT. */
#define STRATA_ACQUIRE_HOST_WAIT 2u

/* Abandon the running step (since 1.1), e.g. after the framework's compute raised: the acquired
 * layer (if any) is released on `stream` with nothing sent out of its slot, the layers not yet
 * run are dropped, and the call blocks until the step's copies are done; the next
 * strata_step_begin starts a fresh step. Grads already queued (layers whose backward pass was
 * released) still land and reach an attached optimizer, as a framework's autograd would have
 * accumulated them: in STRATA_UPDATE_EXPLICIT mode they are held like any others; in
 * STRATA_UPDATE_AUTO mode what they started (accumulation, or updates of those layers) runs to
 * its end, the step counter does not advance, and the next step starts a fresh accumulation.
 * The acquired layer's in-place gradient sums (STRATA_GRAD_SUM_IN_PLACE) that held a grad keep
 * what the framework added to them before the abort, measured anew (the optimizer's grad calls
 * on them wait for `stream` to get past the abort); those that held none or zeros drop those
 * adds (their next backward load zero-fills them). Without a running step it does nothing. A
 * load that failed (IO, DATA_CORRUPTION) is not the abort's error: the acquire that needed it
 * reported it, and the next step loads again.
 * Errors: INVALID_ARGUMENT (NULL), INVALID_STATE (another thread is inside
 * strata_layer_acquire), BACKEND. Thread-safe. */
STRATA_API_SINCE(1, 1) strata_status_t strata_step_abort(strata_executor_t* executor, void* stream);

/* Acquire the next layer of the step. Makes `stream` wait (device-side) until the layer's data
 * is in HBM, fills *views, and lets loads further ahead start. The calling thread blocks only
 * when it has run more than the prefetch depth ahead of the device (the layer's slot is still
 * in use there), for weights homed on NVMe, or (since 1.5, STRATA_GRAD_SUM_IN_PLACE) when a
 * backward load it issues applies a pending factor to an in-place gradient sum (a copy of the
 * param out of HBM and back, behind the weight loads already queued) or when another thread's
 * strata_optimizer_grad_info or _read is measuring a sum of the layer it acquires for its
 * backward pass. Layers must come in step order.
 * Errors: INVALID_ARGUMENT (NULL, a layer index the graph does not have, unknown phase or
 * flags, bad struct_size), INVALID_STATE (outside a step, out of order, already acquired),
 * BACKEND, IO, DATA_CORRUPTION (an NVMe-homed weight failed its checksum). After an error the
 * layer is not acquired (a retry fails the same way, a release is refused): strata_step_abort,
 * and the next step loads it again. Thread-safe. */
STRATA_API strata_status_t strata_layer_acquire(strata_executor_t* executor, uint32_t layer,
                                                strata_phase_t phase, void* stream, uint32_t flags,
                                                strata_layer_views_t* views);

/* With STRATA_ACQUIRE_NO_WAIT: make `stream` wait for one tensor of the acquired layer.
 * Errors: INVALID_ARGUMENT (NULL, unknown role, index out of range), INVALID_STATE (not the
 * acquired layer), BACKEND, IO, DATA_CORRUPTION (the tensor's load from NVMe failed: its view
 * holds no valid data; strata_step_abort abandons the step). Thread-safe. */
STRATA_API strata_status_t strata_layer_wait_tensor(strata_executor_t* executor, uint32_t layer,
                                                    strata_phase_t phase, strata_view_role_t role,
                                                    uint32_t index, void* stream);

/* One view of the acquired layer as a DLPack tensor (kDLCUDA on the cuda backend, kDLCPU on the
 * host backend), with the registered tensor's dtype and shape, so a framework binds its
 * parameters to slot memory zero-copy (torch.from_dlpack, jax.dlpack). *out: transferred to
 * the caller, who calls its deleter (a consumer such as from_dlpack does); the memory it
 * points at is valid only until the matching strata_layer_release, after which the slot is
 * refilled: drop every framework tensor made from it before releasing. Grads have views in the
 * backward pass only. Errors: INVALID_ARGUMENT (NULL, unknown phase or role, index out of
 * range), INVALID_STATE (not the acquired layer). Thread-safe. */
STRATA_API strata_status_t strata_layer_export_dlpack(strata_executor_t* executor, uint32_t layer,
                                                      strata_phase_t phase, strata_view_role_t role,
                                                      uint32_t index,
                                                      DLManagedTensorVersioned** out);

/* Copy `bytes` from `src` (device or host memory, borrowed) into one view of the acquired layer,
 * synchronously (the copy is done when the call returns): for frameworks whose arrays are
 * immutable and cannot be written in place (JAX hands grads back this way). `bytes` must be
 * the tensor's size. Errors: INVALID_ARGUMENT (NULL, unknown phase or role, index out of range,
 * a size that is not the tensor's), INVALID_STATE (not the acquired layer; since 1.5 a grad that
 * is an in-place gradient sum, STRATA_GRAD_SUM_IN_PLACE: a copy would drop the sum, so add into
 * the view instead), BACKEND. Thread-safe. */
STRATA_API strata_status_t strata_layer_write_view(strata_executor_t* executor, uint32_t layer,
                                                   strata_phase_t phase, strata_view_role_t role,
                                                   uint32_t index, const void* src, uint64_t bytes);

/* Release the acquired layer once its work is queued on `stream`: the slot is refilled only
 * after the stream gets past this point, and the layer's checkpoints (forward) or grads
 * (backward) leave for DRAM after it. The calling thread does not block, except (since 1.5,
 * STRATA_GRAD_SUM_IN_PLACE) where a backward load it issues ahead applies a pending factor to
 * an in-place gradient sum: it then waits for that param's copy out of HBM and back, behind
 * the weight loads already queued (a framework that calls strata_optimizer_grad_scale and
 * accumulates again without zeroing pays it at the first release after the next step_begin
 * that reaches that layer's backward load). A BACKEND error from that load comes after the
 * release took effect (the layer is released, its grads queued; a retried release is
 * INVALID_STATE): the next acquire issues the load again, or strata_step_abort.
 * Errors: INVALID_ARGUMENT (NULL, unknown layer or phase), INVALID_STATE (no matching acquire:
 * double release, release without acquire, the wrong layer), BACKEND. Thread-safe. */
STRATA_API strata_status_t strata_layer_release(strata_executor_t* executor, uint32_t layer,
                                                strata_phase_t phase, void* stream);

typedef struct strata_executor_stats {
  size_t struct_size; /* caller sets STRATA_EXECUTOR_STATS_STRUCT_SIZE */
  uint64_t steps;
  uint64_t loads;        /* layer loads issued */
  uint64_t reused_loads; /* loads skipped: the layer was still in its slot */
  uint64_t bytes_in;     /* queued into HBM */
  uint64_t bytes_out;    /* queued out of HBM */
} strata_executor_stats_t;
#define STRATA_EXECUTOR_STATS_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_executor_stats_t, bytes_out)

/* Counters since the executor was created. Errors: INVALID_ARGUMENT. Thread-safe. */
STRATA_API strata_status_t strata_executor_get_stats(strata_executor_t* executor,
                                                     strata_executor_stats_t* out);

/* ---------------------------------------------------------------------------------------------
 * Optimizer: fp32 masters and optimizer state in DRAM, updated on the CPU beside the stream
 *
 * Per trainable weight the optimizer keeps an fp32 master (the weight itself when it is fp32)
 * and its state (AdamW and Adam: exp_avg and exp_avg_sq; SGD: momentum_buffer; Lion: exp_avg;
 * Adagrad: sum) as runtime tensors in DRAM named "<weight>.master", "<weight>.exp_avg", ...,
 * and writes the working copy the GPU receives (bf16, fp16 or fp32) from the master at every
 * update. The update is PyTorch's (torch.optim.AdamW: decoupled weight decay, bias correction;
 * torch.optim.SGD: L2 weight decay, momentum, dampening, nesterov; since 1.4 torch.optim.Adam:
 * L2 weight decay, bias correction; torch.optim.Adagrad: L2 weight decay, eps; and Lion, Chen
 * et al. 2023 as lion-pytorch: decoupled weight decay), vectorized (AVX-512 or AVX2, chosen at
 * run time) on a thread pool bound to the GPU's NUMA node.
 *
 * Attached to an executor, each layer's update starts as soon as its grads have landed in DRAM
 * (during the backward pass of the layers below), and the next step's load of that layer waits
 * for it. With clipping or dynamic loss scaling every grad is needed first: the grads' norms
 * are taken as they land, and the updates run in forward order after the last one, overlapped
 * with the next step's forward pass (each layer's load waits only for its own update).
 * ------------------------------------------------------------------------------------------- */
typedef struct strata_optimizer strata_optimizer_t;

typedef int32_t strata_optimizer_kind_t;
#define STRATA_OPTIMIZER_ADAMW 0
#define STRATA_OPTIMIZER_SGD 1
/* Since 1.4. ADAM: torch.optim.Adam (weight_decay is L2: added to the grad; betas, eps as
 * AdamW's). LION: p = p (1 - lr weight_decay) - lr sign(beta1 m + (1 - beta1) g), then
 * m = beta2 m + (1 - beta2) g (defaults lr 1e-4, betas 0.9, 0.99, weight_decay 0; eps unused).
 * ADAGRAD: torch.optim.Adagrad (weight_decay L2, eps default 1e-10, lr default 1e-2); its sum
 * starts at 0 (initial_accumulator_value 0: write STRATA_STATE_EXP_AVG_SQ before the first
 * update for another), and torch's lr_decay is the caller's: set the group's lr to
 * lr / (1 + (t - 1) lr_decay) before update t (strata_optimizer_set_group). */
#define STRATA_OPTIMIZER_ADAM 2
#define STRATA_OPTIMIZER_LION 3
#define STRATA_OPTIMIZER_ADAGRAD 4

typedef struct strata_optimizer_config {
  size_t struct_size; /* STRATA_OPTIMIZER_CONFIG_STRUCT_SIZE */
  strata_optimizer_kind_t kind;
  /* Hyperparameters of group 0 (and the default of every other group). */
  float lr;           /* default 1e-3 */
  float weight_decay; /* AdamW, Lion: decoupled, AdamW's default 1e-2; SGD, Adam, Adagrad: L2,
                         default 0 */
  float beta1, beta2; /* AdamW, Adam, Lion: default 0.9, 0.999 (Lion 0.9, 0.99) */
  float eps;          /* AdamW, Adam: default 1e-8; Adagrad: 1e-10 */
  float momentum;     /* SGD, default 0 (no momentum buffer) */
  float dampening;    /* SGD, default 0 */
  int32_t nesterov;   /* SGD: 1 = Nesterov momentum (needs momentum > 0, dampening 0) */
  /* Global-norm clipping of the unscaled grads, as torch.nn.utils.clip_grad_norm_ (0 = off). */
  float max_grad_norm;
  /* Grads arrive multiplied by the loss scale (the framework scaled the loss by it); the
   * update divides it out. Dynamic: a step whose grads hold inf or NaN is skipped and the scale
   * multiplied by backoff_factor; after growth_interval good steps it is multiplied by
   * growth_factor (torch.amp.GradScaler's rule). Read the scale to use from the stats. */
  float loss_scale;           /* default 1 */
  int32_t dynamic_loss_scale; /* default 0 */
  float growth_factor;        /* default 2 */
  float backoff_factor;       /* default 0.5 */
  uint32_t growth_interval;   /* default 2000 */
  /* Executor steps (or strata_optimizer_step calls) per update: grads are summed in fp32 in
   * DRAM ("<weight>.grad_accum") until the last, which updates. Default 1. */
  uint32_t accumulation_steps;
  /* Update threads; 0 = the CPUs of the GPU's NUMA node less one (for the framework). At most
   * 4096. */
  uint32_t threads;
  /* Since 1.1: when updates happen (STRATA_UPDATE_*); default STRATA_UPDATE_AUTO. */
  uint32_t update_mode;
  /* Since 1.2: where params' fp32 masters and moments live (STRATA_STATE_PLACEMENT_*); default
   * STRATA_STATE_PLACEMENT_DRAM. */
  uint32_t state_placement;
  /* Since 1.2: DRAM for staging NVMe-homed state during updates (a few layers' worth, reused);
   * 0 = auto: STRATA_STATE_PLACEMENT_PLANNED keeps 1/8 of the DRAM budget free for it, and attach
   * takes what is free, up to 4 layers' worth. With grads homed in HBM, attach first takes the
   * buffer they are read through (strata_optimizer_add_param) out of the same free DRAM:
   * include it here. */
  uint64_t nvme_staging_bytes;
} strata_optimizer_config_t;
#define STRATA_OPTIMIZER_CONFIG_STRUCT_SIZE \
  STRATA_STRUCT_SIZE(strata_optimizer_config_t, nvme_staging_bytes)

/* State placement (since 1.2). State on NVMe is read into DRAM staging ahead of its layer's
 * update (from the start of a step that will update, in the order the updates will run, as
 * many layers as there are slots; then as each update is queued),
 * updated there, and written back while later updates run; the layer's next load waits only
 * for the update (the bf16/f16 working copy in DRAM), not for the write-back, unless the weight
 * itself is NVMe-homed (strata_optimizer_add_param): then for its write-back too. Such state is
 * updated only by an attached optimizer (strata_optimizer_step without an executor refuses).
 * DRAM: every param's state in DRAM (as in 1.0; OUT_OF_MEMORY when it does not fit). */
#define STRATA_STATE_PLACEMENT_DRAM 0u
/* PLANNED: each param's state goes to DRAM while the DRAM tier keeps nvme_staging_bytes free
 * after it, else to NVMe. Params come in forward order, so the last layers' state is the one on
 * NVMe: their updates, queued first by the backward pass and needed last by the next forward
 * pass, have the most time to hide the I/O. Without an NVMe tier: DRAM. */
#define STRATA_STATE_PLACEMENT_PLANNED 1u
/* NVME: every param's state on NVMe (needs an NVMe tier). An fp32 weight is its own master
 * and stays where the framework registered it. */
#define STRATA_STATE_PLACEMENT_NVME 2u

/* AUTO: an attached optimizer updates from the executor's steps, every accumulation_steps of
 * them, as their grads land (the loop of a native trainer). */
#define STRATA_UPDATE_AUTO 0u
/* EXPLICIT: a framework owns the loop's semantics (PyTorch's loss.backward(); clip; step();
 * zero_grad()). Executor steps only deliver grads, and each param holds its grad as torch's
 * p.grad does: none, zeros, the grad of the backward passes since it was last zeroed (summed in
 * fp32 when there were several), times any scale applied. strata_optimizer_grad_* read, measure,
 * scale and zero it; strata_optimizer_step queues the update of every param holding a grad
 * (asynchronously, in forward order, each layer's next load waiting for its update) and
 * leaves the grads held until zeroed. A param's update count (AdamW's t) advances only when
 * it held a grad. Needs max_grad_norm 0, no dynamic loss scale, accumulation_steps 1. The fp32
 * sums of accumulation (STRATA_STATE_GRAD_ACCUM) are placed at the first accumulation: in DRAM
 * when its free space holds them all (strata_layout_totals_t.accum_bytes), else, with an NVMe
 * tier, some layers' on NVMe, staged through the staging slots like NVMe-homed state; with
 * neither, that strata_step_begin fails with OUT_OF_MEMORY naming the bytes and the remedies.
 * Params whose HBM grad is their sum (STRATA_GRAD_SUM_IN_PLACE, since 1.5) need none. */
#define STRATA_UPDATE_EXPLICIT 1u

/* PyTorch's defaults for `kind`, and struct_size set. Errors: INVALID_ARGUMENT (NULL, unknown
 * kind). Thread-safe. */
STRATA_API strata_status_t strata_optimizer_config_init(strata_optimizer_kind_t kind,
                                                        strata_optimizer_config_t* config);

/* Create an optimizer over `runtime`'s tensors and start its threads. config: borrowed; NULL =
 * AdamW defaults. out_optimizer: owned by the caller, released with strata_optimizer_destroy()
 * before the runtime handle. Errors: INVALID_ARGUMENT (NULL, bad struct_size, a value out of
 * range: the message names it), INVALID_STATE (no DRAM tier), OUT_OF_MEMORY (the OS refused a
 * thread, e.g. a pids limit: the message has the errno; every thread started is stopped and
 * nothing is left behind). Thread-safe. */
STRATA_API strata_status_t strata_optimizer_create(strata_runtime_t* runtime,
                                                   const strata_optimizer_config_t* config,
                                                   strata_optimizer_t** out_optimizer);

/* Destroy an optimizer (NULL accepted): detaches it from its executor, finishes queued
 * updates, unregisters its state tensors and unpins the weights and grads. Errors:
 * INVALID_STATE (its executor is inside a step: call strata_step_end first; the handle stays
 * valid). Not thread-safe with respect to other calls on the same optimizer. */
STRATA_API strata_status_t strata_optimizer_destroy(strata_optimizer_t* optimizer);

typedef struct strata_param_desc {
  size_t struct_size;      /* STRATA_PARAM_DESC_STRUCT_SIZE */
  strata_tensor_t* weight; /* borrowed: in DRAM or (since 1.2) on NVMe, f32/bf16/f16 */
  strata_tensor_t* grad;   /* borrowed: in DRAM or (since 1.2) HBM, f32/bf16/f16, as many
                              elements as weight */
  uint32_t group;          /* hyperparameter group (strata_optimizer_set_group), 0..65535;
                              0 = default */
  uint32_t master_layout;  /* since 1.2: how a bf16 weight's fp32 master is kept
                              (STRATA_MASTER_*); default STRATA_MASTER_SEPARATE */
  uint32_t grad_sum;       /* since 1.5: where several backward passes' grads are summed
                              (STRATA_GRAD_SUM_*); default STRATA_GRAD_SUM_ACCUMULATOR, what a
                              1.4 caller's struct_size means */
} strata_param_desc_t;
#define STRATA_PARAM_DESC_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_param_desc_t, grad_sum)

/* Master layouts (since 1.2). SEPARATE: the master is an fp32 tensor "<weight>.master" (4 bytes
 * per parameter) and every update also writes the weight, rounded from it. SPLIT (bf16 weights
 * only; an fp32 weight is its own master either way): the weight is the master's upper half,
 * rounded to nearest even as torch's .to(torch.bfloat16), and the optimizer keeps only the
 * signed 16-bit rest, "<weight>.master_low" (I16, STRATA_STATE_MASTER_LOW): 2 bytes per
 * parameter of state instead of 4, on DRAM or NVMe as the state placement says, and no
 * separate working copy to write. From the same master an update writes the same weight and
 * master in both layouts, except where the master lands exactly halfway between two bf16 values
 * and rounds down to the even one: the rest (+2^15) does not fit 16 bits, and the master is
 * kept one ulp (2^-24 relative) nearer the weight (so later updates may round differently from
 * a separate master's). Writing a SPLIT param's weight tensor alone moves its master with it:
 * the weight plus the old rest where that still rounds to the weight, else the weight itself;
 * strata_optimizer_master_write sets both. */
#define STRATA_MASTER_SEPARATE 0u
#define STRATA_MASTER_SPLIT 1u

/* Gradient sums (since 1.5; strata_param_desc_t.grad_sum): where an explicit-mode param's grads
 * of several backward passes are summed.
 * ACCUMULATOR (the default, as before 1.5): each backward pass's grad lands in the grad tensor
 * (DRAM, or an HBM home zeroed at every backward load), and one landing onto a grad not zeroed
 * since the last is added to an fp32 accumulator, "<weight>.grad_accum"
 * (STRATA_STATE_GRAD_ACCUM, 4 bytes per parameter in DRAM or staged on NVMe, placed at the
 * first accumulation for every such param at once).
 * IN_PLACE: the grad tensor, in HBM and F32, is the sum itself. The backward load zero-fills it
 * only when the param holds no grad (none, or zeros: never computed, or zeroed since); else it
 * keeps the running sum, and the framework ADDS each backward pass's grad into the view. Nothing
 * is copied out at the release, no accumulator exists, and the optimizer reads the sum through
 * its grad fetch buffer (strata_layout_request_t.grad_sum counts it). A model whose sums do not
 * fit the host this way takes 4 bytes per parameter of HBM instead of 6 of DRAM (a bf16 grad and
 * its fp32 sum). Needs STRATA_UPDATE_EXPLICIT and a grad in STRATA_TIER_HBM of dtype F32
 * (INVALID_ARGUMENT naming the problem otherwise). What holds for such a param, beyond
 * STRATA_UPDATE_EXPLICIT's rules:
 *  - The view's data must be added to, never copied over: strata_layer_write_view on it is
 *    INVALID_STATE.
 *  - From its layer's backward load (issued up to the plan's prefetch depth ahead of the
 *    acquire) to its backward release, strata_optimizer_grad_scale is INVALID_STATE: a factor
 *    would have to apply to the sum the backward pass is adding to and not to what it adds.
 *    While the layer is acquired for its backward pass, strata_optimizer_grad_info, _read,
 *    _write and _zero are INVALID_STATE too (the framework's adds are in flight).
 *  - Elsewhere strata_optimizer_grad_scale stays lazy (no data moves); a factor still pending at
 *    the layer's next backward load is applied to the sum there (a synchronous copy out of HBM,
 *    the product, a copy back), so later backward passes add to the scaled sum. The executor
 *    call that issues that load (strata_step_begin, strata_layer_acquire or _release) waits
 *    for it. If the copy out fails, nothing changed and that call returns BACKEND; if the copy
 *    back fails, the sum stays held with unspecified values and its factor is dropped: its
 *    strata_optimizer_grad_info sum of squares is NaN from then on, through later backward
 *    passes, until strata_optimizer_grad_zero or _write succeeds.
 *  - strata_optimizer_grad_zero after the backward load and before the acquire zeroes the sum at
 *    once, on the device queue the load's fills use (a zero fill queued earlier cannot land after
 *    it); elsewhere the next backward load zero-fills it.
 *  - strata_optimizer_grad_write stores the fp32 values exactly, in the sum (through the same
 *    queue, waited for).
 *  - A backward pass's landing copies nothing: strata_optimizer_grad_info measures the sum when
 *    first asked after it changed and keeps the figure until it changes again. The first such
 *    call queues the measurement of every unmeasured sum (the optimizer's threads copy them out
 *    of HBM through its pinned buffer) and waits for its layer's; the sums' layers' next
 *    backward loads and acquires wait for them too. strata_optimizer_grad_read measures it on
 *    the way. The update reads it once more.
 *  - strata_step_abort with the layer acquired leaves what the framework had added in the sum
 *    (it cannot be taken out, as PyTorch's autograd leaves what it had accumulated into p.grad):
 *    a held sum stays held with those adds, and strata_optimizer_grad_info measures it anew; a
 *    param that held no grad still holds none (its next backward load zero-fills the home).
 * Results equal an ACCUMULATOR param's (a DRAM or HBM grad of the weight's dtype) bit for bit
 * when the framework adds what it would have written, except where an ACCUMULATOR param's grad
 * tensor rounds: a grad_write of one backward pass's grad between steps is stored in that
 * tensor's dtype there, exactly here; and an abort's partial adds, above. */
#define STRATA_GRAD_SUM_ACCUMULATOR 0u
#define STRATA_GRAD_SUM_IN_PLACE 1u

/* Make a weight trainable: allocates its state where the config's state_placement says
 * (zeroed; the master copied from the weight) and pins weight and grad in place while the
 * optimizer lives. To start from fp32 values a bf16 weight cannot hold, write them to the
 * master (strata_optimizer_master_write). An NVMe-homed weight (since 1.2) is updated only by an
 * attached optimizer: each update stages it in DRAM with its layer's NVMe-homed state and
 * writes it back, and the executor loads the layer again only after that write has landed.
 * An HBM-homed grad (since 1.2; 2 bytes per bf16 parameter of DRAM less, the grads' bytes of
 * HBM more) is likewise read by an attached optimizer only: each job that reads a layer's
 * grads (norm, accumulation, update, explicit mode's landing) first copies them into one DRAM
 * buffer the size of the largest layer's HBM-homed grads, allocated at attach and counted in
 * state_bytes; strata_optimizer_grad_read copies the one it reads. Results are bit for bit
 * those of the same grads in DRAM. With grad_sum STRATA_GRAD_SUM_IN_PLACE (since 1.5) that HBM
 * grad is the param's fp32 sum of backward passes (see STRATA_GRAD_SUM_IN_PLACE).
 * Errors: INVALID_ARGUMENT (NULL, bad struct_size, dtypes, element counts differ, weight given
 * as its own grad, group above 65535, unknown master_layout, STRATA_MASTER_SPLIT with an f16
 * weight, unknown grad_sum, STRATA_GRAD_SUM_IN_PLACE with a grad not in HBM or not F32 or in
 * STRATA_UPDATE_AUTO mode), NOT_FOUND, ALREADY_EXISTS (already a param, or a state
 * tensor's name is taken), UNSUPPORTED (weight not in DRAM or NVMe, grad not in DRAM or HBM),
 * OUT_OF_MEMORY (DRAM budget: nothing is left allocated), BUSY (moving), INVALID_STATE
 * (already attached). Thread-safe. */
STRATA_API strata_status_t strata_optimizer_add_param(strata_optimizer_t* optimizer,
                                                      const strata_param_desc_t* desc);

/* Set a group's learning rate and weight decay (creating the group). Takes effect at the next
 * update that has not started: for an attached optimizer, the next strata_step_begin that
 * starts an update (so set the step's learning rate before its step_begin). Groups are
 * 0..65535. Errors: INVALID_ARGUMENT (NULL, group above 65535, negative or non-finite values).
 * Thread-safe. */
STRATA_API strata_status_t strata_optimizer_set_group(strata_optimizer_t* optimizer, uint32_t group,
                                                      float lr, float weight_decay);

/* Every hyperparameter of a group (since 1.3). torch's optimizers read their param groups at
 * every step, and schedulers change more than the learning rate (OneCycleLR cycles AdamW's
 * beta1): a framework sets each group's values before each step. */
typedef struct strata_group_hyperparams {
  size_t struct_size; /* STRATA_GROUP_HYPERPARAMS_STRUCT_SIZE */
  float lr;           /* >= 0 */
  float weight_decay; /* >= 0; AdamW, Lion: decoupled; SGD, Adam, Adagrad: L2 */
  /* AdamW and Adam; Lion reads the betas, Adagrad eps (the others ignore them, but they are
   * checked): beta1 and beta2 in [0, 1), eps > 0. An
   * update at step t uses the betas set for it: its bias corrections are 1 - beta1^t and
   * 1 - beta2^t with those betas, as torch's AdamW computes them. */
  float beta1, beta2;
  float eps;
} strata_group_hyperparams_t;
#define STRATA_GROUP_HYPERPARAMS_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_group_hyperparams_t, eps)

/* A group's current hyperparameters into *out (the caller sets out->struct_size; the library
 * writes at most that many bytes). A group not created yet reads as group 0, which is what it
 * would be created as. out: borrowed. Errors: INVALID_ARGUMENT (NULL, struct_size below
 * STRATA_GROUP_HYPERPARAMS_STRUCT_SIZE of 1.3, group above 65535); *out is then untouched.
 * Thread-safe. */
STRATA_API_SINCE(1, 3)
strata_status_t strata_optimizer_get_group(strata_optimizer_t* optimizer, uint32_t group,
                                           strata_group_hyperparams_t* out);

/* Set a group's hyperparameters (creating the group as a copy of group 0 first). Fields beyond
 * hyperparams->struct_size keep the group's current values. Takes effect as
 * strata_optimizer_set_group's values do: at the next update that has not started (an update
 * already running keeps the values it started with). hyperparams: borrowed, read during the
 * call. Errors: INVALID_ARGUMENT (NULL, struct_size below the 1.3 size, group above 65535,
 * lr or weight_decay negative or non-finite, a beta outside [0, 1), eps not above 0 or
 * non-finite), the group then unchanged. Thread-safe. */
STRATA_API_SINCE(1, 3)
strata_status_t strata_optimizer_set_group_hyperparams(
    strata_optimizer_t* optimizer, uint32_t group, const strata_group_hyperparams_t* hyperparams);

/* Run the updates from `executor`'s steps: every param must be a weight of one of its layers,
 * with its grad among that layer's grads. Call between steps. The executor keeps the optimizer
 * alive until it is destroyed or the optimizer is. Errors: INVALID_ARGUMENT (a param outside
 * the graph: the message names it), INVALID_STATE (no params, inside a step), BUSY (either is
 * already attached). Thread-safe. */
STRATA_API strata_status_t strata_optimizer_attach(strata_optimizer_t* optimizer,
                                                   strata_executor_t* executor);

/* Without an executor: take every param's grad from its grad tensor now and update (or, short
 * of accumulation_steps, accumulate); blocks until done, using the optimizer's threads.
 * Attached in STRATA_UPDATE_EXPLICIT mode (since 1.1): queue the updates of every param holding
 * a grad and return at once (strata_optimizer_synchronize waits for them).
 * Errors: INVALID_ARGUMENT (NULL), INVALID_STATE (attached in AUTO mode, inside an executor
 * step in EXPLICIT mode, no params, a failed update; without an executor: params whose state
 * or weights live on NVMe, or whose grads live in HBM). Thread-safe (calls are serialized). */
STRATA_API strata_status_t strata_optimizer_step(strata_optimizer_t* optimizer);

/* Block until every queued update has finished (an attached optimizer's updates otherwise
 * finish in the background; reading weights or masters needs this first), NVMe-homed state
 * and weights included: their write-backs end and any copy read ahead is dropped. Errors:
 * INVALID_ARGUMENT, BACKEND (the grads of a layer failed to land: the message names it; the
 * optimizer then refuses further steps until a checkpoint load with it succeeds). A failed
 * optimizer's synchronize returns once no update is running and no transfer is in flight,
 * without waiting for queued updates whose grads may never land. Thread-safe. */
STRATA_API strata_status_t strata_optimizer_synchronize(strata_optimizer_t* optimizer);

/* What a param holds as its grad in STRATA_UPDATE_EXPLICIT mode (since 1.1). */
typedef struct strata_grad_info {
  size_t struct_size; /* caller sets STRATA_GRAD_INFO_STRUCT_SIZE */
  int32_t has_grad;   /* 0: none (never computed, or zeroed to none) */
  double sum_squares; /* of the grad's values (0 without one): the squared L2 norm */
  uint64_t step;      /* updates this param has received (its AdamW t) */
} strata_grad_info_t;
#define STRATA_GRAD_INFO_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_grad_info_t, step)

/* The four calls below (since 1.1) work on an optimizer attached in STRATA_UPDATE_EXPLICIT mode,
 * between or inside executor steps; each first waits for grads of the param's layer still
 * landing or being summed. Errors (all four): INVALID_ARGUMENT (NULL, bad struct_size),
 * NOT_FOUND (not a param), INVALID_STATE (AUTO mode, not attached; an in-place gradient sum
 * whose layer is acquired for its backward pass, STRATA_GRAD_SUM_IN_PLACE), BACKEND (grads
 * failed to land, or an in-place sum's copy out of HBM failed: that call's error only, the next
 * call copies it again). Thread-safe. */

/* The param's grad: whether it has one, its squared norm, its update count. */
STRATA_API_SINCE(1, 1)
strata_status_t strata_optimizer_grad_info(strata_optimizer_t* optimizer, strata_tensor_t* weight,
                                           strata_grad_info_t* out);

/* Copy the param's grad, as fp32, into `dst` (borrowed host memory of `count` floats; count must
 * be the param's element count). Errors also: INVALID_ARGUMENT (count), INVALID_STATE (no grad). */
STRATA_API_SINCE(1, 1)
strata_status_t strata_optimizer_grad_read(strata_optimizer_t* optimizer, strata_tensor_t* weight,
                                           float* dst, uint64_t count);

/* Multiply the param's grad by `factor` (clipping: torch's p.grad.mul_(clip_coef)). No data moves:
 * the factor applies when the grad is next read, summed or used; inside an executor step too,
 * where the next backward pass's grad is added to the scaled grad. An in-place gradient sum
 * (STRATA_GRAD_SUM_IN_PLACE) takes a factor between its layer's backward release and its next
 * backward load, where a pending factor is applied to the sum in HBM (a copy out and back).
 * Errors also: INVALID_STATE (no grad; an in-place sum from its layer's backward load to its
 * release: the message says so, and the grad is unchanged). */
STRATA_API_SINCE(1, 1)
strata_status_t strata_optimizer_grad_scale(strata_optimizer_t* optimizer, strata_tensor_t* weight,
                                            float factor);

/* Zero the param's grad: to none (keep_zeros 0: the next backward's grad replaces it, and a step
 * before that skips the param) or to zeros (keep_zeros 1: a step before the next backward updates
 * it with a zero grad, as torch's zero_grad(set_to_none=False)). An in-place gradient sum
 * (STRATA_GRAD_SUM_IN_PLACE) holding a grad whose backward load was issued and whose layer is
 * not yet acquired is zeroed in HBM at once; otherwise no data moves: its next backward load
 * zero-fills the home (until then the sum is read as none or zeros, whatever the home holds).
 * Errors also: BACKEND (that zero fill failed: the grad is still held, its values unspecified,
 * its sum of squares NaN until a zero or write succeeds). */
STRATA_API_SINCE(1, 1)
strata_status_t strata_optimizer_grad_zero(strata_optimizer_t* optimizer, strata_tensor_t* weight,
                                           int32_t keep_zeros);

/* Set the param's grad to `count` fp32 values from `src` (borrowed, read during the call; count
 * must be the param's element count), as torch's in-place ops on p.grad (clamp_, nan_to_num_,
 * clip_grad_value_) change it (since 1.3; explicit mode, attached, as the four calls above). A
 * framework applies an elementwise op to what strata_optimizer_grad_read returned and writes the
 * result back. Where the grad is held decides how it is stored: in the param's grad tensor
 * (DRAM or HBM; the grad of one backward pass, or zeros) in that tensor's dtype, rounded to
 * nearest even as an update rounds the working copy; in the fp32 accumulator (after
 * accumulation, or a zeroed grad written inside an executor step, whose backward will add to
 * it) exactly; an in-place gradient sum's F32 tensor (STRATA_GRAD_SUM_IN_PLACE) always, exactly,
 * through the device queue its backward loads' zero fills use, waited for. A factor from
 * strata_optimizer_grad_scale is replaced: the values are the grad's. strata_optimizer_grad_read
 * then returns the stored values and strata_optimizer_grad_info their sum of squares. First waits
 * for the param's layer's queued updates and landing grads (an update queued by
 * strata_optimizer_step reads the grad in the background). Errors also: INVALID_ARGUMENT (count),
 * INVALID_STATE (no grad: zeroed to none; the grad is then unchanged), OUT_OF_MEMORY (the
 * accumulator could not be allocated; the grad is unchanged), BACKEND (the copy into HBM failed:
 * the grad is still held, its values unspecified, its sum of squares NaN; an in-place gradient
 * sum's stays NaN through later backward passes until a zero or write succeeds). Thread-safe. */
STRATA_API_SINCE(1, 3)
strata_status_t strata_optimizer_grad_write(strata_optimizer_t* optimizer, strata_tensor_t* weight,
                                            const float* src, uint64_t count);

/* Set a param's update count (its AdamW t), e.g. restoring a framework's optimizer state dict
 * (since 1.1; STRATA_UPDATE_EXPLICIT mode, where counts are per param). Waits for the param's
 * queued updates. Errors: INVALID_ARGUMENT (NULL), NOT_FOUND (not a param), INVALID_STATE (AUTO
 * mode). Thread-safe. */
STRATA_API_SINCE(1, 1)
strata_status_t strata_optimizer_set_param_step(strata_optimizer_t* optimizer,
                                                strata_tensor_t* weight, uint64_t step);

typedef int32_t strata_state_kind_t;
#define STRATA_STATE_MASTER 0     /* fp32 master (the weight itself when it is fp32) */
#define STRATA_STATE_EXP_AVG 1    /* AdamW/Adam/Lion m, SGD momentum buffer */
#define STRATA_STATE_EXP_AVG_SQ 2 /* AdamW/Adam v, Adagrad sum (since 1.4) */
#define STRATA_STATE_GRAD_ACCUM 3 /* fp32 grad sum (accumulation_steps > 1) */
#define STRATA_STATE_MASTER_LOW 4 /* since 1.2: a split master's low halves (I16) */

/* The state tensor of one kind for a param's weight (owned by the optimizer: read or write it
 * between updates, i.e. after strata_optimizer_synchronize and outside executor steps — state
 * on NVMe is read ahead of its update from the start of a step; do not unregister it). Errors:
 * INVALID_ARGUMENT (NULL, unknown kind), NOT_FOUND (not a param, or no state of that kind:
 * STRATA_STATE_MASTER of a split master, whose halves are the weight and
 * STRATA_STATE_MASTER_LOW — strata_optimizer_master_read gives it whole).
 * Thread-safe. */
STRATA_API strata_status_t strata_optimizer_get_state(strata_optimizer_t* optimizer,
                                                      strata_tensor_t* weight,
                                                      strata_state_kind_t kind,
                                                      strata_tensor_t** out_tensor);

/* A param's fp32 master, `count` floats (the param's element count) into `dst` (borrowed),
 * in any layout and tier: the weight itself when fp32, "<weight>.master", or a split master
 * put together. Waits for queued updates (as strata_optimizer_synchronize). Errors:
 * INVALID_ARGUMENT (NULL, count is not the param's), NOT_FOUND (not a param), INVALID_STATE
 * (inside an executor step: its updates and read-ahead run), and the optimizer's failure or a
 * tier's read error (DATA_CORRUPTION, IO). Thread-safe. */
STRATA_API_SINCE(1, 2)
strata_status_t strata_optimizer_master_read(strata_optimizer_t* optimizer, strata_tensor_t* weight,
                                             float* dst, uint64_t count);

/* Set a param's fp32 master from `src` (borrowed, `count` floats) and its weight to the master
 * rounded to the weight's dtype (nearest even), as an update writes them: the value the next
 * load streams and the next update starts from (a SPLIT master's halfway case as above).
 * Waits, errors and thread-safety as strata_optimizer_master_read (a tier's write error
 * instead of a read error). */
STRATA_API_SINCE(1, 2)
strata_status_t strata_optimizer_master_write(strata_optimizer_t* optimizer,
                                              strata_tensor_t* weight, const float* src,
                                              uint64_t count);

typedef struct strata_optimizer_stats {
  size_t struct_size;     /* caller sets STRATA_OPTIMIZER_STATS_STRUCT_SIZE */
  uint64_t step;          /* updates applied (AdamW's t) */
  uint64_t skipped_steps; /* steps skipped for inf/NaN grads */
  uint64_t micro_step;    /* accumulation steps done towards the next update */
  double last_grad_norm;  /* of the unscaled grads, when computed (clipping or dynamic
                             loss scaling); -1 otherwise */
  float loss_scale;       /* to multiply the next step's loss by */
  uint64_t params;
  uint64_t elements;
  uint64_t state_bytes;  /* DRAM the optimizer allocated */
  double update_seconds; /* thread-pool time spent on updates, norms and accumulation */
  uint32_t threads;
  char isa[16];     /* "avx512", "avx2" or "generic" */
  char binding[32]; /* "NUMA node N" or "unbound" (diagnostic) */
  /* Since 1.2: state placed on NVMe, and its staging (state_bytes counts DRAM only). */
  uint64_t nvme_state_bytes;  /* state tensors on NVMe */
  uint64_t nvme_state_params; /* params with state on NVMe */
  uint64_t nvme_state_layers; /* executor layers staged through DRAM for their updates: with
                                 state (or, since weights may be, weights) on NVMe (0 until
                                 attached) */
  uint64_t staging_bytes;     /* DRAM of the staging slots (part of state_bytes) */
  uint32_t staging_slots;     /* layers whose state can be staged at once */
  uint64_t nvme_read_bytes;   /* state read for updates since creation */
  uint64_t nvme_write_bytes;  /* state written back since creation */
  double stage_wait_seconds;  /* time an update whose grads were in waited for its state */
} strata_optimizer_stats_t;
#define STRATA_OPTIMIZER_STATS_STRUCT_SIZE \
  STRATA_STRUCT_SIZE(strata_optimizer_stats_t, stage_wait_seconds)

/* Counters since creation (or since the checkpoint loaded). Errors: INVALID_ARGUMENT.
 * Thread-safe. */
STRATA_API strata_status_t strata_optimizer_get_stats(strata_optimizer_t* optimizer,
                                                      strata_optimizer_stats_t* out);

/* ---------------------------------------------------------------------------------------------
 * Checkpoints: the whole training state, straight from the tiers
 *
 * A checkpoint is a directory: model.safetensors holds every tensor registered with role
 * WEIGHT, in its dtype, under its name (Hugging Face tools read it: safetensors.safe_open,
 * transformers' from_pretrained); optimizer.safetensors holds the optimizer's masters and
 * state and, in its metadata, the step, loss scale and skipped-step counters. Every tensor's
 * CRC-32C is in its file's metadata and checked on load. Saving is atomic: the files are
 * written and fsynced in "<path>.partial", which then replaces <path> in one rename, so a crash
 * at any moment leaves the previous checkpoint whole.
 * ------------------------------------------------------------------------------------------- */

/* Save to the directory `path` (borrowed). optimizer may be NULL (weights only). Waits for the
 * running updates of every optimizer of the runtime, `optimizer` or not, so the files hold
 * whole updated weights. Must be called between optimizer steps (not inside an accumulation)
 * and between executor steps. Errors: INVALID_ARGUMENT (NULL runtime or path), INVALID_STATE
 * (mid-step: an executor of the runtime is between strata_step_begin and strata_step_end, or
 * the optimizer is inside an accumulation; or no tensor is registered with role WEIGHT), IO
 * (the message names the file; the previous checkpoint is untouched).
 * Thread-safe, but concurrent saves to one path are not supported. */
STRATA_API strata_status_t strata_checkpoint_save(strata_runtime_t* runtime,
                                                  strata_optimizer_t* optimizer, const char* path);

/* Load the directory `path` into the registered tensors (and the optimizer's state, when
 * optimizer is non-NULL), between steps. Everything is checked before any tensor is written:
 * every registered weight (and, with an optimizer, every param's state) must be in the files
 * with the same dtype and shape, the files hold nothing else, and every tensor carries its
 * CRC-32C entry. Errors: INVALID_ARGUMENT (NULL, a malformed file, mismatched names, dtypes or
 * shapes, a tensor without its checksum entry: the message names them; nothing written),
 * NOT_FOUND (no checkpoint at path), INVALID_STATE (mid-step, as for save), IO,
 * DATA_CORRUPTION (a tensor failed its checksum while loading: the tensors are partly loaded,
 * and the optimizer refuses to step until a load succeeds). Waits first for the running
 * updates of every optimizer of the runtime (a late update would overwrite the load). A load
 * with the optimizer is how a failed optimizer recovers (a failed load, step or synchronize):
 * the failed step's queued updates and held grads are dropped, and its success clears the
 * failure; a save of a failed optimizer is refused with its error. With
 * optimizer NULL only the registered tensors are written: an optimizer that holds loaded
 * weights keeps its masters and moments (a separate master would put its old value back at
 * the next update; a split one keeps its low half only where that still rounds to the new
 * weight), so to train from the loaded weights set the masters with
 * strata_optimizer_master_write, or load with the optimizer. Thread-safe with respect to other
 * runtimes. */
STRATA_API strata_status_t strata_checkpoint_load(strata_runtime_t* runtime,
                                                  strata_optimizer_t* optimizer, const char* path);

/* Atomic directories (since 1.5): the replacement strata_checkpoint_save does, for a framework
 * that writes its own files beside Strata's (strata.torch's resident.pt, strata.jax's jax.npz)
 * into one checkpoint directory. A save calls strata_atomic_dir_begin, writes everything into
 * the staging directory (strata_checkpoint_save into a subdirectory of it included) and calls
 * strata_atomic_dir_commit; a load reads the directory strata_atomic_dir_resolve names. A crash
 * at any moment leaves one complete version to load, the previous one or the new one, never a
 * mix: where the file system has renameat2(RENAME_EXCHANGE) the commit swaps the two in one
 * rename; elsewhere it renames the previous one to "<path>.old" first, and resolve returns that
 * when a crash came between the two renames. No runtime is needed. `path` (borrowed, read during
 * the call) names the checkpoint directory; trailing '/' are ignored. Thread-safe for different
 * paths; concurrent calls on one path are not supported. Buffers follow strata_plan_dump's rules:
 * the path NUL-terminated into `buffer` (borrowed, `capacity` bytes), its length without the NUL
 * into *out_length (may be NULL), a NULL buffer only asks for the length, a buffer too small is
 * refused (INVALID_ARGUMENT naming the size needed). Every function also fails with
 * INVALID_ARGUMENT for a NULL or empty path and one with no last component ("/", ".."). */

/* The staging directory of `path`, "<path>.partial" (strlen(path) + 9 bytes always suffice),
 * for every process of a save to write into; nothing is touched. Errors: INVALID_ARGUMENT. */
STRATA_API_SINCE(1, 5)
strata_status_t strata_atomic_dir_staging(const char* path, char* buffer, size_t capacity,
                                          size_t* out_length);

/* Prepare the staging directory of `path`: a leftover of a save that crashed is removed, the
 * directory and any missing parents created (the parents made durable). Errors:
 * INVALID_ARGUMENT (also: `path` exists and is not a directory), IO (the message names the file
 * and the OS error). */
STRATA_API_SINCE(1, 5)
strata_status_t strata_atomic_dir_begin(const char* path);

/* Make the written staging directory `path`: every regular file and directory under it is
 * fsynced, then it replaces `path` atomically (above) and the parent directory is fsynced; the
 * previous version is removed afterwards. On success the staging directory no longer exists.
 * Errors: INVALID_ARGUMENT (also: the staging directory or `path` exists and is not a
 * directory), NOT_FOUND (no staging directory: strata_atomic_dir_begin was not called, or a
 * commit already took it), IO (the message names the file; before the replacement `path` is
 * untouched; an IO error removing the previous version comes after the new one is in place,
 * and the next strata_atomic_dir_begin removes the leftover). */
STRATA_API_SINCE(1, 5)
strata_status_t strata_atomic_dir_commit(const char* path);

/* The directory a load should read (strlen(path) + 5 bytes always suffice): `path` when it is a
 * directory, else "<path>.old" when a replacement was interrupted between its two renames. A
 * staging directory left by a crash is never returned. Nothing is modified. Errors:
 * INVALID_ARGUMENT (also: `path` exists and is not a directory), NOT_FOUND (neither exists: the
 * message names both), IO. */
STRATA_API_SINCE(1, 5)
strata_status_t strata_atomic_dir_resolve(const char* path, char* buffer, size_t capacity,
                                          size_t* out_length);

/* ---------------------------------------------------------------------------------------------
 * Tracing: where the bytes went, how fast each link ran, where the GPU waited
 *
 * Off by default. When on, every migration, device copy (moves and the executor's streaming),
 * NVMe request, and layer acquire (with how long its stream waited) and release is recorded
 * into per-thread lock-free rings; flushing writes a Chrome trace / Perfetto JSON file with a
 * track per link and per stream. `tools/strata-prof` summarizes and plots such files.
 * ------------------------------------------------------------------------------------------- */
typedef int32_t strata_trace_kind_t;
#define STRATA_TRACE_MIGRATION 0
#define STRATA_TRACE_COPY_H2D 1
#define STRATA_TRACE_COPY_D2H 2
#define STRATA_TRACE_NVME_READ 3
#define STRATA_TRACE_NVME_WRITE 4
#define STRATA_TRACE_ACQUIRE 5
#define STRATA_TRACE_RELEASE 6
#define STRATA_TRACE_OPTIMIZER 7
#define STRATA_TRACE_KIND_COUNT 8

typedef struct strata_trace_config {
  size_t struct_size; /* STRATA_TRACE_CONFIG_STRUCT_SIZE */
  /* Records per thread before new ones are dropped; 0 = 65536; at most 1048576 (1 << 20). */
  uint32_t ring_capacity;
} strata_trace_config_t;
#define STRATA_TRACE_CONFIG_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_trace_config_t, ring_capacity)

/* Start (or restart, discarding earlier records) tracing. config: borrowed; NULL = defaults.
 * A recording thread whose ring cannot be allocated drops its records (counted in `dropped`).
 * Errors: INVALID_ARGUMENT (NULL runtime, bad struct_size, ring_capacity over 1 << 20).
 * Thread-safe. */
STRATA_API strata_status_t strata_trace_start(strata_runtime_t* runtime,
                                              const strata_trace_config_t* config);

/* Stop recording; what was recorded stays until flushed or restarted. Errors:
 * INVALID_ARGUMENT. Thread-safe. */
STRATA_API strata_status_t strata_trace_stop(strata_runtime_t* runtime);

/* Write every record so far to `path` (borrowed) as Chrome trace JSON, atomically (a
 * temporary file renamed into place). Records acquires only once their wait is known (at
 * strata_step_end). Errors: INVALID_ARGUMENT (NULL), IO (the file cannot be written).
 * Thread-safe. */
STRATA_API strata_status_t strata_trace_flush(strata_runtime_t* runtime, const char* path);

typedef struct strata_trace_counters {
  size_t struct_size;                        /* caller sets STRATA_TRACE_COUNTERS_STRUCT_SIZE */
  uint64_t records[STRATA_TRACE_KIND_COUNT]; /* per strata_trace_kind_t */
  uint64_t bytes[STRATA_TRACE_KIND_COUNT];
  uint64_t dropped; /* records lost to full rings */
} strata_trace_counters_t;
#define STRATA_TRACE_COUNTERS_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_trace_counters_t, dropped)

/* Counts of the records since strata_trace_start. Errors: INVALID_ARGUMENT. Thread-safe. */
STRATA_API strata_status_t strata_trace_get_counters(strata_runtime_t* runtime,
                                                     strata_trace_counters_t* out);

/* ---------------------------------------------------------------------------------------------
 * Placement (since 1.2): where a streamed model's training state should live
 *
 * Declare, then place: before registering anything, a framework describes each layer by role
 * (streamed weights, grads, optimizer state, and the update's size), the DRAM and NVMe budgets
 * and the rates a step runs at; the placement tries every split of the state and the weights
 * between DRAM and NVMe the budgets allow (always the last layers' first: their grads land
 * first and the next forward pass needs them last), predicts each one's step with a
 * simulation of the executor and the optimizer together (PCIe loads and grads, compute, CPU
 * updates, the disk's reads and writes, the staging slots), and keeps the fastest (within 1%:
 * the fewest bytes on NVMe). The caller then registers its tensors where it says, and gives the
 * optimizer STRATA_STATE_PLACEMENT_PLANNED with nvme_staging_bytes = staging_slots * slot_bytes
 * (+ grad_fetch_bytes with grads in HBM) and a DRAM budget of dram_bytes: it then puts this
 * placement's state on NVMe, or less (it fills the DRAM left over param by param in forward
 * order, so the first spilled layers keep part of their state in DRAM: the prediction,
 * nvme_bytes and dram_bytes count that). Nothing is allocated.
 * ------------------------------------------------------------------------------------------- */
typedef struct strata_placement strata_placement_t;

#define STRATA_HOME_CHOOSE (-1) /* the placement chooses: STRATA_TIER_DRAM or STRATA_TIER_NVME */

typedef struct strata_placement_layer {
  size_t struct_size;       /* STRATA_PLACEMENT_LAYER_STRUCT_SIZE */
  const char* name;         /* borrowed (copied); NULL = "layer.N" */
  uint64_t weight_bytes;    /* the streamed working copy, loaded for both passes */
  uint64_t grad_bytes;      /* grad_tier DRAM: sent there by the backward pass; HBM: copied
                               to DRAM by each read of them (the update; with
                               updates_after_backward, the norm or landing too) */
  uint64_t state_bytes;     /* optimizer state (fp32 master, moments); 0 = frozen layer */
  uint64_t update_elements; /* elements one update of the layer touches */
  double forward_seconds;   /* device time per step; 0 = not counted */
  double backward_seconds;  /* recomputation included; 0 = not counted */
  int32_t weight_tier;      /* STRATA_HOME_CHOOSE, STRATA_TIER_DRAM or STRATA_TIER_NVME */
  int32_t state_tier;       /* the same, for the optimizer state */
  /* Where the grads live, as registered (the placement does not choose it): STRATA_TIER_DRAM,
   * the default, or STRATA_TIER_HBM, which takes no DRAM per layer but one buffer of the
   * largest such layer's grad_bytes that every read goes through (strata_optimizer_add_param,
   * "HBM-homed grad"). */
  int32_t grad_tier;
} strata_placement_layer_t;
#define STRATA_PLACEMENT_LAYER_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_placement_layer_t, grad_tier)

typedef struct strata_placement_request {
  size_t struct_size; /* STRATA_PLACEMENT_REQUEST_STRUCT_SIZE */
  /* Borrowed: layer_count pointers, forward order, each with its own struct_size. */
  const strata_placement_layer_t* const* layers;
  uint32_t layer_count;
  uint32_t staging_slots;     /* 0 = choose, 1..max_staging_slots */
  uint32_t max_staging_slots; /* 0 = 4, what the optimizer stages at once at most; 1..4 */
  uint32_t prefetch_depth;    /* layers loaded ahead of the compute; 0 = 1 */
  /* 0 = what the runtime's tier has free (DRAM's largest free block; NVMe's free bytes), or
   * none without a runtime. */
  uint64_t dram_budget_bytes;
  uint64_t nvme_budget_bytes;
  double other_device_seconds; /* device time per step outside the layers (head, loss) */
  /* Rates; 0 = measured on the runtime (links: a few 64 MiB copies; the disk: 4 GiB written,
   * read, then read and written at once, through two 256 MiB DRAM buffers, less where the tier
   * or DRAM has less free, about 10 s at 2 GB/s; the
   * update: AdamW over 64M scratch elements on the optimizer's default threads, about a
   * second), or not counted without one. nvme_mixed: the time to read and write at
   * once over the time to do them one after the other, 0.5..1. All finite and >= 0. */
  double h2d_bytes_per_second;
  double d2h_bytes_per_second;
  double nvme_read_bytes_per_second;
  double nvme_write_bytes_per_second;
  double nvme_mixed;
  double update_elements_per_second;
  /* 1: a layer's update waits for the whole backward pass (gradient clipping, or an explicit
   * optimizer step such as PyTorch's); 0: for its own grads only. */
  int32_t updates_after_backward;
} strata_placement_request_t;
#define STRATA_PLACEMENT_REQUEST_STRUCT_SIZE \
  STRATA_STRUCT_SIZE(strata_placement_request_t, updates_after_backward)

/* Defaults, and struct_size set. Errors: INVALID_ARGUMENT (NULL). Thread-safe. */
STRATA_API_SINCE(1, 2)
strata_status_t strata_placement_request_init(strata_placement_request_t* request);
STRATA_API_SINCE(1, 2)
strata_status_t strata_placement_layer_init(strata_placement_layer_t* layer);

/* Choose a placement. runtime: may be NULL (then every rate and budget must be given, or is
 * not counted / none); used only to measure rates and read budgets, never changed beyond the
 * scratch memory a measurement borrows and gives back. request: borrowed. out_placement: owned
 * by the caller (strata_placement_destroy). Errors: INVALID_ARGUMENT (NULL request or output,
 * bad struct_size, no layers or more than 16384, a size above 2^44 bytes or elements, a rate
 * between 0 and 1 per second, a time above 1e9 s, max_staging_slots above 4, prefetch_depth
 * above 1024, a home fixed on NVMe with no NVMe budget, a tier that
 * is not DRAM, NVMe or STRATA_HOME_CHOOSE, a grad tier that is not DRAM or HBM, a negative or
 * non-finite rate or time, nvme_mixed outside 0.5..1, staging_slots above max_staging_slots),
 * OUT_OF_MEMORY (no placement fits the budgets: the message says what DRAM, or else NVMe, needs at
 * least and what it has; or a measurement's scratch memory was refused). On a runtime without an
 * NVMe tier (or with no NVMe budget) the disk's rates are not measured: nothing can spill.
 * Thread-safe with respect to other runtimes; measurements on one runtime serialize with its
 * allocations. */
STRATA_API_SINCE(1, 2)
strata_status_t strata_placement_create(strata_runtime_t* runtime,
                                        const strata_placement_request_t* request,
                                        strata_placement_t** out_placement);

/* Destroy a placement; NULL is accepted. */
STRATA_API_SINCE(1, 2) strata_status_t strata_placement_destroy(strata_placement_t* placement);

typedef struct strata_placement_info {
  size_t struct_size; /* caller sets STRATA_PLACEMENT_INFO_STRUCT_SIZE */
  uint32_t layers;
  uint32_t staging_slots;      /* 0 when nothing is staged */
  uint32_t state_nvme_layers;  /* layers whose optimizer state is on NVMe */
  uint32_t weight_nvme_layers; /* layers whose weights are on NVMe */
  uint32_t candidates;         /* placements simulated */
  uint64_t slot_bytes;         /* one staging slot */
  uint64_t dram_bytes; /* grads in DRAM (or their fetch buffer), DRAM weights and state (with
                         the first spilled layers' state the DRAM left over keeps), slots */
  uint64_t nvme_bytes;
  /* The rates used (given or measured). */
  double h2d_bytes_per_second;
  double d2h_bytes_per_second;
  double nvme_read_bytes_per_second;
  double nvme_write_bytes_per_second;
  double nvme_mixed;
  double update_elements_per_second;
  double predicted_step_seconds; /* steady state, one step's end to the next one's */
  /* Busy time of each resource in one step. */
  double predicted_compute_seconds;
  double predicted_h2d_seconds;
  double predicted_d2h_seconds;
  double predicted_nvme_read_seconds;
  double predicted_nvme_write_seconds;
  double predicted_update_seconds;
  double predicted_gpu_wait_seconds; /* compute idle */
  /* The CPU idle from the backward pass's end to the last update's end: updates waiting for
   * their state from NVMe. */
  double predicted_update_wait_seconds;
  char bottleneck[16]; /* "compute", "h2d", "d2h", "nvme" or "update" */
  /* The buffer HBM-homed grads are read through (part of dram_bytes; 0 with none): the
   * optimizer lays it out before its staging slots, so give it nvme_staging_bytes =
   * staging_slots * slot_bytes + grad_fetch_bytes. */
  uint64_t grad_fetch_bytes;
} strata_placement_info_t;
#define STRATA_PLACEMENT_INFO_STRUCT_SIZE \
  STRATA_STRUCT_SIZE(strata_placement_info_t, grad_fetch_bytes)

/* The placement's numbers. Errors: INVALID_ARGUMENT (NULL, bad struct_size). Thread-safe. */
STRATA_API_SINCE(1, 2)
strata_status_t strata_placement_get_info(strata_placement_t* placement,
                                          strata_placement_info_t* out);

/* Layer `index`'s homes: STRATA_TIER_DRAM or STRATA_TIER_NVME for its weights and its state
 * (either output may be NULL). Errors: INVALID_ARGUMENT (NULL placement, index out of range).
 * Thread-safe. */
STRATA_API_SINCE(1, 2)
strata_status_t strata_placement_get_layer(strata_placement_t* placement, uint32_t index,
                                           int32_t* weight_tier, int32_t* state_tier);

/* The placement as JSON or readable text (STRATA_PLAN_FORMAT_*), with the same buffer rules as
 * strata_plan_dump. Errors: INVALID_ARGUMENT. Thread-safe. */
STRATA_API_SINCE(1, 2)
strata_status_t strata_placement_dump(strata_placement_t* placement, strata_plan_format_t format,
                                      char* buffer, size_t capacity, size_t* out_length);

/* ---------------------------------------------------------------------------------------------
 * Layout sizes (since 1.3): what a streamed model's tensors take of each tier
 *
 * Before creating a runtime, a framework or a C trainer asks what its layout needs: per layer,
 * the bytes of its weights, its grads (in DRAM, or the DRAM buffer HBM-homed grads are read
 * through), its optimizer state as the optimizer's STRATA_STATE_PLACEMENT_PLANNED counts it;
 * and in all, the default DRAM, HBM and NVMe budgets, the staging slot and the tiers' margins.
 * The numbers come from the rules the runtime allocates by (the DRAM arena's 4 KiB blocks, the
 * optimizer's state per element, its planned threshold, its grad fetch buffer's layout): the
 * per-layer figures are what strata_placement_layer_t wants, so a placement never counts less
 * DRAM than the registrations and the optimizer then take. Nothing is allocated; no runtime is
 * needed.
 * ------------------------------------------------------------------------------------------- */
typedef struct strata_layout_request {
  size_t struct_size; /* STRATA_LAYOUT_REQUEST_STRUCT_SIZE */
  /* The streamed weights' and their grads' dtype: STRATA_DTYPE_F32, _BF16 (the default) or
   * _F16. */
  strata_dtype_t dtype;
  /* The optimizer (STRATA_OPTIMIZER_ADAMW, the default, _SGD or, since 1.4, _ADAM, _LION,
   * _ADAGRAD) and, for SGD, whether it keeps a momentum buffer (1: its config's momentum is
   * above 0; default 0). */
  strata_optimizer_kind_t optimizer;
  int32_t sgd_momentum;
  /* How bf16 weights keep their fp32 masters (STRATA_MASTER_*; default SEPARATE). SPLIT with
   * f16 weights is INVALID_ARGUMENT; with f32 weights (their own masters) it changes nothing. */
  uint32_t master_layout;
  /* Where the grads live: STRATA_TIER_DRAM (the default) or STRATA_TIER_HBM. */
  strata_tier_t grad_tier;
  /* Staging slots the default DRAM budget (dram_bytes) keeps room for; default 4, the most
   * the optimizer stages at once. */
  uint32_t staging_slots;
  uint32_t layer_count; /* 1..16384 */
  /* Borrowed (read during the call): per layer, its trainable tensors' count (layer_count
   * entries), and their element counts, layer after layer (the counts' sum of entries). A
   * trainable tensor has a grad and optimizer state; a frozen one is a weight only.
   * frozen_counts NULL: no frozen tensors (frozen_elements is then not read). At most 2^24
   * tensors and 2^44 elements in all. */
  const uint32_t* trainable_counts;
  const uint64_t* trainable_elements;
  const uint32_t* frozen_counts;
  const uint64_t* frozen_elements;
  /* An NVMe tier's budget to size nvme_placeable_bytes for; 0 (the default): nvme_bytes. */
  uint64_t nvme_budget_bytes;
  /* Since 1.5: the params' gradient sums (STRATA_GRAD_SUM_*; default ACCUMULATOR, what a 1.4
   * caller's struct_size means). IN_PLACE needs grad_tier STRATA_TIER_HBM: the grads are then
   * F32 whatever dtype says (grad_hbm_bytes, grad_bytes and grad_fetch_bytes count 4 bytes an
   * element) and accum_bytes is 0. */
  uint32_t grad_sum;
} strata_layout_request_t;
#define STRATA_LAYOUT_REQUEST_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_layout_request_t, grad_sum)

/* One layer's needs. Every field is 8 bytes wide, and fields appended later will be too, so
 * sizeof equals STRATA_LAYOUT_LAYER_STRUCT_SIZE and an array of them is struct_size apart. */
typedef struct strata_layout_layer {
  size_t struct_size; /* caller sets STRATA_LAYOUT_LAYER_STRUCT_SIZE, in every element */
  /* Trainable and frozen weights in DRAM (or on NVMe): each tensor's 4 KiB arena block and a
   * page more (the margin a placement counts so it never plans less than is allocated). */
  uint64_t weight_bytes;
  /* Grads in DRAM: counted as the weights are. Grads in HBM: what one read of them copies to
   * DRAM, the optimizer's fetch buffer for this layer (each param's grads 64-byte aligned, the
   * block and a page); 0 for a layer without trainable tensors. */
  uint64_t grad_bytes;
  /* Grads in HBM: the HBM they take (their bytes, 1% and 64 KiB for the HBM arena's
   * per-tensor alignment); 0 with grads in DRAM. */
  uint64_t grad_hbm_bytes;
  /* Optimizer state (fp32 master unless the weights are f32, or a split master's low halves;
   * AdamW's m and v; SGD's momentum buffer) as STRATA_STATE_PLACEMENT_PLANNED counts it when
   * it decides whether DRAM holds a param's state: each param's bytes, 1/64 and 24 KiB more
   * (never below what the state tensors take of the arena). 0 for a layer without trainable
   * tensors. */
  uint64_t state_bytes;
  uint64_t update_elements; /* trainable elements: what one update of the layer touches */
} strata_layout_layer_t;
#define STRATA_LAYOUT_LAYER_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_layout_layer_t, update_elements)

typedef struct strata_layout_totals {
  size_t struct_size;       /* caller sets STRATA_LAYOUT_TOTALS_STRUCT_SIZE */
  uint64_t weight_bytes;    /* the layers' sums */
  uint64_t grad_dram_bytes; /* DRAM-homed grads */
  uint64_t grad_hbm_bytes;  /* HBM-homed grads' HBM */
  /* HBM-homed grads: the one DRAM buffer every read goes through, the largest layer's
   * grad_bytes (what strata_placement_info_t.grad_fetch_bytes reports); 0 with grads in DRAM. */
  uint64_t grad_fetch_bytes;
  uint64_t state_bytes;
  uint64_t slot_bytes; /* the largest layer's state_bytes: a staging slot for it */
  uint64_t update_elements;
  uint64_t state_bytes_per_element; /* the optimizer's state per trainable element (AdamW, bf16
                                       weights, separate masters: 12) */
  /* The DRAM every tensor in DRAM takes, with room for staging_slots slots and dram_margin_bytes
   * for the optimizer's buffers' page rounding: a DRAM budget that never spills state. */
  uint64_t dram_bytes;
  uint64_t dram_margin_bytes;
  /* The budgets the Python packages default to without an NVMe tier: DRAM for every tensor,
   * 2% for page rounding and 256 MiB of headroom (with HBM-homed grads, the fetch buffer and 1
   * MiB more); HBM for 4 slots of the largest layer's weights and grad buffers and 64 MiB (with
   * HBM-homed grads, grad_hbm_bytes more). */
  uint64_t streaming_dram_bytes;
  uint64_t streaming_hbm_bytes;
  /* The NVMe tier's headroom beyond what a placement puts there: nvme_margin_bytes (64 MiB a
   * layer) and 5%. nvme_bytes: a budget holding every layer's weights, state and accumulators;
   * nvme_placeable_bytes: what a placement may put on a tier of the request's
   * nvme_budget_bytes (or nvme_bytes), (budget - margin) / 1.05; 0 when the margin takes it
   * all. */
  uint64_t nvme_margin_bytes;
  uint64_t nvme_bytes;
  uint64_t nvme_placeable_bytes;
  /* Since 1.4 (a 1.3 caller's struct_size ends before it; the field is then not written).
   * Explicit update mode's fp32 gradient accumulators (one per trainable tensor, created at the
   * first backward pass onto grads not zeroed since the last one), as the DRAM arena takes them:
   * each one's 4 KiB blocks and a page. The optimizer puts them in DRAM when its free space
   * holds them, else, with an NVMe tier, (the last layers') on NVMe, staged through the staging
   * slots like NVMe-homed state: a DRAM budget of dram_bytes (or streaming_dram_bytes) plus
   * accum_bytes accumulates without touching the disk. nvme_bytes has room for them. */
  uint64_t accum_bytes;
  /* Since 1.5 (not written for a 1.4 caller's struct_size). Of dram_bytes, what the GPU's
   * copies read or write (weights, DRAM-homed grads or the grad fetch buffer) and
   * dram_margin_bytes: the strata_runtime_config_t.dram_pinned_bytes that pins all of it and
   * leaves the optimizer's state, staging slots and accumulators (read by the CPU only)
   * unpinned. */
  uint64_t dram_gpu_bytes;
} strata_layout_totals_t;
#define STRATA_LAYOUT_TOTALS_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_layout_totals_t, dram_gpu_bytes)

/* Defaults (BF16, AdamW, separate masters, grads in DRAM, 4 staging slots, no layers, gradient
 * sums in accumulators), and struct_size set. Errors: INVALID_ARGUMENT (NULL). Thread-safe. */
STRATA_API_SINCE(1, 3)
strata_status_t strata_layout_request_init(strata_layout_request_t* request);

/* What the request's layout needs. request: borrowed. layers: borrowed, an array of
 * request->layer_count structs the caller owns, each with struct_size set (one value for all:
 * the library steps through the array by it), or NULL when only totals are wanted. totals:
 * borrowed, the caller sets its struct_size; may be NULL. The library writes at most each
 * struct_size's bytes. Errors: INVALID_ARGUMENT (NULL request, bad struct_size, layers whose
 * struct_sizes differ, no layers or more than 16384, a NULL count or element array with
 * tensors to read, a dtype other than F32, BF16 or F16, an unknown optimizer, master layout or
 * grad tier, a split master with F16, more than 2^24 tensors or 2^44 elements, an unknown
 * grad_sum, STRATA_GRAD_SUM_IN_PLACE with grads in DRAM); nothing is written then. Thread-safe;
 * touches no runtime. */
STRATA_API_SINCE(1, 3)
strata_status_t strata_layout_query(const strata_layout_request_t* request,
                                    strata_layout_layer_t* layers, strata_layout_totals_t* totals);

/* ---------------------------------------------------------------------------------------------
 * Step-memory plan (since 1.5): what keeps one training step inside the device's and the host's
 * memory, decided by the runtime for every binding
 *
 * A binding measures and executes; the runtime decides. The binding describes the step in a
 * profile (its blocks, a linear chain in model order: their parameters and what each would keep
 * for its backward pass; the device's and the host's memory as its allocator sees them; the
 * batch; a measured step's peaks) and gets back, per block: resident in HBM or streamed;
 * recompute, keep selectively (only the outputs of its matrix products and attention) or keep
 * wholly; its checkpoint (its input, kept from its forward to its backward pass) on the device or
 * in host memory; and for the step: the loss's chunk of tokens, the host budget as counted, the
 * predicted peak, what a backward block may allocate, and how much optimizer state an NVMe tier
 * should take so that the host holds the checkpoints. The profile says which decisions to
 * make: residency when every block is STRATA_RESIDENCY_CHOOSE, checkpoint homes with
 * STRATA_STEP_PLAN_CHECKPOINTS, kept activations with STRATA_STEP_PLAN_KEPT; the host budget
 * and the loss chunk whenever their figures are given. A binding plans at each moment it learns
 * more (strata.torch: residency at set-up, checkpoint homes at the first forward pass of a
 * batch, kept activations once two steps were measured). Within one call kept activations are
 * decided first, and checkpoint homes counted with them. The constants (shares, margins, factors)
 * live in the library only; strata_step_plan_dump says every choice and why. Nothing is
 * allocated on any tier; no runtime is needed.
 *
 * For a framework other than PyTorch: "held" is what its allocator has reserved from the device
 * (XLA's preallocated pool: all of it), "free" what the device has beside it; a measured peak is
 * the allocator's high-water mark (allocated, and reserved: pass allocated for both where the
 * allocator has no separate figure); a measured step is one in which every block recomputed.
 * ------------------------------------------------------------------------------------------- */
typedef struct strata_step_plan strata_step_plan_t;

typedef int32_t strata_residency_t;
#define STRATA_RESIDENCY_CHOOSE 0 /* input only: the plan chooses (all blocks or none) */
#define STRATA_RESIDENCY_RESIDENT 1
#define STRATA_RESIDENCY_STREAMED 2

typedef int32_t strata_keep_t;
#define STRATA_KEEP_RECOMPUTE 0 /* the backward pass recomputes the block's forward */
#define STRATA_KEEP_SELECTIVE 1 /* only its products' and attention's outputs are kept */
#define STRATA_KEEP_WHOLE 2     /* everything its backward needs is kept (resident blocks only) */

typedef int32_t strata_step_point_t;
#define STRATA_STEP_POINT_FORWARD 0  /* a block begins its forward pass with grad */
#define STRATA_STEP_POINT_BACKWARD 1 /* a block begins its backward pass */
#define STRATA_STEP_POINT_END 2      /* the step ends (after the first block's backward) */

/* strata_step_profile_t.flags: the decisions asked for, and facts about the measurements.
 * PLAN_CHECKPOINTS: checkpoint homes (needs a device, blocks, tokens and checkpoint_bytes).
 * PLAN_KEPT: kept activations (needs a device, blocks and a measured step: its peaks, every
 * block's keep RECOMPUTE). ALLOCATOR_RETURNS_CACHE: the allocator gives its cache back where an
 * allocation needs it (torch's expandable segments): a smaller margin. BLOCK_SAVED_MEASURED:
 * block_saved_bytes was measured (else one block's working set is taken as 16 checkpoints).
 * LOSS_CHUNKED: the loss runs over chunks of tokens. */
#define STRATA_STEP_PLAN_CHECKPOINTS 0x1u
#define STRATA_STEP_PLAN_KEPT 0x2u
#define STRATA_STEP_ALLOCATOR_RETURNS_CACHE 0x100u
#define STRATA_STEP_BLOCK_SAVED_MEASURED 0x200u
#define STRATA_STEP_LOSS_CHUNKED 0x400u

typedef struct strata_step_block {
  size_t struct_size;     /* STRATA_STEP_BLOCK_STRUCT_SIZE */
  uint64_t elements;      /* the block's parameters (a count, not bytes) */
  uint64_t rank_elements; /* of them, what this process holds (data parallel); 0 = all */
  /* What the block saves for its backward pass when it does not recompute, at the profile's
   * batch (0: unmeasured; such a resident block is not kept, nor any before it), and only its
   * products' and attention's outputs (0: it cannot be kept so). A streamed block is only ever
   * kept selectively (wholly would keep its weights). */
  uint64_t keep_whole_bytes;
  uint64_t keep_selective_bytes;
  /* Input: RESIDENT and STREAMED fix it (resident blocks first), CHOOSE lets the plan choose
   * (then for every block). Output (strata_step_plan_get_block): RESIDENT or STREAMED. */
  strata_residency_t residency;
  /* Input: how the block keeps now (the checkpoint plan counts what kept blocks hold; WHOLE only
   * for a resident block). Output: the plan's choice (the input's where kept activations were
   * not planned). */
  strata_keep_t keep;
  /* Output only: STRATA_TIER_HBM or STRATA_TIER_DRAM, where its checkpoint waits for its
   * backward pass (ignored as input; HBM where checkpoints were not planned, and for a block
   * without a checkpoint of its own, below). */
  strata_tier_t checkpoint_tier;
  /* Output only: the block whose checkpoint this block's input comes from. Its own index where
   * it keeps a checkpoint. An earlier block's, g, where the plan grouped checkpoints (the
   * profile's max_group_blocks above 1, and one checkpoint per block fitting neither the device
   * nor host_room_bytes): the binding drops this block's input after its forward pass and, in
   * the backward pass before block index's backward (the first of the group to come), runs
   * blocks g .. index-1 forward again from g's checkpoint (same weights, RNG and autocast state
   * as their forward pass, no grad) to regenerate the inputs of blocks g+1 .. index. Only
   * streamed blocks that recompute are grouped, in runs of consecutive ones. */
  uint32_t group_start;
  /* Output only: the sequence tiles its MLP runs over (1: the whole batch at once; ignored as
   * input). With k above 1 the binding runs the block's MLP (its sequence-independent, per-token
   * work) over k tiles of strata_step_plan_info_t.mlp_tile_tokens tokens (the last one shorter),
   * saving only the MLP's input for its backward pass and recomputing each tile there, so no
   * intermediate of the whole batch exists at once; the weight grads are the sum over the tiles.
   * Only a block that recomputes (keep RECOMPUTE) is tiled, streamed or resident; 1 where
   * checkpoints were not planned. */
  uint32_t mlp_tiles;
  /* Input: the FLOPs of the block's forward pass a token through its weights (2 x the
   * parameters one token's products use: a dense block's 2 x elements; a mixture-of-experts
   * block's routed experts at top_k / num_experts of theirs and the rest whole; attention's
   * products with the sequence not counted). 0 (the default): a dense block's. */
  uint64_t active_flops;
  /* Output only: 1 where the block streams and, at the profile's tokens and rates, loading its
   * weights (for its forward and again for its backward pass) takes longer than its compute
   * (forward, backward at twice the forward, and the forward again recomputing): an MoE block at
   * a small batch. Such a block keeps no activations where the plan decides them (its recompute
   * runs while its weights load). 0 otherwise and where transfers were not judged (the
   * profile's tokens, h2d_bytes_per_second, device_flops_per_second or weight_bytes_per_param
   * 0). Resident blocks are the first ones whatever their FLOPs (a resident block after a
   * streamed one is refused): the plan cannot choose the transfer-bound ones resident, and its
   * dump says so. */
  uint32_t transfer_bound;
} strata_step_block_t;
#define STRATA_STEP_BLOCK_STRUCT_SIZE STRATA_STRUCT_SIZE(strata_step_block_t, transfer_bound)

typedef struct strata_step_interval {
  size_t struct_size;            /* STRATA_STEP_INTERVAL_STRUCT_SIZE */
  strata_step_point_t point;     /* the point that ends the interval */
  uint32_t block;                /* its block (model order; 0 for STRATA_STEP_POINT_END) */
  uint64_t allocated_peak_bytes; /* the framework's allocator's peaks within the interval, */
  uint64_t reserved_peak_bytes;  /* reserved >= allocated, neither above the step's */
} strata_step_interval_t;
#define STRATA_STEP_INTERVAL_STRUCT_SIZE \
  STRATA_STRUCT_SIZE(strata_step_interval_t, reserved_peak_bytes)

typedef struct strata_step_profile {
  size_t struct_size; /* STRATA_STEP_PROFILE_STRUCT_SIZE */
  /* Borrowed: block_count pointers (0..16384), model order, each with its own struct_size. */
  const strata_step_block_t* const* blocks;
  /* Borrowed: interval_count pointers (0..65540; NULL with 0), a measured step's intervals
   * between block starts; with both points of every block the kept blocks are counted only in
   * the intervals where they are alive, else at the step's peak. */
  const strata_step_interval_t* const* intervals;
  uint32_t block_count;
  uint32_t interval_count;
  uint32_t flags;         /* STRATA_STEP_* bits; an unknown one is INVALID_ARGUMENT */
  uint32_t ranks_on_host; /* processes of this host each making a host budget; 0 = 1 */
  /* Residency: the bytes a resident parameter takes on the device (weight, grad, optimizer
   * state; 1..64 when choosing), and with the streamed grads in HBM their bytes per parameter
   * (at most the resident's; 0 exactly when streamed_grads_hbm_bytes is 0). */
  uint32_t resident_bytes_per_param;
  uint32_t streamed_grad_bytes_per_param;
  /* The device (bytes; device_total 0: none, nothing is planned on it): its memory, what it has
   * free now, what the framework's allocator holds (free + held: what it could hold). */
  uint64_t device_total_bytes;
  uint64_t device_free_bytes;
  uint64_t framework_held_bytes;
  /* Residency: Strata's HBM tier still to be allocated (its slots), the parameters outside the
   * blocks still coming to the device (embedding, head), the streamed grads' bytes in HBM. */
  uint64_t hbm_tier_bytes;
  uint64_t outside_elements;
  uint64_t streamed_grads_hbm_bytes;
  /* Checkpoint homes: the batch's tokens, one block's checkpoint bytes, what one block saves for
   * its backward at this batch (with STRATA_STEP_BLOCK_SAVED_MEASURED), what the framework holds
   * allocated as the forward pass begins (checkpoints of this step not yet among it), the grads
   * its backward pass will allocate, and bytes that leave the device before the loss (paged
   * optimizer state). */
  uint64_t tokens;
  uint64_t checkpoint_bytes;
  uint64_t block_saved_bytes;
  uint64_t in_use_bytes;
  uint64_t backward_grad_bytes;
  uint64_t leaving_bytes;
  /* Loss: the head's vocabulary and hidden size (both needed for the loss's working set), a
   * chunk of tokens the user gave (0: the default, the tokens whose fp32 logits fit in 1 GiB, a
   * multiple of 8), and the loss's working set when the binding knows it (0: from the
   * vocabulary: 8 bytes a logit of a chunk and the head's fp32 grad, or 12 a logit whole). */
  uint64_t vocab;
  uint64_t hidden;
  uint64_t loss_chunk_tokens;
  uint64_t loss_working_bytes;
  /* Kept activations: a measured step's allocated and reserved peaks (reserved >= allocated). */
  uint64_t step_allocated_peak_bytes;
  uint64_t step_reserved_peak_bytes;
  /* Host (bytes): the user's budget (0: the default: the arena, beside_bytes, and half of what
   * beside_bytes leaves of this process's share of host_available_bytes), the DRAM tier's budget,
   * the host's available memory once the arena is made, and pinned bytes the binding holds beside
   * the arena that it cannot do without. */
  uint64_t host_budget_bytes;
  uint64_t arena_bytes;
  uint64_t host_available_bytes;
  uint64_t beside_bytes;
  /* Checkpoint groups: the host memory the spilled checkpoints may take (the binding's room in
   * its host budget and the machine's; UINT64_MAX, the default: unbounded), and the most blocks
   * the binding can regenerate from one checkpoint (0 or 1, the default: each block keeps its
   * own; at most 16384; the plan forms groups of at most 8). The plan takes the smallest group
   * with which the step fits the device and the spilled checkpoints the room. */
  uint64_t host_room_bytes;
  uint32_t max_group_blocks;
  /* Groups of exactly this many blocks, the user's choice (MegaTrain's checkpoint interval),
   * whatever fits; 0 (the default): the plan chooses, as above. At most 16384. */
  uint32_t checkpoint_group_blocks;
  /* Sequence tiles (with STRATA_STEP_PLAN_CHECKPOINTS): of block_saved_bytes, what the block's
   * MLP saves per token of the batch (its intermediates: gate, up, activation, product; not its
   * input, which a tiled MLP still keeps whole). 0 (the default): unknown, the MLP never tiled
   * by the plan. Needs STRATA_STEP_BLOCK_SAVED_MEASURED, and mlp_token_bytes x tokens at most
   * block_saved_bytes. One block's backward working set is then the rest of block_saved_bytes
   * (attention, norms: what depends on the whole sequence) plus one tile's MLP bytes. The plan
   * tiles only where the step does not fit untiled with the checkpoints in host memory as the
   * host's room allows: the fewest tiles with which it fits (tiles of at least 1024 tokens),
   * before grouping checkpoints, which reruns whole blocks. */
  uint64_t mlp_token_bytes;
  /* The user's tile count (0, the default: the plan chooses as above), whatever fits; at most
   * tokens, and only with STRATA_STEP_PLAN_CHECKPOINTS. */
  uint32_t mlp_tiles;
  /* The optimizer state's tier (with STRATA_STEP_PLAN_CHECKPOINTS): the streamed blocks'
   * optimizer state the host holds in DRAM, counted in the budget host_room_bytes is left of
   * (0, the default: none), and what the NVMe tier can still take (0, the default: no NVMe
   * tier). See strata_step_plan_info_t.state_nvme_bytes. */
  uint64_t state_dram_bytes;
  uint64_t nvme_free_bytes;
  /* Transfers against compute (with tokens; see strata_step_block_t.transfer_bound): the
   * host-to-device link's rate in bytes a second, the device's achieved FLOP/s, and the bytes a
   * streamed weight moves a parameter (2 for bf16). Any 0 (the default): not judged. */
  double h2d_bytes_per_second;
  double device_flops_per_second;
  uint32_t weight_bytes_per_param;
} strata_step_profile_t;
#define STRATA_STEP_PROFILE_STRUCT_SIZE \
  STRATA_STRUCT_SIZE(strata_step_profile_t, weight_bytes_per_param)

/* Zeroes, and struct_size set (a block CHOOSE, RECOMPUTE, checkpoint in HBM, 1 MLP tile; a
 * profile with one rank on its host, no flags, host_room_bytes UINT64_MAX, max_group_blocks 1,
 * mlp_token_bytes and mlp_tiles 0: the MLP tiled by the plan only when measured). Each writes this
 * header's whole struct. Errors: INVALID_ARGUMENT (NULL). Thread-safe. */
STRATA_API_SINCE(1, 5) strata_status_t strata_step_profile_init(strata_step_profile_t* profile);
STRATA_API_SINCE(1, 5) strata_status_t strata_step_block_init(strata_step_block_t* block);
STRATA_API_SINCE(1, 5)
strata_status_t strata_step_interval_init(strata_step_interval_t* interval);

/* Plan the step `profile` describes. profile and everything it points to: borrowed (read during
 * the call only). out_plan: owned by the caller (strata_step_plan_destroy). Errors:
 * INVALID_ARGUMENT, naming the field (NULL profile or output, a bad struct_size, more than 16384
 * blocks or 65540 intervals, a NULL block or interval, an unknown flag, residency, keep or point,
 * some blocks CHOOSE and others fixed, a resident block after a streamed one, a streamed block
 * kept WHOLE, an interval's block out of range or an END interval's not 0, a size above 2^56,
 * rank_elements above elements, free or held above the device's total, max_group_blocks or
 * checkpoint_group_blocks above 16384, mlp_token_bytes without STRATA_STEP_BLOCK_SAVED_MEASURED
 * or times tokens above block_saved_bytes, state_dram_bytes or nvme_free_bytes above 2^56,
 * mlp_tiles above tokens or without STRATA_STEP_PLAN_CHECKPOINTS, h2d_bytes_per_second or
 * device_flops_per_second negative, NaN or above 1e18, weight_bytes_per_param above 64, an
 * active_flops above 2^56, choosing residency with
 * resident_bytes_per_param 0 or above 64 or a grad size above it or not matching the grads'
 * total, STRATA_STEP_PLAN_CHECKPOINTS without a device, blocks, tokens or checkpoint_bytes,
 * STRATA_STEP_PLAN_KEPT without a device or blocks or with a block's keep not RECOMPUTE,
 * a reserved peak below its allocated one or an interval's above the step's, intervals without
 * STRATA_STEP_PLAN_KEPT); nothing is written then. A step predicted short of device memory is
 * not an error: strata_step_plan_info_t.fits says so. Thread-safe; touches no runtime. */
STRATA_API_SINCE(1, 5)
strata_status_t strata_step_plan_create(const strata_step_profile_t* profile,
                                        strata_step_plan_t** out_plan);

/* Destroy a plan; NULL is accepted. Not while another thread uses the same plan. */
STRATA_API_SINCE(1, 5) strata_status_t strata_step_plan_destroy(strata_step_plan_t* plan);

/* strata_step_plan_info_t.planned: the decisions the plan made. */
#define STRATA_STEP_PLANNED_RESIDENCY 0x1u
#define STRATA_STEP_PLANNED_CHECKPOINTS 0x2u
#define STRATA_STEP_PLANNED_KEPT 0x4u

/* strata_step_plan_info_t.state_tier_reason: why the plan advises the optimizer state it does. */
#define STRATA_STEP_STATE_NOT_PLANNED 0  /* checkpoints were not planned */
#define STRATA_STEP_STATE_ROOM 1         /* the host's room holds the checkpoints: none moves */
#define STRATA_STEP_STATE_MOVE 2         /* state_nvme_bytes to NVMe, its room to checkpoints */
#define STRATA_STEP_STATE_DEVICE_SHORT 3 /* the device short even with all spilled */
#define STRATA_STEP_STATE_NO_NVME 4      /* no NVMe tier (nvme_free_bytes 0) */
#define STRATA_STEP_STATE_NO_STATE 5     /* no optimizer state in DRAM (state_dram_bytes 0) */
#define STRATA_STEP_STATE_TOO_LITTLE 6   /* what NVMe could take would not lower the group */

typedef struct strata_step_plan_info {
  size_t struct_size; /* caller sets STRATA_STEP_PLAN_INFO_STRUCT_SIZE */
  uint32_t blocks;
  uint32_t resident_blocks;
  uint32_t spilled_checkpoints; /* the first blocks' checkpoints go to host memory */
  uint32_t kept_blocks;         /* blocks keeping their activations, any mode (the output's) */
  uint32_t whole_blocks;        /* of them, kept wholly */
  /* Spilled checkpoints the binding restores ahead of the backward pass beyond the block's own
   * (the plan counts this many + 1 in flight). */
  uint32_t restore_depth;
  uint32_t planned; /* STRATA_STEP_PLANNED_* bits */
  /* With checkpoints planned: 1 when the step is predicted inside the device, 0 when it is
   * short even with every checkpoint in host memory. 1 otherwise. */
  uint32_t fits;
  /* With checkpoints planned (else 0): the predicted peak of the step with the plan's spills,
   * and what one block's backward pass may allocate beyond what it holds at its start (its
   * working set, the restores in flight, the margin). */
  uint64_t predicted_peak_bytes;
  uint64_t backward_reserve_bytes;
  /* With a device: device_free + framework_held, and the margin the plan keeps free of it. */
  uint64_t usable_bytes;
  uint64_t margin_bytes;
  uint64_t judged_peak_bytes; /* with kept activations planned: the measured peak as counted */
  uint64_t host_total_bytes;  /* the host budget (0 with no host figures in the profile) */
  uint64_t loss_chunk_tokens; /* the given chunk, or the default (0 without a vocabulary) */
  /* With checkpoints planned: the host memory the spilled checkpoints take, and the checkpoint
   * group chosen (1: one checkpoint per block; k: the streamed blocks' checkpoints one per k,
   * see strata_step_block_t.group_start). 0 and 1 otherwise. */
  uint64_t spilled_checkpoint_bytes;
  uint32_t checkpoint_group_blocks;
  /* With checkpoints planned: the sequence tiles of the recomputing blocks' MLP (1: untiled;
   * see strata_step_block_t.mlp_tiles) and the tokens of each tile but the last (the batch's
   * tokens when untiled). 1 and 0 otherwise. */
  uint32_t mlp_tiles;
  uint64_t mlp_tile_tokens;
  /* The optimizer state's tier, with checkpoints planned (else 0, 1 and
   * STRATA_STEP_STATE_NOT_PLANNED): where the host's room (host_room_bytes) cannot hold the
   * checkpoints the step wants spilled (one per block, or the smallest group the device allows)
   * and an NVMe tier can take the streamed blocks' optimizer state, the bytes of that state
   * (of state_dram_bytes, at most nvme_free_bytes) whose room the checkpoints would get, the
   * checkpoint group with it, and why (STRATA_STEP_STATE_*). Advice to the binding's placement:
   * the state lives where it was placed when the DRAM tier was made, before any batch, so this
   * plan's checkpoint homes are the step's with the room as given; a binding that moves
   * state_nvme_bytes plans again with host_room_bytes grown and state_dram_bytes and
   * nvme_free_bytes shrunk by as much: that plan's checkpoint group is state_nvme_group_blocks,
   * and where state_nvme_bytes was all the step wanted (not the most NVMe or the state could
   * give), its reason STRATA_STEP_STATE_ROOM. */
  uint64_t state_nvme_bytes;
  uint32_t state_nvme_group_blocks;
  uint32_t state_tier_reason;
  /* The streamed blocks judged transfer-bound (strata_step_block_t.transfer_bound). */
  uint32_t transfer_bound_blocks;
} strata_step_plan_info_t;
#define STRATA_STEP_PLAN_INFO_STRUCT_SIZE \
  STRATA_STRUCT_SIZE(strata_step_plan_info_t, transfer_bound_blocks)

/* The plan's numbers. Errors: INVALID_ARGUMENT (NULL, bad struct_size). Thread-safe. */
STRATA_API_SINCE(1, 5)
strata_status_t strata_step_plan_get_info(strata_step_plan_t* plan, strata_step_plan_info_t* out);

/* Block `index`'s plan into `out` (the caller sets its struct_size): residency, keep,
 * checkpoint_tier, group_start, mlp_tiles and transfer_bound; elements, the measured bytes and
 * active_flops as the profile gave them. Errors:
 * INVALID_ARGUMENT (NULL, bad struct_size, index out of range). Thread-safe. */
STRATA_API_SINCE(1, 5)
strata_status_t strata_step_plan_get_block(strata_step_plan_t* plan, uint32_t index,
                                           strata_step_block_t* out);

/* The plan, every choice with its reason, as JSON or readable text (STRATA_PLAN_FORMAT_*), with
 * strata_plan_dump's buffer rules. Errors: INVALID_ARGUMENT. Thread-safe. */
STRATA_API_SINCE(1, 5)
strata_status_t strata_step_plan_dump(strata_step_plan_t* plan, strata_plan_format_t format,
                                      char* buffer, size_t capacity, size_t* out_length);

/* ---------------------------------------------------------------------------------------------
 * Experimental: no stability promise (the rules are at the top of this header). Empty in this
 * release.
 * ------------------------------------------------------------------------------------------- */
#ifdef STRATA_EXPERIMENTAL
#endif /* STRATA_EXPERIMENTAL */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_STRATA_H_ */
