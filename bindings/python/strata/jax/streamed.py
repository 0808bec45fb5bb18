"""strata.jax.Trainer: train any JAX model whose repeated blocks stream through Strata.

The user gives the model as three pure functions and two pytrees:

    embed_fn(residents, batch) -> hidden | (hidden, extras)   # before the blocks
    block_fn(block_params, hidden, *extras) -> hidden          # one block, repeated
    loss_fn(residents, hidden, batch) -> scalar loss           # after the blocks

blocks: the blocks' parameters, stacked (one pytree whose leaves carry a leading layer axis,
as for jax.lax.scan) or listed (a list of pytrees of one structure); residents: any pytree of
arrays kept on the device and trained by any optax GradientTransformation. The blocks' leaves
live in Strata's DRAM (or NVMe) and are trained by Strata's CPU AdamW (strata.jax.AdamW: fp32
masters, param groups, learning rates as floats, callables or optax schedules), each block
updated as soon as its grads land. See docs/python-guide.md and docs/python-reference.md."""
import time
import warnings

import jax
import jax.numpy as jnp

from .. import core
from . import _data_parallel, _ffi
from ._checkpoint import _Checkpoints
from ._held import _HeldUpdates
from ._hostloop import _HostLoop
from ._optim import AdamW
from ._params import _Params
from ._programs import _Programs
from ._setup import _Setup
from ._stepplan import _StepPlanning
from ._tiers import _Tiers
from ._tree import _DTYPE_NAMES, _SUPPORTED


