"""strata.torch's optimizers: AdamW, Adam, SGD, Lion and Adagrad for an offloaded model, each a
real torch.optim.Optimizer.

The streamed parameters are updated by Strata's CPU optimizer of the same kind (fp32 masters in
DRAM; the update of each block is queued at step() and runs while the next forward pass streams
the blocks below it in); the resident ones (embedding, final norm, head) by torch's own
optimizer on the device (Lion: _TorchLion below, lion-pytorch's formula), with fp32 masters
where they are not fp32. Semantics are the torch optimizer's: updates happen at step(), from
the grads as they are then (accumulated over any number of backward passes, clipped or scaled
in between), for parameters that have a grad; per-group hyperparameters read at every step;
LR schedulers, state_dict()/load_state_dict() and zero_grad(set_to_none=...) work as usual.
One base class (_Optimizer) holds all of that; each optimizer is a small subclass naming its
Strata kind, its torch counterpart, its state and how its groups reach Strata's."""

import time
import weakref

import torch
from torch import nn

from . import _params
from ._agreement import EveryRank
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


def _resident_torch(cls, groups, foreach, fused):
    """torch's `cls` (AdamW, Adam) over the resident parameters' fp32 masters: fused (one
    kernel reading and writing each master, grad, m and v once; issue 13 asks for it, and on
    an H200 it is ~0.06 s a step less than foreach's ~80 bytes a parameter for 3.5 G resident
    parameters) unless `foreach` or `fused` says otherwise, as passed to the strata.torch
    optimizer. Where torch has no fused kernel for the device, its default. Fused rounds a few
    elements differently from foreach or the for-loop (another order of the same fp32
    operations), as Strata's CPU optimizer does for the streamed parameters: the same training
    within issue 12's tolerances."""
    if fused is None and foreach is None and _fused_supported(groups):
        return cls(groups, fused=True)
    return cls(groups, foreach=foreach, fused=fused)


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


class _TorchLion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) on the device for the resident parameters, as lion-pytorch's
    reference: p *= 1 - lr wd; p -= lr sign(lerp(m, g, 1 - beta1)); m = lerp(m, g, 1 - beta2).
    State: exp_avg."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - lr * wd)
                p.add_(torch.lerp(m, p.grad, 1 - beta1).sign_(), alpha=-lr)
                m.lerp_(p.grad, 1 - beta2)
        return loss


def _check_options(name, **flags):
    """torch options strata.torch does not implement, refused by name when set."""
    on = sorted(k for k, v in flags.items() if v)
    if on:
        raise ValueError("strata.torch.%s: %s not supported" % (name, ", ".join(on)))


