"""StreamedTrainer: the Llama-style model of llama_zoo.jax_llama through strata.jax.Trainer, with
the residents' fp32 masters trained by PyTorch's AdamW arithmetic in JAX (no optax needed)."""
import jax
import jax.numpy as jnp
import numpy as np
from strata.jax import AdamW, Trainer, chunked_cross_entropy

from . import jax_llama as models


class TorchAdamW:
    """An optax-style GradientTransformation (init/update) computing PyTorch's AdamW
    (models.adamw: decay as p - p*lr*wd) on fp32 arrays; lr a float or a schedule."""

    def __init__(self, learning_rate=1e-3, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8):
        self.learning_rate, self.weight_decay = learning_rate, weight_decay
        self.b1, self.b2, self.eps = b1, b2, eps

    def init(self, params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return {"m": zeros, "v": jax.tree_util.tree_map(jnp.zeros_like, params),
                "count": jnp.zeros((), jnp.int32)}

    def update(self, grads, state, params):
        t = state["count"] + 1
        lr = self.learning_rate(state["count"]) if callable(self.learning_rate) \
            else self.learning_rate
        out = jax.tree_util.tree_map(
            lambda p, g, m, v: models.adamw(p, g.astype(p.dtype), m, v, t, lr, self.b1, self.b2,
                                            self.eps, self.weight_decay),
            params, grads, state["m"], state["v"])
        pick = lambda i: jax.tree_util.tree_map(  # noqa: E731
            lambda o: o[i], out, is_leaf=lambda o: isinstance(o, tuple))
        updates = jax.tree_util.tree_map(jnp.subtract, pick(0), params)
        return updates, {"m": pick(1), "v": pick(2), "count": t}


class StreamedTrainer(Trainer):
    """config: llama_zoo.LlamaConfig; blocks, residents: as models.init_params returns (the
    blocks are copied into Strata and the host copies may be dropped). dtype: the compute dtype
    of the streamed weights and of the residents' working copies (fp32 masters either way).
    lr, weight_decay: floats or schedules (callables of the step). backend: "cuda" or "host"
    (default: cuda when JAX's default device is a GPU). ffi, scan, step_memory: as
    strata.jax.Trainer's. The head's loss is strata.jax.chunked_cross_entropy over the step
    plan's chunk (models.head_loss's value, never the whole fp32 logits), and the blocks keep
    their tagged products and attention (models.SAVED_NAMES) where the plan says so.
    data_parallel: as strata.jax.Trainer's (under jax.distributed, each process's rows).
    step(ids) takes token ids (batch, seq)."""

    def __init__(self, config, blocks, residents, lr=1e-3, weight_decay=0.0, dtype=jnp.float32,
                 gpu_budget=None, host_budget=None, nvme=None, backend=None, threads=0,
                 slot_budget=0, ffi=None, scan=None, step_memory=None, data_parallel=None):
        self.config = config
        dtype = jnp.dtype(dtype)

        def embed_fn(r, ids):
            return r["embed"].astype(dtype)[ids], models.rotary(config, ids.shape[1], dtype)

        def block_fn(p, x, cos, sin):
            return models.block_forward(config, p, x, cos, sin)

        def loss_fn(r, x, ids):
            y = models.rms_norm(x, r["norm"].astype(dtype), config.rms_norm_eps)
            return chunked_cross_entropy(y[:, :-1], r["head"].astype(dtype), ids[:, 1:])

        block_optimizer = AdamW(lr, weight_decay=weight_decay, threads=threads)
        block_optimizer.hyper(0, 0)  # a clear error for a rate that is neither float nor schedule
        # Any sequence stays as given (llama_zoo.jax_llama.LazyBlocks builds each block when
        # the Trainer reads it); an iterator becomes a list.
        if not (hasattr(blocks, "__getitem__") and hasattr(blocks, "__len__")):
            blocks = list(blocks)
        super().__init__(block_fn, blocks,
                         {k: jnp.asarray(v, jnp.float32) for k, v in residents.items()},
                         embed_fn=embed_fn, loss_fn=loss_fn,
                         optimizer=TorchAdamW(lr, weight_decay),
                         block_optimizer=block_optimizer,
                         dtype=dtype, gpu_budget=gpu_budget, host_budget=host_budget, nvme=nvme,
                         backend=backend, slot_budget=slot_budget, ffi=ffi, scan=scan,
                         stacked=False, step_memory=step_memory,
                         saved_names=models.SAVED_NAMES, data_parallel=data_parallel)

    def step(self, ids):
        """One training step on token ids (batch, seq); returns the loss (a float)."""
        return super().step(jnp.asarray(ids))
