"""offload()'s arguments checked and resolved before anything changes (Request, validate): the
device, the backend, the blocks, the dtype, where the grads live, the NVMe tier's options, the
weights file, the chunked loss."""

import dataclasses
import warnings

import torch

from ... import core
from .. import _chunked_loss, _planning, _surgery, _weights


@dataclasses.dataclass
class Request:
    """offload()'s arguments, checked and resolved (validate)."""
    all_blocks: list  # every repeated block, resident ones first
    device: torch.device
    dtype: torch.dtype
    backend: str
    grads_home: str  # "dram", "hbm" or "hbm_sums" (strata.torch._planning.GRAD_HOMES)
    nvme: list
    nvme_budget: int
    state_placement: str
    gpu_budget: int
    host_budget: int
    slot_budget: int
    mesh: object  # strata.torch._distributed.Mesh, or None
    source: tuple  # offload(weights=): (SafetensorsWeights, names by tensor), or None
    # The chunked loss (strata.torch._chunked_loss): None (off), or the tokens per chunk
    # (0: its default for the vocabulary).
    loss_chunk_tokens: int = None
    spill_checkpoints: bool = None  # None (when the device is short), True or False
    mlp_tiles: int = None  # the blocks' MLP over this many sequence tiles (None: the plan's)

    def close(self):
        if self.source is not None:
            self.source[0].close()



