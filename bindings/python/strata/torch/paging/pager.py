"""StatePager: the paged state's way out and back, a state machine driven by the optimizer
(page_out after the update, bring_in before it and before any read or write outside a step)
and by the session's hooks (forward_begins, backward_begins, resident_backward_begins).
strata.torch.paging's docstring says when the state leaves, when it comes back and why."""

import torch

from .buffers import FlatBuffers
from .groups import by_group, device_tensors, nbytes
from .host import HostCopies
from .inbound import Inbound
from .outbound import Outbound
from .sizing import PageSizing


class StatePager:
    """Pages the fp32 masters in `groups` (lists of them, in forward order) and their state
    tensors in `inner.state` (a torch optimizer's) out to host memory and back. `live`: the
    masters that are the model's own parameters (fp32 models): their state pages, they do
    not. `sizing`: measure the first steps and keep paging only what fits (CUDA)."""

    def __init__(self, inner, groups, device, live=(), sizing=True, auto=False, reserve=None,
                 budget=None):
        self.inner = inner
        self.groups = [list(g) for g in groups if g]
        # The session's strata.torch._planning.HostBudget: the host copies take at most what
        # host_budget leaves (auto: decided at the first step's end; a count of blocks or
        # every resident parameter's: the first groups that fit now, here).
        self.budget = budget
        self.live = {id(m) for m in live}
        self.device = device
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.copies = HostCopies(budget, self.stream)
        self.buffers = FlatBuffers(device)
        self.outbound = Outbound(self.buffers, device, self.stream)
        self.inbound = Inbound(self.buffers, device, self.stream, reserve)
        self.sizing = PageSizing(self.live, sizing, auto, device)
        self.state = "in"  # "in", "leaving" (copies out queued), "out", "coming" (in part)
        self.pairs = []  # (device tensor, host tensor) of the last page-out, in group order
        self.pieces = []  # the same pairs by group: [(group index, [(tensor, host)])]
        self.active = len(self.groups)  # the groups that page (a prefix)
        self.paged_bytes = 0  # of the last page-out
        # Times the host waited at the forward pass's last block for the copies out, and
        # steps that began before the copies back were done.
        self.late_out = 0
        self.late_in = 0
        # Whether the host copies hold what the device tensors hold (a page-out completed and
        # nothing wrote since): a forward pass that pages out again (gradient accumulation,
        # after a read or a failed step) then frees without copying.
        self.current = False
        self.has_paged = False  # some page-out took tensors (the keeper measures afresh)
        self.last_point = "end"  # the forward pass's last point seen (forward_begins)
        if budget is not None:
            budget.add("paged optimizer state", self.copies)
            if self.sizing.probe is None:
                fits = self.sizing.budget_fit(self.groups, budget.room())
                self.groups = self.groups[:fits]
                self.active = fits

    def _tensors(self, groups):
        """(key, tensor) for each tensor of those groups with device memory now, masters
        first (groups.device_tensors)."""
        return device_tensors(groups, self.inner.state, self.live, self.device)

    # --- out -------------------------------------------------------------------------------

    @torch.no_grad()
    def page_out(self, timed=True, again=False):
        """After the update (queued on the current stream): the paged tensors are to leave.
        Their copies out are issued a share at a time as the next forward pass goes (send):
        issued at once, they held the loop's own small copies to the host (a loss.item()
        after the step) behind them on the copy engine. A group's device memory stays until
        FREE_LAG forward points after its copies were issued (the last groups': release).
        `timed`: a step's page-out, whose copies the next forward pass times. `again`: a
        forward pass begins with the state in HBM (the step's page-out was cancelled by a
        write, a failed step brought it back, or this is a later micro-batch of gradient
        accumulation): it leaves in this forward pass too, copied only if the host copies are
        not current."""
        if self.state != "in":
            return
        if self.sizing.probe is not None and (again or self._probing(timed)):
            return
        if not self.sizing.sized and not again:
            self._size()
        pending, counts = [], []
        for g, group in enumerate(self.groups[:self.active]):
            mine = [(k, t) for k, t in self._tensors([group]) if t.untyped_storage().nbytes() > 0]
            if mine:
                pending.extend(mine)
                counts.append((g, len(mine)))
        if not pending:
            return
        self.pairs = self.copies.pairs(pending)
        self.pieces = by_group(self.pairs, counts)
        self.paged_bytes = sum(nbytes(t) for t, _ in self.pairs)
        self.has_paged = True
        self.state = "leaving"
        if not again:
            self.current = False  # the update wrote them
        self.outbound.start(self.pairs, self.pieces, self.paged_bytes, self.current)
        if self.stream is None:  # the CPU: each share copied when it is sent
            return
        self.sizing.page_out_timed(timed and not again, self.paged_bytes)

    def _send(self, share):
        """Issue the copies out until `share` of the paged bytes are issued (all: 1)."""
        if self.state != "leaving":
            return
        before = self.outbound.send(share)
        if before is not None:
            self.sizing.copies_issued(before, self.outbound.departed)

    @torch.no_grad()
    def release(self):
        """The forward pass reached its last block: free what the copies out read (the host
        waits for them first: the memory then is the same every step)."""
        if self.state != "leaving":
            return
        self._send(1.0)
        departed = self.outbound.departed
        if departed is not None:
            self.sizing.window_ends()
            if not departed.query():
                self.late_out += 1
            departed.synchronize()
        self.buffers.free_all([t for t, _ in self.pairs])
        self.outbound.all_gone(self.pieces)
        self.state = "out"
        self.current = True  # every pair was sent and has departed

    def _probing(self, timed):
        """auto, at a page-out: whether nothing pages now. Not at the optimizer's creation
        (`timed` False: the masters would leave before any step measured anything); at the
        first step's end, the first groups whose host copies fit (PageSizing.host_fit) page
        from then on, as without auto (none fit: nothing ever pages)."""
        if not timed:
            return True
        fits = self.sizing.host_fit(self.groups, self.budget)
        self._keep(fits)
        return fits == 0

    def _keep(self, fits):
        """Only the first `fits` groups page from now on (none: nothing ever pages)."""
        self.groups = self.groups[:fits] if fits else self.groups
        self.active = fits

    def _size(self):
        """From the timed page-out: keep paging the groups whose copies fit in the window
        (PageSizing.window_fit)."""
        active = self.sizing.window_fit(
            [sum(nbytes(t) for _, t in self._tensors([group])) for group in self.groups],
            self.paged_bytes)
        if active is None:
            return
        self.active = active
        if active == 0:
            # Nothing pages any more: the tensors stay views of their flat buffers, and the
            # host memory goes.
            self.buffers.clear()
            self.copies.clear()
            self.pairs, self.pieces = [], []
            self.paged_bytes = 0
        else:  # what stays in HBM from now on leaves the flat buffers, a group at a time
            self.buffers.unflatten({g: [t for _, t in self._tensors([self.groups[g]])]
                                    for g in range(active, len(self.groups))})

    # --- in --------------------------------------------------------------------------------

    @torch.no_grad()
    def page_in(self, share=1.0, room=None):
        """Queue copies back, a group at a time, until `share` of the paged bytes are queued
        (Inbound.queue). `room`: the bytes the device may give them now (None: no limit); a
        group that does not fit waits for a later call (the step's bring_in takes every
        one)."""
        if self.state == "leaving":
            self.release()
        if self.state == "out":
            self.inbound.coming = list(self.pieces)
            self.state = "coming"
        if self.state != "coming":
            return
        try:
            self.inbound.queue(share, room, self.paged_bytes)
        finally:
            if not self.inbound.coming:
                self.state = "in"

    def bring_in(self, writes=True):
        """Everything in and usable on the current stream: before the update, and before any
        read (`writes` False: state_dict, a checkpoint) or write of the state outside a step.
        A read while the copies out are under way leaves them going (the tensors stay valid
        until they are freed; once a group was freed, every group leaves and comes back
        first); a write cancels them, and the next forward pass pages the state out again
        (page_out(again=True))."""
        current = torch.cuda.current_stream(self.device) if self.stream is not None else None
        again = False
        if self.state == "leaving" and self.outbound.freed:
            # Some groups already left the device: the rest leave too, and all come back; a
            # read in the middle of a forward pass then has them leave again (copied already:
            # freed at the next point), so the loss still runs without them.
            again = not writes and self.last_point != "end"
            self.release()
        elif self.state == "out" and not writes and self.last_point != "end":
            # Out since a later micro-batch's start (_drop_coming), in the middle of its
            # forward pass: back for the read, then out again before the loss, as above.
            again = True
        if self.state == "leaving":
            if not writes:
                return
            # Still in HBM: writes wait for the copies out issued so far to have read it;
            # they are dropped, and so are those not issued.
            if self.outbound.departed is not None:
                current.wait_event(self.outbound.departed)
            self.outbound.cancel()
            self.state = "in"
            self.current = False
            return
        self.page_in(1.0)
        if writes:
            self.current = False
        if self.inbound.wait():
            self.late_in += 1
        if again:
            self.page_out(timed=False, again=True)

    # --- the session's hooks ---------------------------------------------------------------

    def forward_begins(self, index, resident, streamed):
        """A forward pass with grad reaches point `index` of its blocks: None the model's
        start, then its `resident` blocks', then its `streamed` blocks' (the last: release).
        The copies out are issued in even shares over those points. At its first point (the
        model's start, or its first block when the model's own hook did not run: an eval-mode
        model, model.forward called directly) the state leaves in every forward pass, not
        only in the one after a step: in HBM still, it is paged out again (a write cancelled
        the step's page-out, a failed backward pass left it in, a later micro-batch of
        gradient accumulation; there, with the copies back under way, what came back is freed
        and the rest not brought in), so that the loss's peak is the same in every forward
        pass."""
        if index is None or index == 0:
            # Both points (the model's hook may not run, or may have run for a forward pass
            # that failed before its first block): paging out again is idempotent.
            if self.state == "coming" and self.current and self.active:
                # Part of it back (a later micro-batch of gradient accumulation: the last
                # backward pass began the copies back, nothing wrote the state since): what
                # came back goes, the rest stays on the host.
                self._drop_coming()
            elif self.state in ("coming", "in") and self.active and self.has_paged:
                # In, and the copies back done on the current stream: the memory they write
                # may be freed at this forward pass's last block.
                self.bring_in(writes=False)
                self.page_out(timed=False, again=True)
            # A fresh forward pass's window starts here (not a failed one's): at the model's
            # start, or at the first block when the model's hook did not run just before.
            fresh = index is None or self.last_point is not None
            if fresh and self.state == "leaving":
                self.sizing.window_begins()
        self.last_point = index
        if index is None:
            point = 0
        elif index == resident + streamed - 1:
            self.release()
            self.last_point = "end"
            return
        else:
            point = index + 1
        if self.state == "leaving":
            self.outbound.free_departed(point)
        self.outbound.point = point
        self._send((point + 1) / (resident + streamed))

    @torch.no_grad()
    def _drop_coming(self):
        """The copies back are under way and the host copies current: free the groups already
        back (their flat buffers, from the current stream's pool, after their copies in stream
        order) and leave the rest on the host; the state is out, as after release(). Bringing
        every group in only to free it again cost the forward pass's start a wait for the
        copies and the link their bytes."""
        self.inbound.wait()
        waiting = {g for g, _ in self.inbound.coming}
        for g, _ in self.pieces:
            if g not in waiting:
                self.buffers.free(g)
        self.inbound.coming = []
        self.outbound.all_gone(self.pieces)
        self.state = "out"

    def backward_begins(self, index, last):
        """Streamed block `index` of 0..`last` begins its backward pass: the copies back keep
        to an even share per streamed block, as far as the device has room for them."""
        self.page_in((last + 1 - index) / (last + 1), self.inbound.room())

    def resident_backward_begins(self, index):
        """Resident block `index` begins its backward pass (the later blocks' checkpoints and
        kept activations are freed): what the streamed blocks' backward had no room for comes
        back as far as there is room now; the step brings in the rest."""
        if self.state in ("out", "coming"):
            self.page_in(1.0, self.inbound.room())

    def leaving_bytes(self):
        """The paged bytes still on the device on their way out (a group freed FREE_LAG
        forward points after its copies were issued, the rest at the forward pass's last
        block, before the loss)."""
        return self.outbound.leaving_bytes() if self.state == "leaving" else 0

    @property
    def settled(self):
        """Whether the groups that page from now on are known (the last page-out took them;
        the activation keeper measures the next step's memory)."""
        return self.sizing.sized

    @property
    def is_out(self):
        return self.state in ("out", "coming")
