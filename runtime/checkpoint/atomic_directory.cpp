#include "runtime/checkpoint/atomic_directory.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <system_error>
#include <vector>

namespace strata {

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kPartialSuffix = ".partial";
constexpr std::string_view kOldSuffix = ".old";

Status io_error(const char* what, const std::string& path, const std::error_code& ec) {
  return error(Code::kIo, "atomic directory: ", what, " ", path, " failed: ", ec.message());
}

Status errno_error(const char* what, const std::string& path, int err) {
  return io_error(what, path, std::error_code(err, std::generic_category()));
}

// Drops trailing slashes, so that suffixes name a sibling ("ckpt/" -> "ckpt.partial", not
// "ckpt/.partial"), and rejects paths that have no last component to rename.
Status normalize(const std::string& path, std::string* out) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const std::string name = fs::path(p).filename().string();
  if (name.empty() || name == "." || name == "..") {
    return error(Code::kInvalidArgument, "atomic directory: \"", path,
                 "\" does not name a directory that can be replaced");
  }
  *out = std::move(p);
  return Status::ok();
}

std::string parent_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// The type of what `path` names (following symlinks); not_found is not an error.
Status type_of(const std::string& path, fs::file_type* type) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) {
    *type = fs::file_type::not_found;
    return Status::ok();
  }
  if (ec) return io_error("stat", path, ec);
  *type = st.type();
  return Status::ok();
}

Status fsync_path(const std::string& path, bool directory) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0) return errno_error("opening for fsync", path, errno);
  const int rc = fsync(fd);
  const int err = errno;
  close(fd);
  return rc == 0 ? Status::ok() : errno_error("fsync", path, err);
}

// fsyncs every regular file and directory under `root`, then `root`: a rename only makes the
// directory entry durable, not the data behind it.
Status sync_tree(const std::string& root) {
  std::error_code ec;
  fs::recursive_directory_iterator it(root, ec);
  if (ec) return io_error("listing", root, ec);
  for (const fs::recursive_directory_iterator end; it != end; it.increment(ec)) {
    if (ec) return io_error("listing", root, ec);
    const fs::file_type type = it->symlink_status(ec).type();
    if (ec) return io_error("stat", it->path().string(), ec);
    if (type == fs::file_type::regular || type == fs::file_type::directory) {
      STRATA_RETURN_IF_ERROR(fsync_path(it->path().string(), type == fs::file_type::directory));
    }
  }
  if (ec) return io_error("listing", root, ec);
  return fsync_path(root, true);
}

Status remove_tree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  return ec ? io_error("removing", path, ec) : Status::ok();
}

// After the new version is in place: a failure here leaves garbage, not a broken checkpoint.
Status remove_previous(const std::string& path, const std::string& final_path) {
  const Status s = remove_tree(path);
  if (s.is_ok()) return Status::ok();
  return error(Code::kIo, "atomic directory: ", final_path,
               " was committed, but removing its previous version failed: ", s.message());
}

bool exchange_unsupported(int err) {
  return err == EINVAL || err == ENOSYS || err == ENOTSUP || err == EOPNOTSUPP;
}

}  // namespace

Status atomic_staging_path(const std::string& final_path, std::string* staging) {
  std::string final_dir;
  STRATA_RETURN_IF_ERROR(normalize(final_path, &final_dir));
  *staging = final_dir + std::string(kPartialSuffix);
  return Status::ok();
}

Status begin_atomic_directory(const std::string& final_path, std::string* staging) {
  std::string final_dir;
  STRATA_RETURN_IF_ERROR(normalize(final_path, &final_dir));
  fs::file_type type;
  STRATA_RETURN_IF_ERROR(type_of(final_dir, &type));
  if (type != fs::file_type::not_found && type != fs::file_type::directory) {
    return error(Code::kInvalidArgument, "atomic directory: ", final_dir,
                 " exists and is not a directory");
  }
  std::string partial;
  STRATA_RETURN_IF_ERROR(atomic_staging_path(final_dir, &partial));
  STRATA_RETURN_IF_ERROR(remove_tree(partial));

  // Parents created here must be made durable too, or a crash could lose the committed
  // directory along with the parent entry that led to it.
  std::vector<std::string> created;
  for (std::string dir = parent_of(final_dir);;) {
    fs::file_type t;
    STRATA_RETURN_IF_ERROR(type_of(dir, &t));
    if (t != fs::file_type::not_found) break;
    created.push_back(dir);
    std::string up = parent_of(dir);
    if (up == dir) break;
    dir = std::move(up);
  }
  std::error_code ec;
  fs::create_directories(partial, ec);
  if (ec) return io_error("creating", partial, ec);
  for (auto it = created.rbegin(); it != created.rend(); ++it) {
    STRATA_RETURN_IF_ERROR(fsync_path(parent_of(*it), true));
  }
  *staging = partial;
  return Status::ok();
}

