// UTF-8 validation: tensor names must be well-formed UTF-8 so that every tensor can be named in
// a JSON document (a checkpoint's safetensors header, a trace, a plan).
#pragma once

#include <string_view>

namespace strata {

// Whether `text` is well-formed UTF-8 (what JSON strings, and so tensor names, must be).
bool valid_utf8(std::string_view text);

}  // namespace strata
