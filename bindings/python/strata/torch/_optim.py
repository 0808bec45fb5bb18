"""strata.torch.AdamW: torch.optim.AdamW for an offloaded model, as a real torch.optim.Optimizer.

The streamed parameters are updated by Strata's CPU AdamW (fp32 masters in DRAM; the update of
each block is queued at step() and runs while the next forward pass streams the blocks below
it in); the resident ones (embedding, final norm, head) by torch's own AdamW on the device,
with fp32 masters where they are not fp32. Semantics are torch.optim.AdamW's: updates happen
at step(), from the grads as they are then (accumulated over any number of backward passes,
clipped or scaled in between), for parameters that have a grad; per-group lr and weight_decay;
LR schedulers, state_dict()/load_state_dict() and zero_grad(set_to_none=...) work as usual."""

import weakref

import torch
from torch import nn

from . import _params
from ._grads import StreamedGrad
from ._paging import StatePager, paged_groups


@torch.no_grad()
def _kept_fp32_values(params, layout):
    """id(p) -> the fp32 values offload kept for resident parameter p (cast to a narrower
    compute dtype), where they still are its values: not written since (a load: torch counts
    its version) and still rounding to it (a write through .data, which torch does not
    count). Under data parallelism the ranks agree (rank 0's values went to every rank: one
    that finds them stale makes every rank start from the parameter)."""
    usable = []
    for p in params:
        initial = _params.fp32(p)
        usable.append(initial is not None and
                      _params.fp32_version(p) == p._version and
                      initial.shape == p.shape and
                      torch.equal(initial.to(p.device, p.dtype), p.detach()))
    if layout is not None:
        usable = layout.agree(usable)
    return {id(p): _params.fp32(p) for p, ok in zip(params, usable) if ok}


def _session_of(p):
    return _params.owner(p)


def _resident_adamw(groups, foreach, fused):
    """torch's AdamW over the resident parameters' fp32 masters: fused (one kernel reading
    and writing each master, grad, m and v once; issue 13 asks for it, and on an H200 it is
    ~0.06 s a step less than foreach's ~80 bytes a parameter for 3.5 G resident parameters)
    unless `foreach` or `fused` says otherwise, as passed to strata.torch.AdamW. Where torch
    has no fused kernel for the device, its default. Fused rounds a few elements differently
    from foreach or the for-loop (another order of the same fp32 operations), as Strata's CPU
    AdamW does for the streamed parameters: the same training within issue 12's tolerances."""
    if fused is None and foreach is None and _fused_supported(groups):
        return torch.optim.AdamW(groups, fused=True)
    return torch.optim.AdamW(groups, foreach=foreach, fused=fused)


