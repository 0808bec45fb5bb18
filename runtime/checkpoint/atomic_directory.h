// Replacing a checkpoint directory so that a crash at any point leaves one complete version to
// load, never a mix of two. A save writes into "<final>.partial", then commits it, which swaps
// it with <final> in one rename where the file system can (renameat2 RENAME_EXCHANGE), else in
// two renames through "<final>.old"; resolve_atomic_directory() finds the version to load after
// a crash between those two.
#pragma once

#include <string>

#include "common/status.h"

namespace strata {

// The staging directory begin_atomic_directory() prepares for final_path ("<final>.partial"),
// without touching the file system; kInvalidArgument as begin's for a path with no last
// component.
Status atomic_staging_path(const std::string& final_path, std::string* staging);

// Prepares "<final>.partial" (removing a leftover of a crashed save, creating the directory and
// any missing parents) and returns its path. final_path may end in '/'; if it exists it must be
// a directory.
Status begin_atomic_directory(const std::string& final_path, std::string* staging);

// Makes everything in `staging` durable (every regular file and directory in it is fsynced),
// then makes it final_path atomically and fsyncs the parent directory. The previous version, if
// any, is removed afterwards; an error doing so (kIo) comes after the new version is in place,
// and the leftover is removed by the next begin_atomic_directory().
Status commit_atomic_directory(const std::string& staging, const std::string& final_path);

// The directory a loader should read: final_path if it exists, else "<final>.old" when a
// two-rename replacement was interrupted between its renames; kNotFound naming the path
// otherwise.
Status resolve_atomic_directory(const std::string& final_path, std::string* existing);

}  // namespace strata
