// The NVMe tier's backing files: one per path, opened with O_DIRECT and preallocated with
// fallocate, so writes never allocate blocks (no ENOSPC mid-step, no fragmentation) and the
// page cache is bypassed.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "backends/storage/storage_engine.h"

namespace strata {

struct StorageFileSet {
  std::vector<StorageFile> files;
  std::vector<bool> created;                       // Strata created it, so Strata removes it
  std::vector<std::pair<uint64_t, uint64_t>> ids;  // (st_dev, st_ino) of each file
};

// Opens (creating where absent), locks (flock, exclusive) and preallocates `bytes_per_file` in
// each path. On error every file opened so far is closed (and removed if it was created). kIo
// names the path and errno; kInvalidArgument for two paths naming one file (same inode); kBusy
// for a file another runtime holds locked.
Status open_storage_files(const std::vector<std::string>& paths, uint64_t bytes_per_file,
                          StorageFileSet* out);
// Closes the files and removes those Strata created.
void close_storage_files(StorageFileSet* set);

}  // namespace strata