class _Optimizer(torch.optim.Optimizer):
    """What every strata.torch optimizer shares (see the module's docstring). A subclass sets
    NAME, KIND (core.OPTIMIZERS's key), HYPER (the group keys the resident optimizer copies at
    every step), STATE (torch's state key -> Strata's state tensor) and implements
    _settings, _make_resident and _set_groups."""

    NAME = KIND = None
    HYPER = ()
    STATE = {}
    STEP_IN_STATE = True  # torch keeps a "step" per parameter (SGD and Lion do not)

    def _settings(self):
        """core.Optimizer's settings for the streamed blocks (group 0's, from the defaults)."""
        raise NotImplementedError

    def _make_resident(self, groups):
        """The torch optimizer over the resident masters' param groups."""
        raise NotImplementedError

    def _set_groups(self, optimizer):
        """Every group's hyperparameters as they are now into Strata's optimizer."""
        raise NotImplementedError

    def _check_groups(self):
        """Refuse param groups Strata's optimizer cannot run, before anything is laid out."""

    def _state_kinds(self):
        return self.STATE

    def _initial_value(self, key):
        """The constant a state tensor holds before any update, as torch's optimizer starts it
        (zeros, Adagrad's initial_accumulator_value)."""
        return 0.0

    def _initial_state(self, key, shape, device):
        """A state tensor before any update (torch's initial value)."""
        return torch.full(shape, self._initial_value(key), device=device)

    def _fresh_resident_state(self, master):
        """A resident parameter's torch state when it has none (None: torch makes it)."""
        return None

    def _start(self, params, defaults, max_grad_norm, threads, accumulation_steps=None):
        who = "strata.torch." + self.NAME
        self._ready = False
        self._session = None
        # The arguments' checks, then the build (collective under data parallelism): every
        # rank learns whether the checks passed on every rank before the build's first
        # collective (strata.torch._agreement), instead of the others waiting in it until
        # DataParallel's timeout. Those before the session is known (torch's own, of the
        # params and groups) raise where they fail: the same call fails alike on every rank.
        checking = EveryRank.deferred("checking %s's arguments" % who)
        with checking:
            group_of = self._check_start(params, defaults, max_grad_norm, accumulation_steps,
                                         who)
        session = self._session
        checking.agree(None if session is None else session.mesh)
        if session is not None and session.executor is not None and session.blocks_train():
            # Built without an optimizer by a checkpoint's load (st.load_checkpoint before
            # the optimizer): laid out again from the loaded weights, as the plain model
            # that loaded them and then made its optimizer.
            session.builder.unbuild()
        if session is not None and session.executor is None:
            # (frozen blocks built before: nothing to lay out)
            session.builder.build(dict(self._settings(), kind=self.KIND, threads=threads), group_of)
        started = time.perf_counter()  # the resident parameters' masters and torch optimizer
        kept = _kept_fp32_values(  # (collective under data parallelism: the ranks agree)
            [p for g in self.param_groups for p in g["params"] if _session_of(p) is None],
            None if session is None else session.layout)
        # The rest is this rank's own work until the first step's collectives.
        mesh = None if session is None else session.mesh
        try:
            with EveryRank(mesh, "creating %s's state" % who):
                if session is not None and session.optimizer is not None:
                    initial = time.perf_counter()
                    self._init_streamed_state()
                    started += session.timed("initial_state", initial) - initial
                self._make_masters(kept)
        except BaseException:
            if mesh is not None:  # as a failed build: half made on every rank, the job ends
                session.close()
            raise
        if session is not None:
            session.timed("resident_optimizer", started)

    def _check_start(self, params, defaults, max_grad_norm, accumulation_steps, who):
        """The optimizer's arguments checked against its session (self._session, found here),
        nothing built: returns id(param) -> group index."""
        if isinstance(params, nn.Module):
            params = [p for p in params.parameters() if p.requires_grad]
        if accumulation_steps not in (None, 1):
            raise ValueError(
                "%s: accumulation_steps is gone: accumulate as in plain PyTorch ((loss / "
                "N).backward() per micro-batch, step() and zero_grad() every N), which Strata "
                "follows exactly" % who)
        if not 0.0 <= max_grad_norm:
            raise ValueError("%s: max_grad_norm must be >= 0" % who)
        torch.optim.Optimizer.__init__(self, params, defaults)
        self._check_groups()
        self.max_grad_norm = float(max_grad_norm)
        sessions = {}
        for group in self.param_groups:
            for p in group["params"]:
                s = _session_of(p)
                if s is not None:
                    sessions[id(s)] = s
        if len(sessions) > 1:
            raise ValueError("%s: the parameters belong to several offloaded models; use one "
                             "optimizer per model" % who)
        self._session = next(iter(sessions.values()), None)
        paged = self.PAGED_STATE
        if not (paged in ("auto", None) or isinstance(paged, int) and
                not isinstance(paged, bool) and paged >= 0):
            # Before anything is built: the optimizer can be created again once it is set right.
            raise ValueError("%s.PAGED_STATE is %r, not 'auto', None (every resident "
                             "parameter's) or a count of resident blocks >= 0" % (who, paged))
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self._group_of = group_of
        session = self._session
        if session is None:
            return group_of
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
                "%s: create the optimizer once, before the first forward pass with grad "
                "(the streamed blocks' optimizer state is laid out with them)%s" % (
                    who, "" if session.optimizer is not None else
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
                        "%s: the streamed parameter %r requires grad but is not among "
                        "the optimizer's parameters; pass all of them (or "
                        "requires_grad_(False) the ones to freeze)"
                        % (who, session.prefixes[session.blocks.index(block)] + name))
        return group_of

    def _make_masters(self, kept):
        """The resident parameters' fp32 masters and torch optimizer, and the pager of their
        state. kept: _kept_fp32_values' (offload's fp32 copies still valid)."""
        # Resident parameters: torch's optimizer on fp32 masters (the parameter itself when
        # fp32).
        self._resident = []  # (param, master, our group index)
        inner_groups, self._inner_of = [], {}
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
                inner_groups.append(dict(params=masters, **{k: group[k] for k in self.HYPER}))
        self._inner = self._make_resident(inner_groups) if inner_groups else None
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

    def _init_streamed_state(self):
        """The streamed parameters' state where torch's does not start at zero (Adagrad's
        initial_accumulator_value): Strata's starts zeroed. Decided from the constant, not by
        building each parameter's initial tensor to test it: that was a tensor per parameter
        and state, about 210 GB written and read for a 30B's AdamW (its 47 streamed blocks'
        moments; 49 s of its setup)."""
        for key, kind in self._state_kinds().items():
            if self._initial_value(key) == 0.0:
                continue
            for sp in self._streamed():
                self._write_state(sp, kind, self._initial_state(key, sp.shape, "cpu"))

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
        spill = session.spill
        pager = StatePager(self._inner, groups, session.device, live, auto=auto,
                           reserve=spill.backward_reserve,
                           budget=getattr(session, "host_budget", None))
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
        session.on_resident_backward_begin.append(
            lambda index: ref() is not None and ref().resident_backward_begins(index))
        # The spill decision counts the state on its way out as gone by the loss.
        spill.leaving = lambda: ref().leaving_bytes() if ref() is not None else 0
        return pager

    def _bring_in(self, writes=True):
        if self._pager is not None:
            self._pager.bring_in(writes)

    def add_param_group(self, param_group):
        if self._ready:
            raise NotImplementedError(
                "strata.torch.%s: param groups are fixed at construction (the streamed blocks' "
                "optimizer state is laid out then); pass every group to the constructor"
                % self.NAME)
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
                session.passes.sync_grads()
        if self.max_grad_norm > 0:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if session is not None and session.optimizer is not None:
            # Every group's hyperparameters as they are now: torch's optimizers read them from
            # their param groups at every step (OneCycleLR cycles AdamW's betas too), and so
            # does Strata's, bias corrections included.
            self._set_groups(session.optimizer)
            session.optimizer.step()
        if self._inner is not None:
            for gi, ii in self._inner_of.items():
                inner, group = self._inner.param_groups[ii], self.param_groups[gi]
                for key in self.HYPER:
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
        """torch's optimizer over the resident parameters, a chunk at a time: each inner step sees
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
            self._session.passes.sync_grads()

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

    def _streamed_entry(self, sp):
        """A streamed parameter's state as torch's optimizer holds it, or None (no state)."""
        _, _, t = self._session.optimizer.grad_info(sp.weight)
        if t == 0 and not self._state_from_start():
            return None
        entry = {"step": torch.tensor(float(t))} if self.STEP_IN_STATE else {}
        for key, kind in self._state_kinds().items():
            entry[key] = self._read_state(sp, kind)
        if not entry:
            return None  # SGD without momentum keeps none (torch neither)
        if self._session.dtype != torch.float32:
            entry["master"] = self._read_state(sp, "master")
        return entry

    def _state_from_start(self):
        """Whether torch holds state for a parameter never updated (Adagrad: from creation)."""
        return False

    def _filled_state(self):
        """self.state as the torch optimizer would hold it (streamed state read from Strata)."""
        state = {}
        for sp in self._streamed():
            entry = self._streamed_entry(sp)
            if entry is not None:
                state[sp.param] = entry
        if self._inner is not None:
            self._bring_in(writes=False)
            self._sync_resident_masters()
            # Paged state leaves the device at the next forward pass, its tensors' storage
            # freed: what is returned must outlive that (a state dict held while training
            # goes on, saved from a thread), so it is copied to host memory; unpaged, the
            # tensors themselves, as torch's optimizers return them.
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
            raise ValueError("strata.torch.%s.load_state_dict: the state dict's param groups "
                             "do not match this optimizer's (counts of groups or parameters "
                             "differ)" % self.NAME)
        by_index = {}
        for g, mine in zip(groups, self.param_groups):
            by_index.update(zip(g["params"], mine["params"]))
            for key, value in g.items():
                if key != "params":
                    mine[key] = value
        saved = {by_index[k]: v for k, v in state_dict["state"].items()}
        if self._session is not None and self._session.optimizer is not None:
            for sp in self._streamed():
                entry = saved.get(sp.param) or {}
                for key, kind in self._state_kinds().items():
                    value = entry.get(key)
                    self._write_state(sp, kind, self._initial_state(key, sp.shape, "cpu")
                                      if value is None else value)
                if "master" in entry and self._session.dtype != torch.float32:
                    self._write_state(sp, "master", entry["master"])
                if self.STEP_IN_STATE:
                    step = int(entry["step"]) if "step" in entry else 0
                else:  # any count above 0 is "updated before" (SGD's buffer then exists)
                    step = 1 if any(k in entry for k in self._state_kinds()) else 0
                self._session.optimizer.set_param_step(sp.weight, step)
        if self._inner is not None:
            self._bring_in()
            for p, master, _ in self._resident:
                self._restore_resident(p, master, saved.get(p))

    def _restore_resident(self, p, master, entry):
        """A resident parameter's torch optimizer state (and fp32 master) from a saved entry; no
        entry: no state (the parameter has not been updated yet), or torch's initial one
        (Adagrad's). A saved master is the parameter's from then on (a write to the parameter
        before it does not count)."""
        self._inner.state.pop(master, None)
        if entry is None:
            fresh = self._fresh_resident_state(master)
            if fresh is not None:
                self._inner.state[master] = fresh
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


def _betas(name, betas):
    if len(tuple(betas)) != 2:
        raise ValueError("strata.torch.%s: betas must be two numbers (beta1, beta2), got %r"
                         % (name, betas))
    return tuple(betas)


class AdamW(_Optimizer):
    """torch.optim.AdamW (decoupled weight decay)."""

    NAME, KIND = "AdamW", "adamw"
    HYPER = ("lr", "betas", "eps", "weight_decay")
    STATE = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    TORCH = torch.optim.AdamW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, max_grad_norm=0.0, threads=0,
                 accumulation_steps=None):
        _check_options(self.NAME, amsgrad=amsgrad, maximize=maximize, capturable=capturable,
                       differentiable=differentiable)
        defaults = dict(lr=lr, betas=_betas(self.NAME, betas), eps=eps,
                        weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=foreach, capturable=False, differentiable=False, fused=fused)
        self._start(params, defaults, max_grad_norm, threads, accumulation_steps)

    def _settings(self):
        d = self.defaults
        return dict(lr=d["lr"], beta1=d["betas"][0], beta2=d["betas"][1], eps=d["eps"],
                    weight_decay=d["weight_decay"])

    def _make_resident(self, groups):
        return _resident_torch(self.TORCH, groups, self.defaults["foreach"],
                               self.defaults["fused"])

    def _set_groups(self, optimizer):
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            optimizer.set_group(gi, float(group["lr"]), float(group["weight_decay"]),
                                betas=(float(beta1), float(beta2)), eps=float(group["eps"]))


class Adam(AdamW):
    """torch.optim.Adam (L2 weight decay: added to the grad; bias corrections as torch's)."""

    NAME, KIND = "Adam", "adam"
    TORCH = torch.optim.Adam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, max_grad_norm=0.0, threads=0):
        AdamW.__init__(self, params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                       foreach=foreach, capturable=capturable, differentiable=differentiable,
                       fused=fused, max_grad_norm=max_grad_norm, threads=threads)


class SGD(_Optimizer):
    """torch.optim.SGD (momentum, dampening, Nesterov, L2 weight decay). The streamed blocks'
    momentum, dampening and nesterov are their optimizer's config: the same in every group,
    fixed at creation (a change is refused at the next step); lr and weight decay are read
    from the groups at every step."""

    NAME, KIND = "SGD", "sgd"
    HYPER = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    STEP_IN_STATE = False
    _FIXED = ("momentum", "dampening", "nesterov")

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, max_grad_norm=0.0, threads=0):
        _check_options(self.NAME, maximize=maximize, differentiable=differentiable)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("strata.torch.SGD: Nesterov momentum requires a momentum and zero "
                             "dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=False,
                        foreach=foreach, differentiable=False, fused=fused)
        self._fixed = tuple(float(defaults[k]) for k in self._FIXED)
        self.STATE = {"momentum_buffer": "exp_avg"} if momentum > 0 else {}
        self._start(params, defaults, max_grad_norm, threads)

    def _check_groups(self, when=None):
        """The groups holding streamed parameters take the config's momentum, dampening and
        nesterov; `when`: the call that found a change (None: creation)."""
        for gi, group in enumerate(self.param_groups):
            now = tuple(float(group[k]) for k in self._FIXED)
            if now == self._fixed or all(_session_of(p) is None for p in group["params"]):
                continue
            raise ValueError(
                "strata.torch.SGD: momentum, dampening and nesterov of the streamed blocks' "
                "groups are fixed when the optimizer is created (%s) and the same in every "
                "group, but %sgroup %d has %s; give every group the same, and change only lr "
                "and weight_decay while training (OneCycleLR: cycle_momentum=False)"
                % (dict(zip(self._FIXED, self._fixed)), "at %s " % when if when else "", gi,
                   dict(zip(self._FIXED, now))))

    def _settings(self):
        d = self.defaults
        return dict(lr=d["lr"], momentum=d["momentum"], dampening=d["dampening"],
                    nesterov=int(bool(d["nesterov"])), weight_decay=d["weight_decay"])

    def _make_resident(self, groups):
        extra = {} if self.defaults["fused"] is None else {"fused": self.defaults["fused"]}
        return torch.optim.SGD(groups, foreach=self.defaults["foreach"], **extra)

    def _set_groups(self, optimizer):
        self._check_groups("step()")
        for gi, group in enumerate(self.param_groups):
            optimizer.set_group(gi, float(group["lr"]), float(group["weight_decay"]))