class Trainer(_Setup, _Tiers, _Programs, _StepPlanning, _HostLoop, _HeldUpdates, _Params,
              _Checkpoints):
    """Train a JAX model whose blocks stream through Strata (see the module's docstring).

    block_fn(block_params, hidden, *extras) -> hidden; blocks: stacked or listed block params
    (stacked=None decides: a list or tuple is listed, anything else stacked; with
    stacked=False any sequence is listed, and a lazy one that builds block i when indexed is
    read one block at a time, so host memory holds one block); residents: a
    pytree of arrays on the device; embed_fn(residents, batch) -> hidden or (hidden, extras);
    loss_fn(residents, hidden, batch) -> scalar. optimizer: an optax GradientTransformation for
    the residents (None: they stay frozen); block_optimizer: a strata.jax.AdamW. dtype: the
    compute dtype of the streamed weights (None: each leaf's own; float32, bfloat16 or float16;
    fp32 masters either way, initialized from fp32 values where given). backend: "cuda" or
    "host" (None: cuda when JAX's default device is a GPU). Budgets in bytes (None: from the
    model's size).

    nvme: the NVMe tier, a path or a list of paths (files, striped), as strata.torch.offload
    takes it: the library's placement (strata_placement_*, the rates measured on this
    runtime) chooses which blocks' optimizer state and, when host_budget cannot even hold
    every weight beside the grads and staging, which blocks' weights live there (staged
    through DRAM for each update; the weights streamed from NVMe); `placement` is its choice
    and placement_info() reads back where everything is. host_budget with nvme: the DRAM
    arena (None: what everything needs or 85% of the available memory, whichever is less);
    nvme_budget: the tier's bytes (None or 0: room for everything that could spill);
    state_placement: "planned" (the default with nvme: DRAM first, the rest on NVMe) or
    "nvme" (every block's state on NVMe). Budgets that cannot hold the model even with NVMe
    are refused with a ValueError naming the short one. The training is bit for bit that of
    the same trainer in DRAM.

    ffi: run each step as one XLA program whose begin and end of the executor's step and
    acquire and release of the blocks are XLA FFI custom calls (no host call inside a step;
    docs/python-reference.md). None (the default): when
    the FFI library can be built and loaded here and JAX's device matches the backend (a GPU
    with cuda, the CPU with host), else the host-synchronised loop (with a warning saying why);
    $STRATA_JAX_FFI=0 or 1 overrides None. True: required (raises if unavailable); False: the
    host-synchronised loop. scan: in the FFI program, loop over the blocks with jax.lax.scan
    (one compiled body; needs every block of one shape) rather than unrolled; None: scan when
    the blocks' shapes allow.

    Inside your own jax.jit: trainer.apply_blocks(hidden, *extras) is the streamed blocks as a
    differentiable JAX function (FFI path only), so your jitted step can embed, run the blocks,
    compute its loss and metrics and update the residents with your optax; embed_fn and
    loss_fn may then be None (step() needs them). Each differentiated call is one step of the
    blocks (their grads go to Strata's AdamW); see apply_blocks.

    Setup: block values may be numpy arrays or JAX arrays on any device; JAX arrays on the GPU
    are converted there and copied straight into Strata's pinned memory (build the model on the
    device for the fastest setup). A lazy sequence of listed blocks is indexed twice per block
    (shapes first, then values). setup_seconds says where the construction's time went, per
    phase.

    Clipping and accumulation (strata.jax.AdamW's max_grad_norm, accumulation): optax's
    MultiSteps over clip_by_global_norm and the optimizers, over blocks and residents together;
    step() is then one micro-batch, micro_step counts those towards the next update, and
    last_grad_norm is the last update's global norm (of the mean grads, before clipping).

    Any batch (the step plan, strata.step_plan: libstrata decides, this class measures and
    executes): on each batch shape's first step the trainer measures the step (one block's
    checkpoint and saved bytes, the loss head, the device; docs/python-guide.md) and the
    library plans it; `plan` is the current batch shape's StepPlan (`plans` every shape's).
    On the FFI path each block then keeps what the plan says (a jax.checkpoint policy:
    recompute from its input, or keep the outputs its block_fn names with
    jax.ad_checkpoint.checkpoint_name, saved_names) and its checkpoint waits in device or
    pinned host memory (XLA's host offload); a loss_fn calling
    strata.jax.chunked_cross_entropy runs over the plan's chunk of tokens (loss_chunk_tokens:
    the user's chunk, else the library's). step_memory: the device bytes the plan plans
    within (None: XLA's pool from the device's memory_stats; the CPU has none, so there every
    block recomputes with its checkpoint on the device unless step_memory is given).

    Several devices (data_parallel; strata.jax._data_parallel, docs/python-guide.md): one
    process per device under jax.distributed (initialize it before building the Trainer; None:
    on when there are several processes, False: off, or a strata.jax.DataParallel). Every
    process builds the Trainer alike and passes its own rows to step() (every batch leaf has
    its rows first); the step is one XLA program over every process's device (jax.shard_map):
    each block all-gathered from the ranks' chunks, its grads reduce-scattered (averaged over
    every rank) inside the program before Strata's optimizer updates them, the residents'
    grads averaged, the loss the ranks' mean. The processes of a host share one copy of the
    blocks' training state (each holds 1/shard_size of every leaf's weight, grad, master and
    moments); the residents start from rank 0's values and stay replicas. Needs the FFI path
    and step(); get_params is collective (every process calls it)."""

    def __init__(self, block_fn, blocks, residents=None, *, embed_fn=None, loss_fn=None,
                 optimizer=None, block_optimizer=None, stacked=None, dtype=None,
                 gpu_budget=None, host_budget=None, nvme=None, nvme_budget=None,
                 state_placement=None, backend=None, slot_budget=0, ffi=None, scan=None,
                 step_memory=None, saved_names=None, loss_chunk_tokens=None,
                 data_parallel=None):
        self.setup_seconds = {}
        started = time.perf_counter()
        nvme, nvme_budget = core.tier_arguments("strata.jax.Trainer", nvme, nvme_budget,
                                                state_placement)
        self._init_plan(step_memory, saved_names, loss_chunk_tokens)
        if (embed_fn is None) != (loss_fn is None):
            raise TypeError("strata.jax: give both embed_fn and loss_fn (for step()), or neither "
                            "(your own jitted step calls trainer.apply_blocks)")
        self.block_fn, self.embed_fn, self.loss_fn = block_fn, embed_fn, loss_fn
        self.block_optimizer = block_optimizer if block_optimizer is not None else AdamW()
        if not isinstance(self.block_optimizer, AdamW):
            raise TypeError("strata.jax: block_optimizer must be a strata.jax.AdamW (Strata's "
                            "CPU optimizer updates the streamed blocks); use `optimizer` for an "
                            "optax transformation of the resident parameters")
        if self.block_optimizer.holds_grads and embed_fn is None:
            raise TypeError("strata.jax: max_grad_norm and accumulation (strata.jax.AdamW) "
                            "apply in step(), which measures the residents' grads with the "
                            "blocks': give embed_fn and loss_fn (apply_blocks in your own "
                            "jitted step does not support them yet)")
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        if self.dtype is not None and self.dtype not in _DTYPE_NAMES:
            raise TypeError("strata.jax: dtype %s is not supported: streamed weights are %s"
                            % (self.dtype, _SUPPORTED))
        # This process's device (under jax.distributed, jax.devices() lists every process's).
        self.device = jax.local_devices()[0]
        self._layout = _data_parallel.resolve(data_parallel) or _data_parallel.Whole()
        self.data_parallel = self._layout if self._layout.world > 1 else None
        if backend is None:
            backend = "cuda" if self.device.platform == "gpu" else "host"
        self.stacked = not isinstance(blocks, (list, tuple)) if stacked is None else stacked
        ffi = self._ffi_choice(ffi, backend)
        if self.data_parallel is not None:
            self._refuse_data_parallel(ffi, nvme)
        if ffi is not False:
            _ffi.start_build()  # compiled (first use) while the blocks are read, runtime made
        per_layer = self._split_blocks(blocks)  # per layer, its leaves (numpy or JAX arrays)
        self.layers = len(per_layer)
        started = self._timed("check", started)
        self.scan = scan if scan is not None else all(s == self.shapes[0] for s in self.shapes)
        if self.scan and any(s != self.shapes[0] for s in self.shapes):
            raise ValueError("strata.jax: scan=True needs every block of one shape")
        hbm, dram, pinned, nvme_budget = self._budgets(gpu_budget, host_budget, nvme,
                                                       nvme_budget, state_placement)
        self.runtime = core.Runtime(backend=backend, hbm_budget=hbm, dram_budget=dram,
                                    nvme=nvme or None, nvme_budget=nvme_budget,
                                    dram_pinned=pinned,
                                    **self._layout.runtime_options(self.device, backend))
        started = self._timed("runtime", started)
        try:
            self._place(state_placement)  # with nvme: the library's choice, rates measured
            started = self._timed("placement", started)
            self._ffi = self._open_ffi(ffi)  # waits for the library's compile, if still running
            if self._ffi is None and self.data_parallel is not None:
                raise RuntimeError("strata.jax: data parallel runs the step as one XLA program "
                                   "with the FFI ops, which are unavailable here (see the "
                                   "warning above)")
        except BaseException:
            self.runtime.close()
            raise
        self._steps = 0  # the host loop's count (the FFI path counts in its session)
        self.last_grad_norm = None  # the last held update's global norm (_HeldUpdates)
        self._timed("ffi", started)
        try:
            self._register(per_layer, slot_budget)
            del per_layer
            started = time.perf_counter()
            self._init_residents(residents, optimizer)
            started = self._timed("residents", started)
            if self._ffi is not None and not self.block_optimizer.holds_grads:
                # Held updates set the hyperparameters when they update (_HeldUpdates).
                self._ffi.set_hook(self._set_hyperparameters)
            self._compile()
            self._timed("compile", started)
        except BaseException:
            if self._ffi is not None:
                self._ffi.close()
            self.runtime.close()
            raise

    @property
    def step_count(self):
        """Training steps done (a step that raised is not counted)."""
        return self._ffi.state()[0] if self._ffi is not None else self._steps

    @step_count.setter
    def step_count(self, value):
        if self._ffi is not None:
            self._ffi.set_steps(value)
        self._steps = int(value)

    def _set_hyperparameters(self, step):
        """Each group's learning rate and weight decay for the step about to begin (the
        optimizer reads them at the executor's step begin)."""
        for group in range(len(self.block_optimizer.groups) + 1):
            self.optimizer.set_group(group, *self.block_optimizer.hyper(group, step))

    def apply_blocks(self, hidden, *extras):
        """The streamed blocks applied to `hidden` (block_fn(block_i, x, *extras) for each
        block in order), as a JAX function for use inside your own jax.jit (FFI path only).

        Differentiated (jax.grad, value_and_grad, vjp of something that depends on `hidden`
        or on an inexact extra), one call is one training step of the blocks: its forward pass
        begins the executor's step and streams the blocks in, its backward pass streams them
        again, hands their grads to Strata's AdamW (which updates each block as its grads land,
        with this step's learning rate) and ends the step; grads flow back to `hidden` and to
        the inexact extras as for any JAX function. Not differentiated, it is a forward-only
        step (evaluation: nothing is updated). Call it once per step (per jitted call); the
        block params are not arguments (Strata owns them: get_params reads them). A program
        that fails mid-step leaves the step to be abandoned by the next one (its released
        grads were applied; it is not counted), as step() does."""
        if self._ffi is None:
            raise RuntimeError("strata.jax: apply_blocks needs the XLA FFI ops (this trainer "
                               "runs the host-synchronised loop: ffi=False, or the library is "
                               "unavailable); use step()")
        if self.runtime._handle is None:
            raise ValueError("strata.jax: the trainer is closed")
        if self.block_optimizer.holds_grads:
            raise RuntimeError("strata.jax: apply_blocks does not support max_grad_norm or "
                               "accumulation (strata.jax.AdamW) yet: use step()")
        return self._apply_blocks(hidden, *extras)

    def _settle(self):
        """Before host work on the blocks' state: wait for running programs (the outputs JAX
        holds), abandon a step a failed program left open, wait for running updates."""
        if self._ffi is None:
            return
        if self._ffi.state()[2]:
            for a in jax.live_arrays():
                try:
                    a.block_until_ready()
                except Exception:  # noqa: BLE001: a failed program's outputs
                    pass
            if self._ffi.abandon():
                warnings.warn("strata.jax: a step that failed after it began was abandoned: "
                              "blocks whose grads it had released were updated; it is not "
                              "counted", RuntimeWarning, stacklevel=3)

    @property
    def uses_ffi(self):
        """Whether steps run as one XLA program with the FFI acquire/release ops."""
        return self._ffi is not None

    def step(self, batch):
        """One training step on `batch` (any pytree: it is passed to embed_fn and loss_fn).
        Returns the loss (a float). A step that raises leaves the trainer usable: before any
        block's grads were released, nothing was updated; after (an interrupt mid-backward),
        the blocks whose grads were released were updated and the step is not counted."""
        if self.runtime._handle is None:
            raise ValueError("strata.jax: the trainer is closed")
        if self.embed_fn is None:
            raise TypeError("strata.jax: step() needs embed_fn and loss_fn (this trainer was made "
                            "without them: call trainer.apply_blocks in your own jitted step)")
        if self._ffi is not None:
            return self._step_ffi(batch)
        return self._step_host(batch)

    def _step_ffi(self, batch):
        """The step as one XLA program whose begin, acquire, release and end ops drive the
        executor (see _ffi_program); the host waits once, for the loss."""
        self._check_not_traced(batch, "step")
        self._settle()
        ranks = self.data_parallel
        given = None
        if ranks is not None:
            ranks.check()
            given = ranks.global_batch(batch)  # this process's rows, its part of all of them
        out = None
        try:
            program = self._program_for(batch, given)  # planned on the batch shape's first step
            out = program(self.residents, self.opt_state, batch if given is None else given)
            jax.block_until_ready(out)
        except BaseException as e:
            # Traced but failed while running: some blocks may have released their grads.
            self._abort(out, 1 if out is not None else 0, exact=False)
            if ranks is not None and isinstance(e, _data_parallel.RUNTIME_ERRORS):
                raise ranks.failure("step %d" % (self.step_count + 1), e) from e
            raise
        if self.block_optimizer.holds_grads:
            loss, grads = out
            self._held_step(grads)
        else:
            loss, self.residents, self.opt_state = out
        return float(loss if ranks is None else loss.addressable_data(0))

    def synchronize(self):
        """Wait for the blocks' running updates."""
        self._settle()
        self.optimizer.synchronize()

    def close(self):
        if self._ffi is not None and self.runtime._handle is not None:
            self._settle()
        if self._ffi is not None:
            self._ffi.close()
        self.runtime.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()