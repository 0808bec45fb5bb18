"""The Llama-style decoder of llama_zoo.torch_llama in plain jax.numpy: parameters as dicts of
arrays (one per block, plus the resident embedding, final norm and head) and pure functions,
so a block can run with its weights taken from Strata's slots."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from .shapes import LlamaConfig, PRESETS, flops_per_token  # noqa: F401

BLOCK_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def init_params(config, seed=0, dtype=jnp.float32):
    """(blocks, residents): numpy arrays (host memory), normal(0.02) matrices, unit norms."""
    rng = np.random.default_rng(seed)
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = h // config.num_attention_heads * config.num_key_value_heads

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)

    blocks = []
    for _ in range(config.num_hidden_layers):
        blocks.append({"attn_norm": np.ones(h, dtype), "wq": normal(h, h), "wk": normal(h, kv),
                       "wv": normal(h, kv), "wo": normal(h, h), "mlp_norm": np.ones(h, dtype),
                       "w_gate": normal(h, i), "w_up": normal(h, i), "w_down": normal(i, h)})
    residents = {"embed": normal(v, h), "norm": np.ones(h, dtype), "head": normal(h, v)}
    return blocks, residents


class LazyBlocks:
    """The blocks as a sequence that builds block i (numpy, host memory) when indexed, from a
    generator seeded by (seed, i): strata.jax.Trainer registers listed blocks one at a time, so
    host memory holds one block beside Strata's arena (the 8B model's fp32 init would need 28
    GB more). Not init_params' values: uniform with init_params' standard deviation (0.02),
    which numpy draws several times faster than normal values (the 8B model's 7 B)."""

    def __init__(self, config, seed=0, dtype=jnp.float32):
        self.config, self.seed, self.dtype = config, seed, dtype

    def __len__(self):
        return self.config.num_hidden_layers

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        config, dtype = self.config, self.dtype
        rng = np.random.default_rng((self.seed, i))
        h, inter = config.hidden_size, config.intermediate_size
        kv = h // config.num_attention_heads * config.num_key_value_heads

        def normal(*shape):
            return _uniform(rng, shape, dtype)

        return {"attn_norm": np.ones(h, dtype), "wq": normal(h, h), "wk": normal(h, kv),
                "wv": normal(h, kv), "wo": normal(h, h), "mlp_norm": np.ones(h, dtype),
                "w_gate": normal(h, inter), "w_up": normal(h, inter), "w_down": normal(inter, h)}

    def residents(self):
        rng = np.random.default_rng((self.seed, len(self)))
        h, v = self.config.hidden_size, self.config.vocab_size
        return {"embed": _uniform(rng, (v, h), self.dtype), "norm": np.ones(h, self.dtype),
                "head": _uniform(rng, (h, v), self.dtype)}


def _uniform(rng, shape, dtype):
    """Uniform on [-a, a] with standard deviation 0.02 (a = 0.02 * sqrt(3))."""
    a = np.float32(0.02 * 3 ** 0.5)
    x = rng.random(shape, dtype=np.float32)
    x *= 2 * a
    x -= a
    return x.astype(dtype, copy=False)


def rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def rotary(config, seq, dtype):
    dim = config.hidden_size // config.num_attention_heads
    inv = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = jnp.outer(jnp.arange(seq, dtype=jnp.float32), inv)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _rotate_half(x):
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-b, a], axis=-1)


# The names block_forward tags its matrix products' and attention's outputs with: a
# jax.checkpoint policy (strata.jax.Trainer's saved_names) keeps them and recomputes the rest.
SAVED_NAMES = ("proj", "attn")


def block_forward(config, p, x, cos, sin):
    """One decoder block: x + attention(norm(x)), then + SwiGLU(norm(x)); the products' and
    attention's outputs tagged (SAVED_NAMES) for selective checkpointing."""
    y = rms_norm(x, p["attn_norm"], config.rms_norm_eps)
    q, k, v = (checkpoint_name(y @ p[w], "proj") for w in ("wq", "wk", "wv"))
    x = x + checkpoint_name(attention(config, q, k, v, cos, sin) @ p["wo"], "proj")
    y = rms_norm(x, p["mlp_norm"], config.rms_norm_eps)
    gate, up = checkpoint_name(y @ p["w_gate"], "proj"), checkpoint_name(y @ p["w_up"], "proj")
    return x + checkpoint_name((jax.nn.silu(gate) * up) @ p["w_down"], "proj")


def attention(config, q, k, v, cos, sin):
    """Causal attention of the projected q (b, t, h), k and v (b, t, kv), rotary applied: the
    heads' outputs (b, t, h), before the output projection (also llama_zoo.nnx_llama's); the
    attention's output tagged "attn" (SAVED_NAMES)."""
    b, t, h = q.shape
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = h // heads
    q = q.reshape(b, t, heads, d).transpose(0, 2, 1, 3)
    k = k.reshape(b, t, kv_heads, d).transpose(0, 2, 1, 3)
    v = v.reshape(b, t, kv_heads, d).transpose(0, 2, 1, 3)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    if kv_heads != heads:
        k = jnp.repeat(k, heads // kv_heads, axis=1)
        v = jnp.repeat(v, heads // kv_heads, axis=1)
    scores = (q @ k.transpose(0, 1, 3, 2)).astype(jnp.float32) / np.sqrt(d)
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(mask, scores, -jnp.inf)
    attn = checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(q.dtype) @ v, "attn")
    return attn.transpose(0, 2, 1, 3).reshape(b, t, h)


def head_loss(config, r, x, ids):
    """Final norm, head, next-token cross-entropy (fp32)."""
    logits = (rms_norm(x, r["norm"], config.rms_norm_eps) @ r["head"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    target = ids[:, 1:]
    return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))


def loss_fn(config, blocks, residents, ids):
    """The whole model, for plain JAX training (the reference)."""
    x = residents["embed"][ids]
    cos, sin = rotary(config, ids.shape[1], x.dtype)
    for p in blocks:
        x = block_forward(config, p, x, cos, sin)
    return head_loss(config, residents, x, ids)


def adamw(p, g, m, v, t, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    """PyTorch's AdamW on fp32 arrays (decay as p - p*lr*wd, as Strata's CPU kernel)."""
    p = p - p * (lr * wd)
    m = m + (1 - b1) * (g - m)
    v = v * b2 + (1 - b2) * g * g
    denom = jnp.sqrt(v) / jnp.sqrt(1 - b2 ** t) + eps
    return p - (lr / (1 - b1 ** t)) * m / denom, m, v
