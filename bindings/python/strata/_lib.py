"""ctypes declarations of libstrata's C ABI (include/strata/strata.h): the structs, in the
header's field order, and the functions' signatures. Only this module knows the C layout.

Written by hand, checked by machine: the test abi_layout (tests/python/core/test_abi_layout.py) compares
every struct here, field by field (name, offset, size, type), and the constants below with what
a C program generated from strata.h prints. Every public struct of the header has its class here,
named after it (strata_tier_usage_t: TierUsage)."""
import ctypes
import ctypes.util
import os
import pathlib

c_size_t = ctypes.c_size_t
c_int32 = ctypes.c_int32
c_uint32 = ctypes.c_uint32
c_int64 = ctypes.c_int64
c_uint64 = ctypes.c_uint64
c_double = ctypes.c_double
c_float = ctypes.c_float
c_char_p = ctypes.c_char_p
c_void_p = ctypes.c_void_p

# The ABI these declarations are written against: the library must have this major version and
# at least this minor one (the test abi_layout checks it is strata.h's version).
ABI_VERSION = (1, 5)

MAX_NAME_LENGTH = 255
MAX_NDIM = 8
TIER_COUNT = 3
TRACE_KIND_COUNT = 8


# Where pip install . puts the library (CMakeLists.txt's install rules under the package).
BUNDLED_LIBRARY = pathlib.Path(__file__).resolve().parent / "lib" / "libstrata.so.1"


def _find_library():
    """(path, source) of the libstrata to load, the first of:

    1. $STRATA_LIBRARY ("STRATA_LIBRARY"): an explicit choice wins over anything found, so a
       developer's or the test suite's fresh build is the one tested even when a pip-installed
       strata is the one imported;
    2. the library bundled in this package by `pip install .` ("bundled");
    3. a build of this checkout, build/{release,gpu,debug}/lib ("checkout"), for the package
       used from the source tree (PYTHONPATH=bindings/python);
    4. the system's libstrata.so.1, from `cmake --install` ("system").
    docs/install.md says the same."""
    env = os.environ.get("STRATA_LIBRARY")
    if env:
        return env, "STRATA_LIBRARY"
    if BUNDLED_LIBRARY.exists():
        return str(BUNDLED_LIBRARY), "bundled"
    root = pathlib.Path(__file__).resolve().parents[3]
    for preset in ("release", "gpu", "debug"):
        candidate = root / "build" / preset / "lib" / "libstrata.so.1"
        if candidate.exists():
            return str(candidate), "checkout"
    found = ctypes.util.find_library("strata")
    if found:
        return found, "system"
    raise OSError("libstrata.so.1 not found: pip install . from the repository root (it builds "
                  "and bundles it), or build it (cmake --preset release && cmake --build "
                  "--preset release), or set STRATA_LIBRARY to its path")


def _loaded_path(library):
    """The file a loaded library came from: its own path, or for a bare name that the dynamic
    loader resolved (the system case), the file mapped into this process under that name."""
    name = library._name
    if os.path.dirname(name):
        return os.path.abspath(name)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip()
                if os.path.basename(path).startswith("libstrata.so"):
                    return os.path.realpath(path)
    except OSError:
        pass
    return name


