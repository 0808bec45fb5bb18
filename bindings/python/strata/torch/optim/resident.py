"""The resident parameters' half of a strata.torch optimizer (embedding, final norm, head,
resident blocks): torch's optimizer of the same kind on the device over their fp32 masters
(Lion: TorchLion, lion-pytorch's formula), the masters kept in step with the parameters, the
update a chunk at a time, and the pager of their state (strata.torch.paging)."""

import weakref

import torch

from .. import _params
from ..paging.groups import paged_groups
from ..paging.pager import StatePager


@torch.no_grad()
def kept_fp32_values(params, layout):
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


def resident_torch(cls, groups, foreach, fused):
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


class TorchLion(torch.optim.Optimizer):
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


class ResidentOptimizer:
    """torch's optimizer (`inner`, None without resident parameters) over the resident
    parameters' fp32 masters (the parameter itself when fp32), one per strata.torch optimizer,
    which owns it and passes what its subclass decides (the torch optimizer, the group keys
    copied at every step, a parameter's fresh state, the chunk size)."""

    def __init__(self, param_groups, hyper, make_inner, kept):
        """param_groups: the strata.torch optimizer's; hyper: the group keys `inner` takes;
        make_inner(groups): the torch optimizer over the masters' groups; kept:
        kept_fp32_values' (offload's fp32 copies still valid)."""
        # Resident parameters: torch's optimizer on fp32 masters (the parameter itself when
        # fp32).
        self.entries = []  # (param, master, our group index)
        inner_groups, self.inner_of = [], {}
        for gi, group in enumerate(param_groups):
            masters = []
            for p in group["params"]:
                if _params.owner(p) is not None:
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
                self.entries.append((p, master, gi))
                masters.append(master)
            if masters:
                self.inner_of[gi] = len(inner_groups)
                inner_groups.append(dict(params=masters, **{k: group[k] for k in hyper}))
        self.inner = make_inner(inner_groups) if inner_groups else None
        self.hyper = hyper
        self.pager = None  # the pager of the masters' state (make_pager), or None
        # Each resident parameter's version (torch's in-place write counter) when its master
        # and it last agreed: a write since (model.load_state_dict, st.load_checkpoint, an
        # in-place edit under no_grad) makes the master follow the parameter before the next
        # update, as plain PyTorch's AdamW, which updates the parameter itself, would
        # (mark_all_synced starts it).
        self.synced = {}

    def mark_all_synced(self):
        """Every resident parameter agrees with its master now."""
        for p, master, _ in self.entries:
            self.mark_synced(p, master)

    def make_pager(self, session, paged):
        """The pager of the masters' state, called by the session at each block's start
        (None: nothing pages). paged: the optimizer's PAGED_STATE."""
        if self.inner is None or session is None or \
                not session.layout.pages_resident_state or paged == 0:
            return None
        auto = isinstance(paged, str)
        if auto and session.device.type != "cuda":
            return None  # nothing to make room for
        groups = paged_groups(self.entries, session, None if auto else paged)
        if not any(groups):
            return None
        live = [master for p, master, _ in self.entries if master is p]
        spill = session.spill
        pager = StatePager(self.inner, groups, session.device, live, auto=auto,
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

    def bring_in(self, writes=True):
        """The paged state back on the device (`writes`: the host copies go stale)."""
        if self.pager is not None:
            self.pager.bring_in(writes)

    def mark_synced(self, p, master):
        if master is not p:
            self.synced[id(p)] = p._version

    @torch.no_grad()
    def sync_masters(self):
        """The fp32 master of every resident parameter written since it last agreed with its
        master becomes the parameter's values (widened), as strata.torch's streamed
        parameters' masters do on a load (Session.store_weight). Writes through p.data are not
        seen (torch counts no version for them)."""
        for p, master, _ in self.entries:
            if master is not p and p._version != self.synced.get(id(p)):
                self.bring_in(writes=True)  # the host copies of the masters go stale
                master.copy_(p)
                self.mark_synced(p, master)

    def step(self, param_groups, chunk_elements):
        """torch's optimizer over the resident parameters, a chunk at a time: each inner step sees
        only the chunk's masters (its param groups' lists swapped for the chunk's), with fp32
        copies of their grads. Per element that is the same update as one step over all of
        them; the memory it needs beside the state is a chunk's, where all at once an 8B
        model's 11 resident blocks and head took 14 GB of fp32 grads and as much again in
        foreach temporaries. param_groups: the strata.torch optimizer's, whose hyperparameters
        (as they are now: an LR scheduler changes them) the inner groups take first;
        chunk_elements: the optimizer's RESIDENT_CHUNK."""
        for gi, ii in self.inner_of.items():
            inner, group = self.inner.param_groups[ii], param_groups[gi]
            for key in self.hyper:
                inner[key] = group[key]
        self.bring_in()
        self.sync_masters()
        groups = self.inner.param_groups
        saved = [g["params"] for g in groups]
        chunks, chunk, size = [], [], 0
        for entry in self.entries:
            if chunk and size + entry[1].numel() > chunk_elements:
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
                    groups[self.inner_of[gi]]["params"].append(master)
                self.inner.step()
                for p, master, _ in chunk:
                    if master is not p:
                        master.grad = None  # 4 bytes per parameter, needed only by the update
                        if p.grad is not None:
                            p.copy_(master)
                            self.mark_synced(p, master)
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params
        if self.pager is not None:
            self.pager.page_out()

    def restore(self, p, master, entry, fresh_state):
        """A resident parameter's torch optimizer state (and fp32 master) from a saved entry; no
        entry: no state (the parameter has not been updated yet), or torch's initial one
        (Adagrad's). A saved master is the parameter's from then on (a write to the parameter
        before it does not count)."""
        self.inner.state.pop(master, None)
        if entry is None:
            fresh = fresh_state(master)
            if fresh is not None:
                self.inner.state[master] = fresh
            return
        inner = {}
        for key, value in entry.items():
            if key == "master":
                master.copy_(value)
                self.mark_synced(p, master)
            elif key == "step":
                # Where torch's own load_state_dict puts it: on the device for the fused (and
                # capturable) kernels, which read it there; on the CPU otherwise.
                on_device = self.inner.defaults.get("fused") or \
                    self.inner.defaults.get("capturable")
                inner[key] = value.detach().to(master.device if on_device else "cpu",
                                               torch.float32).clone()
            else:
                inner[key] = value.detach().to(master.device, torch.float32).clone()
        self.inner.state[master] = inner
