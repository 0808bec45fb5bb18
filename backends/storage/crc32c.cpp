#include "backends/storage/crc32c.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <climits>

namespace strata {

uint32_t crc32c(const void* data, std::size_t bytes) {
  return crc32c_extend(0, data, bytes);
}

uint32_t crc32c_extend(uint32_t crc, const void* data, std::size_t bytes) {
  // ISA-L's crc32_iscsi takes the running CRC without the final inversion and an int length;
  // undoing the inversion of a finished CRC is what lets it continue.
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t running = crc ^ 0xFFFFFFFFu;
  while (bytes > 0) {
    const std::size_t n = std::min<std::size_t>(bytes, INT_MAX / 2);
    running = crc32_iscsi(const_cast<unsigned char*>(p), static_cast<int>(n), running);
    p += n;
    bytes -= n;
  }
  return running ^ 0xFFFFFFFFu;
}

}  // namespace strata
