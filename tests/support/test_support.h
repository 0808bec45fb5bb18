// Helpers shared by the C ABI tests: status checks that print the library's message, RAII
// owners for runtimes and events, random bytes.
#pragma once

#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "scratch_dir.h"
#include "strata/strata.h"

#define STRATA_REQUIRE_OK(expr)                                     \
  do {                                                              \
    const strata_status_t strata_s_ = (expr);                       \
    INFO(#expr << " -> " << strata_status_string(strata_s_) << ": " \
               << strata_last_error_message());                     \
    REQUIRE(strata_s_ == STRATA_OK);                                \
  } while (0)

// Checks the status and that the message is non-empty and mentions `needle`.
#define STRATA_REQUIRE_ERROR(expr, status, needle)                                 \
  do {                                                                             \
    const strata_status_t strata_s_ = (expr);                                      \
    const std::string strata_m_ = strata_last_error_message();                     \
    INFO(#expr << " -> " << strata_status_string(strata_s_) << ": " << strata_m_); \
    REQUIRE(strata_s_ == (status));                                                \
    REQUIRE_THAT(strata_m_, Catch::Contains(needle));                              \
  } while (0)

namespace strata_test {

struct RuntimeDeleter {
  void operator()(strata_runtime_t* r) const { strata_runtime_destroy(r); }
};
using RuntimePtr = std::unique_ptr<strata_runtime_t, RuntimeDeleter>;

struct EventDeleter {
  void operator()(strata_event_t* e) const { strata_event_destroy(e); }
};
using EventPtr = std::unique_ptr<strata_event_t, EventDeleter>;

// The backend under test: STRATA_TEST_BACKEND=cuda|host (default host).
inline strata_device_backend_t backend_under_test() {
  const char* env = std::getenv("STRATA_TEST_BACKEND");
  return env != nullptr && std::string(env) == "cuda" ? STRATA_DEVICE_BACKEND_CUDA
                                                      : STRATA_DEVICE_BACKEND_HOST;
}

// The storage engine under test: STRATA_TEST_IO_ENGINE=posix|uring|auto (default auto).
inline strata_io_engine_t io_engine_under_test() {
  const char* env = std::getenv("STRATA_TEST_IO_ENGINE");
  const std::string e = env != nullptr ? env : "auto";
  return e == "posix"   ? STRATA_IO_ENGINE_POSIX
         : e == "uring" ? STRATA_IO_ENGINE_URING
                        : STRATA_IO_ENGINE_AUTO;
}

inline strata_runtime_config_t config_for(strata_device_backend_t backend, uint64_t hbm,
                                          uint64_t dram, uint64_t host_bps = 0) {
  strata_runtime_config_t c;
  strata_runtime_config_init(&c);
  c.device_backend = backend;
  c.hbm_budget_bytes = hbm;
  c.dram_budget_bytes = dram;
  c.host_link_bytes_per_second = host_bps;
  return c;
}

inline RuntimePtr make_runtime(const strata_runtime_config_t& config) {
  strata_runtime_t* r = nullptr;
  const strata_status_t s = strata_runtime_create(&config, &r);
  INFO("strata_runtime_create -> " << strata_status_string(s) << ": "
                                   << strata_last_error_message());
  REQUIRE(s == STRATA_OK);
  return RuntimePtr(r);
}

inline strata_tensor_desc_t desc(const char* name, const int64_t* shape, int32_t ndim,
                                 strata_tier_t home, strata_dtype_t dtype = STRATA_DTYPE_U8,
                                 strata_role_t role = STRATA_ROLE_WEIGHT) {
  strata_tensor_desc_t d{};
  d.struct_size = STRATA_TENSOR_DESC_STRUCT_SIZE;
  d.name = name;
  d.dtype = dtype;
  d.ndim = ndim;
  d.shape = shape;
  d.role = role;
  d.home_tier = home;
  return d;
}

// Registers a 1-D u8 tensor of `bytes` bytes.
inline strata_tensor_t* register_bytes(strata_runtime_t* r, const std::string& name, uint64_t bytes,
                                       strata_tier_t home) {
  const int64_t shape[1] = {static_cast<int64_t>(bytes)};
  const strata_tensor_desc_t d = desc(name.c_str(), shape, 1, home);
  strata_tensor_t* t = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_register(r, &d, &t));
  return t;
}

inline std::vector<unsigned char> random_bytes(std::size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

}  // namespace strata_test
