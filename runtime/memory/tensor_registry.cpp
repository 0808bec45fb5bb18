#include "runtime/memory/tensor_registry.h"

#include <atomic>
#include <limits>

#include "common/utf8.h"

namespace strata {
namespace {
std::atomic<TensorId> next_id{1};
}

Status validate_spec(const TensorSpec& spec, uint64_t* nbytes) {
  if (spec.name.empty()) return error(Code::kInvalidArgument, "tensor name is empty");
  if (spec.name.size() > TensorRegistry::kMaxNameLength) {
    return error(Code::kInvalidArgument, "tensor name of ", spec.name.size(),
                 " bytes is longer than the limit of ", TensorRegistry::kMaxNameLength);
  }
  // Names must survive a checkpoint: safetensors headers are JSON (UTF-8 strings), and
  // "__metadata__" is the format's own key.
  if (!valid_utf8(spec.name)) {
    return error(Code::kInvalidArgument, "tensor name is not valid UTF-8");
  }
  if (spec.name == "__metadata__") {
    return error(Code::kInvalidArgument,
                 "tensor name \"__metadata__\" is reserved (safetensors' metadata key)");
  }
  if (!valid_dtype(static_cast<int32_t>(spec.dtype))) {
    return error(Code::kInvalidArgument, "tensor '", spec.name, "': unknown dtype ",
                 static_cast<int32_t>(spec.dtype));
  }
  if (!valid_role(static_cast<int32_t>(spec.role))) {
    return error(Code::kInvalidArgument, "tensor '", spec.name, "': unknown role ",
                 static_cast<int32_t>(spec.role));
  }
  if (!valid_tier(static_cast<int32_t>(spec.home))) {
    return error(Code::kInvalidArgument, "tensor '", spec.name, "': unknown home tier ",
                 static_cast<int32_t>(spec.home));
  }
  if (spec.shape.size() > TensorRegistry::kMaxNdim) {
    return error(Code::kInvalidArgument, "tensor '", spec.name, "': ", spec.shape.size(),
                 " dimensions, at most ", TensorRegistry::kMaxNdim, " are supported");
  }
  uint64_t bytes = dtype_size(spec.dtype);
  for (std::size_t i = 0; i < spec.shape.size(); ++i) {
    const int64_t dim = spec.shape[i];
    if (dim < 0) {
      return error(Code::kInvalidArgument, "tensor '", spec.name, "': dimension ", i,
                   " is negative (", dim, ")");
    }
    if (dim != 0 && bytes > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(dim)) {
      return error(Code::kInvalidArgument, "tensor '", spec.name, "': byte size overflows 64 bits");
    }
    bytes *= static_cast<uint64_t>(dim);
  }
  *nbytes = bytes;
  return Status::ok();
}

Status TensorRegistry::add(TensorSpec spec, uint64_t nbytes, Tier tier, uint64_t offset,
                           TensorId* id) {
  if (by_name_.count(spec.name) != 0) {
    return error(Code::kAlreadyExists, "a tensor named '", spec.name, "' is already registered");
  }
  auto record = std::make_unique<TensorRecord>();
  record->id = next_id.fetch_add(1, std::memory_order_relaxed);
  record->nbytes = nbytes;
  record->tier = tier;
  record->offset = offset;
  record->spec = std::move(spec);
  *id = record->id;
  by_name_.emplace(record->spec.name, record->id);
  by_id_.emplace(record->id, std::move(record));
  return Status::ok();
}

Status TensorRegistry::remove(TensorId id) {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return error(Code::kNotFound, "no tensor with handle ", id);
  by_name_.erase(it->second->spec.name);
  by_id_.erase(it);
  return Status::ok();
}

TensorRecord* TensorRegistry::find(TensorId id) {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

TensorRecord* TensorRegistry::find(std::string_view name) {
  auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? nullptr : find(it->second);
}

}  // namespace strata
