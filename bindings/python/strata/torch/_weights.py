"""A safetensors checkpoint as the source of an offloaded model's values (st.offload(weights=)):
a model built on the meta device gets its parameters from the file, the streamed blocks'
into Strata's pinned arena (converted to the compute dtype on the way; fp32 values also start
the fp32 master), the rest onto the device. A thread reads the next block's (or module's)
tensors while the current ones are copied, so the disk streams at its rate; host memory holds
at most two groups of tensors, never the model, and nothing is initialized only to be
overwritten.

A Hugging Face checkpoint directory works as it is: model.safetensors, or the shards that
model.safetensors.index.json lists. Names are the model's state_dict names, or for a
transformers model the names and layouts its checkpoints use, converted as from_pretrained
converts them (its conversion mapping, applied through transformers' own classes): renamings
(a vision-language model's checkpoint says `language_model.model.layers.0...` where the
module is `model.language_model.layers.0...`) and tensor conversions (a mixture of experts'
checkpoint stores one tensor per expert, `mlp.experts.0.gate_proj.weight`, where the model
has one fused 3-D `mlp.experts.gate_up_proj`: the converter stacks and concatenates a
block's experts when that parameter is read, so host memory holds one parameter's sources,
never the model's). A tied parameter (an output head sharing the embedding) needs one of its
names in the file."""

import copy
import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ._surgery import swap_data


class WeightsError(ValueError):
    """A weights= checkpoint that cannot give the model its values (missing, unreadable, of
    other shapes, or a conversion of transformers' that fails on it): the message names it
    (strata-train prints it as its error line)."""


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
                raise WeightsError("strata.torch.offload: weights=%r is a directory without "
                                 "model.safetensors or model.safetensors.index.json" % path)
        elif os.path.exists(path):
            files = [path]
        else:
            raise WeightsError("strata.torch.offload: weights=%r does not exist" % path)
        self.path = path
        self._files = []
        self._where = {}
        self._file_key = {}  # a model's name -> the file's key, where they differ (renamed)
        self._converted = {}  # a model's name -> the _Conversion that makes it from the file
        try:
            for name in files:
                handle = safe_open(name, framework="pt", device="cpu")
                self._files.append(handle)
                for key in handle.keys():
                    self._where[key] = handle
        except Exception as e:
            self.close()
            raise WeightsError("strata.torch.offload: weights=%r: %s" % (path, e)) from None

    def close(self):
        for handle in self._files:
            exit_ = getattr(handle, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._files = []

    def adopt_conversions(self, model):
        """The model's names for the file's keys that transformers renames or converts on
        loading (_mapping) find those tensors too."""
        renamed, conversions = _mapping(model, list(self._where))
        for name, key in renamed.items():
            if name not in self._where:
                self._where[name] = self._where[key]
                self._file_key[name] = key
        for conversion in conversions:
            try:
                made = conversion.shapes(self._file_shape)
            except Exception as e:
                raise WeightsError(
                    "strata.torch.offload: weights=%r: transformers' conversion of %s into %s "
                    "fails: %s" % (self.path, conversion.first_key(), conversion.first_name(),
                                   e)) from None
            for name in made:
                if name not in self._where:
                    self._converted[name] = conversion

    def find(self, names):
        """The first of `names` the checkpoint has (as it is, renamed or converted), or None."""
        for name in names:
            if name in self._where or name in self._converted:
                return name
        return None

    def _file_shape(self, key):
        return tuple(self._where[key].get_slice(self._file_key.get(key, key)).get_shape())

    def shape(self, name):
        if name in self._converted:
            return self._converted[name].shapes(self._file_shape)[name]
        return self._file_shape(name)

    def _file_tensor(self, key):
        return self._where[key].get_tensor(self._file_key.get(key, key))

    def tensor(self, names):
        """The values of the first of `names` the checkpoint has (a CPU tensor over the file's
        memory map where the dtype allows and no conversion made a new one)."""
        name = self.find(names)
        if name is None:
            raise KeyError("none of %s is in %s" % (list(names), self.path))
        if name in self._converted:
            return self._converted[name].run(self._file_tensor)[name]
        return self._file_tensor(name)


class _Conversion:
    """One of transformers' WeightConverters for one group of the model's parameters (a
    block's fused experts) with the file's keys it gathers, in the order from_pretrained
    gathers them (its dot_natural_key order: expert 2 before expert 10)."""

    def __init__(self, converter, first_name, model):
        self._converter = copy.deepcopy(converter)  # a clean one: it collects tensors
        self._first_name, self._model = first_name, model
        self._sources = []  # (the file's key, the converter's source pattern it matched)
        self._shapes = None

    def first_name(self):
        return self._first_name

    def first_key(self):
        return self._sources[0][0]

    def add(self, key, pattern):
        self._sources.append((key, pattern))

    def run(self, read):
        """{the model's name: tensor} for this group, converted by transformers' operations
        from the file's tensors that read(key) gives. (A converter that splits one tensor into
        several parameters runs once for each of them: only the MoE fusions, many to one, are
        in the mappings of the families tested.)"""
        converter = copy.deepcopy(self._converter)
        for key, pattern in self._sources:
            converter.add_tensor(self._first_name, key, pattern, functools.partial(read, key))
        # No loading_info: transformers then raises a conversion's error instead of only
        # logging it and skipping the parameter.
        return converter.convert(self._first_name, model=self._model, config=self._model.config)

    def shapes(self, file_shape):
        """{the model's name: shape} this group makes, from the file's shapes alone (the
        conversion run on meta tensors: nothing is read)."""
        if self._shapes is None:
            made = self.run(lambda key: torch.empty(file_shape(key), device="meta"))
            self._shapes = {name: tuple(t.shape) for name, t in made.items()}
        return self._shapes


def _mapping(model, keys):
    """For the checkpoint `keys` that transformers renames or converts when from_pretrained
    loads them into `model` (the model's conversion mapping: its WeightRenamings, the base
    model's prefix added or dropped, its WeightConverters): ({the model's name: the file's key}
    for the renamed ones, [_Conversion] for the converted ones). Nothing for a model that is
    not a transformers one, or a transformers without conversion mappings."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     dot_natural_key, rename_source_key)
    except ImportError:
        return {}, []
    if not isinstance(model, PreTrainedModel):
        return {}, []
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    names = dict.fromkeys(model.state_dict(), True)
    renamed, conversions = {}, {}
    for key in sorted(keys, key=dot_natural_key):
        if key in names:
            continue
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix,
                                          names)
        if name not in names:
            continue
        if pattern is None:
            if name != key:
                renamed[name] = key
        else:
            conversions.setdefault(name, _Conversion(by_pattern[pattern], name, model)).add(
                key, pattern)
    return renamed, list(conversions.values())


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
        raise WeightsError(
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
