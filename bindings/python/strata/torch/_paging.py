"""The optimizer state of resident parameters paged to host memory between a step and the next
backward pass (issue 13: the HBM that kept activations need at the loss's peak). On by
default on CUDA (strata.torch.AdamW.PAGED_STATE = "auto"; docs/python-reference.md, Performance): from
the first step's end, as much as fits in what host_budget leaves beside the arena and the
spilled checkpoints (the session's strata.torch._planning.HostBudget; the default budget leaves
half the host memory available once the arena is made). Measured in
docs/benchmarks.md: with the activation keeper planning from the allocated peak, the 3.6B
Llama at 32x1024 on an H200 keeps 22 blocks instead of 14 (414 TFLOPS against 402 in one run),
the 8B 13 instead of 3 (2.6% faster in one run), and the 8B at 16x1024 on an H100 7 instead of
3 (15% faster).

A resident block is updated on the device by torch's AdamW, from its fp32 master and moments:
12 bytes a bf16 parameter that the update needs for a few milliseconds a step and that sit in
HBM the rest of it, through the forward pass and the loss, where the device's memory peaks
(the logits' fp32 work at the start of the backward pass, with every kept activation alive)
and where what is free decides how many blocks keep their activations instead of
recomputing them. So those tensors leave the device once the step has updated them:

- out: after the update, copied to host memory on the pager's own stream while the next
  forward pass computes, a share issued at each block's forward start (issued at once, they
  held a loss.item() after the step behind them on the copy engine); their device memory
  (one flat buffer per group, so that freeing it leaves one hole) is freed two block starts
  after the one that issued the group's last copy (StatePager.FREE_LAG; in stream order, the
  compute stream waiting for the copies, the host never), the rest when the forward pass
  reaches its last streamed block (the model's last block: the head and the loss come
  next), where the host waits for the copies if they are not done. Freed at fixed
  points, so the memory a step uses does not depend on how fast the copies ran, and what the
  activation keeper measures is what every later step uses; freed as the forward pass goes,
  not all at its end, so the blocks after them may keep their activations in the room;
- in: while the backward pass computes, from its first streamed block on (the loss's
  transients are gone by then), a share at each streamed block so that the copies leave the
  link to the executor's weight transfers most of the time (all at once, an 8B's backward
  pass got 0.4 s slower on an H200), a group (a resident block's tensors) at a time and only
  as far as the device has room for them beside what the rest of the backward pass needs
  (the spill decision's estimate of a block's backward working set, the restores in flight
  and the margin: strata.torch._spill.Spiller.backward_reserve); what did not fit comes at
  the resident blocks' backward passes, as their checkpoints free, and the rest when the
  step begins; the step waits for them. With a large batch the blocks' checkpoints hold the
  device through the streamed blocks' backward: at 148 x 1024 an 8B's whole paged state
  (31 GB) arriving there ran out of memory.

Every forward pass with grad has the state out at its loss (forward_begins): a read between
steps leaves the copies out going, and after a write (a load), a failed backward pass, or in
a later micro-batch of gradient accumulation, the state in HBM at a forward pass's start
leaves again, copied only where the host copies are not current. In a later micro-batch
with the copies back still under way (the last backward pass began them), the groups back
are freed and the rest stay on the host: nothing wrote the state since it left.

The values never change on the way: the update reads exactly the tensors it wrote (the same
objects, only their memory moves), so training is bit for bit what it is without paging.
The tensors keep their identity (torch's optimizer state and the masters stay the same Python
objects): they become views of the flat buffer, whose storage is resized to nothing while out
and back to its size when in, as FSDP frees its unsharded parameters. Anything that reads or
writes them outside a step (state_dict, a checkpoint, a load) brings them in first.

How much pages is measured, not guessed: the first steps' page-outs take everything (masters
and moments of every resident parameter, or under "auto" what fits on the host); the forward
pass after the second of them times how long the copies out took against how long the
forward pass ran to its last block (after the first, the allocator still growing into the new
pattern made that window long), and from then on only the
groups (a resident block's parameters; then the embedding, head and norms) whose copies fit in
85% of that window page, the rest stays in HBM. The activation keeper waits for that decision,
empties the allocator's cache once and plans from the next step's peak
(ActivationKeeper.on_step(settled=, paged=)).

The cost: 12 bytes a parameter over the PCIe link each way a step, at times the link carries
little (the forward pass's weights go the other way, the backward pass moves the streamed
blocks' grads and weights, 2 bytes a parameter each), and the host memory to hold them: host
buffers of the session's runtime (strata.h "Host buffers"), made at the first page-out at their
exact size (not torch's pinned allocator, which rounds a buffer up to a power of two), pinned
by the runtime on CUDA and charged against its one host budget. Not under data parallelism (strata.torch._distributed keeps the
residents replicated and in sync as they are); on the CPU (the tests) the host copy is another
CPU buffer and nothing is sized."""