Status commit_atomic_directory(const std::string& staging, const std::string& final_path) {
  std::string staging_dir, final_dir;
  STRATA_RETURN_IF_ERROR(normalize(staging, &staging_dir));
  STRATA_RETURN_IF_ERROR(normalize(final_path, &final_dir));
  if (staging_dir == final_dir) {
    return error(Code::kInvalidArgument, "atomic directory: staging and final path are both ",
                 final_dir);
  }
  fs::file_type type;
  STRATA_RETURN_IF_ERROR(type_of(staging_dir, &type));
  if (type == fs::file_type::not_found) {
    return error(Code::kNotFound, "atomic directory: staging directory ", staging_dir,
                 " does not exist");
  }
  if (type != fs::file_type::directory) {
    return error(Code::kInvalidArgument, "atomic directory: staging path ", staging_dir,
                 " is not a directory");
  }
  STRATA_RETURN_IF_ERROR(sync_tree(staging_dir));

  STRATA_RETURN_IF_ERROR(type_of(final_dir, &type));
  const std::string parent = parent_of(final_dir);
  const std::string old = final_dir + std::string(kOldSuffix);
  if (type == fs::file_type::not_found) {
    if (std::rename(staging_dir.c_str(), final_dir.c_str()) != 0) {
      return errno_error("renaming to", final_dir, errno);
    }
    STRATA_RETURN_IF_ERROR(fsync_path(parent, true));
    // A ".old" here is the previous version of an interrupted two-rename replacement.
    return remove_previous(old, final_dir);
  }
  if (type != fs::file_type::directory) {
    return error(Code::kInvalidArgument, "atomic directory: ", final_dir,
                 " exists and is not a directory");
  }

  if (renameat2(AT_FDCWD, staging_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    STRATA_RETURN_IF_ERROR(fsync_path(parent, true));
    return remove_previous(staging_dir, final_dir);  // the old tree, now at the staging path
  }
  const int err = errno;
  if (!exchange_unsupported(err)) return errno_error("exchanging with", final_dir, err);

  // Two renames: between them only ".old" holds a complete version, which
  // resolve_atomic_directory() then returns. With final_dir present, any ".old" is stale.
  STRATA_RETURN_IF_ERROR(remove_tree(old));
  if (std::rename(final_dir.c_str(), old.c_str()) != 0) {
    return errno_error("renaming aside", final_dir, errno);
  }
  if (std::rename(staging_dir.c_str(), final_dir.c_str()) != 0) {
    const int rename_err = errno;
    (void)std::rename(old.c_str(), final_dir.c_str());  // put the previous version back
    return errno_error("renaming to", final_dir, rename_err);
  }
  STRATA_RETURN_IF_ERROR(fsync_path(parent, true));
  return remove_previous(old, final_dir);
}

Status resolve_atomic_directory(const std::string& final_path, std::string* existing) {
  std::string final_dir;
  STRATA_RETURN_IF_ERROR(normalize(final_path, &final_dir));
  fs::file_type type;
  STRATA_RETURN_IF_ERROR(type_of(final_dir, &type));
  if (type == fs::file_type::directory) {
    *existing = final_dir;
    return Status::ok();
  }
  if (type != fs::file_type::not_found) {
    return error(Code::kInvalidArgument, "atomic directory: ", final_dir,
                 " exists and is not a directory");
  }
  const std::string old = final_dir + std::string(kOldSuffix);
  STRATA_RETURN_IF_ERROR(type_of(old, &type));
  if (type == fs::file_type::directory) {
    *existing = old;
    return Status::ok();
  }
  return error(Code::kNotFound, "atomic directory: ", final_dir,
               " does not exist (nor does an interrupted replacement's ", old, ")");
}

}  // namespace strata
