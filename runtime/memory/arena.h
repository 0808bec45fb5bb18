// Arena: best-fit sub-allocation with coalescing over one contiguous region that was allocated
// once at start-up (the HBM arena, the pinned DRAM arena). It manages offsets only and never
// touches the memory, so it is the same for every backend and testable without one.
//
// Best fit (smallest free block that fits) keeps large holes intact for large tensors; freeing
// merges a block with free neighbours at once, so free space never stays split needlessly.
// Every offset and size is a multiple of the arena's alignment: 256 bytes for HBM (CUDA's
// allocation alignment, enough for any vector load), 4 KiB for DRAM and NVMe (what O_DIRECT
// needs of buffers, offsets and lengths).
//
// Not thread-safe: the owner (the runtime) serializes calls.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "common/status.h"

namespace strata {

class Arena {
 public:
  static constexpr uint64_t kDefaultAlignment = 256;

  // `name` is used in error messages ("hbm"); `capacity` is rounded down to `alignment`, a power
  // of two.
  Arena(std::string_view name, uint64_t capacity, uint64_t alignment = kDefaultAlignment);

  // Reserve `bytes` (0 counts as 1; rounded up to the alignment). On success *offset is the
  // block's start and *untouched (if given) whether no byte of the block was ever part of an
  // earlier block: memory that was zero when the arena was made is still zero there, so the
  // optimizer need not zero its new state a second time. Exhaustion returns kOutOfMemory naming
  // `what`, the requested bytes, the free bytes and the largest free block.
  Status allocate(uint64_t bytes, std::string_view what, uint64_t* offset,
                  bool* untouched = nullptr);

  // Return a block; `offset` must come from allocate() and not have been freed (kInternal if not:
  // freeing twice is a bug in the caller, reported rather than corrupting the free lists).
  Status free(uint64_t offset);

  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_; }
  uint64_t free_bytes() const { return capacity_ - used_; }
  uint64_t largest_free() const;
  std::size_t free_block_count() const { return free_by_offset_.size(); }

  uint64_t alignment() const { return alignment_; }
  // `bytes` (0 counts as 1) rounded up to `alignment`; 0 if that overflows.
  static uint64_t round_up(uint64_t bytes, uint64_t alignment = kDefaultAlignment);

 private:
  void insert_free(uint64_t offset, uint64_t size);
  void erase_free(uint64_t offset, uint64_t size);

  std::string name_;
  uint64_t alignment_;
  uint64_t capacity_;
  uint64_t used_ = 0;
  // No block ever handed out reached at or above this offset. One mark, not a set of ranges: a
  // fresh arena fills from its start (best fit in one free block), so the mark tells exactly for
  // the blocks of a set-up, and a block in a hole some earlier block left is never untouched.
  uint64_t untouched_from_ = 0;
  std::map<uint64_t, uint64_t> free_by_offset_;           // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;  // (size, offset), for best fit
  std::unordered_map<uint64_t, uint64_t> allocated_;      // offset -> size
};

}  // namespace strata
