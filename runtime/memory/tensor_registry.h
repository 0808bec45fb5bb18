// TensorRegistry: the runtime's table of tensors by id and by name. Ids are never reused (a
// process-wide counter), so a stale or foreign handle is found missing instead of aliasing a
// newer tensor. Not thread-safe: the runtime serializes access under its mutex.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "common/types.h"
#include "runtime/memory/checksums.h"

namespace strata {

using TensorId = uint64_t;

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  Role role = Role::kOther;
  Tier home = Tier::kDram;
};

struct TensorRecord {
  TensorId id = 0;
  TensorSpec spec;
  uint64_t nbytes = 0;
  Tier tier = Tier::kDram;  // where the data lives now
  uint64_t offset = 0;      // of the data in that tier's arena
  uint64_t skew = 0;        // the data starts this far into its arena block (offset - skew)
  bool migrating = false;
  int export_count = 0;  // live DLPack exports
  int io_count = 0;      // synchronous reads/writes running outside the runtime lock
  // Checksums of the NVMe copy, while the tensor lives on NVMe with checksums on.
  std::shared_ptr<Checksums> nvme_crcs;

  int executor_pins = 0;  // executors streaming it

  // A tensor that may not change place: moving or unregistering it must wait.
  bool pinned_in_place() const {
    return migrating || export_count > 0 || io_count > 0 || executor_pins > 0;
  }
};

// Checks a spec and computes its byte size: name length, shape, overflow.
Status validate_spec(const TensorSpec& spec, uint64_t* nbytes);

class TensorRegistry {
 public:
  static constexpr std::size_t kMaxNameLength = 255;
  static constexpr std::size_t kMaxNdim = 8;

  // Adds a record with a fresh id; kAlreadyExists if the name is taken.
  Status add(TensorSpec spec, uint64_t nbytes, Tier tier, uint64_t offset, TensorId* id);
  Status remove(TensorId id);
  // nullptr if absent.
  TensorRecord* find(TensorId id);
  TensorRecord* find(std::string_view name);
  std::size_t size() const { return by_id_.size(); }

  template <typename F>
  void for_each(F&& f) {
    for (auto& [id, record] : by_id_) f(*record);
  }

 private:
  std::unordered_map<TensorId, std::unique_ptr<TensorRecord>> by_id_;
  std::unordered_map<std::string, TensorId> by_name_;
};

}  // namespace strata
