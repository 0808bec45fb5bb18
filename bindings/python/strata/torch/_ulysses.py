"""Ulysses attention (DeepSpeed-Ulysses, arXiv 2309.14509) as a transformers attention function
(strata.torch._context_parallel has the design): q, k, v of this rank's shard of the sequence,
[batch, heads, shard, dim], become the whole sequence for 1/size of the heads through one
all-to-all each (torch's functional collective, which autograd differentiates: its backward is
the reverse all-to-all), Hugging Face's SDPA attention runs causally on them, and one all-to-all
brings the output back to the shard's tokens for every head.

Grouped-query attention: where the key/value heads divide by the group size, each rank gets
the key/value heads of its query heads (query head i reads key/value head i // (heads / kv
heads), so contiguous blocks of both line up); where they do not, the key/value heads are
repeated to one per query head first (repeat_kv, what eager attention does), more bytes on the
wire for the same result.

The forward on fake tensors that strata.torch runs to measure a block's activations
(strata.torch._measure) cannot take part in a collective: there the all-to-all is replaced by a
copy of the same shape (an all-to-all's output has its input's shape), so the measured sizes
are those of the real step."""


try:
    from torch.distributed import _functional_collectives as funcol
except ImportError:  # a torch built without distributed support
    funcol = None

ATTENTION = "strata_ulysses"


class ContextParallelError(ValueError):
    """A model, configuration or batch that context parallelism cannot train correctly."""


def _exchange(x, group):
    """all_to_all_single over dim 0 of x ([size, ...]), differentiable; a copy on fake tensors."""
    from torch._subclasses.fake_tensor import is_fake

    x = x.contiguous()
    if is_fake(x):
        return x.clone()
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, None, None, group))


def _to_heads(x, size, group):
    """[b, h, s, d] sharded by sequence -> [b, h/size, size*s, d] sharded by head."""
    b, h, s, d = x.shape
    x = x.reshape(b, size, h // size, s, d).transpose(0, 1)  # chunk j of the heads to rank j
    x = _exchange(x, group)  # [size (source rank = sequence shard), b, h/size, s, d]
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _to_sequence(x, size, group):
    """[b, s_all, h/size, d] (SDPA's output layout) -> [b, s_all/size, h, d]."""
    b, total, h, d = x.shape
    s = total // size
    x = x.reshape(b, size, s, h, d).transpose(0, 1)  # shard j of the sequence to rank j
    x = _exchange(x, group)  # [size (source rank = head chunk), b, s, h/size, d]
    return x.permute(1, 2, 0, 3, 4).reshape(b, s, size * h, d)


def _refuse_unsupported(module, kwargs, total):
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is not None and window < total:
        raise ContextParallelError(
            "strata.torch.context_parallel: sliding-window attention (window %d of a %d-token "
            "sequence) is not supported" % (window, total))
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ContextParallelError(
                "strata.torch.context_parallel: attention with %s is not supported" % name)


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function signature: q [b, h, s, d], k/v [b, kv, s, d] of this
    rank's shard; returns ([b, s, h, d], None)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    state = getattr(module, "strata_context_parallel", None)
    if state is None:
        raise ContextParallelError(
            "strata.torch.context_parallel: attention %r is selected for a module that "
            "context_parallel(model, size) did not set up" % ATTENTION)
    if attention_mask is not None:
        raise ContextParallelError(
            "strata.torch.context_parallel: attention masks are not supported (the attention is "
            "causal over the whole sequence; pass no attention_mask)")
    state.attention_calls += 1
    size, group = state.size, state.group
    heads, kv = query.shape[1], key.shape[1]
    _refuse_unsupported(module, kwargs, query.shape[2] * size)
    if size == 1:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    if heads % size:
        raise ContextParallelError(
            "strata.torch.context_parallel: %d attention heads do not divide among %d ranks"
            % (heads, size))
    if kv % size:
        key, value = repeat_kv(key, heads // kv), repeat_kv(value, heads // kv)
    query, key, value = (_to_heads(t, size, group) for t in (query, key, value))
    out, _ = sdpa_attention_forward(module, query, key, value, None, **kwargs)
    return _to_sequence(out, size, group), None


def register():
    """Registers ulysses_attention in transformers' attention registry (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)