import torch

from .. import step_plan
from . import _planning


class StatePager:
    """Pages the fp32 masters in `groups` (lists of them, in forward order) and their state
    tensors in `inner.state` (a torch optimizer's) out to host memory and back. `live`: the
    masters that are the model's own parameters (fp32 models): their state pages, they do
    not. `sizing`: measure the first steps and keep paging only what fits (CUDA)."""

    # The share of the measured window (copies out during the forward pass) the paged bytes
    # may take: the copies' rate varies with what the host does meanwhile.
    WINDOW_SHARE = 0.85
    # A group's device memory is freed this many forward points (block starts) after the one
    # that issued its last copy out: at a fixed point, so the memory a step uses does not
    # depend on how fast the copies ran and what the activation keeper measures holds in
    # every later step. Freed in stream order: the compute stream waits for the copies'
    # event first, the host never (the host runs blocks ahead of the device, far ahead
    # through the resident blocks, which load nothing: waiting there, 35 times a step, cost
    # an 8B's forward pass 0.14 s on an H200). The copies run at ~53 GB/s there, a share (1
    # GB) in less than a block's forward pass at 32 x 1024 (27 ms): the device rarely waits.
    FREE_LAG = 2

    def __init__(self, inner, groups, device, live=(), sizing=True, auto=False, reserve=None,
                 budget=None):
        self.inner = inner
        # What the backward pass may still allocate beyond what it holds when a block's
        # backward begins (bytes; None: unknown, and the copies back follow the schedule alone).
        self.reserve = reserve
        self.groups = [list(g) for g in groups if g]
        # The session's strata.torch._planning.HostBudget: the host copies take at most what
        # host_budget leaves (auto: decided at the first step's end; a count of blocks or
        # every resident parameter's: the first groups that fit now, here).
        self.budget = budget
        self.live = {id(m) for m in live}
        self.device = device
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.host = {}  # (id(master), key) -> host tensor (a view of a host buffer)
        self.registered = []  # (bytes charged, uint8 tensor) of each host buffer (_host_memory)
        self.state = "in"  # "in", "leaving" (copies out queued), "out", "coming" (in part)
        self.pairs = []  # (device tensor, host tensor) of the last page-out, in group order
        self.pieces = []  # the same pairs by group: [(group index, [(tensor, host)])]
        # While paging, a group's paged tensors are views of one device buffer, so that freeing
        # them leaves one hole per group the loss's large transients fit in (freed one by one,
        # the holes between the blocks' activations stranded as much memory as was paged: an
        # 8B's reserved peak stayed at 139 GB with 91 GB allocated). One buffer per group, not
        # one for all: the copies back allocate a group at a time, as the backward pass frees
        # room (one buffer for all needed the whole state's bytes free at the first streamed
        # block's backward, where a large batch's checkpoints still hold the device: an 8B at
        # 148 x 1024 ran out of memory there).
        self.flats = {}  # group index -> its flat buffer
        self._layouts = {}  # group index -> [(id(tensor), offset)] of its tensors in it
        self.coming = []  # the pieces not yet queued back
        self.departed = None  # event after the copies out
        # Groups whose copies out are all issued: [(forward point, event after their copies,
        # [group index])], in issue order; each is freed FREE_LAG forward points after the one
        # that issued it (_free_departed), and the groups freed so far (indices). Freed there,
        # not at the forward pass's last block: the blocks that keep their activations after
        # them take the room (an 8B at 32 x 1024: 31 GB held to the end left no room for any
        # streamed block to keep its activations).
        self.departing = []
        self.freed = set()
        self.arrived = None  # event after the copies back, for the step to wait on
        self.active = len(self.groups)  # the groups that page (a prefix)
        self.sized = not (sizing and cuda)
        self.timing = None  # ([(copies start, end)], forward begins, reaches its last block)
        self.timed, self.busy, self.began, self.reached = False, [], None, None
        self.unsent, self.sent, self.ready = [], 0, None
        self.full_bytes = 0  # what every group's tensors take (once the moments exist)
        self.paged_bytes = 0  # of the last page-out
        # Times the host waited at the forward pass's last block for the copies out, and
        # steps that began before the copies back were done.
        self.late_out = 0
        self.late_in = 0
        # auto: the first step's end decides how much pages from the host's available memory
        # ("first"; None: decided, or not auto).
        self.probe = "first" if auto and cuda else None
        self.decision = None  # auto's: the host memory it saw, what fits (diagnostics)
        # Whether the host copies hold what the device tensors hold (a page-out completed and
        # nothing wrote since): a forward pass that pages out again (gradient accumulation,
        # after a read or a failed step) then frees without copying.
        self.current = False
        self.has_paged = False  # some page-out took tensors (the keeper measures afresh)
        self.full_steps = 0  # steps' page-outs that took everything, before the sizing
        self.last_point = "end"  # the forward pass's last point seen (forward_begins)
        if budget is not None:
            budget.add("paged optimizer state", self)
            if self.probe is None:
                fits = self._fitting(budget.room())
                self.groups = self.groups[:fits]
                self.active = fits
                if fits == 0:
                    self.sized = True  # nothing to time: the activation keeper may plan

    @property
    def host_bytes(self):
        """Bytes of host memory the host copies hold (their buffers' charges)."""
        return sum(charged for charged, _ in self.registered)

    # --- which tensors ---------------------------------------------------------------------

    def _tensors(self, groups):
        """(key, tensor) for each tensor of those groups with device memory now, masters
        first."""
        for group in groups:
            for m in group:
                if id(m) not in self.live:
                    yield (id(m), "master"), m
                for key, value in sorted(self.inner.state.get(m, {}).items()):
                    if torch.is_tensor(value) and value.device == self.device \
                            and value.numel() > 1:
                        yield (id(m), key), value

    def _host_for(self, pending):
        """Host tensors for `pending` [(key, tensor)], made once, in one host buffer for each
        page-out that meets new tensors (a tensor that changed shape gets a new one)."""
        missing = [(k, t) for k, t in pending
                   if k not in self.host or self.host[k].shape != t.shape
                   or self.host[k].dtype != t.dtype]
        if missing:
            nbytes = sum(_aligned(_nbytes(t)) for _, t in missing)
            buffer = self._host_memory(nbytes)
            offset = 0
            for k, t in missing:
                n = _nbytes(t)
                self.host[k] = buffer[offset:offset + n].view(t.dtype).view(t.shape)
                offset += _aligned(n)
        return [(t, self.host[k]) for k, t in pending]

    def _host_memory(self, nbytes):
        """A zero uint8 host tensor of `nbytes` for the host copies, recorded in `registered`:
        a host buffer of the session's runtime under its host budget (pinned by the runtime on
        CUDA; freed once no host copy views it, after the pager's copies), or without a budget
        (a pager made outside strata.torch.AdamW) torch's own memory, page-locked by torch's
        pinned allocator on CUDA."""
        if self.budget is None:
            memory = torch.zeros(nbytes, dtype=torch.uint8,
                                 pin_memory=self.stream is not None)
            self.registered.append((memory.numel(), memory))
            return memory
        stream = self.stream
        buf, why = self.budget.allocate(
            nbytes, "paged optimizer state",
            before_free=None if stream is None else stream.synchronize)
        if buf is None:
            raise RuntimeError(
                "strata.torch: no host memory for %d bytes of the resident parameters' "
                "optimizer state: %s; raise host_budget, or set strata.torch.AdamW.PAGED_STATE "
                "= 0 to keep it in HBM"
                % (nbytes, "host_budget has %d bytes of room left" % self.budget.room()
                   if why == "budget" else "the machine's memory would have dropped below "
                   "the runtime's reserve (%d bytes available kept)" % self.budget.reserve()))
        memory = _planning.tensor(buf)
        self.registered.append((buf.charged, memory))
        return memory

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
        if self.probe is not None and (again or self._probing(timed)):
            return
        if not self.sized and not again:
            self._size()
        pending, counts = [], []
        for g, group in enumerate(self.groups[:self.active]):
            mine = [(k, t) for k, t in self._tensors([group]) if t.untyped_storage().nbytes() > 0]
            if mine:
                pending.extend(mine)
                counts.append((g, len(mine)))
        if not pending:
            return
        self.pairs = self._host_for(pending)
        self.pieces, at = [], 0
        for g, n in counts:
            self.pieces.append((g, self.pairs[at:at + n]))
            at += n
        self.paged_bytes = sum(_nbytes(t) for t, _ in self.pairs)
        self.has_paged = True
        self.state = "leaving"
        if not again:
            self.current = False  # the update wrote them
        self.unsent, self.sent = ([], self.paged_bytes) if self.current else \
            (list(self.pairs), 0)
        self.departed = None
        self.departing, self.freed = [], set()
        self.point = 0  # the forward point whose share _send issues
        if self.current:  # nothing to copy: every group may go at the first forward points
            self.departing.append((-self.FREE_LAG, None, [g for g, _ in self.pieces]))
        if self.stream is None:  # the CPU: each share copied when it is sent
            return
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(self.device))
        # The copies are timed in the second step's forward pass that pages everything, not
        # the first: its window ran long with the allocator growing into the new pattern and
        # sized too much in (a 3.6B at 32x1024: 22-23 of 28 groups, its forward pass 0.07-0.1 s
        # longer, the host waiting for the copies at the last block; 15-16 timed later).
        if timed and not again and not self.sized and self.paged_bytes >= self.full_bytes > 0:
            self.full_steps += 1
        self.timed = self.full_steps >= 2 and timed and not again and not self.sized and \
            self.paged_bytes >= self.full_bytes > 0
        self.busy, self.began, self.reached = [], None, None

    @torch.no_grad()
    def _send(self, share):
        """Issue the copies out until `share` of the paged bytes are issued (all: 1)."""
        if self.state != "leaving" or not self.unsent:
            return
        before_count = len(self.pairs) - len(self.unsent)
        batch, taken = _take(self.unsent, None if share >= 1.0
                             else self.paged_bytes * share - self.sent)
        self.sent += taken
        if not batch:
            return
        done = self._groups_issued(before_count, before_count + len(batch))
        if self.stream is None:
            for t, h in batch:
                h.copy_(t)
            if done:
                self.departing.append((self.point, None, done))
            return
        self.stream.wait_event(self.ready)
        with torch.cuda.stream(self.stream):
            before = torch.cuda.Event(enable_timing=True)
            before.record(self.stream)
            for t, h in batch:
                h.copy_(t, non_blocking=True)
            self.departed = torch.cuda.Event(enable_timing=True)
            self.departed.record(self.stream)
        if done:
            self.departing.append((self.point, self.departed, done))
        if self.timed:
            # Each batch's copies from when the stream got to them: their own time, not the
            # forward pass's pace of issuing them.
            self.busy.append((before, self.departed))

    def _groups_issued(self, before, after):
        """The groups whose last pair is among pairs[before:after] (their copies out all issued
        by this batch)."""
        done, end = [], 0
        for g, pairs in self.pieces:
            end += len(pairs)
            if before < end <= after:
                done.append(g)
        return done

    @torch.no_grad()
    def _free_departed(self, point):
        """At forward point `point`: free the device memory of the groups issued FREE_LAG or
        more points before, after their copies in stream order. The memory came from the
        current stream's pool (page_in allocates there) and goes back to it: what reuses it
        runs on that stream after the wait, the copies' reads done."""
        while self.state == "leaving" and self.departing and \
                self.departing[0][0] <= point - self.FREE_LAG:
            _, event, groups = self.departing.pop(0)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            for g in groups:
                self._free_group(g)

    def _free_group(self, g):
        """Free group `g`'s flat buffer, whose memory page_in took from the current stream's
        pool. Tensors not (yet) views of one (the first page-out's, a load's) may come from
        another stream's pool (the optimizer made them elsewhere): release() frees them, after
        the host waited for the copies."""
        flat = self.flats.get(g)
        bases = self._flat_pointers()
        pairs = dict(self.pieces)[g]
        if flat is None or any(t.untyped_storage().data_ptr() not in bases for t, _ in pairs):
            return
        flat.untyped_storage().resize_(0)
        self.freed.add(g)

    @torch.no_grad()
    def release(self):
        """The forward pass reached its last block: free what the copies out read (the host
        waits for them first: the memory then is the same every step)."""
        if self.state != "leaving":
            return
        self._send(1.0)
        if self.departed is not None:
            if self.timed and self.began is not None and self.reached is None:
                self.reached = self._event()
                self.timing = (self.busy, self.began, self.reached)
            if not self.departed.query():
                self.late_out += 1
            self.departed.synchronize()
        bases = self._flat_pointers()
        for t, _ in self.pairs:
            if t.untyped_storage().data_ptr() not in bases:  # not (yet) a view of a flat buffer
                t.untyped_storage().resize_(0)
        for flat in self.flats.values():
            flat.untyped_storage().resize_(0)
        self.departing, self.freed = [], set(g for g, _ in self.pieces)
        self.state = "out"
        self.current = True  # every pair was sent and has departed

    def _probing(self, timed):
        """auto, at a page-out: whether nothing pages now. Not at the optimizer's creation
        (`timed` False: the masters would leave before any step measured anything); at the
        first step's end (the moments exist), the first groups whose tensors fit in what the
        budget leaves then (without one, a pager made outside strata.torch.AdamW: what the
        library's step plan leaves a default host budget's pools of the host memory available,
        half of it: strata.step_plan) page from
        then on, as without auto (none fit: nothing ever pages)."""
        if not timed:
            return True
        self.probe = None
        if self.budget is not None:
            available = None
            room = self.budget.room()
        else:
            available = _available_host_bytes()
            room = step_plan.plan_step([], host_available_bytes=available).host_total_bytes
        fits = self._fitting(room)
        self.decision = dict(host_available_bytes=available, host_room_bytes=int(room),
                             groups_fitting_host=fits)
        if fits == 0:
            self.active, self.sized = 0, True
            return True
        self.groups = self.groups[:fits]
        self.active = fits
        return False

    def _fitting(self, room):
        """How many of the first groups' host copies fit in `room` bytes."""
        fits, total = 0, 0
        for group in self.groups:
            total += sum(self._paged_size(m) for m in group)
            if total > room:
                break
            fits += 1
        return fits

    def _paged_size(self, master):
        """The bytes a master pages once AdamW's state exists: the master itself (unless it
        is the model's own fp32 parameter) and its two fp32 moments (counted from the master:
        a first step without grads makes none, and a fit counted from what exists then was 3x
        too small). The host buffer aligns each tensor to 512 bytes (_host_for): at most
        that much more per tensor, inside host_budget's documented constant."""
        moments = 2 * master.numel() * 4
        return moments + (0 if id(master) in self.live else _nbytes(master))

    def _size(self):
        """From the timed page-out (the copies out against the forward pass that ran beside
        them): keep paging the groups whose copies fit in WINDOW_SHARE of the window."""
        self.full_bytes = sum(_nbytes(t) for _, t in self._tensors(self.groups))
        if self.timing is None:
            return
        busy, began, reached = self.timing
        self.timing = None
        copies = sum(b.elapsed_time(a) for b, a in busy)  # ms
        window = began.elapsed_time(reached)
        if copies <= 0 or window <= 0:
            return
        budget = self.paged_bytes * min(1.0, self.WINDOW_SHARE * window / copies)
        total, active = 0, 0
        for group in self.groups:
            total += sum(_nbytes(t) for _, t in self._tensors([group]))
            if total > budget:
                break
            active += 1
        self.active = active
        self.sized = True
        if active == 0:
            # Nothing pages any more: the tensors stay views of their flat buffers, which are
            # never freed again (cloning them out would hold the state twice at once), and the
            # host memory goes.
            self.flats, self._layouts = {}, {}
            self.pairs, self.pieces, self.host, self.registered = [], [], {}, []
            self.paged_bytes = 0
        else:  # what stays in HBM from now on leaves the flat buffers, a group at a time
            for g in [g for g in self.flats if g >= active]:
                base = self.flats[g].untyped_storage().data_ptr()
                for _, t in self._tensors([self.groups[g]]):
                    if t.untyped_storage().data_ptr() == base:
                        t.data = t.data.clone()
                del self.flats[g], self._layouts[g]

    # --- in --------------------------------------------------------------------------------

    @torch.no_grad()
    def page_in(self, share=1.0, room=None):
        """Queue copies back, a group at a time, until `share` of the paged bytes are queued
        (the device memory allocated on the current stream, which the backward pass uses).
        `room`: the bytes the device may give them now (None: no limit); a group that does
        not fit waits for a later call (the step's bring_in takes every one). The share counts
        bytes copied, as paged_bytes and the copies out (_take) do; the room, the device memory
        a group's buffer takes (each tensor in it aligned: _allocate)."""
        if self.state == "leaving":
            self.release()
        if self.state == "out":
            self.coming = list(self.pieces)
            self.state = "coming"
        if self.state != "coming":
            return
        left = sum(_nbytes(h) for _, pairs in self.coming for _, h in pairs)
        quota = None if share >= 1.0 else left - self.paged_bytes * (1.0 - max(0.0, share))
        batch = []
        try:
            while self.coming and (quota is None or quota > 0):
                g, pairs = self.coming[0]
                size = sum(_aligned(_nbytes(h)) for _, h in pairs)
                if room is not None and size > room:
                    break
                # Queued once its memory is there: an allocation that fails (out of memory,
                # in a backward pass) leaves the group to come, and the groups allocated
                # before it are copied all the same (finally), not lost to the step.
                self._allocate(g, pairs)
                self.coming.pop(0)
                batch.extend(pairs)
                if room is not None:
                    room -= size
                if quota is not None:
                    quota -= sum(_nbytes(h) for _, h in pairs)
        finally:
            if not self.coming:
                self.state = "in"
            self._copy_in(batch)

    def _copy_in(self, batch):
        """Queue the copies back of `batch` [(device tensor, host copy)] (their memory
        allocated on the current stream) on the pager's stream; `arrived` follows them."""
        if not batch:
            return
        if self.stream is None:
            for t, h in batch:
                t.copy_(h)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for t, h in batch:
                t.copy_(h, non_blocking=True)
            self.arrived = torch.cuda.Event()
            self.arrived.record(self.stream)

    def _allocate(self, g, pairs):
        """Device memory for group `g`'s paged tensors `pairs`: its flat buffer at its size
        again when they are its views, else a new one they become views of (the first
        page-in, and after the tensors changed: the moments that the first step made, a
        load)."""
        offsets, total = [], 0
        for t, h in pairs:
            offsets.append(total)
            total += _aligned(_nbytes(h))
        layout = [(id(t), o) for (t, _), o in zip(pairs, offsets)]
        flat = self.flats.get(g)
        if flat is not None and self._layouts.get(g) == layout:
            flat.untyped_storage().resize_(total)
            return
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        for (t, h), offset in zip(pairs, offsets):
            t.data = flat[offset:offset + _nbytes(h)].view(h.dtype).view(h.shape)
        self.flats[g], self._layouts[g] = flat, layout

    def _flat_pointers(self):
        return {f.untyped_storage().data_ptr() for f in self.flats.values()
                if f.untyped_storage().nbytes() > 0}

    def _room(self):
        """The device memory the copies back may take now: what torch could still allocate
        (free on the device, and cached by torch but unused) less what the rest of the
        backward pass may need (`reserve`); None where that is not known (the CPU, or no
        estimate: the schedule alone decides, as before the estimate existed)."""
        if self.stream is None or self.reserve is None:
            return None
        reserve = self.reserve()
        if reserve is None:
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - \
            torch.cuda.memory_allocated(self.device)
        return free + cached - reserve

    def bring_in(self, writes=True):
        """Everything in and usable on the current stream: before the update, and before any
        read (`writes` False: state_dict, a checkpoint) or write of the state outside a step.
        A read while the copies out are under way leaves them going (the tensors stay valid
        until they are freed; once a group was freed, every group leaves and comes back
        first); a write cancels them, and the next forward pass pages the state out again
        (page_out(again=True))."""
        current = torch.cuda.current_stream(self.device) if self.stream is not None else None
        again = False
        if self.state == "leaving" and self.freed:
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
            if self.departed is not None:
                current.wait_event(self.departed)
            self.unsent = []
            self.departing = []  # nothing leaves any more: no group is freed later
            self.state = "in"
            self.current = False
            return
        self.page_in(1.0)
        if writes:
            self.current = False
        if self.arrived is not None:
            if not self.arrived.query():
                self.late_in += 1
            current.wait_event(self.arrived)
            self.arrived = None
        if again:
            self.page_out(timed=False, again=True)

    # --- the session's hooks ---------------------------------------------------------------

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

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
            if fresh and self.state == "leaving" and self.timed:
                self.began = self._event()
        self.last_point = index
        if index is None:
            point = 0
        elif index == resident + streamed - 1:
            self.release()
            self.last_point = "end"
            return
        else:
            point = index + 1
        self._free_departed(point)
        self.point = point
        self._send((point + 1) / (resident + streamed))

    @torch.no_grad()
    def _drop_coming(self):
        """The copies back are under way and the host copies current: free the groups already
        back (their flat buffers, from the current stream's pool, after their copies in stream
        order) and leave the rest on the host; the state is out, as after release(). Bringing
        every group in only to free it again cost the forward pass's start a wait for the
        copies and the link their bytes."""
        if self.arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(self.arrived)
            self.arrived = None
        waiting = {g for g, _ in self.coming}
        for g, _ in self.pieces:
            flat = self.flats.get(g)
            if g not in waiting and flat is not None:
                flat.untyped_storage().resize_(0)
        self.coming, self.departing = [], []
        self.freed = set(g for g, _ in self.pieces)
        self.state = "out"

    def backward_begins(self, index, last):
        """Streamed block `index` of 0..`last` begins its backward pass: the copies back keep
        to an even share per streamed block, as far as the device has room for them."""
        self.page_in((last + 1 - index) / (last + 1), self._room())

    def resident_backward_begins(self, index):
        """Resident block `index` begins its backward pass (the later blocks' checkpoints and
        kept activations are freed): what the streamed blocks' backward had no room for comes
        back as far as there is room now; the step brings in the rest."""
        if self.state in ("out", "coming"):
            self.page_in(1.0, self._room())

    def leaving_bytes(self):
        """The paged bytes still on the device on their way out (a group freed FREE_LAG
        forward points after its copies were issued, the rest at the forward pass's last
        block, before the loss)."""
        if self.state != "leaving":
            return 0
        pieces = dict(self.pieces)
        return self.paged_bytes - sum(_nbytes(t) for g in self.freed for t, _ in pieces[g])

    @property
    def settled(self):
        """Whether the groups that page from now on are known (the last page-out took them;
        the activation keeper measures the next step's memory)."""
        return self.sized

    @property
    def is_out(self):
        return self.state in ("out", "coming")


