#include "backends/storage/storage_files.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace strata {

Status open_storage_files(const std::vector<std::string>& paths, uint64_t bytes_per_file,
                          StorageFileSet* out) {
  StorageFileSet set;
  auto fail = [&](const std::string& path, const char* what, int err) {
    close_storage_files(&set);
    return error(
        Code::kIo, "nvme path ", path, ": ", what, " failed: ", std::strerror(err), " (errno ", err,
        ")", err == EINVAL ? "; the file system may not support O_DIRECT (tmpfs does not)" : "");
  };
  for (const std::string& path : paths) {
    struct stat st {};
    const bool existed = stat(path.c_str(), &st) == 0;
    if (existed && !S_ISREG(st.st_mode)) {
      close_storage_files(&set);
      return error(Code::kInvalidArgument, "nvme path ", path, " exists and is not a regular file");
    }
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0) return fail(path, "open with O_DIRECT", errno);
    set.files.push_back(StorageFile{path, fd});
    set.created.push_back(!existed);
    // One file given twice (the same path, a link, a bind mount) would stripe two parts of the
    // tier onto the same blocks: the same inode is refused, whatever its name.
    struct stat opened {};
    if (fstat(fd, &opened) != 0) return fail(path, "fstat", errno);
    for (std::size_t i = 0; i + 1 < set.files.size(); ++i) {
      if (set.ids[i].first == opened.st_dev && set.ids[i].second == opened.st_ino) {
        const std::string first = set.files[i].path;
        close_storage_files(&set);
        return error(Code::kInvalidArgument, "nvme paths ", first, " and ", path,
                     " are the same file (device ", opened.st_dev, ", inode ", opened.st_ino,
                     "): each path must be a distinct file");
      }
    }
    set.ids.emplace_back(opened.st_dev, opened.st_ino);
    // Another runtime (in this process or another) using the file would overwrite our blocks:
    // an exclusive lock for as long as the tier lives, released when the fd closes.
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err != EWOULDBLOCK) return fail(path, "flock", err);
      set.created.back() = false;  // the other runtime's file: never ours to remove
      close_storage_files(&set);
      return error(Code::kBusy, "nvme path ", path,
                   " is in use by another runtime (it holds the file's lock, flock)");
    }
    const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes_per_file));
    if (rc != 0) return fail(path, "preallocating (fallocate)", rc);
  }
  *out = std::move(set);
  return Status::ok();
}

void close_storage_files(StorageFileSet* set) {
  for (std::size_t i = 0; i < set->files.size(); ++i) {
    if (set->files[i].fd >= 0) {
      // Unlock explicitly: io_uring's registered files keep the open file description (and so
      // the lock) alive until the ring's asynchronous teardown, after close() returns.
      if (i < set->ids.size()) (void)flock(set->files[i].fd, LOCK_UN);
      close(set->files[i].fd);
    }
    if (set->created[i]) unlink(set->files[i].path.c_str());
  }
  set->files.clear();
  set->created.clear();
  set->ids.clear();
}

}  // namespace strata
