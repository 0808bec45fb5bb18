// The optimizer kernels built for generic (flags in runtime/optimizer/CMakeLists.txt).
#define STRATA_KERNEL_NS generic
#define STRATA_KERNEL_ISA Isa::kGeneric
#include "runtime/optimizer/kernels_impl.h"
