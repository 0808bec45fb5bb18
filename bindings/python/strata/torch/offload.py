"""The machinery behind strata.torch.offload: a session per model (runtime, executor,
optimizer), a wrapper per block that runs it as a checkpointed autograd function, and AdamW."""

import torch
from torch import nn

from .. import core
from ..core import BACKWARD, FORWARD, VIEW_GRAD, VIEW_WEIGHT

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def materialize(module, device, init, recurse=True):
    """A module built on the meta device (to build a model larger than host memory allows
    twice) gets real storage on `device` and its init function's values."""
    params = module.parameters(recurse=recurse)
    if not any(p.is_meta for p in params):
        return
    if init is None:
        raise ValueError("strata.torch.offload: the model is on the meta device and has no "
                         "_init_weights(module) to initialize it")
    module.to_empty(device=device, recurse=recurse)
    for m in (module.modules() if recurse else [module]):
        init(m)


def find_blocks(model):
    """The model's repeated blocks: Hugging Face decoders keep them in model.model.layers (or
    transformer.h for GPT-2 style models); otherwise the largest nn.ModuleList of one type."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "layers", "blocks", "h"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    best = None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(x) for x in m}) == 1:
            if best is None or sum(p.numel() for p in m.parameters()) > \
                    sum(p.numel() for p in best.parameters()):
                best = m
    if best is None:
        raise ValueError("strata.torch.offload: the model has no list of repeated blocks "
                         "(nn.ModuleList) to stream")
    return best


class StrataSession:
    """One offloaded model: the runtime, the blocks' tensors, the executor, the optimizer and the
    step state. The blocks are registered with the runtime when the optimizer is created (or at
    the first forward pass without one), so each block is materialized, copied in, and its
    optimizer state written from its fp32 values one block at a time: host memory never holds
    the model twice."""

    def __init__(self, blocks, device, dtype, gpu_budget, host_budget, nvme, backend,
                 slot_budget=0, init=None):
        self.blocks = blocks
        self.inners = list(blocks)
        self.device = device
        self.dtype = dtype
        self.cuda = device.type == "cuda"
        self.init = init
        self.slot_budget = slot_budget
        hbm, dram = core.streaming_budgets([sum(p.numel() for p in b.parameters()) for b in blocks],
                                           torch.finfo(dtype).bits // 8)
        gpu_budget = hbm if gpu_budget is None else gpu_budget
        host_budget = dram if host_budget is None else host_budget
        self.runtime = core.Runtime(backend=backend, hbm_budget=gpu_budget, dram_budget=host_budget,
                                    nvme=nvme)
        self.weights, self.grads, self.params, self.shapes = [], [], [], []
        self.executor = None
        self.optimizer = None
        self.in_step = False
        self.on_step_begin = []  # callbacks (the optimizer's learning rate)
        self._placeholder = torch.empty(0, device=device, dtype=dtype)

    def build(self, optimizer=None):
        """Register every block (materializing meta blocks on the CPU first), with optimizer
        state when `optimizer` (core.Optimizer settings) is given; plan; create the executor."""
        if self.executor is not None:
            raise RuntimeError("strata.torch: create the optimizer (strata.torch.AdamW) before "
                               "the first forward pass")
        opt = core.Optimizer(self.runtime, "adamw", **optimizer) if optimizer is not None else None
        for i, block in enumerate(self.inners):
            # Materializing a meta block replaces its parameters: list them afterwards.
            materialize(block, torch.device("cpu"), self.init)
            ws, gs, owned = [], [], []
            for name, p in block.named_parameters():
                full = "layers.%d.%s" % (i, name)
                w = self.runtime.register(full, p.shape, _DTYPE_NAMES[self.dtype], "weight", "dram")
                g = self.runtime.register(full + ".grad", p.shape, _DTYPE_NAMES[self.dtype],
                                          "grad", "dram")
                host = p.detach().to("cpu", self.dtype).contiguous()
                w.write_pointer(host.data_ptr(), host.numel() * host.element_size())
                if opt is not None:
                    opt.add_param(w, g)
                    if p.dtype == torch.float32 and self.dtype != torch.float32:
                        # The master starts from the fp32 values, not their rounded copy.
                        values = p.detach().to("cpu").contiguous()
                        opt.state(w, "master").write_pointer(values.data_ptr(),
                                                             values.numel() * 4)
                ws.append(w)
                gs.append(g)
                owned.append(p)
            self.weights.append(ws)
            self.grads.append(gs)
            self.params.append(owned)
            self.shapes.append([p.shape for p in owned])
            # The block's parameters give their storage up: they point at slot memory while
            # acquired and at an empty placeholder otherwise.
            for p in owned:
                p.data = self._placeholder
        self.executor = core.Executor(
            self.runtime, [{"name": "layers.%d" % i, "weights": ws, "grads": gs}
                           for i, (ws, gs) in enumerate(zip(self.weights, self.grads))],
            slot_budget=self.slot_budget)
        if opt is not None:
            opt.attach(self.executor)
        self.optimizer = opt

    def stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream if self.cuda else None

    def bind(self, index, phase):
        """Point the block's parameters at its weights in the slot (zero-copy, DLPack)."""
        for k, p in enumerate(self.params[index]):
            p.data = torch.from_dlpack(self.executor.view(index, phase, VIEW_WEIGHT, k))

    def unbind(self, index):
        for p in self.params[index]:
            p.data = self._placeholder

    def begin(self, index, phase):
        if self.executor is None:
            self.build()
        if phase == FORWARD and index == 0:
            if self.in_step:
                raise RuntimeError(
                    "strata.torch: a new forward pass began before the last one's backward "
                    "finished; every streamed forward needs its backward (use "
                    "torch.no_grad() for evaluation)")
            for callback in self.on_step_begin:
                callback()
            self.executor.step_begin()
            self.in_step = True
        self.executor.acquire(index, phase, self.stream())
        self.bind(index, phase)

    def end(self, index, phase):
        self.unbind(index)
        self.executor.release(index, phase, self.stream())
        if phase == BACKWARD and index == 0:
            self.executor.step_end()
            self.in_step = False

    def load_block(self, index):
        """For evaluation without grads: the block's weights copied from DRAM (no executor)."""
        if self.executor is None:
            self.build()
        if self.optimizer is not None:
            self.optimizer.synchronize()  # updates still running would be read half-done
        for p, w, shape in zip(self.params[index], self.weights[index], self.shapes[index]):
            host = torch.empty(shape, dtype=self.dtype)
            w.read_pointer(host.data_ptr(), host.numel() * host.element_size())
            p.data = host.to(self.device)

    def close(self):
        self.runtime.close()