class Struct(ctypes.Structure):
    """A versioned argument struct: struct_size is set to the full size on creation."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.struct_size = ctypes.sizeof(self)


class RuntimeConfig(Struct):
    _fields_ = [("struct_size", c_size_t), ("device_backend", c_int32), ("device_ordinal", c_int32),
                ("hbm_budget_bytes", c_uint64), ("dram_budget_bytes", c_uint64),
                ("nvme_budget_bytes", c_uint64), ("host_link_bytes_per_second", c_uint64),
                ("dram_numa_policy", c_int32), ("dram_numa_node", c_int32),
                ("dram_fault_threads", c_uint32), ("nvme_paths", ctypes.POINTER(c_char_p)),
                ("nvme_path_count", c_uint32), ("io_engine", c_int32), ("io_block_size", c_uint32),
                ("io_queue_depth", c_uint32), ("nvme_checksums", c_int32),
                ("io_dram_direct", c_int32), ("dram_pinned_bytes", c_uint64)]


class Capabilities(Struct):
    _fields_ = [("struct_size", c_size_t), ("device_backend", c_int32), ("device_ordinal", c_int32),
                ("cuda_compiled", c_int32), ("cuda_available", c_int32),
                ("tiers_available", c_int32 * TIER_COUNT),
                ("tier_budget_bytes", c_uint64 * TIER_COUNT), ("device_numa_node", c_int32),
                ("device_name", ctypes.c_char * 128), ("backend_reason", ctypes.c_char * 256),
                ("dram_placement", ctypes.c_char * 64), ("dram_numa_node", c_int32),
                ("dram_huge_pages", c_int32), ("dram_fault_threads", c_uint32),
                ("dram_fault_seconds", c_double), ("dram_pin_seconds", c_double),
                ("io_engine", ctypes.c_char * 16), ("io_engine_reason", ctypes.c_char * 256),
                ("dram_pinned_bytes", c_uint64)]


class TierUsage(Struct):
    _fields_ = [("struct_size", c_size_t), ("budget_bytes", c_uint64), ("used_bytes", c_uint64),
                ("largest_free_bytes", c_uint64), ("tensor_count", c_uint64),
                ("pinned_budget_bytes", c_uint64), ("pinned_used_bytes", c_uint64),
                ("dram_fallbacks", c_uint64)]


class HostUsage(Struct):
    _fields_ = [("struct_size", c_size_t), ("budget_bytes", c_uint64), ("arena_bytes", c_uint64),
                ("buffer_bytes", c_uint64), ("buffer_count", c_uint64), ("room_bytes", c_uint64),
                ("reserve_bytes", c_uint64), ("available_bytes", c_uint64)]


class HostBufferDesc(Struct):
    _fields_ = [("struct_size", c_size_t), ("bytes", c_uint64), ("name", c_char_p)]


class HostBufferInfo(Struct):
    _fields_ = [("struct_size", c_size_t), ("data", c_void_p), ("bytes", c_uint64),
                ("charged_bytes", c_uint64), ("pinned", c_uint32), ("numa_node", c_int32)]


class LinkStats(Struct):
    _fields_ = [("struct_size", c_size_t), ("bytes", c_uint64), ("transfers", c_uint64),
                ("busy_ns", c_uint64)]


class TensorDesc(Struct):
    _fields_ = [("struct_size", c_size_t), ("name", c_char_p), ("dtype", c_int32),
                ("ndim", c_int32), ("shape", ctypes.POINTER(c_int64)), ("role", c_int32),
                ("home_tier", c_int32)]


class TensorInfo(Struct):
    _fields_ = [("struct_size", c_size_t), ("name", ctypes.c_char * (MAX_NAME_LENGTH + 1)),
                ("dtype", c_int32), ("ndim", c_int32), ("shape", c_int64 * MAX_NDIM),
                ("nbytes", c_uint64), ("role", c_int32), ("home_tier", c_int32), ("tier", c_int32),
                ("migrating", c_int32), ("export_count", c_int32)]


class LayerDesc(Struct):
    _fields_ = [("struct_size", c_size_t), ("name", c_char_p),
                ("weights", ctypes.POINTER(c_void_p)), ("weight_count", c_uint32),
                ("grads", ctypes.POINTER(c_void_p)), ("grad_count", c_uint32),
                ("activations", ctypes.POINTER(c_void_p)), ("activation_count", c_uint32),
                ("optimizer_state", ctypes.POINTER(c_void_p)), ("optimizer_state_count", c_uint32),
                ("forward_flops", c_double), ("backward_flops", c_double)]


class PlanConfig(Struct):
    _fields_ = [("struct_size", c_size_t), ("micro_batches", c_uint32),
                ("hbm_slot_budget_bytes", c_uint64), ("h2d_bytes_per_second", c_double),
                ("d2h_bytes_per_second", c_double), ("device_flops_per_second", c_double),
                ("max_prefetch_depth", c_uint32), ("chunk_bytes", c_uint64)]


class PlanInfo(Struct):
    _fields_ = [("struct_size", c_size_t), ("layers", c_uint32), ("micro_batches", c_uint32),
                ("slots", c_uint32), ("forward_prefetch_depth", c_uint32),
                ("backward_prefetch_depth", c_uint32), ("all_layers_fit", c_int32),
                ("slot_bytes", c_uint64), ("resident_bytes", c_uint64),
                ("h2d_bytes_per_second", c_double), ("d2h_bytes_per_second", c_double),
                ("predicted_step_seconds", c_double), ("predicted_h2d_seconds", c_double),
                ("predicted_d2h_seconds", c_double), ("predicted_nvme_seconds", c_double),
                ("predicted_compute_seconds", c_double), ("predicted_gpu_wait_seconds", c_double),
                ("bottleneck", ctypes.c_char * 16)]


class PlacementLayer(Struct):
    _fields_ = [("struct_size", c_size_t), ("name", c_char_p), ("weight_bytes", c_uint64),
                ("grad_bytes", c_uint64), ("state_bytes", c_uint64),
                ("update_elements", c_uint64), ("forward_seconds", c_double),
                ("backward_seconds", c_double), ("weight_tier", c_int32),
                ("state_tier", c_int32), ("grad_tier", c_int32)]


class PlacementRequest(Struct):
    _fields_ = [("struct_size", c_size_t), ("layers", ctypes.POINTER(ctypes.POINTER(PlacementLayer))),
                ("layer_count", c_uint32), ("staging_slots", c_uint32),
                ("max_staging_slots", c_uint32), ("prefetch_depth", c_uint32),
                ("dram_budget_bytes", c_uint64), ("nvme_budget_bytes", c_uint64),
                ("other_device_seconds", c_double), ("h2d_bytes_per_second", c_double),
                ("d2h_bytes_per_second", c_double), ("nvme_read_bytes_per_second", c_double),
                ("nvme_write_bytes_per_second", c_double), ("nvme_mixed", c_double),
                ("update_elements_per_second", c_double), ("updates_after_backward", c_int32)]


class StepBlock(Struct):
    _fields_ = [("struct_size", c_size_t), ("elements", c_uint64), ("rank_elements", c_uint64),
                ("keep_whole_bytes", c_uint64), ("keep_selective_bytes", c_uint64),
                ("residency", c_int32), ("keep", c_int32), ("checkpoint_tier", c_int32),
                ("group_start", c_uint32), ("mlp_tiles", c_uint32),
                ("active_flops", c_uint64), ("transfer_bound", c_uint32)]


class StepInterval(Struct):
    _fields_ = [("struct_size", c_size_t), ("point", c_int32), ("block", c_uint32),
                ("allocated_peak_bytes", c_uint64), ("reserved_peak_bytes", c_uint64)]


class StepProfile(Struct):
    _fields_ = [("struct_size", c_size_t), ("blocks", ctypes.POINTER(ctypes.POINTER(StepBlock))),
                ("intervals", ctypes.POINTER(ctypes.POINTER(StepInterval))),
                ("block_count", c_uint32), ("interval_count", c_uint32), ("flags", c_uint32),
                ("ranks_on_host", c_uint32), ("resident_bytes_per_param", c_uint32),
                ("streamed_grad_bytes_per_param", c_uint32),
                ("device_total_bytes", c_uint64), ("device_free_bytes", c_uint64),
                ("framework_held_bytes", c_uint64), ("hbm_tier_bytes", c_uint64),
                ("outside_elements", c_uint64), ("streamed_grads_hbm_bytes", c_uint64),
                ("tokens", c_uint64), ("checkpoint_bytes", c_uint64),
                ("block_saved_bytes", c_uint64), ("in_use_bytes", c_uint64),
                ("backward_grad_bytes", c_uint64), ("leaving_bytes", c_uint64),
                ("vocab", c_uint64), ("hidden", c_uint64), ("loss_chunk_tokens", c_uint64),
                ("loss_working_bytes", c_uint64), ("step_allocated_peak_bytes", c_uint64),
                ("step_reserved_peak_bytes", c_uint64), ("host_budget_bytes", c_uint64),
                ("arena_bytes", c_uint64), ("host_available_bytes", c_uint64),
                ("beside_bytes", c_uint64), ("host_room_bytes", c_uint64),
                ("max_group_blocks", c_uint32), ("checkpoint_group_blocks", c_uint32),
                ("mlp_token_bytes", c_uint64), ("mlp_tiles", c_uint32),
                ("state_dram_bytes", c_uint64), ("nvme_free_bytes", c_uint64),
                ("h2d_bytes_per_second", ctypes.c_double),
                ("device_flops_per_second", ctypes.c_double),
                ("weight_bytes_per_param", c_uint32)]


class StepPlanInfo(Struct):
    _fields_ = [("struct_size", c_size_t), ("blocks", c_uint32), ("resident_blocks", c_uint32),
                ("spilled_checkpoints", c_uint32), ("kept_blocks", c_uint32),
                ("whole_blocks", c_uint32), ("restore_depth", c_uint32), ("planned", c_uint32),
                ("fits", c_uint32), ("predicted_peak_bytes", c_uint64),
                ("backward_reserve_bytes", c_uint64), ("usable_bytes", c_uint64),
                ("margin_bytes", c_uint64), ("judged_peak_bytes", c_uint64),
                ("host_total_bytes", c_uint64), ("loss_chunk_tokens", c_uint64),
                ("spilled_checkpoint_bytes", c_uint64), ("checkpoint_group_blocks", c_uint32),
                ("mlp_tiles", c_uint32), ("mlp_tile_tokens", c_uint64),
                ("state_nvme_bytes", c_uint64), ("state_nvme_group_blocks", c_uint32),
                ("state_tier_reason", c_uint32), ("transfer_bound_blocks", c_uint32)]


class PlacementInfo(Struct):
    _fields_ = [("struct_size", c_size_t), ("layers", c_uint32), ("staging_slots", c_uint32),
                ("state_nvme_layers", c_uint32), ("weight_nvme_layers", c_uint32),
                ("candidates", c_uint32), ("slot_bytes", c_uint64), ("dram_bytes", c_uint64),
                ("nvme_bytes", c_uint64), ("h2d_bytes_per_second", c_double),
                ("d2h_bytes_per_second", c_double), ("nvme_read_bytes_per_second", c_double),
                ("nvme_write_bytes_per_second", c_double), ("nvme_mixed", c_double),
                ("update_elements_per_second", c_double), ("predicted_step_seconds", c_double),
                ("predicted_compute_seconds", c_double), ("predicted_h2d_seconds", c_double),
                ("predicted_d2h_seconds", c_double), ("predicted_nvme_read_seconds", c_double),
                ("predicted_nvme_write_seconds", c_double),
                ("predicted_update_seconds", c_double), ("predicted_gpu_wait_seconds", c_double),
                ("predicted_update_wait_seconds", c_double), ("bottleneck", ctypes.c_char * 16),
                ("grad_fetch_bytes", c_uint64)]


class LayoutRequest(Struct):
    _fields_ = [("struct_size", c_size_t), ("dtype", c_int32), ("optimizer", c_int32),
                ("sgd_momentum", c_int32), ("master_layout", c_uint32), ("grad_tier", c_int32),
                ("staging_slots", c_uint32), ("layer_count", c_uint32),
                ("trainable_counts", ctypes.POINTER(c_uint32)),
                ("trainable_elements", ctypes.POINTER(c_uint64)),
                ("frozen_counts", ctypes.POINTER(c_uint32)),
                ("frozen_elements", ctypes.POINTER(c_uint64)), ("nvme_budget_bytes", c_uint64),
                ("grad_sum", c_uint32)]


class LayoutLayer(Struct):
    _fields_ = [("struct_size", c_size_t), ("weight_bytes", c_uint64), ("grad_bytes", c_uint64),
                ("grad_hbm_bytes", c_uint64), ("state_bytes", c_uint64),
                ("update_elements", c_uint64)]


class LayoutTotals(Struct):
    _fields_ = [("struct_size", c_size_t), ("weight_bytes", c_uint64),
                ("grad_dram_bytes", c_uint64), ("grad_hbm_bytes", c_uint64),
                ("grad_fetch_bytes", c_uint64), ("state_bytes", c_uint64), ("slot_bytes", c_uint64),
                ("update_elements", c_uint64), ("state_bytes_per_element", c_uint64),
                ("dram_bytes", c_uint64), ("dram_margin_bytes", c_uint64),
                ("streaming_dram_bytes", c_uint64), ("streaming_hbm_bytes", c_uint64),
                ("nvme_margin_bytes", c_uint64), ("nvme_bytes", c_uint64),
                ("nvme_placeable_bytes", c_uint64), ("accum_bytes", c_uint64),
                ("dram_gpu_bytes", c_uint64)]


class LayerViews(Struct):
    _fields_ = [("struct_size", c_size_t), ("weight_count", c_uint32),
                ("weights", ctypes.POINTER(c_void_p)), ("grad_count", c_uint32),
                ("grads", ctypes.POINTER(c_void_p)), ("activation_count", c_uint32),
                ("activations", ctypes.POINTER(c_void_p))]


class ExecutorStats(Struct):
    _fields_ = [("struct_size", c_size_t), ("steps", c_uint64), ("loads", c_uint64),
                ("reused_loads", c_uint64), ("bytes_in", c_uint64), ("bytes_out", c_uint64)]


class TraceConfig(Struct):
    _fields_ = [("struct_size", c_size_t), ("ring_capacity", c_uint32)]


class TraceCounters(Struct):
    _fields_ = [("struct_size", c_size_t), ("records", c_uint64 * TRACE_KIND_COUNT),
                ("bytes", c_uint64 * TRACE_KIND_COUNT), ("dropped", c_uint64)]


class OptimizerConfig(Struct):
    _fields_ = [("struct_size", c_size_t), ("kind", c_int32), ("lr", c_float),
                ("weight_decay", c_float), ("beta1", c_float), ("beta2", c_float), ("eps", c_float),
                ("momentum", c_float), ("dampening", c_float), ("nesterov", c_int32),
                ("max_grad_norm", c_float), ("loss_scale", c_float),
                ("dynamic_loss_scale", c_int32), ("growth_factor", c_float),
                ("backoff_factor", c_float), ("growth_interval", c_uint32),
                ("accumulation_steps", c_uint32), ("threads", c_uint32),
                ("update_mode", c_uint32), ("state_placement", c_uint32),
                ("nvme_staging_bytes", c_uint64)]


class GroupHyperparams(Struct):
    _fields_ = [("struct_size", c_size_t), ("lr", c_float), ("weight_decay", c_float),
                ("beta1", c_float), ("beta2", c_float), ("eps", c_float)]


class GradInfo(Struct):
    _fields_ = [("struct_size", c_size_t), ("has_grad", c_int32), ("sum_squares", c_double),
                ("step", c_uint64)]


class ParamDesc(Struct):
    _fields_ = [("struct_size", c_size_t), ("weight", c_void_p), ("grad", c_void_p),
                ("group", c_uint32), ("master_layout", c_uint32), ("grad_sum", c_uint32)]


class OptimizerStats(Struct):
    _fields_ = [("struct_size", c_size_t), ("step", c_uint64), ("skipped_steps", c_uint64),
                ("micro_step", c_uint64), ("last_grad_norm", c_double), ("loss_scale", c_float),
                ("params", c_uint64), ("elements", c_uint64), ("state_bytes", c_uint64),
                ("update_seconds", c_double), ("threads", c_uint32), ("isa", ctypes.c_char * 16),
                ("binding", ctypes.c_char * 32), ("nvme_state_bytes", c_uint64),
                ("nvme_state_params", c_uint64), ("nvme_state_layers", c_uint64),
                ("staging_bytes", c_uint64), ("staging_slots", c_uint32),
                ("nvme_read_bytes", c_uint64), ("nvme_write_bytes", c_uint64),
                ("stage_wait_seconds", c_double)]


# DLPack v1.0 (the header's declarations).
class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(c_int64)), ("strides", ctypes.POINTER(c_int64)),
                ("byte_offset", c_uint64)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion), ("manager_ctx", c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))),
    ("flags", c_uint64), ("dl_tensor", DLTensor)]

P = ctypes.POINTER
_SIGNATURES = {
    "strata_version": (c_uint32, []),
    "strata_status_string": (c_char_p, [c_int32]),
    "strata_last_error_message": (c_char_p, []),
    "strata_version_string": (c_char_p, []),
    "strata_dtype_size": (c_size_t, [c_int32]),
    "strata_runtime_config_init": (c_int32, [P(RuntimeConfig)]),
    "strata_runtime_create": (c_int32, [P(RuntimeConfig), P(c_void_p)]),
    "strata_runtime_destroy": (c_int32, [c_void_p]),
    "strata_runtime_capabilities": (c_int32, [c_void_p, P(Capabilities)]),
    "strata_runtime_tier_usage": (c_int32, [c_void_p, c_int32, P(TierUsage)]),
    "strata_runtime_link_stats": (c_int32, [c_void_p, c_int32, P(LinkStats)]),
    "strata_runtime_reset_stats": (c_int32, [c_void_p]),
    "strata_runtime_synchronize": (c_int32, [c_void_p]),
    "strata_runtime_set_host_budget": (c_int32, [c_void_p, c_uint64]),
    "strata_runtime_host_usage": (c_int32, [c_void_p, P(HostUsage)]),
    "strata_host_buffer_create": (c_int32, [c_void_p, P(HostBufferDesc), P(c_void_p)]),
    "strata_host_buffer_get_info": (c_int32, [c_void_p, c_void_p, P(HostBufferInfo)]),
    "strata_host_buffer_free": (c_int32, [c_void_p, c_void_p]),
    "strata_tensor_register": (c_int32, [c_void_p, P(TensorDesc), P(c_void_p)]),
    "strata_tensor_find": (c_int32, [c_void_p, c_char_p, P(c_void_p)]),
    "strata_tensor_unregister": (c_int32, [c_void_p, c_void_p]),
    "strata_tensor_get_info": (c_int32, [c_void_p, c_void_p, P(TensorInfo)]),
    "strata_tensor_write": (c_int32, [c_void_p, c_void_p, c_uint64, c_void_p, c_uint64]),
    "strata_tensor_read": (c_int32, [c_void_p, c_void_p, c_uint64, c_void_p, c_uint64]),
    "strata_tensor_export_dlpack": (c_int32, [c_void_p, c_void_p, P(P(DLManagedTensorVersioned))]),
    "strata_tensor_data_pointer": (c_int32, [c_void_p, c_void_p, P(c_void_p)]),
    "strata_graph_create": (c_int32, [c_void_p, P(c_void_p)]),
    "strata_graph_destroy": (c_int32, [c_void_p]),
    "strata_graph_add_layer": (c_int32, [c_void_p, P(LayerDesc), P(c_uint32)]),
    "strata_graph_add_resident": (c_int32, [c_void_p, c_void_p]),
    "strata_plan_config_init": (c_int32, [P(PlanConfig)]),
    "strata_plan_create": (c_int32, [c_void_p, P(PlanConfig), P(c_void_p)]),
    "strata_plan_destroy": (c_int32, [c_void_p]),
    "strata_plan_get_info": (c_int32, [c_void_p, P(PlanInfo)]),
    "strata_plan_dump": (c_int32, [c_void_p, c_int32, c_char_p, c_size_t, P(c_size_t)]),
    "strata_placement_request_init": (c_int32, [P(PlacementRequest)]),
    "strata_placement_layer_init": (c_int32, [P(PlacementLayer)]),
    "strata_placement_create": (c_int32, [c_void_p, P(PlacementRequest), P(c_void_p)]),
    "strata_placement_destroy": (c_int32, [c_void_p]),
    "strata_placement_get_info": (c_int32, [c_void_p, P(PlacementInfo)]),
    "strata_placement_get_layer": (c_int32, [c_void_p, c_uint32, P(c_int32), P(c_int32)]),
    "strata_placement_dump": (c_int32, [c_void_p, c_int32, c_char_p, c_size_t, P(c_size_t)]),
    "strata_step_profile_init": (c_int32, [P(StepProfile)]),
    "strata_step_block_init": (c_int32, [P(StepBlock)]),
    "strata_step_interval_init": (c_int32, [P(StepInterval)]),
    "strata_step_plan_create": (c_int32, [P(StepProfile), P(c_void_p)]),
    "strata_step_plan_destroy": (c_int32, [c_void_p]),
    "strata_step_plan_get_info": (c_int32, [c_void_p, P(StepPlanInfo)]),
    "strata_step_plan_get_block": (c_int32, [c_void_p, c_uint32, P(StepBlock)]),
    "strata_step_plan_dump": (c_int32, [c_void_p, c_int32, c_char_p, c_size_t, P(c_size_t)]),
    "strata_layout_request_init": (c_int32, [P(LayoutRequest)]),
    "strata_layout_query": (c_int32, [P(LayoutRequest), c_void_p, P(LayoutTotals)]),
    "strata_executor_create": (c_int32, [c_void_p, P(c_void_p)]),
    "strata_executor_destroy": (c_int32, [c_void_p]),
    "strata_executor_get_stats": (c_int32, [c_void_p, P(ExecutorStats)]),
    "strata_step_begin": (c_int32, [c_void_p]),
    "strata_step_end": (c_int32, [c_void_p]),
    "strata_step_abort": (c_int32, [c_void_p, c_void_p]),
    "strata_layer_acquire": (c_int32, [c_void_p, c_uint32, c_int32, c_void_p, c_uint32,
                                       P(LayerViews)]),
    "strata_layer_release": (c_int32, [c_void_p, c_uint32, c_int32, c_void_p]),
    "strata_layer_write_view": (c_int32, [c_void_p, c_uint32, c_int32, c_int32, c_uint32,
                                          c_void_p, c_uint64]),
    "strata_layer_export_dlpack": (c_int32, [c_void_p, c_uint32, c_int32, c_int32, c_uint32,
                                             P(P(DLManagedTensorVersioned))]),
    "strata_optimizer_config_init": (c_int32, [c_int32, P(OptimizerConfig)]),
    "strata_optimizer_create": (c_int32, [c_void_p, P(OptimizerConfig), P(c_void_p)]),
    "strata_optimizer_destroy": (c_int32, [c_void_p]),
    "strata_optimizer_add_param": (c_int32, [c_void_p, P(ParamDesc)]),
    "strata_optimizer_set_group": (c_int32, [c_void_p, c_uint32, c_float, c_float]),
    "strata_optimizer_get_group": (c_int32, [c_void_p, c_uint32, P(GroupHyperparams)]),
    "strata_optimizer_set_group_hyperparams": (c_int32, [c_void_p, c_uint32,
                                                         P(GroupHyperparams)]),
    "strata_optimizer_attach": (c_int32, [c_void_p, c_void_p]),
    "strata_optimizer_step": (c_int32, [c_void_p]),
    "strata_optimizer_synchronize": (c_int32, [c_void_p]),
    "strata_optimizer_grad_info": (c_int32, [c_void_p, c_void_p, P(GradInfo)]),
    "strata_optimizer_grad_read": (c_int32, [c_void_p, c_void_p, c_void_p, c_uint64]),
    "strata_optimizer_grad_scale": (c_int32, [c_void_p, c_void_p, c_float]),
    "strata_optimizer_grad_write": (c_int32, [c_void_p, c_void_p, c_void_p, c_uint64]),
    "strata_optimizer_grad_zero": (c_int32, [c_void_p, c_void_p, c_int32]),
    "strata_optimizer_set_param_step": (c_int32, [c_void_p, c_void_p, c_uint64]),
    "strata_optimizer_get_state": (c_int32, [c_void_p, c_void_p, c_int32, P(c_void_p)]),
    "strata_optimizer_master_read": (c_int32, [c_void_p, c_void_p, c_void_p, c_uint64]),
    "strata_optimizer_master_write": (c_int32, [c_void_p, c_void_p, c_void_p, c_uint64]),
    "strata_optimizer_get_stats": (c_int32, [c_void_p, P(OptimizerStats)]),
    "strata_checkpoint_save": (c_int32, [c_void_p, c_void_p, c_char_p]),
    "strata_checkpoint_load": (c_int32, [c_void_p, c_void_p, c_char_p]),
    "strata_atomic_dir_staging": (c_int32, [c_char_p, c_char_p, c_size_t, P(c_size_t)]),
    "strata_atomic_dir_begin": (c_int32, [c_char_p]),
    "strata_atomic_dir_commit": (c_int32, [c_char_p]),
    "strata_atomic_dir_resolve": (c_int32, [c_char_p, c_char_p, c_size_t, P(c_size_t)]),
    "strata_trace_start": (c_int32, [c_void_p, P(TraceConfig)]),
    "strata_trace_stop": (c_int32, [c_void_p]),
    "strata_trace_flush": (c_int32, [c_void_p, c_char_p]),
    "strata_trace_get_counters": (c_int32, [c_void_p, P(TraceCounters)]),
}


def _load():
    """(library, the file it was loaded from, which rule of _find_library found it)."""
    path, source = _find_library()
    library = ctypes.CDLL(path)
    path = _loaded_path(library)
    library.strata_version.restype = c_uint32
    found = library.strata_version()
    major, minor = found // 10000, found // 100 % 100
    if major != ABI_VERSION[0] or minor < ABI_VERSION[1]:
        raise OSError("%s is libstrata %d.%d.%d; this strata package needs ABI %d.%d or a later "
                      "%d.x: rebuild the library or point STRATA_LIBRARY at a matching one"
                      % (path, major, minor, found % 100, *ABI_VERSION, ABI_VERSION[0]))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(library, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return library, path, source


lib, library_file, library_source = _load()
