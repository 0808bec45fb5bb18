"""A safetensors checkpoint as the source of an offloaded model's values (st.offload(weights=)):
a model built on the meta device gets its parameters from the file, the streamed blocks'
into Strata's pinned arena (converted to the compute dtype on the way; fp32 values also start
the fp32 master), the rest onto the device. A thread reads the next block's (or module's)
tensors while the current ones are copied, so the disk streams at its rate; host memory holds
at most two groups of tensors, never the model, and nothing is initialized only to be
overwritten.

A Hugging Face checkpoint directory works as it is: model.safetensors, or the shards that
model.safetensors.index.json lists. Names are the model's state_dict names, or for a
transformers model the names its checkpoints use where transformers renames them on loading
(its conversion mapping's renamings, as from_pretrained applies them: a vision-language
model's checkpoint says `language_model.model.layers.0...` where the module is
`model.language_model.layers.0...`); its tensor conversions (fused or split tensors) are not
renamings and are not applied. A tied parameter (an output head sharing the embedding) needs
one of its names in the file."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ._surgery import swap_data


class SafetensorsWeights:
    """Read-only access to the tensors of one or more safetensors files, by name."""

    def __init__(self, path):
        from safetensors import safe_open
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            single = os.path.join(path, "model.safetensors")
            if os.path.exists(index):
                with open(index) as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
                files = [os.path.join(path, name) for name in files]
            elif os.path.exists(single):
                files = [single]
            else:
                raise ValueError("strata.torch.offload: weights=%r is a directory without "
                                 "model.safetensors or model.safetensors.index.json" % path)
        elif os.path.exists(path):
            files = [path]
        else:
            raise ValueError("strata.torch.offload: weights=%r does not exist" % path)
        self.path = path
        self._files = []
        self._where = {}
        self._file_key = {}  # a model's name -> the file's key, where they differ (renamed)
        try:
            for name in files:
                handle = safe_open(name, framework="pt", device="cpu")
                self._files.append(handle)
                for key in handle.keys():
                    self._where[key] = handle
        except Exception as e:
            self.close()
            raise ValueError("strata.torch.offload: weights=%r: %s" % (path, e)) from None

    def close(self):
        for handle in self._files:
            exit_ = getattr(handle, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._files = []

    def adopt_renamings(self, model):
        """The model's names for the file's keys that transformers renames on loading
        (_renamings) find those tensors too."""
        for name, key in _renamings(model, list(self._where)).items():
            if name not in self._where:
                self._where[name] = self._where[key]
                self._file_key[name] = key

    def find(self, names):
        """The first of `names` the checkpoint has, or None."""
        for name in names:
            if name in self._where:
                return name
        return None

    def shape(self, name):
        return tuple(self._where[name].get_slice(self._file_key.get(name, name)).get_shape())

    def tensor(self, names):
        """The values of the first of `names` the checkpoint has (a CPU tensor over the file's
        memory map where the dtype allows)."""
        name = self.find(names)
        if name is None:
            raise KeyError("none of %s is in %s" % (list(names), self.path))
        return self._where[name].get_tensor(self._file_key.get(name, name))


def _renamings(model, keys):
    """{the model's name: the file's key} for the checkpoint `keys` that transformers renames
    to another of the model's state_dict names when from_pretrained loads them (the model's
    conversion mapping: its WeightRenamings, the base model's prefix added or dropped); keys a
    WeightConverter transforms (fused or split tensors) are left out. Empty for a model that
    is not a transformers one, or a transformers without conversion mappings."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     rename_source_key)
    except ImportError:
        return {}
    if not isinstance(model, PreTrainedModel):
        return {}
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    names = dict.fromkeys(model.state_dict(), True)
    found = {}
    for key in keys:
        if key in names:
            continue
        name, converted = rename_source_key(key, renamings, converters,
                                            model.base_model_prefix, names)
        if converted is None and name != key and name in names:
            found[name] = key
    return found


def check_covers(weights, model):
    """Every parameter of `model` (under one of its names) and every persistent buffer still on
    the meta device must be in `weights` with its shape: else a ValueError that lists what is
    missing or mismatched (nothing is changed before this check)."""
    names = names_by_tensor(model)
    missing, mismatched = [], []
    for p in unique_parameters(model):
        found = weights.find(names[id(p)])
        if found is None:
            missing.append(names[id(p)][0])
        elif weights.shape(found) != tuple(p.shape):
            mismatched.append("%s: %s in the file, %s in the model"
                              % (found, list(weights.shape(found)), list(p.shape)))
    for module_name, m in model.named_modules():
        for name, b in m.named_buffers(recurse=False):
            if b.is_meta and name not in m._non_persistent_buffers_set:
                full = module_name + "." + name if module_name else name
                if weights.find([full]) is None:
                    missing.append(full)
    if missing or mismatched:
        raise ValueError(
            "strata.torch.offload: weights=%r does not fit the model: %s%s; nothing was changed"
            % (weights.path,
               "missing %d: %s" % (len(missing), ", ".join(missing[:8]) +
                                   (", ..." if len(missing) > 8 else "")) if missing else "",
               ("; " if missing else "") + "shapes differ: " + "; ".join(mismatched[:8])
               if mismatched else ""))


def names_by_tensor(model):
    """id(parameter or buffer) -> every name the model gives it (tied ones have several)."""
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for n, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), []).append(n)
    return names


def unique_parameters(model):
    return list({id(p): p for p in model.parameters()}.values())


class Prefetcher:
    """Reads the tensors of the next group (a block's, a module's parameters) on a thread while
    the caller writes the current group's: the file's reads overlap the copies into the arena
    and onto the device (which release the GIL). Two groups' values in memory at most."""

    def __init__(self, weights, names, groups):
        self._weights, self._names, self._groups = weights, names, groups
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-weights")
        self._next, self._future = 0, None
        self._submit()

    def _submit(self):
        self._future = None
        if self._next < len(self._groups):
            group = self._groups[self._next]
            # clone(): safetensors hands out tensors over the file's memory map, whose pages
            # are read when first touched; touching them here is the read ahead.
            self._future = self._pool.submit(
                lambda: [self._weights.tensor(self._names[id(t)]).clone() for t in group])
            self._next += 1

    def next(self):
        """The next group's values, in order (a read's error is raised here)."""
        values = self._future.result()
        self._submit()
        return values

    def close(self):
        self._pool.shutdown(wait=True, cancel_futures=True)


@torch.no_grad()
def load_module(module, device, weights, names, values=None):
    """`module`'s own parameters get their values from `weights` on `device` (a meta one gets
    storage there; the parameters stay the same objects), and so do its persistent buffers
    still on the meta device (its non-persistent ones are rebuilt by the caller). values: the
    parameters' values already read (a Prefetcher's), in parameters() order."""
    for k, p in enumerate(module.parameters(recurse=False)):
        read = weights.tensor(names[id(p)]) if values is None else values[k]
        # To the device in the file's dtype, converted there: a bf16 file for an fp32 model
        # would otherwise be widened on the CPU and copied at twice the bytes.
        read = read.to(device=device, copy=True).to(dtype=p.dtype)
        if p.is_meta:
            swap_data(p, read)
        else:
            p.data = read
    load_buffers(module, device, weights, names)


@torch.no_grad()
def load_buffers(module, device, weights, names):
    """`module`'s own persistent buffers still on the meta device, from `weights`."""
    for name, b in list(module.named_buffers(recurse=False)):
        if b.is_meta and name not in module._non_persistent_buffers_set:
            module._buffers[name] = weights.tensor(names[id(b)]).to(device=device, dtype=b.dtype,
                                                                    copy=True)