def _fused_supported(groups):
    """Whether torch has a fused AdamW kernel for every tensor in `groups` (asked up front:
    newer torch only checks at the first step)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:
        devices = {"cuda"}
    return all(p.device.type in devices and p.is_floating_point()
               for g in groups for p in g["params"])


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, max_grad_norm=0.0, threads=0,
                 accumulation_steps=None):
        if isinstance(params, nn.Module):
            params = [p for p in params.parameters() if p.requires_grad]
        if amsgrad or maximize or capturable or differentiable:
            raise ValueError("strata.torch.AdamW: amsgrad, maximize, capturable and "
                             "differentiable are not supported")
        if accumulation_steps not in (None, 1):
            raise ValueError(
                "strata.torch.AdamW: accumulation_steps is gone: accumulate as in plain "
                "PyTorch ((loss / N).backward() per micro-batch, step() and zero_grad() every "
                "N), which Strata follows exactly")
        if not 0.0 <= max_grad_norm:
            raise ValueError("strata.torch.AdamW: max_grad_norm must be >= 0")
        if len(tuple(betas)) != 2:
            raise ValueError("strata.torch.AdamW: betas must be two numbers (beta1, beta2), "
                             "got %r" % (betas,))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False, foreach=foreach, capturable=False,
                        differentiable=False, fused=fused)
        self._ready = False
        super().__init__(params, defaults)
        self.max_grad_norm = float(max_grad_norm)
        sessions = {}
        for group in self.param_groups:
            for p in group["params"]:
                s = _session_of(p)
                if s is not None:
                    sessions[id(s)] = s
        if len(sessions) > 1:
            raise ValueError("strata.torch.AdamW: the parameters belong to several offloaded "
                             "models; use one optimizer per model")
        self._session = next(iter(sessions.values()), None)
        paged = self.PAGED_STATE
        if not (paged in ("auto", None) or isinstance(paged, int) and
                not isinstance(paged, bool) and paged >= 0):
            # Before anything is built: the optimizer can be created again once it is set right.
            raise ValueError("strata.torch.AdamW.PAGED_STATE is %r, not 'auto', None (every "
                             "resident parameter's) or a count of resident blocks >= 0"
                             % (paged,))
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        if self._session is not None:
            session = self._session
            session.check_open()
            if session.optimizer is None:
                # A forward pass whose backward never came (a loss computed for logging)
                # changes nothing, as in plain PyTorch.
                session.abort()
            trainable = session.blocks_train()
            # (abort above: no forward pass is waiting for its backward)
            if session.optimizer is not None or session.executor is not None and trainable \
                    and not (session.relayable and session.layout.can_relay):
                raise RuntimeError(
                    "strata.torch.AdamW: create the optimizer once, before the first forward "
                    "pass with grad (the streamed blocks' optimizer state is laid out with "
                    "them)%s" % ("" if session.optimizer is not None else
                                 "; the blocks were laid out without it (a checkpoint "
                                 "loaded, a forward pass of frozen blocks) and cannot be "
                                 "laid out again under data parallelism"
                                 if not session.layout.can_relay else
                                 "; the blocks were laid out without it, with values wider "
                                 "than the compute dtype rounded then or written since: "
                                 "offload the model afresh and create the optimizer first"))
            for block in session.blocks:
                for name, p in block.named_parameters():
                    if p.requires_grad and id(p) not in mine:
                        raise ValueError(
                            "strata.torch.AdamW: the streamed parameter %r requires grad but is "
                            "not among the optimizer's parameters; pass all of them (or "
                            "requires_grad_(False) the ones to freeze)"
                            % (session.prefixes[session.blocks.index(block)] + name))
            group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
            if session.executor is not None and trainable:
                # Built without an optimizer by a checkpoint's load (st.load_checkpoint before
                # the optimizer): laid out again from the loaded weights, as the plain model
                # that loaded them and then made its optimizer.
                session.unbuild()
            if session.executor is None:  # (frozen blocks built before: nothing to lay out)
                session.build(dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                                   weight_decay=weight_decay, threads=threads), group_of)
        # Resident parameters: torch's AdamW on fp32 masters (the parameter itself when fp32).
        self._resident = []  # (param, master, our group index)
        inner_groups, self._inner_of = [], {}
        kept = _kept_fp32_values(
            [p for g in self.param_groups for p in g["params"] if _session_of(p) is None],
            None if self._session is None else self._session.layout)
        for gi, group in enumerate(self.param_groups):
            masters = []
            for p in group["params"]:
                if _session_of(p) is not None:
                    continue
                # A resident cast to the compute dtype by offload starts its master from the
                # fp32 values it had (as the streamed blocks' masters do), unless written since.
                initial = kept.get(id(p))
                if p.dtype == torch.float32:
                    master = p
                elif initial is not None and initial.device == p.device:
                    master = initial.detach().requires_grad_(True)  # offload's own copy
                else:
                    source = p.detach() if initial is None else initial
                    master = source.to(p.device, torch.float32, copy=True).requires_grad_(True)
                self._resident.append((p, master, gi))
                masters.append(master)
            if masters:
                self._inner_of[gi] = len(inner_groups)
                inner_groups.append(dict(params=masters, lr=group["lr"], betas=group["betas"],
                                         eps=group["eps"], weight_decay=group["weight_decay"]))
        self._inner = _resident_adamw(inner_groups, foreach, fused) if inner_groups else None
        if self._session is not None:  # its masters took offload's fp32 copies: they go
            self._session.optimizer_created()
        self._pager = self._make_pager()
        # Each resident parameter's version (torch's in-place write counter) when its master
        # and it last agreed: a write since (model.load_state_dict, st.load_checkpoint, an
        # in-place edit under no_grad) makes the master follow the parameter before the next
        # update, as plain PyTorch's AdamW, which updates the parameter itself, would.
        self._synced = {}
        for p, master, _ in self._resident:
            self._mark_synced(p, master)
        self._ready = True
        if self._pager is not None:
            self._pager.page_out(timed=False)  # the masters, from the first forward pass on

    # The resident parameters' optimizer state paged to host memory between a step and the
    # next backward pass (strata.torch._paging; docs/python-reference.md, Performance): "auto" (on CUDA,
    # as much of every resident parameter's as fits in half the host's available memory at
    # the first step's end), None every resident parameter's, an int the first that many
    # resident blocks', 0 none. Read when the optimizer is created.
    PAGED_STATE = "auto"

    def _make_pager(self):
        session = self._session
        paged = self.PAGED_STATE
        if self._inner is None or session is None or \
                not session.layout.pages_resident_state or paged == 0:
            return None
        auto = isinstance(paged, str)
        if auto and session.device.type != "cuda":
            return None  # nothing to make room for
        groups = paged_groups(self._resident, session, None if auto else paged)
        if not any(groups):
            return None
        live = [master for p, master, _ in self._resident if master is p]
        pager = StatePager(self._inner, groups, session.device, live, auto=auto)
        # The session calls the pager while it lives (weakly held: the optimizer owns it).
        # Forward points count the resident blocks first, then the streamed ones.
        resident, streamed = len(session.resident_blocks), len(session.layers)
        ref = weakref.ref(pager)
        session.on_forward_begin.append(
            lambda index: ref() is not None and ref().forward_begins(
                None if index is None else resident + index, resident, streamed))
        session.on_resident_forward_begin.append(
            lambda index: ref() is not None and ref().forward_begins(index, resident, streamed))
        session.on_backward_begin.append(
            lambda index: ref() is not None and ref().backward_begins(index, streamed - 1))
        return pager

    def _bring_in(self, writes=True):
        if self._pager is not None:
            self._pager.bring_in(writes)

    def add_param_group(self, param_group):
        if self._ready:
            raise NotImplementedError(
                "strata.torch.AdamW: param groups are fixed at construction (the streamed "
                "blocks' optimizer state is laid out then); pass every group to the constructor")
        super().add_param_group(param_group)

    # --- the step ------------------------------------------------------------------------

    def _streamed(self):
        s = self._session
        return [] if s is None or s.optimizer is None else \
            [sp for entries in s.layers for sp in entries if sp.trainable]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        session = self._session
        if session is not None:
            session.check_open()
            session.check_not_gathered("opt.step()")
            # A forward pass whose backward never came changes nothing, as in plain PyTorch.
            session.abort()
            if session.optimizer is not None:
                session.sync_grads()
        if self.max_grad_norm > 0:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if session is not None and session.optimizer is not None:
            # Every group's hyperparameters as they are now: torch's AdamW reads lr, betas,
            # eps and weight decay from its param groups at every step (OneCycleLR cycles the
            # betas too), and so does Strata's, bias corrections included.
            for gi, group in enumerate(self.param_groups):
                beta1, beta2 = group["betas"]
                session.optimizer.set_group(gi, float(group["lr"]), float(group["weight_decay"]),
                                            betas=(float(beta1), float(beta2)),
                                            eps=float(group["eps"]))
            session.optimizer.step()
        if self._inner is not None:
            for gi, ii in self._inner_of.items():
                inner, group = self._inner.param_groups[ii], self.param_groups[gi]
                for key in ("lr", "betas", "eps", "weight_decay"):
                    inner[key] = group[key]
            self._step_resident()
        keeper = None if session is None else session.activations
        if keeper is not None:
            # Which resident blocks may keep their activations from now on: decided once the
            # steps run as every later one will (the pager has sized what pages).
            # `paged`: the pager took tensors at some page-out, even if its sizing then
            # stopped it (the steps before used memory in another pattern).
            keeper.on_step(settled=self._pager is None or self._pager.settled,
                           paged=self._pager is not None and self._pager.has_paged)
        return loss

    # Elements per resident update: the fp32 grads and torch's foreach temporaries exist for
    # chunks of whole tensors up to this size (a larger tensor is a chunk of its own), not for
    # every resident parameter at once.
    RESIDENT_CHUNK = 1 << 26

    def _mark_synced(self, p, master):
        if master is not p:
            self._synced[id(p)] = p._version

    @torch.no_grad()
    def _sync_resident_masters(self):
        """The fp32 master of every resident parameter written since it last agreed with its
        master becomes the parameter's values (widened), as strata.torch's streamed
        parameters' masters do on a load (Session.store_weight). Writes through p.data are not
        seen (torch counts no version for them)."""
        for p, master, _ in self._resident:
            if master is not p and p._version != self._synced.get(id(p)):
                self._bring_in(writes=True)  # the host copies of the masters go stale
                master.copy_(p)
                self._mark_synced(p, master)

    def _step_resident(self):
        """torch's AdamW over the resident parameters, a chunk at a time: each inner step sees
        only the chunk's masters (its param groups' lists swapped for the chunk's), with fp32
        copies of their grads. Per element that is the same update as one step over all of
        them; the memory it needs beside the state is a chunk's, where all at once an 8B
        model's 11 resident blocks and head took 14 GB of fp32 grads and as much again in
        foreach temporaries."""
        self._bring_in()
        self._sync_resident_masters()
        groups = self._inner.param_groups
        saved = [g["params"] for g in groups]
        chunks, chunk, size = [], [], 0
        for entry in self._resident:
            if chunk and size + entry[1].numel() > self.RESIDENT_CHUNK:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(entry)
            size += entry[1].numel()
        if chunk:
            chunks.append(chunk)
        try:
            for chunk in chunks:
                for g in groups:
                    g["params"] = []
                for p, master, gi in chunk:
                    if master is not p:
                        master.grad = None if p.grad is None else p.grad.float()
                    groups[self._inner_of[gi]]["params"].append(master)
                self._inner.step()
                for p, master, _ in chunk:
                    if master is not p:
                        master.grad = None  # 4 bytes per parameter, needed only by the update
                        if p.grad is not None:
                            p.copy_(master)
                            self._mark_synced(p, master)
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params
        if self._pager is not None:
            self._pager.page_out()

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)
        if self._session is not None and self._session.optimizer is not None:
            self._session.sync_grads()

    def synchronize(self):
        """Wait for the streamed blocks' queued updates (reading their weights does so itself)."""
        if self._session is not None:
            self._session.check_open()
            if self._session.optimizer is not None:
                self._session.optimizer.synchronize()

    # --- state ----------------------------------------------------------------------------

    def _read_state(self, sp, kind):
        return self._session.read_state(sp, kind)

    def _write_state(self, sp, kind, value):
        self._session.write_state(sp, kind, value)

    def _filled_state(self):
        """self.state as torch.optim.AdamW would hold it (streamed state read from Strata)."""
        state = {}
        for sp in self._streamed():
            _, _, t = self._session.optimizer.grad_info(sp.weight)
            if t == 0:
                continue
            entry = {"step": torch.tensor(float(t)), "exp_avg": self._read_state(sp, "exp_avg"),
                     "exp_avg_sq": self._read_state(sp, "exp_avg_sq")}
            if self._session.dtype != torch.float32:
                entry["master"] = self._read_state(sp, "master")
            state[sp.param] = entry
        if self._inner is not None:
            self._bring_in(writes=False)
            self._sync_resident_masters()
            # Paged state leaves the device at the next forward pass, its tensors' storage
            # freed: what is returned must outlive that (a state dict held while training
            # goes on, saved from a thread), so it is copied to host memory; unpaged, the
            # tensors themselves, as torch's AdamW returns them.
            paged = self._pager is not None and self._pager.has_paged

            def kept(v):
                if not torch.is_tensor(v) or not paged:
                    return v
                return v.detach().to("cpu", copy=True)
            for p, master, _ in self._resident:
                if master in self._inner.state and self._inner.state[master]:
                    entry = {key: kept(v) for key, v in self._inner.state[master].items()}
                    if master is not p:
                        entry["master"] = kept(master) if paged else master.detach().clone()
                    state[p] = entry
        return state

    def state_dict(self):
        self.synchronize()
        saved = self.state
        try:
            self.state = self._filled_state()
            return super().state_dict()
        finally:
            self.state = saved

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        self.synchronize()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(mine["params"])
                for g, mine in zip(groups, self.param_groups)):
            raise ValueError("strata.torch.AdamW.load_state_dict: the state dict's param groups "
                             "do not match this optimizer's (counts of groups or parameters "
                             "differ)")
        by_index = {}
        for g, mine in zip(groups, self.param_groups):
            by_index.update(zip(g["params"], mine["params"]))
            for key, value in g.items():
                if key != "params":
                    mine[key] = value
        saved = {by_index[k]: v for k, v in state_dict["state"].items()}
        if self._session is not None and self._session.optimizer is not None:
            for sp in self._streamed():
                entry = saved.get(sp.param)
                if entry is None:
                    zeros = torch.zeros(sp.shape)
                    self._write_state(sp, "exp_avg", zeros)
                    self._write_state(sp, "exp_avg_sq", zeros)
                    self._session.optimizer.set_param_step(sp.weight, 0)
                    continue
                self._write_state(sp, "exp_avg", entry["exp_avg"])
                self._write_state(sp, "exp_avg_sq", entry["exp_avg_sq"])
                if "master" in entry and self._session.dtype != torch.float32:
                    self._write_state(sp, "master", entry["master"])
                self._session.optimizer.set_param_step(sp.weight, int(entry["step"]))
        if self._inner is not None:
            self._bring_in()
            for p, master, _ in self._resident:
                self._restore_resident(p, master, saved.get(p))

    def _restore_resident(self, p, master, entry):
        """A resident parameter's torch AdamW state (and fp32 master) from a saved entry; no
        entry: no state (the parameter has not been updated yet). A saved master is the
        parameter's from then on (a write to the parameter before it does not count)."""
        self._inner.state.pop(master, None)
        if entry is None:
            return
        inner = {}
        for key, value in entry.items():
            if key == "master":
                master.copy_(value)
                self._mark_synced(p, master)
            elif key == "step":
                # Where torch's own load_state_dict puts it: on the device for the fused (and
                # capturable) kernels, which read it there; on the CPU otherwise.
                on_device = self._inner.defaults.get("fused") or \
                    self._inner.defaults.get("capturable")
                inner[key] = value.detach().to(master.device if on_device else "cpu",
                                               torch.float32).clone()
            else:
                inner[key] = value.detach().to(master.device, torch.float32).clone()
        self._inner.state[master] = inner

    def resident_state(self):
        """What a whole-state checkpoint keeps besides Strata's files: the resident parameters'
        optimizer state (with masters) and every group's hyperparameters."""
        state = {}
        if self._inner is not None:
            self._bring_in(writes=False)
            self._sync_resident_masters()
            for k, (p, master, _) in enumerate(self._resident):
                if master in self._inner.state and self._inner.state[master]:
                    entry = {key: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                             for key, v in self._inner.state[master].items()}
                    if master is not p:
                        entry["master"] = master.detach().cpu().clone()
                    state[k] = entry
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"resident": state, "param_groups": groups}

    @torch.no_grad()
    def load_resident_state(self, saved):
        if len(saved["param_groups"]) != len(self.param_groups):
            raise ValueError("strata.torch.load_checkpoint: the checkpoint's optimizer has %d "
                             "param groups, this one %d" % (len(saved["param_groups"]),
                                                            len(self.param_groups)))
        for g, mine in zip(saved["param_groups"], self.param_groups):
            mine.update(g)
        if self._inner is None:
            return
        self._bring_in()
        for k, (p, master, _) in enumerate(self._resident):
            self._restore_resident(p, master, saved["resident"].get(k))


__all__ = ["AdamW", "StreamedGrad"]
