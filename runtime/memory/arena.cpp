#include "runtime/memory/arena.h"

#include <algorithm>

#include "common/align.h"

namespace strata {

Arena::Arena(std::string_view name, uint64_t capacity, uint64_t alignment)
    : name_(name), alignment_(alignment), capacity_(capacity / alignment * alignment) {
  if (capacity_ > 0) insert_free(0, capacity_);
}

uint64_t Arena::round_up(uint64_t bytes, uint64_t alignment) {
  return align_up(std::max<uint64_t>(bytes, 1), alignment);  // 0 on overflow
}

uint64_t Arena::largest_free() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

void Arena::insert_free(uint64_t offset, uint64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void Arena::erase_free(uint64_t offset, uint64_t size) {
  free_by_offset_.erase(offset);
  free_by_size_.erase({size, offset});
}

Status Arena::allocate(uint64_t bytes, std::string_view what, uint64_t* offset, bool* untouched) {
  const uint64_t size = round_up(bytes, alignment_);
  auto it = size == 0 ? free_by_size_.end() : free_by_size_.lower_bound({size, 0});
  if (it == free_by_size_.end()) {
    return error(Code::kOutOfMemory, name_, " tier: cannot allocate ", bytes, " bytes for '", what,
                 "': ", free_bytes(), " of ", capacity_, " bytes free, largest free block ",
                 largest_free(), " bytes");
  }
  const auto [block_size, block_offset] = *it;
  erase_free(block_offset, block_size);
  if (block_size > size) insert_free(block_offset + size, block_size - size);
  allocated_.emplace(block_offset, size);
  used_ += size;
  if (untouched != nullptr) *untouched = block_offset >= untouched_from_;
  untouched_from_ = std::max(untouched_from_, block_offset + size);
  *offset = block_offset;
  return Status::ok();
}

Status Arena::free(uint64_t offset) {
  auto found = allocated_.find(offset);
  if (found == allocated_.end()) {
    return error(Code::kInternal, name_, " tier: free of offset ", offset,
                 " that is not an allocated block");
  }
  uint64_t start = offset;
  uint64_t size = found->second;
  allocated_.erase(found);
  used_ -= size;

  // Merge with the free block that ends where this one starts, and the one that starts where
  // this one ends.
  auto next = free_by_offset_.lower_bound(start);
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      erase_free(prev->first, prev->second);
    }
  }
  next = free_by_offset_.lower_bound(start + size);
  if (next != free_by_offset_.end() && next->first == start + size) {
    size += next->second;
    erase_free(next->first, next->second);
  }
  insert_free(start, size);
  return Status::ok();
}

}  // namespace strata