def _available_host_bytes():
    """The host memory available now (a pager without a budget decides from it)."""
    return _planning.available_host_bytes()


def _take(queue, quota):
    """Pop (tensor, host copy) pairs off the front of `queue` until their bytes reach `quota`
    (None: all of them), for one batch of copies either way: (the pairs, their bytes)."""
    batch, taken = [], 0
    while queue and (quota is None or taken < quota):
        pair = queue.pop(0)
        taken += _nbytes(pair[1])
        batch.append(pair)
    return batch, taken


def _nbytes(t):
    return t.numel() * t.element_size()


def _aligned(n):
    return (n + 511) // 512 * 512


def paged_groups(resident, session, blocks):
    """The masters whose state may page, grouped: one group per resident block's parameters
    (in forward order), then one of every other resident parameter (embedding, norms, head);
    `blocks`: only the first that many resident blocks' (None: all of it)."""
    masters = {id(p): master for p, master, _ in resident}
    groups, seen = [], set()
    for block in session.resident_blocks[:blocks]:
        group = [masters[id(p)] for p in block.parameters() if id(p) in masters]
        seen.update(id(p) for p in block.parameters())
        groups.append(group)
    if blocks is None:
        groups.append([master for p, master, _ in resident if id(p) not in seen])
    return groups
