"""A safetensors checkpoint as the source of an offloaded model's values (st.offload(weights=)):
a model built on the meta device gets its parameters from the file, the streamed blocks'
straight into Strata's pinned arena (each tensor read from the file's memory map and copied
once, converted to the compute dtype on the way; fp32 values also start the fp32 master), the
rest onto the device. Host memory never holds the model as torch tensors, and nothing is
initialized only to be overwritten.

A Hugging Face checkpoint directory works as it is: model.safetensors, or the shards that
model.safetensors.index.json lists. Names are the model's state_dict names; a tied parameter
(an output head sharing the embedding) needs one of its names in the file."""

import json
import os

import torch


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

    def find(self, names):
        """The first of `names` the checkpoint has, or None."""
        for name in names:
            if name in self._where:
                return name
        return None

    def shape(self, name):
        return tuple(self._where[name].get_slice(name).get_shape())

    def tensor(self, names):
        """The values of the first of `names` the checkpoint has (a CPU tensor over the file's
        memory map where the dtype allows)."""
        name = self.find(names)
        if name is None:
            raise KeyError("none of %s is in %s" % (list(names), self.path))
        return self._where[name].get_tensor(name)


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


@torch.no_grad()
def load_module(module, device, weights, names):
    """`module`'s own parameters get their values from `weights` on `device` (a meta one gets
    storage there; the parameters stay the same objects), and so do its persistent buffers
    still on the meta device (its non-persistent ones are rebuilt by the caller)."""
    for p in module.parameters(recurse=False):
        values = weights.tensor(names[id(p)])
        if p.is_meta:
            attrs = dict(p.__dict__)
            torch.utils.swap_tensors(p, torch.nn.Parameter(
                values.to(device=device, dtype=p.dtype, copy=True), p.requires_grad))
            p.__dict__.update(attrs)
        else:
            p.data = values.to(device=device, dtype=p.dtype, copy=True)
    load_buffers(module, device, weights, names)


@torch.no_grad()
def load_buffers(module, device, weights, names):
    """`module`'s own persistent buffers still on the meta device, from `weights`."""
    for name, b in list(module.named_buffers(recurse=False)):
        if b.is_meta and name not in module._non_persistent_buffers_set:
            module._buffers[name] = weights.tensor(names[id(b)]).to(device=device, dtype=b.dtype,
                                                                    copy=True)
