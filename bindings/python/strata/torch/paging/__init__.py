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
  after the one that issued the group's last copy (Outbound.FREE_LAG; in stream order, the
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
CPU buffer and nothing is sized.

The parts, one job each: groups (which masters page, in which groups; their bytes), host (the
host copies in host buffers under the host budget), buffers (a group's flat device buffer),
sizing (how many groups page: auto's host fit, the timed window), inbound (the copies back, a
share at a time as the device has room), pager (StatePager: the state's way out and back,
driven by the session's hooks)."""
