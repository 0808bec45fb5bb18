#include "runtime/checkpoint/checkpoint.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/checkpoint/atomic_directory.h"
#include "runtime/checkpoint/safetensors.h"

namespace strata {
namespace {

// Bounce buffer for tensors not in DRAM, and the read size on load.
constexpr uint64_t kChunkBytes = 64ull << 20;
constexpr const char* kFormatVersion = "1";

struct Item {
  TensorId id = 0;
  TensorRecord record;
};

// Every registered weight, by name (a stable order, and the order of the file).
Status collect_weights(Runtime& runtime, std::vector<Item>* out) {
  for (const auto& [id, name] : runtime.tensor_names()) {
    Item item;
    item.id = id;
    if (!runtime.info(id, &item.record).is_ok()) continue;  // unregistered meanwhile
    if (item.record.spec.role == Role::kWeight) out->push_back(std::move(item));
  }
  std::sort(out->begin(), out->end(),
            [](const Item& a, const Item& b) { return a.record.spec.name < b.record.spec.name; });
  return Status::ok();
}

// The optimizer's own tensors: masters that are not the weight itself, and the state.
Status collect_state(Runtime& runtime, Optimizer& optimizer, std::vector<Item>* out) {
  for (const Optimizer::ParamView& p : optimizer.params()) {
    for (TensorId id : {p.master, p.exp_avg, p.exp_avg_sq}) {
      if (id == 0 || id == p.weight) continue;
      Item item;
      item.id = id;
      STRATA_RETURN_IF_ERROR(runtime.info(id, &item.record));
      out->push_back(std::move(item));
    }
  }
  return Status::ok();
}

std::string float_bits(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08" PRIx32, u);
  return buf;
}

Status parse_u64(const std::map<std::string, std::string>& meta, const char* key, uint64_t* out) {
  auto it = meta.find(key);
  if (it == meta.end() || it->second.empty()) {
    return error(Code::kInvalidArgument, "optimizer checkpoint metadata lacks '", key, "'");
  }
  char* end = nullptr;
  *out = std::strtoull(it->second.c_str(), &end, 10);
  if (*end != '\0') {
    return error(Code::kInvalidArgument, "optimizer checkpoint metadata '", key, "' is '",
                 it->second, "', not a number");
  }
  return Status::ok();
}

Status write_file(Runtime& runtime, const std::string& path, const std::vector<Item>& items,
                  std::map<std::string, std::string> metadata) {
  std::vector<safetensors::TensorInfo> infos;
  for (const Item& item : items) {
    safetensors::TensorInfo t;
    t.name = item.record.spec.name;
    t.dtype = item.record.spec.dtype;
    t.shape = item.record.spec.shape;
    infos.push_back(std::move(t));
  }
  std::unique_ptr<safetensors::Writer> writer;
  STRATA_RETURN_IF_ERROR(
      safetensors::Writer::create(path, std::move(infos), std::move(metadata), &writer));
  std::vector<unsigned char> bounce;
  for (const Item& item : items) {
    const TensorRecord& r = item.record;
    if (r.nbytes == 0) continue;
    // DRAM tensors are written from the arena itself; the others through a bounce buffer.
    STRATA_RETURN_IF_ERROR(runtime.pin_in_place(item.id, "checkpoint save"));
    Status s;
    TensorRecord now;
    s = runtime.info(item.id, &now);
    if (s.is_ok() && now.tier == Tier::kDram) {
      s = writer->append(runtime.tier_base(Tier::kDram) + now.offset, now.nbytes);
    } else if (s.is_ok()) {
      bounce.resize(std::min(kChunkBytes, r.nbytes));
      for (uint64_t off = 0; s.is_ok() && off < r.nbytes; off += kChunkBytes) {
        const uint64_t n = std::min(kChunkBytes, r.nbytes - off);
        s = runtime.read(item.id, off, bounce.data(), n);
        if (s.is_ok()) s = writer->append(bounce.data(), n);
      }
    }
    runtime.unpin(item.id);
    STRATA_RETURN_IF_ERROR(s);
  }
  return writer->finish();
}

// The items' names, dtypes and shapes against a file's: all or nothing.
Status match(const safetensors::Reader& file, const std::vector<Item>& items,
             std::vector<const safetensors::TensorInfo*>* found) {
  std::set<std::string> expected;
  for (const Item& item : items) {
    const TensorSpec& spec = item.record.spec;
    expected.insert(spec.name);
    const safetensors::TensorInfo* t = file.find(spec.name);
    if (t == nullptr) {
      return error(Code::kInvalidArgument, "checkpoint ", file.path(), " has no tensor '",
                   spec.name, "'");
    }
    if (t->dtype != spec.dtype || t->shape != spec.shape) {
      auto shape = [](const std::vector<int64_t>& s) {
        std::string out = "[";
        for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
        return out + "]";
      };
      return error(Code::kInvalidArgument, "checkpoint ", file.path(), ": tensor '", spec.name,
                   "' is ", safetensors::dtype_code(t->dtype), " ", shape(t->shape),
                   ", the registered one is ", safetensors::dtype_code(spec.dtype), " ",
                   shape(spec.shape));
    }
    // A tensor without its checksum would load unchecked: a damaged "crc32c." key plus flipped
    // data bytes would pass. Strata writes one for every tensor, so a missing one is refused.
    if (!file.has_checksum(*t)) {
      return error(Code::kInvalidArgument, "checkpoint ", file.path(), ": tensor '", spec.name,
                   "' has no \"crc32c.", spec.name,
                   "\" checksum entry; every tensor of a checkpoint must carry one (was the "
                   "file written by Strata, and is its metadata intact?)");
    }
    found->push_back(t);
  }
  for (const safetensors::TensorInfo& t : file.header().tensors) {
    if (expected.count(t.name) == 0) {
      return error(Code::kInvalidArgument, "checkpoint ", file.path(), " holds tensor '", t.name,
                   "', which is not registered here (", items.size(),
                   " tensors expected): is it the same model?");
    }
  }
  return Status::ok();
}

Status load_items(Runtime& runtime, const safetensors::Reader& file, const std::vector<Item>& items,
                  const std::vector<const safetensors::TensorInfo*>& infos) {
  for (std::size_t i = 0; i < items.size(); ++i) {
    const TensorId id = items[i].id;
    STRATA_RETURN_IF_ERROR(file.read_tensor(*infos[i], kChunkBytes,
                                            [&](const void* data, uint64_t offset, uint64_t bytes) {
                                              return runtime.write(id, offset, data, bytes);
                                            }));
  }
  return Status::ok();
}

// Mid-step the weights are being streamed and (attached optimizer) updated layer by layer: a
// save would mix two steps' weights, a load would be overwritten or torn by the step.
Status check_between_steps(Runtime& runtime, const char* verb) {
  const int steps = runtime.steps_in_progress();
  if (steps > 0) {
    return error(Code::kInvalidState, "cannot ", verb, " a checkpoint mid-step: ", steps,
                 " executor(s) of this runtime are between strata_step_begin and "
                 "strata_step_end; call it between steps");
  }
  return Status::ok();
}

}  // namespace

Status save_checkpoint(Runtime& runtime, Optimizer* optimizer, const std::string& path) {
  STRATA_RETURN_IF_ERROR(check_between_steps(runtime, "save"));
  runtime.wait_for_background_writers();  // every optimizer's updates, given or not
  OptimizerCounters counters;
  if (optimizer != nullptr) STRATA_RETURN_IF_ERROR(optimizer->quiesce_for_checkpoint(&counters));
  std::vector<Item> weights, state;
  STRATA_RETURN_IF_ERROR(collect_weights(runtime, &weights));
  if (weights.empty()) {
    return error(Code::kInvalidState, "checkpoint: no tensor is registered with role WEIGHT");
  }
  if (optimizer != nullptr) STRATA_RETURN_IF_ERROR(collect_state(runtime, *optimizer, &state));
  std::string staging;
  STRATA_RETURN_IF_ERROR(begin_atomic_directory(path, &staging));
  // "format": "pt" is what transformers' from_pretrained looks for.
  STRATA_RETURN_IF_ERROR(write_file(runtime, staging + "/" + kModelFile, weights,
                                    {{"format", "pt"}, {"strata.checkpoint", kFormatVersion}}));
  if (optimizer != nullptr) {
    const OptimizerConfig& c = optimizer->config();
    std::map<std::string, std::string> meta{
        {"strata.checkpoint", kFormatVersion},
        {"optimizer", kind_name(c.kind)},
        {"step", std::to_string(counters.step)},
        {"skipped_steps", std::to_string(counters.skipped_steps)},
        {"growth_tracker", std::to_string(counters.growth_tracker)},
        // The scale's bits, so the resumed run multiplies by exactly the same value.
        {"loss_scale_bits", float_bits(counters.loss_scale)},
        {"loss_scale", std::to_string(counters.loss_scale)},
    };
    if (c.explicit_updates) {
      // Explicit mode counts updates per parameter (a param without a grad is not updated, as
      // in torch.optim): each weight's count, by name.
      nlohmann::json steps = nlohmann::json::object();
      for (const Optimizer::ParamView& p : optimizer->params()) {
        TensorRecord r;
        STRATA_RETURN_IF_ERROR(runtime.info(p.weight, &r));
        steps[r.spec.name] = p.step;
      }
      meta["param_steps"] = steps.dump();
    }
    STRATA_RETURN_IF_ERROR(
        write_file(runtime, staging + "/" + kOptimizerFile, state, std::move(meta)));
  }
  return commit_atomic_directory(staging, path);
}

Status load_checkpoint(Runtime& runtime, Optimizer* optimizer, const std::string& path) {
  STRATA_RETURN_IF_ERROR(check_between_steps(runtime, "load"));
  runtime.wait_for_background_writers();  // a late update would overwrite or tear the load
  std::string dir;
  STRATA_RETURN_IF_ERROR(resolve_atomic_directory(path, &dir));
  std::unique_ptr<safetensors::Reader> model, opt_file;
  STRATA_RETURN_IF_ERROR(safetensors::Reader::open(dir + "/" + kModelFile, &model));
  std::vector<Item> weights, state;
  STRATA_RETURN_IF_ERROR(collect_weights(runtime, &weights));
  std::vector<const safetensors::TensorInfo*> weight_infos, state_infos;
  STRATA_RETURN_IF_ERROR(match(*model, weights, &weight_infos));
  OptimizerCounters counters;
  std::vector<uint64_t> param_steps;
  if (optimizer != nullptr) {
    STRATA_RETURN_IF_ERROR(safetensors::Reader::open(dir + "/" + kOptimizerFile, &opt_file));
    const auto& meta = opt_file->header().metadata;
    const char* kind = kind_name(optimizer->config().kind);
    auto it = meta.find("optimizer");
    if (it == meta.end() || it->second != kind) {
      return error(Code::kInvalidArgument, "checkpoint ", opt_file->path(), " holds ",
                   it == meta.end() ? std::string("no optimizer kind") : it->second,
                   " state; this optimizer is ", kind);
    }
    STRATA_RETURN_IF_ERROR(parse_u64(meta, "step", &counters.step));
    STRATA_RETURN_IF_ERROR(parse_u64(meta, "skipped_steps", &counters.skipped_steps));
    uint64_t tracker = 0;
    STRATA_RETURN_IF_ERROR(parse_u64(meta, "growth_tracker", &tracker));
    counters.growth_tracker = static_cast<uint32_t>(tracker);
    auto bits = meta.find("loss_scale_bits");
    uint32_t u = 0;
    if (bits == meta.end() || std::sscanf(bits->second.c_str(), "%" SCNx32, &u) != 1) {
      return error(Code::kInvalidArgument, "checkpoint ", opt_file->path(),
                   ": metadata 'loss_scale_bits' missing or malformed");
    }
    std::memcpy(&counters.loss_scale, &u, sizeof u);
    STRATA_RETURN_IF_ERROR(collect_state(runtime, *optimizer, &state));
    STRATA_RETURN_IF_ERROR(match(*opt_file, state, &state_infos));
    if (auto ps = meta.find("param_steps"); ps != meta.end()) {
      const nlohmann::json steps = nlohmann::json::parse(ps->second, nullptr, false);
      if (!steps.is_object()) {
        return error(Code::kInvalidArgument, "checkpoint ", opt_file->path(),
                     ": metadata 'param_steps' is not a JSON object");
      }
      for (const Optimizer::ParamView& p : optimizer->params()) {
        TensorRecord r;
        STRATA_RETURN_IF_ERROR(runtime.info(p.weight, &r));
        auto found = steps.find(r.spec.name);
        if (found == steps.end() || !found->is_number_unsigned()) {
          return error(Code::kInvalidArgument, "checkpoint ", opt_file->path(),
                       ": 'param_steps' has no step count for '", r.spec.name, "'");
        }
        param_steps.push_back(found->get<uint64_t>());
      }
    }
    OptimizerCounters ignored;
    STRATA_RETURN_IF_ERROR(optimizer->quiesce_for_checkpoint(&ignored, /*for_load=*/true));
  }
  // Everything checked: from here on a failure leaves the tensors partly loaded.
  Status s = load_items(runtime, *model, weights, weight_infos);
  if (s.is_ok() && optimizer != nullptr) s = load_items(runtime, *opt_file, state, state_infos);
  if (!s.is_ok()) {
    if (optimizer != nullptr) {
      optimizer->invalidate(error(s.code(), "the optimizer's state was partly loaded from ", path,
                                  " when loading failed (", s.message(),
                                  "): load a good checkpoint before stepping"));
    }
    return s;
  }
  if (optimizer != nullptr) {
    STRATA_RETURN_IF_ERROR(optimizer->restore_counters(counters, param_steps));
  }
  return Status::ok();
}

}  // namespace strata