def _device(device):
    """offload(device=) resolved: a torch.device, cuda with its ordinal."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def fallback_device(device):
    """The device a rank whose arguments were refused makes its process groups for (it takes
    part in their creation, then raises with the others): device= where it is one, else the
    default."""
    try:
        return _device(device)
    except Exception:  # noqa: BLE001 (the refusal is raised once every rank knows of it)
        return _device(None)


def check_chunked_loss(model, chunked_loss):
    """offload(chunked_loss=) resolved before anything changes: None (off) or the tokens per
    chunk (0: the default for the model's vocabulary). Refuses True or a count for a model the
    chunked loss does not support; warns when the default falls back to the model's own loss on
    a model with an output head (whose loss would then hold the whole logits)."""
    if chunked_loss is False:
        return None
    if chunked_loss is not None and chunked_loss is not True:
        if not isinstance(chunked_loss, int):  # (True and False are handled above)
            raise ValueError("strata.torch.offload: chunked_loss is %r, not None, True, False "
                             "or a number of tokens per chunk" % (chunked_loss,))
        _chunked_loss.check_chunk_tokens(chunked_loss)
    if _chunked_loss.installed(model) is not None:  # the user's own install stays
        return None
    reason = _chunked_loss.unsupported_reason(model)
    if reason is None:
        return 0 if chunked_loss in (None, True) else chunked_loss
    if chunked_loss is not None:
        raise ValueError("strata.torch.offload: chunked_loss=%r: %s; nothing was changed"
                         % (chunked_loss, reason))
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(head, torch.nn.Module):
        warnings.warn("strata.torch.offload: the loss is the model's own (the chunked loss "
                      "does not support it: %s): with labels it computes the whole logits; "
                      "pass chunked_loss=False to say so" % reason, stacklevel=3)
    return None


# The dtypes grads on the device may have: the compute dtype, or fp32 (the sums, in place).
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def validate(model, gpu_budget, host_budget, nvme, nvme_budget, dtype, device, backend,
              slot_budget, state_placement, parallel, weights, grads, grad_dtype=None):
    """The arguments checked and resolved; the weights file opened (closed again if a check
    after it fails). Nothing of the model changes, and nothing is collective: `parallel` is
    the DataParallel options or None, and the request's mesh comes after (offload)."""
    if grads not in ("host", "device"):
        raise ValueError("strata.torch.offload: grads is %r, not 'host' or 'device'" % (grads,))
    if grad_dtype is not None:
        if grads != "device":
            raise ValueError("strata.torch.offload: grad_dtype=%s is for grads='device' (the "
                             "grads on the GPU); grads='host' keeps them in the compute dtype "
                             "in host memory, summed in fp32 when micro-batches accumulate"
                             % (grad_dtype,))
        if grad_dtype not in _GRAD_DTYPES:
            raise ValueError("strata.torch.offload: grad_dtype is %r, not torch.float32 (the "
                             "grads' fp32 sums on the device) or the compute dtype (bfloat16 or "
                             "float16)" % (grad_dtype,))
    if gpu_budget is not None and not isinstance(gpu_budget, bool) and \
            isinstance(gpu_budget, (int, float)) and 0 < gpu_budget < _SMALLEST_GPU_BUDGET:
        # A budget given in GiB (gpu_budget=8) failed later in the planner as "only 256 bytes
        # are left for slots", naming neither the argument nor its unit.
        raise ValueError("strata.torch.offload: gpu_budget=%r bytes cannot hold one block's "
                         "slots: budgets are in bytes (8 << 30 for 8 GiB); nothing was changed"
                         % (gpu_budget,))
    nvme, nvme_budget = core.tier_arguments("strata.torch.offload", nvme, nvme_budget,
                                            state_placement)
    source = None
    if weights is not None:
        source = _weights.SafetensorsWeights(weights)
        try:
            source.adopt_conversions(model)
            _weights.check_covers(source, model)
        except BaseException:
            source.close()
            raise
        source = (source, _weights.names_by_tensor(model))
    try:
        return _validate_model(model, gpu_budget, host_budget, nvme, nvme_budget, dtype,
                               device, backend, slot_budget, state_placement, parallel,
                               (grads, grad_dtype), source)
    except BaseException:
        if source is not None:
            source[0].close()
        raise


def _validate_model(model, gpu_budget, host_budget, nvme, nvme_budget, dtype, device, backend,
                    slot_budget, state_placement, parallel, grads, source):
    device = _device(device)
    if backend not in ("auto", "cuda", "host"):
        raise ValueError("strata.torch.offload: backend %r is not 'auto', 'cuda' or 'host'"
                         % (backend,))
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" else "host"
    all_blocks = _surgery.find_blocks(model)
    if source is not None and any(not p.is_meta for b in all_blocks for p in b.parameters()):
        # Their values would show (evaluation, state_dict) until the optimizer's build, and
        # then the file's would replace them and any edit made meanwhile.
        raise ValueError("strata.torch.offload: weights= gives the values of a model built on "
                         "the meta device (with torch.device('meta'): ...), and this model's "
                         "blocks hold values already; build it on meta, or load the file "
                         "with model.load_state_dict; nothing was changed")
    _surgery.refuse_shared_blocks(all_blocks)
    if dtype is None:
        dtype = next(all_blocks.parameters()).dtype
    if dtype not in _planning.DTYPE_NAMES:
        raise ValueError("strata.torch.offload: dtype %s is not float32, bfloat16 or float16"
                         % dtype)
    if source is not None and parallel is not None:
        raise NotImplementedError(
            "strata.torch.offload: weights= under data parallelism is not supported yet (each "
            "rank would read its own shards from the file); load the model on each rank, or "
            "train without data_parallel")
    grads_home = _grads_home(*grads, dtype, parallel)
    return Request(list(all_blocks), device, dtype, backend, grads_home, nvme, nvme_budget,
                    state_placement, gpu_budget, host_budget, slot_budget, None, source)


# Below this a gpu_budget is a unit mistake, not a budget (1 MiB: no block's slots fit in it).
_SMALLEST_GPU_BUDGET = 1 << 20

# How offload's arguments spell each grads home, for messages.
GRAD_HOME_TEXT = {"dram": "grads='host'", "hbm": "grads='device' in the compute dtype",
                   "hbm_sums": "grads='device' as fp32 sums"}


def _grads_home(grads, grad_dtype, dtype, parallel):
    """Where the streamed grads live (strata.torch._planning.GRAD_HOMES) for offload's grads=
    and grad_dtype= (checked by validate), the compute dtype known and data parallelism
    (`parallel`: its options, or None) resolved."""
    if grads == "host":
        return "dram"
    if grad_dtype is None:
        # Under data parallelism the sums on the device are the point of grads='device'
        # (a sharded 40B accumulating on one host); on one GPU the default is what it was.
        grad_dtype = torch.float32 if parallel is not None else dtype
    if grad_dtype == torch.float32:
        return "hbm_sums"  # an fp32 model's grads too: grad_dtype=torch.float32 asks for sums
    if grad_dtype != dtype:
        raise ValueError("strata.torch.offload: grad_dtype=%s with compute dtype %s: grads on "
                         "the device are kept in the compute dtype, or as torch.float32 sums "
                         "(added to in place)" % (grad_dtype, dtype))
    return "hbm"
