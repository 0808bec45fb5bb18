// C ABI: runtime lifecycle, capabilities, usage and link statistics.

#include "lib/abi_support.h"

using namespace strata;
using namespace strata::abi;

namespace {

Status runtime_from(strata_runtime_t* runtime) {
  return require(runtime, "runtime");
}

// A 1.0 .. 1.4 caller's config (abi_struct_sizes.h) is smaller than this header's struct.
static_assert(sizeof(strata_runtime_config_t) > kRuntimeConfigV1_0Size);

// Fill the first `bytes` bytes of *config with the defaults and set struct_size.
strata_status_t runtime_config_init(strata_runtime_config_t* config, std::size_t bytes,
                                    std::size_t struct_size) {
  return guarded("strata_runtime_config_init", [&] {
    STRATA_RETURN_IF_ERROR(require(config, "config"));
    strata_runtime_config_t c{};
    c.device_backend = STRATA_DEVICE_BACKEND_AUTO;
    c.nvme_checksums = 1;  // integrity by default
    std::memcpy(static_cast<void*>(config), &c, bytes);
    config->struct_size = struct_size;
    return Status::ok();
  });
}

}  // namespace

extern "C" {

// strata_runtime_config_init writes the whole struct it knows, and 1.5's dram_pinned_bytes made
// it grow from 96 to 104 bytes: programs linked against 1.0 .. 1.4 keep an init that writes only
// their 96, the compat symbol strata_runtime_config_init@STRATA_1.0; programs built against this
// header get the default, @@STRATA_1.5 (docs/abi.md, "*_config_init and growing structs").
STRATA_API strata_status_t strata_runtime_config_init_v1_5(strata_runtime_config_t* config) {
  return runtime_config_init(config, sizeof *config, STRATA_RUNTIME_CONFIG_STRUCT_SIZE);
}

// strata_runtime_config_init@STRATA_1.0, for programs linked against 1.0 .. 1.4.
STRATA_API strata_status_t strata_runtime_config_init_v1_0(strata_runtime_config_t* config) {
  return runtime_config_init(config, kRuntimeConfigV1_0Size, kRuntimeConfigV1_0Size);
}

STRATA_API strata_status_t strata_runtime_create(const strata_runtime_config_t* config,
                                                 strata_runtime_t** out_runtime) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(out_runtime, "out_runtime"));
    // NULL means strata_runtime_config_init's defaults; a short config keeps them for the rest.
    strata_runtime_config_t c{};
    (void)strata_runtime_config_init_v1_5(&c);
    if (config != nullptr) {
      STRATA_RETURN_IF_ERROR(read_struct(config, &c));
    }
    if (c.device_backend < STRATA_DEVICE_BACKEND_AUTO ||
        c.device_backend > STRATA_DEVICE_BACKEND_HOST) {
      return error(Code::kInvalidArgument, "unknown device_backend ", c.device_backend);
    }
    if (c.device_ordinal < 0) {
      return error(Code::kInvalidArgument, "device_ordinal is negative (", c.device_ordinal, ")");
    }
    if (c.dram_numa_policy < STRATA_NUMA_AUTO || c.dram_numa_policy > STRATA_NUMA_INTERLEAVE) {
      return error(Code::kInvalidArgument, "unknown dram_numa_policy ", c.dram_numa_policy);
    }
    if (c.io_engine < STRATA_IO_ENGINE_AUTO || c.io_engine > STRATA_IO_ENGINE_POSIX) {
      return error(Code::kInvalidArgument, "unknown io_engine ", c.io_engine);
    }
    if (c.nvme_path_count > 0 && c.nvme_paths == nullptr) {
      return error(Code::kInvalidArgument, "nvme_paths is NULL with nvme_path_count ",
                   c.nvme_path_count);
    }
    RuntimeOptions options;
    options.device.kind = static_cast<DeviceKind>(c.device_backend);
    options.device.ordinal = c.device_ordinal;
    options.device.host_link_bytes_per_second = c.host_link_bytes_per_second;
    options.budgets = {c.hbm_budget_bytes, c.dram_budget_bytes, c.nvme_budget_bytes};
    options.dram.policy = static_cast<NumaPolicy>(c.dram_numa_policy);
    options.dram.node = c.dram_numa_node;
    options.dram.threads = c.dram_fault_threads;
    options.dram_pinned = c.dram_pinned_bytes;
    for (uint32_t i = 0; i < c.nvme_path_count; ++i) {
      if (c.nvme_paths[i] == nullptr || c.nvme_paths[i][0] == '\0') {
        return error(Code::kInvalidArgument, "nvme_paths[", i, "] is NULL or empty");
      }
      options.nvme.paths.emplace_back(c.nvme_paths[i]);
    }
    options.nvme.engine = static_cast<IoEngineKind>(c.io_engine);
    if (c.io_block_size != 0) options.nvme.block_size = c.io_block_size;
    if (c.io_queue_depth != 0) options.nvme.queue_depth = c.io_queue_depth;
    options.nvme.checksums = c.nvme_checksums != 0;
    options.nvme.direct_dram = c.io_dram_direct != 0;
    std::shared_ptr<Runtime> impl;
    STRATA_RETURN_IF_ERROR(Runtime::create(options, &impl));
    *out_runtime = new strata_runtime{std::move(impl)};
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_runtime_destroy(strata_runtime_t* runtime) {
  if (runtime == nullptr) return STRATA_OK;
  return guarded(__func__, [&] {
    const std::size_t cancelled = runtime->impl->shutdown();
    delete runtime;
    if (cancelled > 0) {
      return error(Code::kCancelled, cancelled,
                   " queued transfer(s) were cancelled because the runtime was destroyed while "
                   "they waited; the runtime is destroyed");
    }
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_runtime_capabilities(strata_runtime_t* runtime,
                                                       strata_capabilities_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_from(runtime));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    const Runtime& rt = *runtime->impl;
    strata_capabilities_t caps{};
    caps.device_backend = static_cast<strata_device_backend_t>(rt.device().kind);
    caps.device_ordinal = rt.device().ordinal;
    caps.cuda_compiled = cuda_backend_compiled() ? 1 : 0;
    caps.cuda_available = rt.device().kind == DeviceKind::kCuda ? 1 : 0;
    for (int t = 0; t < kTierCount; ++t) {
      caps.tiers_available[t] = rt.tier_available(static_cast<Tier>(t)) ? 1 : 0;
      caps.tier_budget_bytes[t] = rt.tier_budget(static_cast<Tier>(t));
    }
    caps.device_numa_node = rt.device_numa_node();
    copy_string(caps.device_name, sizeof caps.device_name, rt.device().name);
    copy_string(caps.backend_reason, sizeof caps.backend_reason, rt.backend_reason());
    const MemoryRegion& dram = rt.dram_region();
    copy_string(caps.dram_placement, sizeof caps.dram_placement, dram.host_report().placement);
    caps.dram_numa_node = dram.host_report().node;
    caps.dram_huge_pages = dram.host_report().huge_pages ? 1 : 0;
    caps.dram_fault_threads = dram.host_report().threads;
    caps.dram_fault_seconds = dram.host_report().fault_seconds;
    caps.dram_pin_seconds = dram.pin_seconds();
    caps.dram_pinned_bytes = dram.pinned_bytes();
    if (const NvmeTier* nvme = rt.nvme()) {
      copy_string(caps.io_engine, sizeof caps.io_engine, nvme->engine_name());
      copy_string(caps.io_engine_reason, sizeof caps.io_engine_reason, nvme->engine_reason());
    }
    write_struct(out, caps);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_runtime_tier_usage(strata_runtime_t* runtime, strata_tier_t tier,
                                                     strata_tier_usage_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_from(runtime));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    if (!valid_tier(tier)) return error(Code::kInvalidArgument, "unknown tier ", tier);
    const TierUsage u = runtime->impl->tier_usage(static_cast<Tier>(tier));
    strata_tier_usage_t usage{};
    usage.budget_bytes = u.budget;
    usage.used_bytes = u.used;
    usage.largest_free_bytes = u.largest_free;
    usage.tensor_count = u.tensors;
    usage.pinned_budget_bytes = u.pinned_budget;
    usage.pinned_used_bytes = u.pinned_used;
    usage.dram_fallbacks = u.fallbacks;
    write_struct(out, usage);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_runtime_link_stats(strata_runtime_t* runtime, strata_link_t link,
                                                     strata_link_stats_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_from(runtime));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    if (!valid_link(link)) return error(Code::kInvalidArgument, "unknown link ", link);
    const LinkCounters c = runtime->impl->link_counters(static_cast<Link>(link));
    strata_link_stats_t stats{};
    stats.bytes = c.bytes;
    stats.transfers = c.transfers;
    stats.busy_ns = c.busy_ns;
    write_struct(out, stats);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_runtime_reset_stats(strata_runtime_t* runtime) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_from(runtime));
    runtime->impl->reset_link_counters();
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_runtime_synchronize(strata_runtime_t* runtime) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(runtime_from(runtime));
    runtime->impl->synchronize();
    return Status::ok();
  });
}

}  // extern "C"

// The two definitions of strata_runtime_config_init: their names stay local (lib/strata.map's
// `local: *`), the versioned aliases are exported.
asm(".symver strata_runtime_config_init_v1_5, strata_runtime_config_init@@STRATA_1.5");
asm(".symver strata_runtime_config_init_v1_0, strata_runtime_config_init@STRATA_1.0");
