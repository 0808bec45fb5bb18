#include <cpuid.h>

#include <cstdlib>
#include <string>

#include "runtime/optimizer/kernels.h"

namespace strata::optim {
namespace generic {
const KernelTable& table();
}
namespace avx2 {
const KernelTable& table();
}
namespace avx512 {
const KernelTable& table();
}

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

namespace {
// F16C from CPUID leaf 1 (ECX bit 29): clang < 15 has no "f16c" for __builtin_cpu_supports.
// Its state is AVX's, whose OS support __builtin_cpu_supports("avx2") has already checked.
bool has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
}  // namespace

bool isa_supported(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma") && has_f16c();
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    default:
      return true;
  }
}

Isa best_isa() {
  Isa best = isa_supported(Isa::kAvx512) ? Isa::kAvx512
             : isa_supported(Isa::kAvx2) ? Isa::kAvx2
                                         : Isa::kGeneric;
  // A lower ceiling for comparisons and for CPUs that clock down under AVX-512.
  if (const char* cap = std::getenv("STRATA_OPTIMIZER_ISA")) {
    const std::string c(cap);
    const Isa want = c == "avx512" ? Isa::kAvx512 : c == "avx2" ? Isa::kAvx2 : Isa::kGeneric;
    if (static_cast<int>(want) < static_cast<int>(best)) best = want;
  }
  return best;
}

const KernelTable& kernels(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return avx512::table();
    case Isa::kAvx2:
      return avx2::table();
    default:
      return generic::table();
  }
}

}  // namespace strata::optim