class _StreamedBlock(torch.autograd.Function):
    """One block as a checkpointed function: the forward pass runs without saving activations
    (only the block's input is kept); the backward pass streams the block in again, recomputes
    its forward with grad enabled and backpropagates, copying the weight grads into the grad
    views the executor sends to DRAM."""

    @staticmethod
    def forward(ctx, session, index, hidden, extra):
        args, kwargs = extra
        session.begin(index, FORWARD)
        try:
            with torch.no_grad():
                out = session.blocks[index].inner(hidden, *args, **kwargs)
        finally:
            session.end(index, FORWARD)
        ctx.session, ctx.index, ctx.extra = session, index, extra
        ctx.tuple_output = isinstance(out, tuple)
        ctx.save_for_backward(hidden)
        return out[0] if ctx.tuple_output else out

    @staticmethod
    def backward(ctx, grad_out):
        session, index = ctx.session, ctx.index
        (hidden,) = ctx.saved_tensors
        args, kwargs = ctx.extra
        session.begin(index, BACKWARD)
        try:
            params = session.params[index]
            with torch.enable_grad():
                h = hidden.detach().requires_grad_(hidden.requires_grad)
                out = session.blocks[index].inner(h, *args, **kwargs)
                if isinstance(out, tuple):
                    out = out[0]
                inputs = ([h] if h.requires_grad else []) + params
                grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
            grad_h = grads[0] if h.requires_grad else None
            for k, g in enumerate(grads[1:] if h.requires_grad else grads):
                view = torch.from_dlpack(session.executor.view(index, BACKWARD, VIEW_GRAD, k))
                if g is not None:
                    view.copy_(g)
                del view
        finally:
            session.end(index, BACKWARD)
        return None, None, grad_h, None


class _BlockWrapper(nn.Module):
    """Stands in for a block: runs it through the session."""

    def __init__(self, session, index, inner):
        super().__init__()
        self.index = index
        self.inner = inner
        self._session = [session]  # a list: not registered as a submodule

    def forward(self, hidden, *args, **kwargs):
        session = self._session[0]
        if not torch.is_grad_enabled():
            session.load_block(self.index)
            try:
                return self.inner(hidden, *args, **kwargs)
            finally:
                session.unbind(self.index)
        out = _StreamedBlock.apply(session, self.index, hidden, (args, kwargs))
        return out


