// The core's enums mirror strata.h's constants value by value, so the ABI layer converts with a
// plain cast (common/status.h and common/types.h promise these checks). Every value is
// checked, not just the last and the count: a renumbered value in the middle of an enum would
// otherwise mistranslate silently. This file only holds static_asserts; it emits no code.
#include "lib/abi_support.h"
#include "runtime/memory/host_buffers.h"
#include "runtime/trace/trace.h"

namespace strata {
namespace {

template <typename E>
constexpr bool is(E value, int abi_constant) {
  return static_cast<int>(value) == abi_constant;
}

static_assert(kHostReservePercent == STRATA_HOST_RESERVE_PERCENT);

static_assert(is(Code::kOk, STRATA_OK));
static_assert(is(Code::kInvalidArgument, STRATA_ERROR_INVALID_ARGUMENT));
static_assert(is(Code::kOutOfMemory, STRATA_ERROR_OUT_OF_MEMORY));
static_assert(is(Code::kNotFound, STRATA_ERROR_NOT_FOUND));
static_assert(is(Code::kAlreadyExists, STRATA_ERROR_ALREADY_EXISTS));
static_assert(is(Code::kBusy, STRATA_ERROR_BUSY));
static_assert(is(Code::kNotReady, STRATA_ERROR_NOT_READY));
static_assert(is(Code::kUnsupported, STRATA_ERROR_UNSUPPORTED));
static_assert(is(Code::kNoDevice, STRATA_ERROR_NO_DEVICE));
static_assert(is(Code::kBackend, STRATA_ERROR_BACKEND));
static_assert(is(Code::kIo, STRATA_ERROR_IO));
static_assert(is(Code::kDataCorruption, STRATA_ERROR_DATA_CORRUPTION));
static_assert(is(Code::kCancelled, STRATA_ERROR_CANCELLED));
static_assert(is(Code::kTimeout, STRATA_ERROR_TIMEOUT));
static_assert(is(Code::kInvalidState, STRATA_ERROR_INVALID_STATE));
static_assert(is(Code::kInternal, STRATA_ERROR_INTERNAL));

static_assert(is(DeviceKind::kAuto, STRATA_DEVICE_BACKEND_AUTO));
static_assert(is(DeviceKind::kCuda, STRATA_DEVICE_BACKEND_CUDA));
static_assert(is(DeviceKind::kHost, STRATA_DEVICE_BACKEND_HOST));

static_assert(is(Tier::kHbm, STRATA_TIER_HBM));
static_assert(is(Tier::kDram, STRATA_TIER_DRAM));
static_assert(is(Tier::kNvme, STRATA_TIER_NVME));
static_assert(kTierCount == STRATA_TIER_COUNT);

static_assert(is(DType::kF32, STRATA_DTYPE_F32));
static_assert(is(DType::kF16, STRATA_DTYPE_F16));
static_assert(is(DType::kBF16, STRATA_DTYPE_BF16));
static_assert(is(DType::kF64, STRATA_DTYPE_F64));
static_assert(is(DType::kI8, STRATA_DTYPE_I8));
static_assert(is(DType::kU8, STRATA_DTYPE_U8));
static_assert(is(DType::kI16, STRATA_DTYPE_I16));
static_assert(is(DType::kI32, STRATA_DTYPE_I32));
static_assert(is(DType::kI64, STRATA_DTYPE_I64));
static_assert(is(DType::kBool, STRATA_DTYPE_BOOL));
static_assert(kDTypeCount == STRATA_DTYPE_COUNT);

static_assert(is(Role::kWeight, STRATA_ROLE_WEIGHT));
static_assert(is(Role::kGrad, STRATA_ROLE_GRAD));
static_assert(is(Role::kOptimizerState, STRATA_ROLE_OPTIMIZER_STATE));
static_assert(is(Role::kActivation, STRATA_ROLE_ACTIVATION));
static_assert(is(Role::kOther, STRATA_ROLE_OTHER));
static_assert(kRoleCount == STRATA_ROLE_COUNT);

static_assert(is(Link::kH2D, STRATA_LINK_H2D));
static_assert(is(Link::kD2H, STRATA_LINK_D2H));
static_assert(is(Link::kNvmeRead, STRATA_LINK_NVME_READ));
static_assert(is(Link::kNvmeWrite, STRATA_LINK_NVME_WRITE));
static_assert(kLinkCount == STRATA_LINK_COUNT);

static_assert(is(IoEngineKind::kAuto, STRATA_IO_ENGINE_AUTO));
static_assert(is(IoEngineKind::kUring, STRATA_IO_ENGINE_URING));
static_assert(is(IoEngineKind::kPosix, STRATA_IO_ENGINE_POSIX));

static_assert(is(NumaPolicy::kAuto, STRATA_NUMA_AUTO));
static_assert(is(NumaPolicy::kNode, STRATA_NUMA_NODE));
static_assert(is(NumaPolicy::kInterleave, STRATA_NUMA_INTERLEAVE));

static_assert(is(Phase::kForward, STRATA_PHASE_FORWARD));
static_assert(is(Phase::kBackward, STRATA_PHASE_BACKWARD));

static_assert(is(ViewRole::kWeight, STRATA_VIEW_WEIGHT));
static_assert(is(ViewRole::kGrad, STRATA_VIEW_GRAD));
static_assert(is(ViewRole::kActivation, STRATA_VIEW_ACTIVATION));

static_assert(is(OptimizerKind::kAdamW, STRATA_OPTIMIZER_ADAMW));
static_assert(is(OptimizerKind::kSgd, STRATA_OPTIMIZER_SGD));
static_assert(is(OptimizerKind::kAdam, STRATA_OPTIMIZER_ADAM));
static_assert(is(OptimizerKind::kLion, STRATA_OPTIMIZER_LION));
static_assert(is(OptimizerKind::kAdagrad, STRATA_OPTIMIZER_ADAGRAD));

static_assert(is(StateKind::kMaster, STRATA_STATE_MASTER));
static_assert(is(StateKind::kExpAvg, STRATA_STATE_EXP_AVG));
static_assert(is(StateKind::kExpAvgSq, STRATA_STATE_EXP_AVG_SQ));
static_assert(is(StateKind::kGradAccum, STRATA_STATE_GRAD_ACCUM));

static_assert(is(MasterLayout::kSeparate, STRATA_MASTER_SEPARATE));
static_assert(is(MasterLayout::kSplit, STRATA_MASTER_SPLIT));

static_assert(is(GradSum::kAccumulator, STRATA_GRAD_SUM_ACCUMULATOR));
static_assert(is(GradSum::kInPlace, STRATA_GRAD_SUM_IN_PLACE));

static_assert(is(StatePlacement::kInDram, STRATA_STATE_PLACEMENT_DRAM));
static_assert(is(StatePlacement::kPlanned, STRATA_STATE_PLACEMENT_PLANNED));
static_assert(is(StatePlacement::kOnNvme, STRATA_STATE_PLACEMENT_NVME));

static_assert(is(TraceKind::kMigration, STRATA_TRACE_MIGRATION));
static_assert(is(TraceKind::kCopyH2D, STRATA_TRACE_COPY_H2D));
static_assert(is(TraceKind::kCopyD2H, STRATA_TRACE_COPY_D2H));
static_assert(is(TraceKind::kNvmeRead, STRATA_TRACE_NVME_READ));
static_assert(is(TraceKind::kNvmeWrite, STRATA_TRACE_NVME_WRITE));
static_assert(is(TraceKind::kAcquire, STRATA_TRACE_ACQUIRE));
static_assert(is(TraceKind::kRelease, STRATA_TRACE_RELEASE));
static_assert(is(TraceKind::kOptimizer, STRATA_TRACE_OPTIMIZER));
static_assert(kTraceKindCount == STRATA_TRACE_KIND_COUNT);

}  // namespace
}  // namespace strata
