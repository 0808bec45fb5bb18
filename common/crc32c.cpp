#include "common/crc32c.h"

#include <dlfcn.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>

namespace strata {
namespace {

// ISA-L's crc32_iscsi: the running CRC (without the final inversion) continued over buf.
using IsalCrc = unsigned int (*)(unsigned char* buf, int len, unsigned int init_crc);

// ISA-L is loaded at run time, not linked: libstrata then also loads where libisal is not
// installed (the GPU servers ship none), and checksums there use the CPU's crc32 instruction.
IsalCrc load_isal() {
  if (const char* force = std::getenv("STRATA_CRC32C");
      force && std::strcmp(force, "builtin") == 0) {
    return nullptr;
  }
  for (const char* name : {"libisal.so.2", "libisal.so"}) {
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) {
      if (void* fn = dlsym(lib, "crc32_iscsi")) return reinterpret_cast<IsalCrc>(fn);
      dlclose(lib);
    }
  }
  return nullptr;
}

IsalCrc isal() {
  static const IsalCrc fn = load_isal();
  return fn;
}

// SSE4.2's crc32 instruction computes exactly CRC-32C, 8 bytes per instruction: ~8 GB/s per
// core, more than a disk (ISA-L's PCLMULQDQ folding reaches tens of GB/s).
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t running, const unsigned char* p,
                                                        std::size_t n) {
  uint64_t r = running;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, sizeof v);
    r = __builtin_ia32_crc32di(r, v);
  }
  auto r32 = static_cast<uint32_t>(r);
  for (; n > 0; --n, ++p) r32 = __builtin_ia32_crc32qi(r32, *p);
  return r32;
}

// Bit by bit (reflected polynomial 0x82F63B78): for CPUs without SSE4.2 only.
uint32_t crc32c_bitwise(uint32_t running, const unsigned char* p, std::size_t n) {
  for (; n > 0; --n, ++p) {
    running ^= *p;
    for (int k = 0; k < 8; ++k) running = (running >> 1) ^ (0x82F63B78u & (0u - (running & 1u)));
  }
  return running;
}

}  // namespace

uint32_t crc32c(const void* data, std::size_t bytes) {
  return crc32c_extend(0, data, bytes);
}

uint32_t crc32c_extend(uint32_t crc, const void* data, std::size_t bytes) {
  // The running CRC is the finished one without its final inversion: undoing the inversion of
  // a finished CRC is what lets it continue.
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t running = crc ^ 0xFFFFFFFFu;
  if (IsalCrc fn = isal()) {
    while (bytes > 0) {
      const std::size_t n = std::min<std::size_t>(bytes, INT_MAX / 2);
      running = fn(const_cast<unsigned char*>(p), static_cast<int>(n), running);
      p += n;
      bytes -= n;
    }
    return running ^ 0xFFFFFFFFu;
  }
  return crc32c_extend_builtin(crc, data, bytes);
}

uint32_t crc32c_extend_builtin(uint32_t crc, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  const uint32_t running = crc ^ 0xFFFFFFFFu;
  __builtin_cpu_init();
  return (__builtin_cpu_supports("sse4.2") ? crc32c_sse42(running, p, bytes)
                                           : crc32c_bitwise(running, p, bytes)) ^
         0xFFFFFFFFu;
}

bool crc32c_uses_isal() {
  return isal() != nullptr;
}

}  // namespace strata