class Lion(_Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as
    lion-pytorch: update = sign(beta1 m + (1 - beta1) g), p -= lr (update + weight_decay p)
    (decoupled), m = beta2 m + (1 - beta2) g. torch has no Lion: the resident parameters use
    _TorchLion, the same formula. State: exp_avg."""

    NAME, KIND = "Lion", "lion"
    HYPER = ("lr", "betas", "weight_decay")
    STATE = {"exp_avg": "exp_avg"}
    STEP_IN_STATE = False

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 max_grad_norm=0.0, threads=0):
        betas = _betas(self.NAME, betas)
        if not lr > 0 or not all(0 <= b <= 1 for b in betas):
            raise ValueError("strata.torch.Lion: lr must be > 0 and betas in [0, 1]")
        self._start(params, dict(lr=lr, betas=betas, weight_decay=weight_decay),
                    max_grad_norm, threads)

    def _settings(self):
        d = self.defaults
        return dict(lr=d["lr"], beta1=d["betas"][0], beta2=d["betas"][1],
                    weight_decay=d["weight_decay"])

    def _make_resident(self, groups):
        return _TorchLion(groups)

    def _set_groups(self, optimizer):
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            optimizer.set_group(gi, float(group["lr"]), float(group["weight_decay"]),
                                betas=(float(beta1), float(beta2)))


class Adagrad(_Optimizer):
    """torch.optim.Adagrad (lr_decay, L2 weight decay, initial_accumulator_value, eps). State
    (from creation, as torch's): step and sum. lr_decay divides a group's lr by
    1 + (step - 1) lr_decay at each step; with lr_decay the streamed parameters of a group must
    have taken the same number of steps (they do unless some had no grad at some step)."""

    NAME, KIND = "Adagrad", "adagrad"
    HYPER = ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value")
    STATE = {"sum": "exp_avg_sq"}

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10, foreach=None, *, maximize=False,
                 differentiable=False, fused=None, max_grad_norm=0.0, threads=0):
        _check_options(self.NAME, maximize=maximize, differentiable=differentiable)
        for key, value in (("lr", lr), ("lr_decay", lr_decay), ("weight_decay", weight_decay),
                           ("initial_accumulator_value", initial_accumulator_value)):
            if not value >= 0:
                raise ValueError("strata.torch.Adagrad: %s must be >= 0, got %r" % (key, value))
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                        maximize=False, differentiable=False, fused=fused)
        self._start(params, defaults, max_grad_norm, threads)

    def _state_from_start(self):
        return True

    def _initial_value(self, key):
        return float(self.defaults["initial_accumulator_value"])

    def _fresh_resident_state(self, master):
        return {"step": torch.tensor(0.0),
                "sum": torch.full_like(master, self._initial_value("sum"),
                                       memory_format=torch.preserve_format)}

    def _settings(self):
        d = self.defaults
        return dict(lr=d["lr"], eps=d["eps"], weight_decay=d["weight_decay"])

    def _make_resident(self, groups):
        extra = {} if self.defaults["fused"] is None else {"fused": self.defaults["fused"]}
        # torch's Adagrad starts every sum from its constructor's initial_accumulator_value
        # (not the group's): passed, as the user passed it to this one.
        return torch.optim.Adagrad(
            groups, initial_accumulator_value=self.defaults["initial_accumulator_value"],
            foreach=self.defaults["foreach"], **extra)

    def _set_groups(self, optimizer):
        steps = {}  # group -> the update counts its streamed parameters holding a grad are at
        if any(g["lr_decay"] != 0 for g in self.param_groups):
            for sp in self._streamed():
                has_grad, _, t = optimizer.grad_info(sp.weight)
                if has_grad:
                    steps.setdefault(self._group_of[id(sp.param)], set()).add(t)
        for gi, group in enumerate(self.param_groups):
            lr = float(group["lr"])
            counts = steps.get(gi)
            if group["lr_decay"] != 0 and counts:
                if len(counts) > 1:
                    raise ValueError(
                        "strata.torch.Adagrad: lr_decay with the streamed parameters of group "
                        "%d at different step counts %s (some had no grad at some step): the "
                        "streamed blocks' update takes one learning rate per group; give "
                        "those parameters a group of their own" % (gi, sorted(counts)))
                lr = lr / (1 + next(iter(counts)) * float(group["lr_decay"]))
            optimizer.set_group(gi, lr, float(group["weight_decay"]), eps=float(group["eps"]))


__all__ = ["AdamW", "Adam", "SGD", "Lion", "Adagrad", "StreamedGrad"]
