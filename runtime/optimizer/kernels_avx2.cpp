// The optimizer kernels built for avx2 (flags in runtime/optimizer/CMakeLists.txt).
#define STRATA_KERNEL_NS avx2
#define STRATA_KERNEL_ISA Isa::kAvx2
#include "runtime/optimizer/kernels_impl.h"
