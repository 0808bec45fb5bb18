"""StrataSession: one offloaded model's runtime, registered tensors, executor, optimizer and step
state. The blocks' parameters stay the model's own nn.Parameter objects (names, identity, hooks
and PEFT wrappers keep working); while a block is not being computed, each parameter's data is a
zero-stride view of one element with the parameter's real shape, dtype and device, so shapes,
numel() and grad assignment behave as in plain PyTorch and nothing is stored twice.

The session holds the state every part of strata.torch reads, and owns the parts that act on it,
one job each: its Builder (strata.torch.session.builder: the blocks laid out in Strata), its
Passes (strata.torch.session.passes: the step's passes and grads) and its Placer
(strata.torch.session.placer: where the training state lives). What the layers below and
above call (the block's forward, the layout, the hooks) it answers itself or hands to them."""

import time

import torch

from .. import _params
from ..layout.local import LocalLayout
from .._streamed import narrows
from .builder import Builder
from .passes import Passes
from .placer import Placer
from .runtime import open_runtime


class StrataSession:
    """One offloaded model. Blocks are registered with the runtime when the optimizer is created
    (or at the first forward pass without one), one at a time: host memory never holds the
    model twice. Every field is declared here; `layout` (strata.torch.layout) says where the
    streamed parameters live across processes, and the session calls it for everything that
    differs under data parallelism."""

    def __init__(self, choices, layout=None):
        self.blocks = choices.blocks
        self.prefixes = choices.prefixes
        self.grads_home = choices.grads_home
        # The grad views are the sums (strata.torch.layout adds each backward's grads into
        # them instead of copying).
        self.grads_in_place = choices.grads_home == "hbm_sums"
        self.device = choices.device
        self.dtype = choices.dtype
        self.cuda = choices.device.type == "cuda"
        self.init = choices.init
        self.slot_budget = choices.slot_budget
        self.resident_blocks = choices.resident_blocks
        self.layout = layout if layout is not None else LocalLayout()
        self.mesh = self.layout.mesh  # strata.torch._distributed.Mesh, or None
        self.closed = False
        # Seconds per setup phase (runtime creation, init, copies into the arena, optimizer
        # state, planning): where offloading a large model spends its time.
        self.setup_seconds = {}
        # With NVMe, what place() chose (the Placer): the core.Placement, the optimizer's
        # options that realize it, and how many of the last blocks keep their weights on NVMe.
        self.placement_choice = None
        self.state_options = {}
        self.nvme_weight_blocks = 0
        # Resident parameters narrowed to the compute dtype that keep offload's fp32 values
        # for their masters (strata.torch._params), until the optimizer exists.
        self.kept_fp32 = []
        # Forward hooks inside streamed blocks are refused (strata.torch._block.refuse_inner_hooks)
        # unless the user says they only observe.
        self.allow_inner_hooks = False
        self.layers = []  # per block: [StreamedParam] in named_parameters order
        self.by_id = {}  # id(param) -> StreamedParam
        self.executor = None
        self.optimizer = None
        self.in_step = False
        # The strata.torch.gathered context whose copies the streamed parameters hold, or None:
        # what reads or writes Strata behind those copies is refused meanwhile.
        self.gathered = None
        self.step_id = 0  # advances at every step_begin: a stale backward can tell
        self.backward_next = None  # the block whose backward the executor expects next
        self.forward_next = 0  # and whose forward, within a step
        self.held = set()  # ids of trainable streamed params the optimizer holds a grad for
        self.delivered = []  # parameters of the block being released that got grads
        # Trainable parameters a backward pass gave no grad (a branch their block did not take)
        # and that held none before it: their grads go back to None when it has landed, so
        # the update skips them, as torch's AdamW skips a parameter whose .grad is None.
        self.ungraded = []
        # Called with the block's index when a streamed block's forward or backward pass begins
        # with grad, and with None when the model's forward pass with grad begins (in training
        # mode): strata.torch.paging frees, times and brings back optimizer state.
        self.on_forward_begin = []
        self.on_backward_begin = []
        self.on_resident_forward_begin = []  # a resident block's, with its index, with grad
        self.on_resident_backward_begin = []  # and its backward pass's, with its index
        # The model's chunked loss (strata.torch._chunked_loss.ChunkedLoss; offload's
        # chunked_loss=), or None: its own.
        self.chunked_loss = None
        # Built without an optimizer (a checkpoint loaded first, a forward pass of frozen
        # blocks, predict) with nothing narrowed to the compute dtype since, or every block's
        # weights then loaded from a checkpoint: the optimizer may lay the blocks out again
        # (unbuild), nothing of the values being lost.
        self.relayable = False
        self.optimizer_made = False  # strata.torch.AdamW was created for this session
        # The host memory account (strata.torch._planning.HostBudget: the arena, the paged
        # state, the spill pool), made by offload once the runtime exists.
        self.host_budget = None
        self.nvme_files = choices.nvme  # this rank's NVMe tier files (none: no tier)
        # Made with the runtime, on this rank (open_runtime): the activation keeper (which
        # resident blocks keep their activations instead of recomputing them, and which
        # streamed blocks their matrix products' and attention's outputs), the spiller (which
        # blocks' checkpoints go to host memory), the anchor (a session-wide empty tensor
        # requiring grad that every streamed block's autograd function takes, so the backward
        # pass reaches each one in order) and its grad accumulator (anchor_node: whether a
        # backward pass accumulates into parameters, loss.backward(), or not,
        # torch.autograd.grad).
        self.activations = self.spill = self.anchor = self.anchor_node = self.runtime = None
        # The session's parts, each with one job, calling back into the session: the build of
        # the blocks in Strata, the step's passes and grads, the placement of the state.
        self.builder = Builder(self, choices.weights_source)
        self.passes = Passes(self)
        self.placer = Placer(self)
        started = time.perf_counter()
        open_runtime(self, choices)
        self.timed("runtime", started)

    def timed(self, phase, started):
        """Add the seconds since `started` to `phase`; returns now (the next phase's start)."""
        now = time.perf_counter()
        self.setup_seconds[phase] = self.setup_seconds.get(phase, 0.0) + now - started
        return now

    # --- the build (Builder) --------------------------------------------------------------------

    def ensure_built(self):
        self.check_open()
        if self.executor is None:
            self.builder.build()

    def register_shape(self, sp, name, shape, trainable):
        """The layout's registration of streamed parameter `sp` (Builder.register_shape)."""
        self.builder.register_shape(sp, name, shape, trainable)

    def write_values(self, sp, values, opt, group):
        """The layout's write of `sp`'s values and optimizer state (Builder.write_values)."""
        self.builder.write_values(sp, values, opt, group)

    def blocks_train(self):
        """Whether some streamed block parameter requires grad now."""
        return any(p.requires_grad for b in self.blocks for p in b.parameters())

    def optimizer_created(self):
        """strata.torch.AdamW was made for this session (its blocks laid out with it, or frozen
        ones kept as built): offload's fp32 copies of resident parameters are its masters'
        now or not needed (frozen ones: an 8B's embedding and head under LoRA, 4 GB), and
        go."""
        self.optimizer_made = True
        for p in self.kept_fp32:
            _params.drop_fp32(p)
        self.kept_fp32 = []

    # --- the placement (Placer) ----------------------------------------------------------------

    def predict(self, forward_seconds=0.0, backward_seconds=0.0, other_seconds=0.0):
        """The step Strata's model predicts for the streamed blocks (Placer.predict)."""
        return self.placer.predict(forward_seconds, backward_seconds, other_seconds)

    def placement(self):
        """Where the training state lives, one line (Placer.describe)."""
        return self.placer.describe()

    def host_pinned_extra_bytes(self):
        """Host memory strata.torch holds beside the arena, counted against host_budget
        (Placer.host_pinned_extra_bytes)."""
        return self.placer.host_pinned_extra_bytes()

    # --- the step (Passes) ---------------------------------------------------------------------

    def stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream if self.cuda else None

    def bind(self, index, phase):
        """The block's parameters on its weights in the slot (Passes.bind)."""
        self.passes.bind(index, phase)

    def unbind(self, index):
        """The block's parameters off the slot again (Passes.unbind)."""
        self.passes.unbind(index)

    def load_block(self, index):
        """For evaluation without grads: the block's weights, no executor (Passes.load_block)."""
        self.passes.load_block(index)

    def begin(self, index, phase):
        """Streamed block `index`'s pass `phase` begins (Passes.begin)."""
        self.passes.begin(index, phase)

    def store_grads(self, index, params, grads):
        """After block `index`'s backward: the grads of its trainable StreamedParams `params`
        (None where a parameter got none) into the acquired layer's grad views."""
        self.layout.store_grads(index, params, grads)

    def end(self, index, phase):
        """Streamed block `index`'s pass `phase` ended (Passes.end)."""
        self.passes.end(index, phase)

    def abort(self):
        """Abandon the running step after an exception (Passes.abort)."""
        self.passes.abort()

    # --- values -------------------------------------------------------------------------------

    def read_weight(self, sp):
        """A streamed parameter's current values (after any running update), on the CPU."""
        self.ensure_built()
        if self.optimizer is not None:
            self.optimizer.synchronize()
        return self.layout.read_weight(sp)

    def read_state(self, sp, kind):
        """A trainable streamed parameter's optimizer state of `kind` (fp32, on the CPU; the
        master put together whatever its layout)."""
        return self.layout.read_state(sp, kind)

    def write_state(self, sp, kind, value):
        """Set a state of `kind`; the master sets the weight too (rounded from it)."""
        if tuple(value.shape) != sp.shape:
            raise ValueError("strata.torch.AdamW.load_state_dict: state %r of %r has shape %s, "
                             "expected %s" % (kind, sp.name, list(value.shape), list(sp.shape)))
        self.layout.write_state(sp, kind, value)

    def read_grad(self, sp):
        """A streamed parameter's held grad as an fp32 CPU tensor (a copy)."""
        return self.layout.read_grad(sp)

    def grad_sums(self, params):
        """The sums of squares of the held grads of `params` (StreamedParams), in order."""
        return self.layout.grad_sums(params)

    def write_weight(self, sp, values):
        """Set a streamed parameter (weight and, when trained, its fp32 master)."""
        self.check_not_gathered("loading weights (model.load_state_dict)")
        self.ensure_built()
        if self.in_step:
            raise RuntimeError("strata.torch: weights can be loaded between steps only")
        if self.optimizer is not None:
            self.optimizer.synchronize()
        if tuple(values.shape) != sp.shape:
            raise ValueError("strata.torch: %r has shape %s, the value given has %s"
                             % (sp.name, list(sp.shape), list(values.shape)))
        if self.optimizer is None and narrows(values, self.dtype):
            # Narrowed here, with no master to keep them: the optimizer could not lay the
            # blocks out again from these values (unbuild).
            self.relayable = False
        self.store_weight(sp, values)

    def masters_from_weights(self):
        """After the weights were written behind the optimizer (a checkpoint loaded without its
        optimizer state): every trained streamed parameter's fp32 master becomes its weight,
        widened, as model.load_state_dict sets it, so the next update starts from the loaded
        weights and not from the masters of before (which would put the old weights back)."""
        if self.optimizer is None or self.dtype == torch.float32:
            return  # an fp32 weight is its own master
        self.layout.masters_from_weights()

    def weights_loaded(self):
        """Every block's weights were just written from a checkpoint without optimizer state:
        the masters follow them, as after model.load_state_dict (the optimizer's moments
        stay); before the optimizer exists, it may lay the blocks out again from them
        (unbuild)."""
        self.masters_from_weights()
        self.relayable = self.optimizer is None

    def store_weight(self, sp, values):
        """write_weight's writes, its checks done: the weight and, when trained, the master."""
        self.layout.store_weight(sp, values)

    # --- checks and lifetime ------------------------------------------------------------------

    def check_not_gathered(self, what):
        """Refuse `what` inside strata.torch.gathered: the streamed parameters hold gathered
        copies there, which a forward pass, an update or a load would bypass."""
        if self.gathered is not None:
            raise RuntimeError("strata.torch: %s inside strata.torch.gathered(...): the streamed "
                               "parameters hold gathered copies of their values there; leave "
                               "the with-block first" % what)

    def check_open(self):
        if self.closed:
            raise RuntimeError("strata.torch: this model's Strata session is closed "
                               "(model.strata.close()); offload a fresh model to train again")

    def _not_copyable(self, *args):
        raise TypeError(
            "strata.torch: an offloaded model cannot be pickled or deep-copied: it holds a live "
            "Strata runtime (pinned memory, threads). Save model.state_dict() or "
            "strata.torch.save_checkpoint(...), and load into a freshly built model")

    __deepcopy__ = _not_copyable
    __reduce_ex__ = _not_copyable

    def close(self):
        if self.closed:
            return
        self.closed = True
        self.builder.close_weights()
        self.spill.close()
        self.runtime.close()
