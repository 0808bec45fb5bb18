"""A step as the session runs it (strata.torch.session.session's Passes): each streamed
block's forward and backward pass begun and ended in order through the layout, its parameters
pointed at the slot's weights meanwhile (or, for evaluation, at weights copied from DRAM or
their own values before the build), the step abandoned after an exception, and the grads the
backward passes deliver shown as each parameter's .grad (and dropped again where the user set
them to None)."""

import torch

from ...core import BACKWARD, FORWARD, VIEW_WEIGHT
from .. import _params
from .._grads import StreamedGrad


class Passes:
    """The session's passes (one per session, which calls it). The step's state the blocks'
    forwards and the layout read stays on the session (in_step, step_id, backward_next,
    forward_next, held, delivered, ungraded); the blocks whose backward landed this step, and
    the values of a block evaluated before the build, are this object's own."""

    def __init__(self, session):
        self.session = session
        self.landed_layers = set()  # blocks whose backward pass this step delivered grads
        # Evaluated before the build: id(param) -> its own data, put back after the block ran.
        self._unmoved = {}

    def note_memory_timeline(self):
        """The activation keeper notes the memory allocated at each block's forward and
        backward start (ActivationKeeper.at_point), on CUDA, called before strata.torch's
        other block-start calls (the pager's), which change it."""
        s = self.session
        keeper = s.activations
        if not keeper.enabled:
            return
        s.on_forward_begin.append(
            lambda i: i is not None and keeper.at_point("f", i, streamed=True))
        s.on_backward_begin.append(lambda i: keeper.at_point("b", i, streamed=True))
        s.on_resident_forward_begin.append(lambda i: keeper.at_point("f", i, streamed=False))
        s.on_resident_backward_begin.append(
            lambda i: keeper.at_point("b", i, streamed=False))

    def begin(self, index, phase):
        """Streamed block `index`'s pass `phase` begins (its forward, or its recomputed forward
        and backward): checked, a step begun at block 0's forward, the block acquired."""
        # Without the optimizer, trainable blocks have nowhere for their grads: before the
        # build, or after one made without it (a checkpoint loaded, predict: the optimizer may
        # lay the blocks out again, which grads in Strata would not survive). Once an
        # optimizer was made, frozen blocks unfrozen are check_trainable's to refuse.
        s = self.session
        if s.optimizer is None and not s.optimizer_made and s.blocks_train():
            added = [s.prefixes[i] + name for i, b in enumerate(s.blocks)
                     for name, p in b.named_parameters()
                     if p.requires_grad and _params.owner(p) is not s]
            if added:
                raise RuntimeError(
                    "strata.torch: streamed blocks have trainable parameters that were added "
                    "after strata.torch.offload (%s%s): adapters (PEFT's get_peft_model, a LoRA "
                    "wrapper) must be applied to the model before offload, which then streams "
                    "them with their blocks" % (", ".join(added[:3]),
                                                ", ..." if len(added) > 3 else ""))
            raise RuntimeError(
                "strata.torch: create the optimizer (strata.torch.AdamW(model.parameters(), "
                "...)) after strata.torch.offload(model) and before the first forward pass with "
                "grad: the streamed blocks' grads live in its state. An optimizer created "
                "before offload, or one of torch.optim's, cannot update streamed parameters "
                "(evaluate under torch.no_grad(), or freeze the blocks, to run without one)")
        s.check_not_gathered("a forward or backward pass of a streamed block")
        s.ensure_built()
        if phase == FORWARD and index == 0:
            if s.in_step:
                # The last forward pass never got its backward (an exception after it, or a
                # forward whose result was dropped): as in plain PyTorch, that changes nothing.
                self.abort()
            self.check_trainable()
            if s.optimizer is not None:
                # Grads set to None since the last backward (model.zero_grad(), p.grad = None)
                # must be dropped before this backward lands, or it would add to them.
                self.sync_grads()
            s.executor.step_begin()
            self.landed_layers = set()
            s.in_step = True
            s.step_id += 1
            s.backward_next = len(s.layers) - 1
            s.forward_next = 0
        if phase == FORWARD and (not s.in_step or index != s.forward_next):
            raise RuntimeError(
                "strata.torch: streamed block %d ran its forward pass where block %d was next: "
                "with grad, the streamed blocks run in order, each once per forward pass, "
                "from block 0 (their weights stream in that order): skipping blocks "
                "(LayerDrop), repeating one or reordering them is not supported (under "
                "torch.no_grad() any order works)"
                % (index, s.forward_next if s.in_step else 0))
        if phase == BACKWARD and index == len(s.layers) - 1 and s.optimizer is not None:
            # Grads set to None between this pass's forward and its backward
            # (model.zero_grad(), p.grad = None) are dropped before it lands, as at the forward
            # pass above; opt.zero_grad() drops them itself.
            self.sync_grads()
        for call in s.on_forward_begin if phase == FORWARD else s.on_backward_begin:
            call(index)
        s.layout.acquire(index, phase)
        if phase == FORWARD:
            s.forward_next = index + 1

    def end(self, index, phase):
        """Streamed block `index`'s pass `phase` ended: released; after a backward pass its
        grads shown, and the step ended at block 0's."""
        s = self.session
        s.layout.release(index, phase)
        if phase == BACKWARD:
            s.backward_next = index - 1
            self.landed_layers.add(index)
            self.show_delivered_grads()
            if index == 0:
                s.in_step = False
                s.executor.step_end()
                self.grads_landed()
        s.layout.after_end(index, phase)

    def load_block(self, index):
        """For evaluation without grads: the block's weights copied from DRAM (no executor).
        Before the blocks move into Strata (no optimizer yet), their own values, on the device."""
        s = self.session
        s.check_open()
        s.check_not_gathered("a forward pass of a streamed block")
        if s.executor is None:
            params = list(s.blocks[index].parameters())
            if any(p.is_meta for p in params):
                raise RuntimeError(
                    "strata.torch: streamed block %d has no values yet (a model built on the "
                    "meta device gets them when the optimizer is created, from its init or "
                    "offload(weights=)): create the optimizer (strata.torch.AdamW) before "
                    "evaluating, or load the weights with model.load_state_dict first" % index)
            self._unmoved = {id(p): p.data for p in params}
            for p in params:
                # In the compute dtype, as every forward pass after the build computes it (the
                # resident modules are in it already).
                p.data = p.data.to(s.device, s.dtype) if p.is_floating_point() else \
                    p.data.to(s.device)
            return
        if s.optimizer is not None:
            s.optimizer.synchronize()  # updates still running would be read half-done
        s.layout.load_block(index)

    def bind(self, index, phase):
        """Point the block's parameters at its weights in the slot (zero-copy, DLPack)."""
        s = self.session
        for sp in s.layers[index]:
            sp.check_untouched()
            sp.param.data = torch.from_dlpack(s.executor.view(index, phase, VIEW_WEIGHT,
                                                              sp.index))

    def unbind(self, index):
        """The block's parameters off the slot again (parked), or, evaluated before the build,
        back on their own values."""
        s = self.session
        if s.executor is None:  # evaluated before the blocks moved: their own values back
            for p in s.blocks[index].parameters():
                p.data = self._unmoved.get(id(p), p.data)
            self._unmoved = {}
            return
        for sp in s.layers[index]:
            sp.park(s.dtype, s.device)

    def abort(self):
        """Abandon the running step after an exception: the next forward starts a fresh one.
        Grads of blocks whose backward finished stay, as autograd would have left them."""
        s = self.session
        if s.executor is None or not s.in_step:
            return
        s.layout.before_abort()
        s.in_step = False
        s.backward_next = None
        s.delivered = []  # what landed is the optimizer's to say (grads_landed, below)
        for i in range(len(s.layers)):
            self.unbind(i)
        s.executor.step_abort(s.stream())
        self.grads_landed()

    def check_trainable(self):
        """Which block parameters get grads is fixed when the blocks move into Strata (their
        grad buffers and optimizer state are laid out then): a later requires_grad_ change is
        refused rather than silently ignored."""
        s = self.session
        for entries in s.layers:
            for sp in entries:
                sp.check_untouched()
                if sp.param.requires_grad != sp.trainable:
                    raise RuntimeError(
                        "strata.torch: requires_grad of streamed parameter %r changed to %s after "
                        "the optimizer was created; freeze or unfreeze block parameters before "
                        "strata.torch.AdamW(...)" % (sp.name, sp.param.requires_grad))

    def show_delivered_grads(self):
        """As autograd sets .grad when a parameter's grad is accumulated, not when the whole
        backward pass ends: the parameters the block just released got grads for show them
        now (a lazy StreamedGrad: nothing waits for the copy). A backward pass that raises
        later leaves them visible, so zero_grad drops them as in plain PyTorch."""
        s = self.session
        for sp in s.delivered:
            if id(sp.param) not in s.held or sp.param.grad is None:
                s.held.add(id(sp.param))
                sp.param.grad = StreamedGrad.of(s, sp)
        s.delivered = []

    def grads_landed(self):
        """After a backward pass: every trainable streamed parameter whose grads came shows
        them as its .grad (a StreamedGrad reading them from Strata)."""
        s = self.session
        if s.optimizer is None:
            return
        for sp in s.ungraded:  # landed as zeros: back to none (waits for its layer's landing)
            s.optimizer.grad_zero(sp.weight, keep_zeros=False)
        s.ungraded = []
        for entries in s.layers:
            for sp in entries:
                if not sp.trainable or (id(sp.param) in s.held and sp.param.grad is not None):
                    continue
                has, _, _ = s.optimizer.grad_info(sp.weight)
                if has:
                    s.held.add(id(sp.param))
                    sp.param.grad = StreamedGrad.of(s, sp)
        # register_post_accumulate_grad_hook: called once per backward pass that accumulated
        # into the parameter, as autograd does.
        for index in sorted(self.landed_layers, reverse=True):
            for sp in s.layers[index]:
                hooks = getattr(sp.param, "_post_accumulate_grad_hooks", None)
                if sp.trainable and hooks:
                    for hook in list(hooks.values()):
                        hook(sp.param)
        self.landed_layers = set()

    def sync_grads(self):
        """Before a step or an update: a held grad the user set to None (model.zero_grad(),
        p.grad = None) is dropped in Strata too; a tensor assigned to it is refused."""
        s = self.session
        for pid in list(s.held):
            sp = s.by_id[pid]
            g = sp.param.grad
            if g is None:
                s.optimizer.grad_zero(sp.weight, keep_zeros=False)
                s.held.discard(pid)
            elif not isinstance(g, StreamedGrad) or g._sp is not sp:
                raise RuntimeError(
                    "strata.torch: the .grad of streamed parameter %r was replaced by another "
                    "tensor; streamed grads live in Strata: change them in place "
                    "(p.grad.copy_(new), mul_, clamp_), zero them (zero_grad) or set them to None"
                    % sp.name)
        for entries in s.layers:
            for sp in entries:
                if sp.trainable and id(sp.param) not in s.held and sp.param.grad is not None:
                    raise RuntimeError(
                        "strata.torch: a tensor was assigned to the .grad of streamed parameter "
                        "%r; streamed grads come from backward passes only" % sp.name)
