// Helpers for the unit tests of the C++ core: a scratch directory, and a check of a Status
// that prints its message.
#pragma once

#include <catch2/catch.hpp>

#include "common/status.h"
#include "scratch_dir.h"

#define REQUIRE_OK(expr)                    \
  do {                                      \
    const ::strata::Status st_ = (expr);    \
    INFO(#expr << " -> " << st_.message()); \
    REQUIRE(st_.is_ok());                   \
  } while (0)
