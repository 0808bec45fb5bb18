#include "common/json.h"

#include <nlohmann/json.hpp>

namespace strata {

std::string json_string(std::string_view text, JsonUtf8 utf8) {
  const auto handler = utf8 == JsonUtf8::kStrict ? nlohmann::json::error_handler_t::strict
                                                 : nlohmann::json::error_handler_t::replace;
  return nlohmann::json(std::string(text)).dump(-1, ' ', false, handler);
}

}  // namespace strata
