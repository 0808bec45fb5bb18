"""strata.jax: train a JAX model whose repeated blocks stream through Strata.

    trainer = strata.jax.Trainer(block_fn, blocks, residents, embed_fn=..., loss_fn=...,
                                 optimizer=optax.adamw(3e-4),
                                 block_optimizer=strata.jax.AdamW(3e-4, weight_decay=0.1))
    for batch in batches:
        loss = trainer.step(batch)

Or inside your own jax.jit, with your loss, metrics and optax:

    trainer = strata.jax.Trainer(block_fn, blocks, block_optimizer=strata.jax.AdamW(3e-4))
    x = trainer.apply_blocks(hidden, *extras)   # differentiable: one step of the blocks

The blocks' weights live in Strata's DRAM (or NVMe). A step is one jitted XLA program in
which beginning and ending the executor's step, acquiring a block (XLA's stream waits on
Strata's loads; the weights are copied from the slot into the program) and releasing it with
its grads are XLA FFI custom calls; where that library cannot be had, a host-synchronised
loop of per-layer programs over DLPack views. The
runtime's CPU AdamW updates fp32 masters as soon as a block's grads land. The residents
(embedding, head, ...) stay on the device, trained by any optax optimizer; the loss over chunks
of tokens (strata.jax.chunked_cross_entropy) never holds the whole logits.

A Flax NNX or Equinox model whose blocks are stacked (nnx.vmap, eqx.filter_vmap):

    model, trainer = strata.jax.offload(model, "layers", block_optimizer=strata.jax.AdamW(3e-4))
    # its forward applies the stack with strata.jax.scan_blocks(self.layers, x, *extras);
    # your nnx.jit / eqx.filter_jit step trains the rest with optax, the blocks through Strata

See docs/python-guide.md and docs/python-reference.md."""
from ._data_parallel import DataParallel, DataParallelError  # noqa: F401
from ._loss import chunked_cross_entropy  # noqa: F401
from ._offload import offload, scan_blocks  # noqa: F401
from .streamed import AdamW, Trainer  # noqa: F401
