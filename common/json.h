// JSON string literals for the JSON the core writes by hand (plans, traces, checkpoint
// headers): the structure is streamed for speed, but escaping is nlohmann_json's, so every
// writer escapes the same, complete way. nlohmann stays out of this header (it is large).
#pragma once

#include <string>
#include <string_view>

namespace strata {

enum class JsonUtf8 {
  kReplace,  // invalid UTF-8 becomes U+FFFD: names in diagnostics (plans, traces)
  kStrict,   // invalid UTF-8 throws nlohmann::json::type_error: files a reader must trust
};

// `text` as a JSON string literal, quotes included; control characters escaped, UTF-8 kept.
std::string json_string(std::string_view text, JsonUtf8 utf8 = JsonUtf8::kReplace);

}  // namespace strata
