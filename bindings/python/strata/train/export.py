"""strata-train's export: the trained model as a directory AutoModelForCausalLM.from_pretrained
loads (config.json, safetensors shards with their index, the tokenizer), written block by block
from Strata's tiers: each streamed block's weights are read with that block's own state_dict()
(strata.torch's hooks read them from Strata onto the CPU; collective under data parallelism),
the resident parameters from the device, and a shard is written whenever the tensors gathered
reach the shard size. Host memory holds at most one shard and one block, never the model.

The shard files are named as transformers names them (model-00001-of-0000N.safetensors and
model.safetensors.index.json; model.safetensors when one is enough). The greedy cut is written
here: huggingface_hub's split_torch_state_dict_into_shards wants every tensor up front."""

import json
import os
import shutil

import torch


def _blocks_by_name(model):
    """(prefix, block) of every streamed block, in the model's order."""
    ids = {id(b) for b in model.strata.blocks}
    return [(name, m) for name, m in model.named_modules() if id(m) in ids]


def _resident_tensors(model, blocks):
    """The parameters and persistent buffers outside the streamed blocks, by name (tied ones
    once, under their first name, as save_pretrained writes them)."""
    inside = {id(t) for _, b in blocks for t in list(b.parameters()) + list(b.buffers())}
    out = {}
    for name, p in model.named_parameters():
        if id(p) not in inside:
            out[name] = p
    for module_name, module in model.named_modules():
        for name, b in module.named_buffers(recurse=False):
            if id(b) not in inside and name not in module._non_persistent_buffers_set:
                out[module_name + "." + name if module_name else name] = b
    return out


def _groups(model):
    """The tensors to write, one group at a time (the residents, then each block): a generator,
    so one block's values are in host memory at a time."""
    blocks = _blocks_by_name(model)
    yield {name: t.detach().to("cpu", copy=True) for name, t in
           _resident_tensors(model, blocks).items()}
    for prefix, block in blocks:
        yield block.state_dict(prefix=prefix + ".")


class ShardWriter:
    """Tensors in, safetensors shards of at most `max_bytes` out (a tensor larger than that is
    a shard of its own), then their final names and the index."""

    def __init__(self, directory, max_bytes, dtype):
        self.directory, self.max_bytes, self.dtype = directory, max_bytes, dtype
        self.pending, self.pending_bytes, self.written = {}, 0, []  # written: [[names]]
        self.total = 0

    def add(self, name, tensor):
        if tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        tensor = tensor.contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total += size

    def flush(self):
        from safetensors.torch import save_file
        if not self.pending:
            return
        save_file(self.pending, self._temporary(len(self.written)), metadata={"format": "pt"})
        self.written.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def _temporary(self, k):
        return os.path.join(self.directory, "shard-%05d.partial" % k)

    def finish(self):
        self.flush()
        n = len(self.written)
        if n == 1:
            os.replace(self._temporary(0), os.path.join(self.directory, "model.safetensors"))
            return
        weight_map = {}
        for k, names in enumerate(self.written):
            final = "model-%05d-of-%05d.safetensors" % (k + 1, n)
            os.replace(self._temporary(k), os.path.join(self.directory, final))
            weight_map.update({name: final for name in names})
        with open(os.path.join(self.directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f,
                      indent=2, sort_keys=True)


def parse_size(text):
    from huggingface_hub.serialization._base import parse_size_to_int
    return parse_size_to_int(text) if isinstance(text, str) else int(text)


@torch.no_grad()
def export(model, directory, tokenizer=None, shard_size="2GB", write=True):
    """Write `model` (offloaded) to `directory` for from_pretrained. Under data parallelism every
    rank calls it (the blocks' reads are collective) and only the rank with write=True writes.
    The weights are written in the compute dtype (config.json's dtype says which)."""
    dtype = model.strata.dtype
    writer = None
    if write:
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.makedirs(directory)
        writer = ShardWriter(directory, parse_size(shard_size), dtype)
    for group in _groups(model):
        if writer is not None:
            for name, tensor in group.items():
                writer.add(name, tensor)
    if writer is None:
        return
    writer.finish()
    model.config.dtype = dtype
    model.config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def compare_logits(model, directory, batch):
    """The largest absolute difference between the logits of `model` (Strata's) and of the
    export reloaded with from_pretrained, on `batch` (loads the whole model in host memory)."""
    from transformers import AutoModelForCausalLM
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=model.strata.dtype)
    reloaded.to(model.strata.device).eval()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = batch["input_ids"].to(model.strata.device)
            mask = batch["attention_mask"].to(model.strata.device)
            ours = model(input_ids=ids, attention_mask=mask).logits.float()
            theirs = reloaded(input_ids=ids, attention_mask=mask).logits.float()
    finally:
        model.train(was_training)
    keep = mask.bool()
    return (ours[keep] - theirs[keep]).abs().max().item()
