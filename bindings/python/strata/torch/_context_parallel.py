"""Context (sequence) parallelism for Hugging Face causal LMs (issue 53 item 2): one sequence
split along its length over the ranks of a context-parallel group, composed with strata.torch's
data parallelism. docs/architecture.md, "Context parallel", has the design.

The world is data-parallel groups x context-parallel groups: `size` consecutive ranks (rank r is
shard r % size of the sequence of data-parallel group r // size) hold one sequence, each its
contiguous shard of the tokens. Everything but attention is per token, so each rank runs the
model on its shard alone; attention is Ulysses' (DeepSpeed-Ulysses, arXiv 2309.14509): q, k
and v of the shard go through one all-to-all each to become all of the sequence for 1/size of
the heads, Hugging Face's own SDPA attention runs on them (causal, no mask tensor), and one
all-to-all brings the output back to the shard's tokens for every head. The function is
registered in transformers' attention registry (AttentionInterface) and chosen by
model.config._attn_implementation, so no model class is patched; the mask registry has no entry
for it, so Hugging Face builds no mask (attention is causal over the whole sequence; padding
masks are not supported). Position ids are the tokens' global positions, from which the model
builds its rotary embedding per shard.

The loss: each rank's labels are the sequence's labels shifted once, globally (the label of a
shard's last token is the next shard's first token), passed as Hugging Face's shift_labels; its
token losses are summed and divided by num_items_in_batch = (the sequence's label count) / size.
The rank's loss is thus size x its share of the sequence's mean, so the sum of the group's grads
is size x the sequence's grad, and strata.torch's data-parallel mean over all data x context
ranks is exactly the mean over the data-parallel groups of their sequences' grads: the
one-process grad of the whole batch. full_loss() gives the sequence's loss for reporting.
"""

import copy

import torch

try:
    import torch.distributed as dist
except ImportError:  # a torch built without distributed support
    dist = None

from ._ulysses import ATTENTION, ContextParallelError, register

IGNORE_INDEX = -100
# Layer kinds of hybrid models (transformers' config.layer_types) that are not softmax
# attention through the registry; a sharded sequence would silently change what they compute.
_ATTENTION_LAYERS = ("full_attention",)


class ContextParallel:
    """What st.context_parallel(model, size) returns: the rank's place in the data x context
    mesh, the batch sharding and the loss for reporting.

    size: ranks per sequence; group: the context-parallel process group of this rank;
    rank: this rank's shard index in it; data_rank / data_world: this rank's data-parallel
    group and their number (feed data_rank's slice of the global batch to shard())."""

    def __init__(self, size, group, rank, data_rank, data_world):
        self.size = size
        self.group = group
        self.rank = rank
        self.data_rank = data_rank
        self.data_world = data_world
        self.attention_calls = 0  # in the model's current forward pass (_ulysses counts)

    def shard(self, input_ids, labels=None, position_ids=None, ignore_index=IGNORE_INDEX):
        """This rank's shard of a batch of whole sequences ([batch, seq]), as model(**shard)
        keywords: input_ids, position_ids (global), labels and shift_labels (the sequence's
        labels shifted once, globally; labels None: input_ids) and num_items_in_batch (the
        group's label count / size). A sequence length not divisible by size is padded at the
        end (ignored labels; causal attention keeps them out of every real token's output)."""
        if input_ids.dim() != 2:
            raise ContextParallelError(
                "strata.torch.context_parallel: shard() takes input_ids of shape [batch, seq] "
                "(got %s)" % (tuple(input_ids.shape),))
        labels = input_ids if labels is None else labels
        if labels.shape != input_ids.shape:
            raise ContextParallelError(
                "strata.torch.context_parallel: labels %s do not match input_ids %s"
                % (tuple(labels.shape), tuple(input_ids.shape)))
        rows, seq = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device)
        position_ids = position_ids.expand(rows, seq)  # [seq] and [1, seq] serve every row
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
        count = int((shifted != ignore_index).sum())
        if count == 0:
            raise ContextParallelError(
                "strata.torch.context_parallel: the batch has no label to learn from")
        pad = -seq % self.size
        if pad:
            last = position_ids[:, -1:]
            steps = torch.arange(1, pad + 1, device=position_ids.device)
            input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=0)
            shifted = torch.nn.functional.pad(shifted, (0, pad), value=ignore_index)
            position_ids = torch.cat([position_ids, last + steps], dim=1)
        length = (seq + pad) // self.size
        mine = slice(self.rank * length, (self.rank + 1) * length)
        local = shifted[:, mine].contiguous()
        return {"input_ids": input_ids[:, mine].contiguous(),
                "position_ids": position_ids[:, mine].contiguous(),
                "labels": local, "shift_labels": local,
                "num_items_in_batch": torch.tensor(count / self.size, dtype=torch.float64)}

    def full_loss(self, loss):
        """The sequence's loss (a float) from this rank's loss: the group's sum / size (a
        collective: every rank of the group calls it)."""
        total = loss.detach().to(torch.float64).reshape(1).clone()
        if self.size > 1:
            dist.all_reduce(total, group=self.group)
        return total.item() / self.size


def _heads(config):
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    return text, heads, kv