def offload(model, gpu_budget=None, host_budget=None, nvme=None, dtype=None, device=None,
            backend="auto", slot_budget=0):
    """Stream `model`'s blocks through Strata; returns the model, changed in place.

    gpu_budget: HBM bytes for the executor's slots (None: a few blocks). host_budget: pinned
    DRAM bytes (None: what the blocks, grads and optimizer state need). nvme: paths for the
    NVMe tier. slot_budget: HBM for streaming slots within gpu_budget (0: all of it). dtype:
    the compute dtype of the streamed weights (None: the model's). device:
    where to compute (None: cuda if available, else cpu with Strata's host backend)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" else "host"
    blocks = find_blocks(model)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        # A KV cache would be updated again by each block's recomputed forward, corrupting
        # the recomputation; training does not use it.
        config.use_cache = False
    if dtype is None:
        dtype = next(blocks.parameters()).dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError("strata.torch.offload: dtype %s is not float32, bfloat16 or float16" % dtype)
    init = getattr(model, "_init_weights", None)
    session = StrataSession(blocks, device, dtype, gpu_budget, host_budget, nvme, backend,
                            slot_budget, init)
    for i in range(len(blocks)):
        blocks[i] = _BlockWrapper(session, i, blocks[i])
    # Everything else is resident on the device, in the compute dtype (buffers keep theirs);
    # the blocks are registered with the runtime later (StrataSession.build).
    in_blocks = {id(m) for inner in session.inners for m in inner.modules()}
    residents = [m for m in model.modules()
                 if id(m) not in in_blocks and not isinstance(m, _BlockWrapper)]
    for m in residents:
        materialize(m, device, init, recurse=False)
        for p in m.parameters(recurse=False):
            p.data = p.data.to(device, dtype)
        for name, b in list(m.named_buffers(recurse=False)):
            m._buffers[name] = b.to(device)
    model.strata = session
    return model


class AdamW:
    """AdamW for an offloaded model: the blocks by Strata's CPU optimizer (fp32 masters in DRAM,
    each block updated as soon as its grads land), the resident parameters on the device with
    fp32 masters. Hyperparameters and param_groups' lr as torch.optim.AdamW's; the learning rate
    of param_groups[0] is read at every step (LR schedulers work as usual)."""

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 accumulation_steps=1, max_grad_norm=0.0, threads=0):
        session = getattr(model, "strata", None)
        if session is None:
            raise ValueError("strata.torch.AdamW: call strata.torch.offload(model) first")
        self.session = session
        session.build(dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                           weight_decay=weight_decay, accumulation_steps=accumulation_steps,
                           max_grad_norm=max_grad_norm, threads=threads))
        block_ids = {id(p) for ps in session.params for p in ps}
        self.resident = [p for p in model.parameters() if id(p) not in block_ids and p.requires_grad]
        # Resident parameters: fp32 masters on the device, torch's AdamW on them.
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.resident]
        # LR schedulers take a torch.optim.Optimizer: give them this one (its param_groups are
        # the ones read at every step).
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay)
        self.param_groups = self.optimizer.param_groups
        self.accumulation_steps = accumulation_steps
        self._micro = 0
        session.on_step_begin.append(self._sync_lr)
        self._sync_lr()

    def _sync_lr(self):
        group = self.param_groups[0]
        self.session.optimizer.set_group(0, float(group["lr"]), float(group["weight_decay"]))

    def step(self):
        """The blocks' updates already run (they started as their grads landed); this updates
        the resident parameters."""
        self._micro += 1
        if self._micro < self.accumulation_steps:
            return
        self._micro = 0
        for p, m in zip(self.resident, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.resident, self.masters):
                p.copy_(m)

    def zero_grad(self, set_to_none=True):
        if self._micro != 0:
            return  # accumulating
        for p in self.resident:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def synchronize(self):
        """Wait for the blocks' updates (before reading their weights)."""
        self.session.optimizer.synchronize()

    def state_dict(self):
        raise NotImplementedError("save with model.strata.runtime.save_checkpoint(path, "
                                  "model.strata.optimizer)")
