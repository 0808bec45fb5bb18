#include "bench_strata.h"

#include "bench_report.h"

#include <algorithm>
#include <stdexcept>

namespace strata_bench {

void check(strata_status_t s, const char* what) {
  if (s != STRATA_OK) {
    throw std::runtime_error(std::string(what) + ": " + strata_status_string(s) + ": " +
                             strata_last_error_message());
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

strata_tensor_t* make_tensor(strata_runtime_t* rt, const std::string& name, uint64_t bytes,
                             strata_tier_t home, bool bf16) {
  const bool two = bf16 && bytes % 2 == 0;
  const int64_t shape[1] = {static_cast<int64_t>(two ? bytes / 2 : bytes)};
  strata_tensor_desc_t d{};
  d.struct_size = STRATA_TENSOR_DESC_STRUCT_SIZE;
  d.name = name.c_str();
  d.dtype = two ? STRATA_DTYPE_BF16 : STRATA_DTYPE_U8;
  d.ndim = 1;
  d.shape = shape;
  d.role = STRATA_ROLE_OTHER;
  d.home_tier = home;
  strata_tensor_t* t = nullptr;
  check(strata_tensor_register(rt, &d, &t), name.c_str());
  return t;
}

strata_runtime_t* open_runtime(const strata_runtime_config_t& config, strata_capabilities_t* caps) {
  progress("creating the runtime (pins " + std::to_string(config.dram_budget_bytes >> 20) +
           " MiB)");
  strata_runtime_t* rt = nullptr;
  check(strata_runtime_create(&config, &rt), "strata_runtime_create");
  *caps = strata_capabilities_t{};
  caps->struct_size = STRATA_CAPABILITIES_STRUCT_SIZE;
  const strata_status_t s = strata_runtime_capabilities(rt, caps);
  if (s != STRATA_OK) strata_runtime_destroy(rt);
  check(s, "capabilities");
  return rt;
}

strata_device_backend_t backend_from(const std::string& name) {
  if (name == "auto") return STRATA_DEVICE_BACKEND_AUTO;
  if (name == "cuda") return STRATA_DEVICE_BACKEND_CUDA;
  if (name == "host") return STRATA_DEVICE_BACKEND_HOST;
  throw std::invalid_argument("--backend must be auto, cuda or host, not '" + name + "'");
}

}  // namespace strata_bench
