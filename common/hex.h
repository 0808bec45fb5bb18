// Hexadecimal for CRC-32C values: the checkpoint format stores them as 8 lowercase digits, and
// error messages print them the same way, so a value in a message can be found in the file.
#pragma once

#include <cstdint>
#include <string>

namespace strata {

// Exactly 8 lowercase hexadecimal digits, no prefix: hex8(0xE3069283) == "e3069283".
inline std::string hex8(uint32_t value) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(8, '0');
  for (int i = 7; i >= 0; --i, value >>= 4) s[static_cast<std::size_t>(i)] = kDigits[value & 0xF];
  return s;
}

}  // namespace strata
