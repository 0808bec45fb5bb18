// The optimizer kernels built for avx512 (flags in runtime/optimizer/CMakeLists.txt).
#define STRATA_KERNEL_NS avx512
#define STRATA_KERNEL_ISA Isa::kAvx512
#include "runtime/optimizer/kernels_impl.h"
