"""strata.jax.chunked_cross_entropy: the head and its cross-entropy over chunks of tokens, so a
step never holds the whole [tokens, vocab] fp32 logits (nor their grad): a jax.lax.scan over the
chunks whose body is a jax.checkpoint, so its backward pass recomputes one chunk's logits at a
time too. The chunk is the step plan's (strata.step_plan: libstrata decides it from the head's
vocabulary and hidden size); the Trainer sets it while it traces the user's loss_fn, and records
the head's shape from the calls it sees there (what the plan needs measured)."""
import contextlib
import threading

import jax
import jax.numpy as jnp

from .. import step_plan

_context = threading.local()  # .chunk: the plan's chunk; .heads: (vocab, hidden) seen


@contextlib.contextmanager
def planned(chunk_tokens=None, heads=None):
    """While tracing the user's loss: chunked_cross_entropy calls without chunk_tokens take
    `chunk_tokens` (the plan's), and each call appends its head's (vocab, hidden) to `heads`."""
    saved = getattr(_context, "chunk", None), getattr(_context, "heads", None)
    _context.chunk, _context.heads = chunk_tokens, heads
    try:
        yield
    finally:
        _context.chunk, _context.heads = saved


def default_chunk(vocab, hidden):
    """The library's chunk for a head of this shape outside a Trainer (the plan's default:
    the tokens whose fp32 logits fit its working set)."""
    return step_plan.plan_step([], vocab=vocab, hidden=hidden).loss_chunk_tokens


def _checked(hidden, weight, labels, where, chunk_tokens):
    if jnp.ndim(weight) != 2:
        raise ValueError("strata.jax.chunked_cross_entropy: the head weight must be "
                         "[hidden, vocab], got shape %s" % (jnp.shape(weight),))
    if jnp.ndim(hidden) < 1 or jnp.shape(hidden)[-1] != jnp.shape(weight)[0]:
        raise ValueError("strata.jax.chunked_cross_entropy: hidden's last axis (%s) must equal "
                         "the head weight's first ([hidden, vocab] = %s)"
                         % (jnp.shape(hidden)[-1] if jnp.ndim(hidden) else "none",
                            jnp.shape(weight)))
    if jnp.shape(labels) != jnp.shape(hidden)[:-1]:
        raise ValueError("strata.jax.chunked_cross_entropy: labels' shape %s must be hidden's "
                         "without its last axis, %s" % (jnp.shape(labels),
                                                        jnp.shape(hidden)[:-1]))
    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise TypeError("strata.jax.chunked_cross_entropy: labels must be integer class "
                        "indices, got %s" % jnp.result_type(labels))
    if where is not None and jnp.shape(where) != jnp.shape(labels):
        raise ValueError("strata.jax.chunked_cross_entropy: where's shape %s must be labels' %s"
                         % (jnp.shape(where), jnp.shape(labels)))
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or
                                     not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError("strata.jax.chunked_cross_entropy: chunk_tokens must be a positive "
                         "int, got %r" % (chunk_tokens,))


def chunked_cross_entropy(hidden, weight, labels, *, where=None, chunk_tokens=None):
    """The mean over tokens of optax.softmax_cross_entropy_with_integer_labels of the logits
    `hidden @ weight` (taken in fp32), computed chunk_tokens tokens at a time.

    hidden: [..., H] (the final norm's output); weight: the head, [H, V]; labels: integers of
    hidden's shape less its last axis; where: an optional boolean mask of labels' shape (the
    mean is over the True tokens; none: 0). chunk_tokens: None takes the Trainer's step plan
    inside Trainer.step, else the library's default for this head. The logits are formed in the
    operands' dtype and widened to fp32 before the softmax, as `(hidden @ weight).astype(f32)`
    would be. Differentiable in hidden and weight: the backward pass recomputes each chunk's
    logits (jax.checkpoint), so it never holds more than one chunk's [chunk, V] either; the
    head's grad is summed over the chunks in its own dtype. A label outside [0, vocab) that
    `where` does not mask gives NaN, as optax's does (values cannot be checked inside a jitted
    step): mask ignored positions (an ignore index such as -100) with `where`."""
    _checked(hidden, weight, labels, where, chunk_tokens)
    h, vocab = jnp.shape(weight)
    heads = getattr(_context, "heads", None)
    if heads is not None:
        heads.append((int(vocab), int(h)))
    if chunk_tokens is None:
        chunk_tokens = getattr(_context, "chunk", None) or default_chunk(vocab, h)
    x = jnp.reshape(hidden, (-1, h))
    y = jnp.reshape(labels, (-1,)).astype(jnp.int32)
    keep = jnp.ones(y.shape, bool) if where is None else jnp.reshape(where, (-1,)).astype(bool)
    tokens = x.shape[0]
    chunk = max(1, min(int(chunk_tokens), tokens))
    pad = -tokens % chunk  # the last chunk padded with masked tokens
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        y, keep = jnp.pad(y, (0, pad)), jnp.pad(keep, (0, pad))
    count = (tokens + pad) // chunk

    @jax.checkpoint
    def chunk_loss(w, xc, yc, kc):
        logits = (xc @ w).astype(jnp.float32)
        # optax.softmax_cross_entropy_with_integer_labels' formula: logsumexp less the label's.
        label = jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
        losses = jax.nn.logsumexp(logits, axis=-1) - label
        return jnp.sum(jnp.where(kc, losses, 0.0))

    def body(total, part):
        return total + chunk_loss(weight, *part), None

    parts = (x.reshape(count, chunk, h), y.reshape(count, chunk), keep.reshape(count, chunk))
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), parts)
    return total / jnp.maximum(jnp.sum(keep), 1).astype(jnp.float32)
