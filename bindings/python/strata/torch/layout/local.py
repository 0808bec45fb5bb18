"""LocalLayout: every streamed parameter whole in this process's runtime (no data
parallelism), and the interface ShardedLayout (strata.torch.layout.sharded) keeps."""

import os

import torch

from ...core import BACKWARD, VIEW_GRAD
from .. import _planning
from .._streamed import StreamedParam


class LocalLayout:
    """Every streamed parameter whole in this process's runtime (no data parallelism)."""

    mesh = None
    # The blocks built without an optimizer may be laid out again by it (StrataSession.unbuild).
    can_relay = True
    # The resident parameters' optimizer state may page to host memory (strata.torch.paging).
    pages_resident_state = True
    # This process writes a checkpoint's shared files and swaps it in.
    lead = True
    # And the streamed part of it (the ranks of one replica hold the same chunks).
    writes_streamed = True

    def __init__(self):
        self.session = None

    def attach(self, session):
        """Called once by the session, its runtime created."""
        self.session = session

    # --- registration ----------------------------------------------------------------------

    def block_counts(self, blocks):
        """Elements per block this process keeps in DRAM."""
        return _planning.block_elements(blocks)

    def streamed_param(self, p, name, local, layer, index):
        return StreamedParam(p, name, local, layer, index)

    def before_build(self, optimizer):
        """The optimizer's settings for the build (core.Optimizer's), or None."""
        return optimizer

    def after_build(self):
        pass

    def register_param(self, sp, p):
        """Register a block parameter's weight and, when it trains, its grad (shapes only)."""
        self.session.register_shape(sp, sp.name, p.shape, p.requires_grad)

    def share_values(self, sp, values):
        """A block parameter's values made the same on every process before write_param
        (collective under data parallelism; here nothing to do)."""

    def write_param(self, sp, values, opt, group):
        """Write a block parameter's values (on the CPU or the compute device) into its weight
        and, when it trains, make it a param of `opt` in group `group`."""
        self.session.write_values(sp, values, opt, group)

    # --- the step --------------------------------------------------------------------------

    def acquire(self, index, phase):
        """The executor's acquire of the block, its parameters bound to the weights."""
        s = self.session
        s.executor.acquire(index, phase, s.stream())
        s.bind(index, phase)

    def release(self, index, phase):
        s = self.session
        s.unbind(index)
        s.executor.release(index, phase, s.stream())

    def store_grads(self, index, params, grads):
        """After block `index`'s backward: the grads of its trainable StreamedParams `params`
        (None where a parameter got none) into the acquired layer's grad views: copied, or
        added to the sums where the views are them (session.grads_in_place)."""
        s = self.session
        for sp, g in zip(params, grads):
            if g is not None:
                view = torch.from_dlpack(s.executor.view(index, BACKWARD, VIEW_GRAD,
                                                         sp.grad_index))
                if s.grads_in_place:
                    # The fp32 sum: zeroed at the backward load only where the param held no
                    # grad, else the earlier passes' sum (widened exactly, one fp32 rounding
                    # per add, as the optimizer's accumulators add).
                    view.add_(g)
                else:  # the view was zeroed when the backward pass began
                    view.copy_(g)
                del view
                s.delivered.append(sp)
            elif id(sp.param) not in s.held or sp.param.grad is None:
                s.ungraded.append(sp)

    def after_end(self, index, phase):
        """The session ended block `index`'s pass `phase` (released it)."""

    def before_abort(self):
        """The session abandons the running step."""

    # --- values ----------------------------------------------------------------------------

    def load_block(self, index):
        """For evaluation without grads, after the build: the block's weights copied from DRAM
        (the optimizer's updates done)."""
        s = self.session
        for sp in s.layers[index]:
            sp.check_untouched()
            host = torch.empty(sp.shape, dtype=s.dtype)
            sp.weight.read_pointer(host.data_ptr(), host.numel() * host.element_size())
            sp.param.data = host.to(s.device)

    def read_weight(self, sp):
        """A streamed parameter's values, on the CPU (the updates done)."""
        host = torch.empty(sp.shape, dtype=self.session.dtype)
        sp.weight.read_pointer(host.data_ptr(), host.numel() * host.element_size())
        return host

    def store_weight(self, sp, values):
        """The weight and, when trained, the master (the weight rounded from it)."""
        s = self.session
        if sp.trainable and s.optimizer is not None and s.dtype != torch.float32:
            # The master and the weight rounded from it, in any layout.
            master = values.detach().to("cpu", torch.float32).contiguous()
            s.optimizer.master_write(sp.weight, master.data_ptr(), master.numel())
            return
        host = values.detach().to("cpu", s.dtype).contiguous()
        sp.weight.write_pointer(host.data_ptr(), host.numel() * host.element_size())

    def masters_from_weights(self):
        """Every trained streamed parameter's fp32 master becomes its weight, widened."""
        s = self.session
        for sp in (sp for entries in s.layers for sp in entries if sp.trainable):
            s.store_weight(sp, s.read_weight(sp))

    def read_state(self, sp, kind):
        t = torch.empty(sp.shape, dtype=torch.float32)
        optimizer = self.session.optimizer
        if kind == "master":
            optimizer.master_read(sp.weight, t.data_ptr(), t.numel())
        else:
            optimizer.state(sp.weight, kind).read_pointer(t.data_ptr(), t.numel() * 4)
        return t

    def write_state(self, sp, kind, value):
        t = value.detach().to("cpu", torch.float32).contiguous()
        optimizer = self.session.optimizer
        if kind == "master":
            optimizer.master_write(sp.weight, t.data_ptr(), t.numel())
        else:
            optimizer.state(sp.weight, kind).write_pointer(t.data_ptr(), t.numel() * 4)

    def read_grad(self, sp):
        host = torch.empty(sp.shape, dtype=torch.float32)
        self.session.optimizer.grad_read(sp.weight, host.data_ptr(), host.numel())
        return host

    def grad_sums(self, params):
        return [self.session.optimizer.grad_info(sp.weight)[1] for sp in params]

    def own_grad(self, sp):
        """The part of a held grad this process holds, as an fp32 CPU tensor (a copy), and the
        `own_part` of any tensor of the parameter's shape (broadcast to it) that lines up with
        it: here the whole grad, in the parameter's shape."""
        return self.read_grad(sp)

    def own_part(self, sp, values):
        return values

    def write_own_grad(self, sp, values):
        """Set the part of a held grad this process holds from what own_grad returned, changed."""
        host = values.detach().to("cpu", torch.float32).contiguous()
        self.session.optimizer.grad_write(sp.weight, host.data_ptr(), host.numel())

    # --- what other modules ask ------------------------------------------------------------

    def agree(self, flags):
        """`flags` (a list of booleans) as every process agrees on them: each one's."""
        return flags

    def checkpoint_layout(self):
        """What a checkpoint records of the processes that wrote it (None: one process)."""
        return None

    def streamed_dir(self, root):
        """Where this process's streamed part of a checkpoint at `root` goes."""
        return os.path.join(root, "streamed")

    def rng_file(self, root):
        """This process's own RNG states' file in a checkpoint (None: in resident.pt)."""
        return None

    def barrier(self, what):
        """Every process of the job reaches this point (one process: at once)."""