def _check_model(model, size):
    config = model.config
    text, heads, kv = _heads(config)
    if heads is None:
        raise ContextParallelError(
            "strata.torch.context_parallel: the model's config names no num_attention_heads; "
            "only Hugging Face causal LMs are supported")
    if heads % size:
        raise ContextParallelError(
            "strata.torch.context_parallel: %d attention heads do not divide among %d "
            "context-parallel ranks (Ulysses gives each rank whole heads)" % (heads, size))
    kinds = set(getattr(text, "layer_types", None) or ())
    other = sorted(kinds.difference(_ATTENTION_LAYERS))
    if other:
        raise ContextParallelError(
            "strata.torch.context_parallel: the model has %s layers, which the attention "
            "registry does not cover (only full causal attention is sharded); a sharded "
            "sequence would change what they compute" % ", ".join(other))
    if getattr(text, "is_causal", True) is False:
        raise ContextParallelError(
            "strata.torch.context_parallel: the model's attention is not causal")


def _check_world(size):
    """The process group this needs, and a world that size divides (checked before the
    model's shape: the world is what a wrong size most often misses)."""
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise ContextParallelError(
            "strata.torch.context_parallel: torch.distributed is not initialized (run under "
            "torchrun and call torch.distributed.init_process_group first)")
    world = dist.get_world_size()
    if world % size:
        raise ContextParallelError(
            "strata.torch.context_parallel: a world of %d ranks is not a multiple of "
            "size=%d" % (world, size))


def _groups(size):
    """(this rank's context-parallel group, its index in it, data rank, data world)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, size):  # every rank creates every group, as torch requires
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return mine, rank % size, rank // size, world // size


def context_parallel(model, size):
    """Train `model` (a Hugging Face causal LM) with each sequence split over `size` ranks:
    registers Ulysses attention in transformers' AttentionInterface and selects it for the
    model, and returns a ContextParallel (its shard() cuts each batch). Call it on every rank,
    after torch.distributed.init_process_group, before or after st.offload(model). Refused:
    heads that do not divide by size, layers other than full causal attention (linear,
    sliding-window, hybrids), a world that is not a multiple of size, and (at its first
    forward pass) a model whose attention does not go through the registry."""
    if not isinstance(size, int) or size < 1:
        raise ContextParallelError(
            "strata.torch.context_parallel: size must be a positive integer (got %r)" % (size,))
    _check_world(size)
    _check_model(model, size)
    group, rank, data_rank, data_world = _groups(size)
    register()
    state = ContextParallel(size, group, rank, data_rank, data_world)
    _own_configs(model)
    for sub in model.modules():
        # The attention function finds its group through the module it is called for; a
        # sub-model's config (a VLM's text model) selects its own implementation.
        sub.strata_context_parallel = state
        config = getattr(sub, "config", None)
        if config is not None:
            config._attn_implementation = ATTENTION
    model.register_forward_pre_hook(_check_inputs, with_kwargs=True)
    model.register_forward_hook(_check_calls)
    return state


def _own_configs(model):
    """The model's configs copied before the attention is selected in them: a config the user
    built the model from may build others (a reference model, the next run's), which must not
    find the context-parallel attention chosen for modules it never set up. Modules sharing a
    config share its copy, and a copied config's sub-configs (a VLM's text_config) are the
    copies too."""
    copies = {}
    for sub in model.modules():
        config = getattr(sub, "config", None)
        if config is not None and id(config) not in copies:
            copies[id(config)] = copy.copy(config)
    for config in copies.values():
        for name, value in list(vars(config).items()):
            if id(value) in copies:
                setattr(config, name, copies[id(value)])
    for sub in model.modules():
        config = getattr(sub, "config", None)
        if config is not None:
            sub.config = copies[id(config)]


def _check_inputs(model, args, kwargs):
    """A forward pass of whole sequences or with a padding mask, refused before it runs: labels
    without shift_labels are not cp.shard()'s (each rank would shift its own shard and score its
    last token against nothing), and a mask is not applied (the attention is causal over the
    whole sequence, Hugging Face builds no mask for it)."""
    model.strata_context_parallel.attention_calls = 0
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ContextParallelError(
            "strata.torch.context_parallel: labels without shift_labels: feed each rank its "
            "shard, model(**cp.shard(input_ids, labels)), which shifts the labels over the "
            "whole sequence")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(torch.all(mask != 0)):
        raise ContextParallelError(
            "strata.torch.context_parallel: an attention_mask with padding is not applied (the "
            "attention is causal over the whole sequence): pack the sequences, or pad them at "
            "the end with ignored labels, and pass no attention_mask")


def _check_calls(model, args, output):
    """A model whose attention does not go through transformers' registry (a class of its own,
    a layer that reads no config) computes attention over its shard alone, silently wrong:
    refused after its first forward pass, before any backward."""
    if model.strata_context_parallel.attention_calls == 0:
        raise ContextParallelError(
            "strata.torch.context_parallel: the model's forward pass never called the %r "
            "attention: its attention does not go through transformers' attention registry "
            "(config._attn_implementation), so each rank would attend to its own shard only"
            % ATTENTION)
