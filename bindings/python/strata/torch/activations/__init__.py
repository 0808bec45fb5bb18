"""Which resident blocks keep their activations for the backward pass instead of recomputing
them (issue 13, item 2: spare HBM spent on skipping recompute), decided from measured memory.

A resident block runs as plain PyTorch with activation checkpointing, so its activation memory
is what a streamed block's is. When the device has memory to spare once the model, its
optimizer state and a step's peak are in, some of them can run without checkpointing: the
same values (checkpointing recomputes exactly what the forward computed, dropout's RNG
included), one forward pass less per block. How many cannot be known at offload time (the
batch's activations and logits are unknown then), so it is measured:

- the bytes each resident block saves for its backward when not checkpointed, for the actual
  inputs of the first forward pass with grad: its forward run once on fake tensors (shapes
  only, no memory, no compute; the RNG state restored), summing what autograd saves beside the
  parameters, and what it would keep selectively (below). Every block is measured, not one
  for all: a model's blocks can differ (dense and mixture-of-experts layers), in their bytes
  and in whether keeping one selectively is safe; a block that cannot be measured (an op
  without a fake kernel, a data-dependent shape) is never kept, nor any before it;
- the memory torch's caching allocator held at its peak through the second optimizer step
  (AdamW's moments exist from the first): reserved, not allocated, since with the default
  allocator what fragmentation strands is as unusable as what is allocated (an H200 run
  planned from the allocated peak ran out of memory asking for 15.6 GiB of logits with 11 GiB
  reserved and unused); with expandable segments (strata.torch._allocator) the allocated peak
  plus 2% of the device when that is less, since that allocator gives back what it caches
  where an allocation needs it (the library judges the peak: runtime/step/kept.cpp);
- what torch could hold at most: the device's free memory plus what torch holds now (the CUDA
  context and Strata's own HBM arena are outside it).

A block can keep what it saves in two ways (issue 13: more blocks skip recompute in the same
memory). Selectively: only the outputs of its matrix products and attention (what costs the
FLOPs) that its recompute reaches (torch stops recomputing past the last tensor autograd
saves, so a Llama block's last product is not cached), its norms, activation functions and
rotary embeddings recomputed in the backward pass from them (torch's selective activation
checkpointing); an 8B Llama block at 32k tokens holds ~3 GB that way instead of ~7 GB, and its
recompute shrinks to elementwise kernels.
Wholly: everything, no recompute at all. Spare memory buys selective blocks first (two to
three times as many blocks per byte for ~90% of the recompute each saves), then upgrades some
of them to whole with what is left. A random op is never served from the cache (a recompute
that skipped one would shift the RNG offsets of every random op after it), nor an attention
with dropout; a block that writes in place into one of those outputs keeps wholly or not at
all (found when measuring, through any alias: torch's own check at the backward pass misses
a write through _unsafe_view's tensor, and the grads would be silently wrong).

From the third step on, the last resident blocks skip recompute, as the library's step plan
decides from these measurements (strata.step_plan; runtime/step/kept.cpp has the rule and its
constants): from the last block back, each kept selectively (wholly when it cannot be) while
its bytes x 1.25 fit in usable - peak - margin, then upgraded to whole, from the last back,
with what that leaves; the margin is 4% of the device with expandable segments
(strata.torch._allocator), 10% without. A forward pass with more tokens, or longer sequences, than the measured steps had
runs checkpointed (activations and logits grow with the tokens, attention's with the
sequence). An out-of-memory error anywhere (the allocator counts them: a forward, a backward,
a step) turns keeping off for good; a step that made the allocator retry an allocation (free
its cache, a device synchronization) drops the first kept block. Only on CUDA.

Streamed blocks (issue 36: an 8B at 32x1024 on an H200 recomputed 17 streamed blocks' forward,
~0.44 s of a 3.9 s step, with ~50 GB of the device unused) keep selectively too, with what the
resident blocks leave: the same plan, the streamed blocks after the resident ones (from the
last streamed block back: their backward comes first, so what they hold is freed soonest), each
only selectively (wholly would save its weights). A streamed block's recompute runs its whole
forward (strata.torch._block: no early stop), so every costly op's output is kept
(measure(everything=True)), measured per streamed block as the resident blocks are (blocks can
differ; each at the batch, on fake tensors: a resident block's measurement stops at the early
stop, so it is not reused). Its forward then runs with grad as its recompute will (the same
ops, the same arguments: under no_grad an attention can skip its logsumexp and a matmul fold
differently), under the forward context of selective_context, its saved tensors dropped as
they are made (only the cached outputs stay); its recompute runs under the paired recompute
context, served those outputs.

The parts, one job each: measures (BlockMeasures: what each block saves, measured on fake
tensors at the most tokens seen), memory (StepMemory: the measured step's allocator peaks by
interval between block starts), keeper (ActivationKeeper: the plan over them, how each block
runs now, and the allocator's retries and out-of-memory errors watched against it)."""
