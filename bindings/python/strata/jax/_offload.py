"""strata.jax.offload: a Flax NNX or Equinox model's stacked blocks streamed through Strata in
one call, and scan_blocks, the one line of the model's forward that applies the stack (plainly
or streamed). Flax and Equinox are optional: each adapter is imported only for a model of its
framework, so `import strata.jax` needs neither."""
import sys

from .streamed import Trainer


class _Streamed:
    """What a model's streamed stack holds (as a static attribute; hashed by identity, so a
    jitted step is traced once per offload): the Trainer that owns the blocks' weights and
    optimizer state, and how the framework's stacked module is rebuilt from its arrays."""

    def __init__(self, trainer, rebuild):
        self.trainer, self._rebuild = trainer, rebuild

    def plain(self):
        """The stacked blocks as the framework's own module, with the trained weights (the
        compute dtype, as JAX arrays): for evaluation without Strata, saving, comparing."""
        if self.trainer.runtime._handle is None:
            raise RuntimeError(
                "strata.jax.offload: the trainer is closed (its `with trainer:` block ended), "
                "and the trained blocks went with its runtime: call plain() (or "
                "trainer.save(dir)) before it closes")
        blocks, _ = self.trainer.get_params()
        return self._rebuild(blocks)


class _StreamedCalls:
    """The members both frameworks' StreamedBlocks share (_nnx.py, _equinox.py): each is its
    framework's module whose one attribute, `streamed` (static), is a _Streamed; calling it
    applies every block in order (trainer.apply_blocks: differentiated, one training step of
    the blocks)."""

    def __call__(self, hidden, *extras):
        return self.streamed.trainer.apply_blocks(hidden, *extras)

    @property
    def trainer(self):
        return self.streamed.trainer

    def plain(self):
        """The stack as the framework's module it was, with the trained weights."""
        return self.streamed.plain()


def _make_trainer(block_fn, blocks, block_optimizer, trainer_kw):
    """The Trainer of an offloaded model: no embed_fn, loss_fn or resident optimizer (the
    user's jitted step owns the embedding, the loss and the rest's optax update), the XLA FFI
    ops required (apply_blocks, called inside that step, needs them)."""
    refused = {"embed_fn", "loss_fn", "optimizer", "residents", "ffi"} & set(trainer_kw)
    if refused:
        raise TypeError("strata.jax.offload: %s cannot be given: your own jitted step embeds, "
                        "computes the loss and updates the rest of the model with its optax; "
                        "the streamed blocks run through the XLA FFI ops" % sorted(refused))
    return Trainer(block_fn, blocks, block_optimizer=block_optimizer, ffi=True, **trainer_kw)


def _framework(model):
    """"nnx" or "equinox": the framework whose module `model` is (only a framework already
    imported can have made it)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(model, nnx.Module):
        return "nnx"
    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(model, eqx.Module):
        return "equinox"
    return None


def offload(model, blocks="layers", *, block_optimizer=None, **trainer_kw):
    """Stream the stacked blocks of a Flax NNX or Equinox model through Strata.

    model: an nnx.Module or an eqx.Module; blocks: where its stacked blocks are (a module
    whose parameters carry a leading layer axis, as nnx.vmap or eqx.filter_vmap make them):
    an attribute path ("layers", "decoder.layers") or, for Equinox, a function model -> blocks
    as eqx.tree_at takes. Calling one block must be `block(hidden, *extras) -> hidden`.
    block_optimizer: a strata.jax.AdamW (the blocks' optimizer); trainer_kw: the Trainer's
    dtype, gpu_budget, host_budget, nvme, nvme_budget, state_placement (the NVMe tier: the
    library places the blocks' weights and optimizer state, as for the Trainer), backend,
    slot_budget, scan.

    Returns (model, trainer). The model's stack is replaced by a streamed one (an NNX model is
    changed in place and returned; an Equinox model is returned anew) that holds no arrays:
    the weights and optimizer state of the blocks live in Strata, owned by `trainer` (close it
    when done; trainer.save/load checkpoints them). Apply the stack in the model's forward
    with strata.jax.scan_blocks(self.layers, x, *extras) (the framework's own scan on a plain
    stack), make the optax optimizer of the rest (embedding, norms, head) after offload, and
    train with your own nnx.jit / eqx.filter_jit step: each differentiated call is one
    training step of the blocks, whose grads go to Strata's AdamW (docs/python-guide.md)."""
    framework = _framework(model)
    if framework == "nnx":
        from . import _nnx
        return _nnx.offload(model, blocks, block_optimizer, trainer_kw)
    if framework == "equinox":
        from . import _equinox
        return _equinox.offload(model, blocks, block_optimizer, trainer_kw)
    raise TypeError("strata.jax.offload: the model is a %s, not a Flax NNX module (flax.nnx."
                    "Module) nor an Equinox module (equinox.Module); for a model given as "
                    "functions and pytrees use strata.jax.Trainer" % type(model).__name__)


def scan_blocks(layers, hidden, *extras):
    """The stacked blocks applied in order: layers(hidden, *extras) where offload streamed
    them, else the framework's own scan over the stack (nnx.scan over an NNX module; for
    Equinox, jax.lax.scan over the eqx.partition'ed arrays), each block called as
    block(hidden, *extras). The one line a model's forward needs to run both ways."""
    if isinstance(getattr(layers, "streamed", None), _Streamed):
        return layers(hidden, *extras)
    framework = _framework(layers)
    if framework == "nnx":
        from . import _nnx
        return _nnx.scan(layers, hidden, extras)
    if framework == "equinox":
        from . import _equinox
        return _equinox.scan(layers, hidden, extras)
    raise TypeError("strata.jax.scan_blocks: the blocks are a %s, not a stacked Flax NNX or "
                    "Equinox module, nor one strata.jax.offload streams"
                    % type(layers).__name__)
