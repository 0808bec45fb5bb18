"""The streamed blocks laid out in Strata (strata.torch.session.session's Builder): registered
with the runtime, materialized or read from offload(weights=), written with their optimizer
state, the executor made; and a build made without an optimizer undone, so that the optimizer
can lay the blocks out again."""

import time

import torch

from ... import core
from .. import _params, _planning, _surgery
from .._agreement import EveryRank
from .._planning import DTYPE_NAMES
from .._streamed import fill, narrows, split_master
from .._weights import Prefetcher, load_buffers


class Builder:
    """The session's build (one per session, which calls it): the blocks move into Strata once,
    when the optimizer is created or at the first forward pass without one. Owns
    offload(weights=)'s checkpoint until the blocks hold its values."""

    def __init__(self, session, weights_source):
        self.session = session
        self.weights_source = weights_source  # closed once the blocks hold its values

    def build(self, optimizer=None, group_of=None):
        """Register every block (materializing meta blocks on the compute device first), with
        optimizer state for trainable parameters when `optimizer` (core.Optimizer settings) is
        given; plan; create the executor. group_of: id(param) -> optimizer group index.
        Under data parallelism the build is collective (the layout's gathers and broadcasts),
        and each of its steps that can fail on one rank alone (the optimizer's memory, a
        block's materialization or writes, the executor) ends in an EveryRank, so a failure
        on any rank stops every rank at the same step; each then closes its session (its
        runtime's memory released: half laid out, the model cannot train, and the job ends)."""
        s = self.session
        s.check_open()
        if s.executor is not None:
            raise RuntimeError("strata.torch: create the optimizer (strata.torch.AdamW) before "
                               "the first forward pass")
        try:
            self._build(s.layout.before_build(optimizer), group_of)
        except BaseException:
            if s.mesh is not None:
                s.close()
            raise

    def _build(self, optimizer, group_of):
        s = self.session
        mesh = s.mesh
        source = self.weights_source  # offload(weights=): (file, names)
        trainable_any = s.blocks_train()
        opt = None
        # Every block's weights and grads are registered (shapes only) before any optimizer
        # state: state placed in DRAM first then sees exactly what DRAM has left for it.
        registered = []
        t = time.perf_counter()
        with EveryRank(mesh, "creating the optimizer and registering the streamed blocks"):
            if optimizer is not None and trainable_any:
                settings = dict(optimizer)
                kind = settings.pop("kind", "adamw")  # strata.torch's optimizers name theirs
                opt = core.Optimizer(s.runtime, kind, update_mode="explicit", **settings,
                                     **s.state_options)
            for i, block in enumerate(s.blocks):
                entries = []
                for k, (local, p) in enumerate(block.named_parameters()):
                    name = s.prefixes[i] + local
                    sp = s.layout.streamed_param(p, name, local, i, k)
                    s.layout.register_param(sp, p)
                    entries.append(sp)
                registered.append(entries)
        t = s.timed("register", t)
        narrowed = False  # values rounded to the compute dtype with no master to keep them
        reads = None
        if source is not None:  # the next block's tensors are read while this one is written
            reads = Prefetcher(*source, [list(b.parameters()) for b in s.blocks])
        try:
            for i, block in enumerate(s.blocks):
                # Per block, this rank's own work before and after the layout shares the
                # values (rank 0's broadcast: collective), each agreed on by every rank.
                with EveryRank(mesh, "materializing streamed block %d" % i):
                    values, t = self._block_values(block, group_of, reads, t)
                entries = registered[i]
                for sp, (v, _) in zip(entries, values):
                    s.layout.share_values(sp, v)
                with EveryRank(mesh, "writing streamed block %d's values" % i):
                    for sp, (v, group) in zip(entries, values):
                        narrowed = narrowed or opt is None and narrows(v, s.dtype)
                        s.layout.write_param(sp, v, opt, group)
                        s.by_id[id(sp.param)] = sp
                    grads = [sp for sp in entries if sp.trainable]
                    for j, sp in enumerate(grads):
                        sp.grad_index = j
                    s.layers.append(entries)
                    # The block's parameters give their storage up: they point at slot memory
                    # while acquired and at a placeholder otherwise.
                    for sp in entries:
                        sp.park(s.dtype, s.device)
                t = time.perf_counter()  # write_values timed the copies and the optimizer state
        finally:
            if reads is not None:
                reads.close()
        with EveryRank(mesh, "creating the executor"):
            self.close_weights()
            s.executor = core.Executor(
                s.runtime, [{"name": "layers.%d" % i,
                             "weights": [sp.weight for sp in entries],
                             "grads": [sp.grad for sp in entries if sp.trainable]}
                            for i, entries in enumerate(s.layers)],
                slot_budget=s.slot_budget)
            if opt is not None:
                opt.attach(s.executor)
            s.optimizer = opt
            # Built without an optimizer and nothing lost: the optimizer may lay it out again.
            s.relayable = opt is None and not narrowed
            s.timed("plan", t)
            s.layout.after_build()

    def _block_values(self, block, group_of, reads, t):
        """The block's values to write, per parameter (values, optimizer group), on the compute
        device or read from offload(weights=); and the time, its phases timed."""
        s = self.session
        source = self.weights_source
        # A meta block gets storage and its init values on the compute device, one block at a
        # time, as `model.to_empty(device=...)` and `_init_weights` would give it: on a GPU its
        # random init runs there (torch's CPU generator is one sequential stream: 1.6-2.2 s
        # per 202M-element normal_, 52 s for a 7B model's blocks), and its values reach the
        # pinned arena by DMA.
        if source is None:
            _surgery.materialize(block, s.device, s.init)
        else:  # only the buffers: the parameters' values go from the file to the arena
            for m in block.modules():
                load_buffers(m, s.device, *source)
                _surgery.rebuild_meta_buffers(m, s.device, s.init)
        t = s.timed("init", t)
        read = None
        if reads is not None:
            read = reads.next()
            t = s.timed("read", t)  # waiting for the file (offload(weights=))
        values = []
        for k, p in enumerate(block.parameters()):
            group = 0 if group_of is None else group_of.get(id(p), 0)
            # A parameter loaded since offload (model.load_state_dict before the optimizer)
            # holds its values; the others of offload(weights=) the file's.
            loaded = _params.take_loaded(p)
            values.append((p.detach() if source is None or loaded else read[k], group))
        return values, t

    def register_shape(self, sp, name, shape, trainable):
        """Register streamed parameter `sp` (its weight, and its grad when `trainable`) with the
        runtime under `name`, of `shape` (the layout's: the whole or this rank's shard)."""
        s = self.session
        sp.weight = s.runtime.register(name, shape, DTYPE_NAMES[s.dtype], "weight",
                                       s.placer.weight_home(sp.layer))
        if trainable:
            # Summed in place: fp32 whatever the compute dtype (strata.h
            # STRATA_GRAD_SUM_IN_PLACE).
            dtype = "float32" if s.grads_in_place else DTYPE_NAMES[s.dtype]
            sp.grad = s.runtime.register(name + ".grad", shape, dtype, "grad",
                                         "dram" if s.grads_home == "dram" else "hbm")

    def write_values(self, sp, values, opt, group):
        """`values` (sp.weight's shape) into sp.weight; its optimizer state (the master from
        the fp32 values, when given in fp32)."""
        s = self.session
        t = time.perf_counter()
        trains = sp.trainable and opt is not None
        layout = _planning.master_layout(s.dtype)
        # The master starts from fp32 values, not their rounded copy: a split one's low
        # halves are computed with the weight, where `values` are (on a GPU: there).
        split = trains and layout == "split" and values.dtype == torch.float32
        weight, rest = split_master(values) if split else (values.to(s.dtype), None)
        fill(sp.weight, weight)  # rounded where `values` are
        t = s.timed("weights", t)
        if trains:
            opt.add_param(sp.weight, sp.grad, group, master_layout=layout,
                          grad_sum=_planning.layout_grads(s.grads_home)["grad_sum"])
            if split:
                fill(opt.state(sp.weight, "master_low"), rest)
            elif values.dtype == torch.float32 and s.dtype != torch.float32:
                fill(opt.state(sp.weight, "master"), values)
            s.timed("optimizer_state", t)

    def unbuild(self):
        """Undo a build made without an optimizer, so that build() can lay the blocks out again
        with the optimizer's state: every block's weights back in its parameters (host memory,
        the compute dtype), the runtime's tensors and the executor gone. Only where the weights
        hold all the values did (`relayable`): values narrowed to the compute dtype at the
        build or since would otherwise start the masters rounded."""
        s = self.session
        if s.optimizer is not None or s.in_step or not s.relayable:
            raise RuntimeError("strata.torch: internal: unbuild of a session that trained")
        values = [[s.read_weight(sp) for sp in entries] for entries in s.layers]
        s.executor.close()
        s.executor = None
        for entries, block_values in zip(s.layers, values):
            for sp, v in zip(entries, block_values):
                sp.weight.unregister()
                if sp.grad is not None:
                    sp.grad.unregister()
                sp.param.data = v
        s.layers, s.by_id = [], {}
        s.relayable = False

    def close_weights(self):
        """Let go of offload(weights=)'s checkpoint once the blocks hold its values."""
        source = self.weights_source
        if source is not None:
            source[0].close()
            self.weights_source = None
