#include <catch2/catch.hpp>

#include <map>
#include <random>

#include "runtime/memory/arena.h"

using strata::Arena;
using strata::Code;

TEST_CASE("arena rounds to 256 bytes and aligns every block", "[arena]") {
  Arena arena("hbm", 1 << 20);
  uint64_t a = 1, b = 1, c = 1;
  REQUIRE(arena.allocate(1, "a", &a).is_ok());
  REQUIRE(arena.allocate(257, "b", &b).is_ok());
  REQUIRE(arena.allocate(0, "c", &c).is_ok());
  for (uint64_t off : {a, b, c}) REQUIRE(off % Arena::kDefaultAlignment == 0);
  REQUIRE(arena.used() == 256 + 512 + 256);
}

TEST_CASE("arena capacity is rounded down to the alignment", "[arena]") {
  Arena arena("dram", 1000);
  REQUIRE(arena.capacity() == 768);
}

TEST_CASE("arena exhaustion reports requested, free and largest-free bytes", "[arena]") {
  Arena arena("hbm", 4096);
  uint64_t off = 0;
  REQUIRE(arena.allocate(4096, "fill", &off).is_ok());
  REQUIRE(arena.free(off).is_ok());
  uint64_t blocks[16];
  for (auto& o : blocks) REQUIRE(arena.allocate(256, "small", &o).is_ok());
  // Free every other block: 2048 bytes free, but no block larger than 256.
  for (int i = 0; i < 16; i += 2) REQUIRE(arena.free(blocks[i]).is_ok());
  REQUIRE(arena.free_bytes() == 2048);
  REQUIRE(arena.largest_free() == 256);
  const strata::Status s = arena.allocate(512, "layer.7.weight", &off);
  REQUIRE(s.code() == Code::kOutOfMemory);
  REQUIRE_THAT(s.message(), Catch::Contains("512 bytes") && Catch::Contains("layer.7.weight") &&
                                Catch::Contains("2048 of 4096 bytes free") &&
                                Catch::Contains("largest free block 256"));
}

TEST_CASE("arena best fit takes the smallest hole that fits", "[arena]") {
  Arena arena("hbm", 64 * 256);
  uint64_t a, gap1, b, gap2, c;
  REQUIRE(arena.allocate(256, "a", &a).is_ok());
  REQUIRE(arena.allocate(4 * 256, "gap1", &gap1).is_ok());  // will be a 4-block hole
  REQUIRE(arena.allocate(256, "b", &b).is_ok());
  REQUIRE(arena.allocate(2 * 256, "gap2", &gap2).is_ok());  // will be a 2-block hole
  REQUIRE(arena.allocate(256, "c", &c).is_ok());
  REQUIRE(arena.free(gap1).is_ok());
  REQUIRE(arena.free(gap2).is_ok());
  uint64_t x = 0;
  REQUIRE(arena.allocate(2 * 256, "x", &x).is_ok());
  REQUIRE(x == gap2);  // the exact-size hole, not the first hole
  uint64_t y = 0;
  REQUIRE(arena.allocate(3 * 256, "y", &y).is_ok());
  REQUIRE(y == gap1);
}

TEST_CASE("arena coalesces neighbours so freed space is whole again", "[arena]") {
  Arena arena("hbm", 8 * 256);
  uint64_t o[8];
  for (auto& x : o) REQUIRE(arena.allocate(256, "t", &x).is_ok());
  REQUIRE(arena.free_block_count() == 0);
  // Free in an order that exercises merge-left, merge-right and merge-both.
  for (int i : {1, 3, 2, 0, 6, 7, 5, 4}) REQUIRE(arena.free(o[i]).is_ok());
  REQUIRE(arena.free_block_count() == 1);
  REQUIRE(arena.largest_free() == 8 * 256);
  uint64_t all = 0;
  REQUIRE(arena.allocate(8 * 256, "all", &all).is_ok());
  REQUIRE(all == 0);
}

TEST_CASE("arena rejects a double free without corrupting its lists", "[arena]") {
  Arena arena("hbm", 4 * 256);
  uint64_t a = 0;
  REQUIRE(arena.allocate(256, "a", &a).is_ok());
  REQUIRE(arena.free(a).is_ok());
  REQUIRE(arena.free(a).code() == Code::kInternal);
  REQUIRE(arena.free(12345).code() == Code::kInternal);
  REQUIRE(arena.used() == 0);
  REQUIRE(arena.largest_free() == 4 * 256);
}

TEST_CASE("arena survives random fragmentation with consistent accounting", "[arena]") {
  const uint64_t capacity = 1 << 22;
  Arena arena("hbm", capacity);
  std::mt19937_64 rng(7);
  std::map<uint64_t, uint64_t> live;  // offset -> rounded size
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const uint64_t want = 1 + rng() % 20000;
      uint64_t off = 0;
      const strata::Status s = arena.allocate(want, "r", &off);
      if (s.is_ok()) {
        const uint64_t size = Arena::round_up(want);
        // The new block overlaps no live block.
        auto next = live.lower_bound(off);
        if (next != live.end()) REQUIRE(off + size <= next->first);
        if (next != live.begin()) {
          auto prev = std::prev(next);
          REQUIRE(prev->first + prev->second <= off);
        }
        REQUIRE(off + size <= arena.capacity());
        live.emplace(off, size);
      } else {
        REQUIRE(s.code() == Code::kOutOfMemory);
        REQUIRE(arena.largest_free() < Arena::round_up(want));
      }
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      REQUIRE(arena.free(it->first).is_ok());
      live.erase(it);
    }
    uint64_t used = 0;
    for (auto& [o, s] : live) used += s;
    REQUIRE(arena.used() == used);
  }
  for (auto& [o, s] : live) REQUIRE(arena.free(o).is_ok());
  REQUIRE(arena.free_block_count() == 1);
  REQUIRE(arena.largest_free() == capacity);
}

TEST_CASE("arena says which blocks no earlier block ever covered", "[arena]") {
  strata::Arena a("dram", 64 * 4096, 4096);
  uint64_t x = 0, y = 0, z = 0, w = 0;
  bool untouched = false;
  REQUIRE(a.allocate(4096, "x", &x, &untouched).is_ok());
  REQUIRE(untouched);
  REQUIRE(a.allocate(3 * 4096, "y", &y, &untouched).is_ok());
  REQUIRE(untouched);
  REQUIRE(a.allocate(4096, "z", &z, &untouched).is_ok());
  REQUIRE(untouched);
  // y's hole is taken again (best fit): covered before, whatever size is asked of it.
  REQUIRE(a.free(y).is_ok());
  REQUIRE(a.allocate(4096, "w", &w, &untouched).is_ok());
  REQUIRE(w == y);
  REQUIRE_FALSE(untouched);
  REQUIRE(a.allocate(2 * 4096, "v", &y, &untouched).is_ok());
  REQUIRE(y == w + 4096);
  REQUIRE_FALSE(untouched);
  // Past everything handed out: untouched, also after the block below it is freed.
  REQUIRE(a.free(z).is_ok());
  REQUIRE(a.allocate(2 * 4096, "u", &z, &untouched).is_ok());
  REQUIRE(z == x + 4 * 4096);  // z's old block and the page above it
  REQUIRE_FALSE(untouched);    // starts inside z's old block
  REQUIRE(a.allocate(4096, "t", &w, &untouched).is_ok());
  REQUIRE(w == z + 2 * 4096);
  REQUIRE(untouched);
}
