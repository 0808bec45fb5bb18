#include "backends/storage/storage_files.h"

#include <fcntl.h>
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
    const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes_per_file));
    if (rc != 0) return fail(path, "preallocating (fallocate)", rc);
  }
  *out = std::move(set);
  return Status::ok();
}

void close_storage_files(StorageFileSet* set) {
  for (std::size_t i = 0; i < set->files.size(); ++i) {
    if (set->files[i].fd >= 0) close(set->files[i].fd);
    if (set->created[i]) unlink(set->files[i].path.c_str());
  }
  set->files.clear();
  set->created.clear();
}

}  // namespace strata
