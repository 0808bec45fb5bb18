"""A streamed parameter's place in Strata (StreamedParam: its block, its runtime tensors, the
placeholder it points at between its block's passes) and how values get into a Strata tensor
(fill, a bf16 weight's split master)."""

import ctypes

import torch

from .. import core
from ._surgery import swap_data


class StreamedParam:
    """Where a streamed parameter lives: its block, its index there, its runtime tensors."""

    __slots__ = ("param", "name", "local", "layer", "index", "weight", "grad", "grad_index",
                 "shape", "zero", "mark")

    def __init__(self, param, name, local, layer, index):
        self.param, self.name, self.local, self.layer = param, name, local, layer
        self.index = index
        self.shape = tuple(param.shape)
        self.weight = self.grad = None
        self.grad_index = None  # among the layer's grads (trainable params only)
        self.zero = None  # the placeholder's one element, this parameter's own
        self.mark = None  # (param version, element version) when the placeholder was set

    def park(self, dtype, device):
        """Point the parameter at its placeholder: the real shape, one element of storage (its
        own: a write cannot reach another parameter), and a mark to notice writes by. The
        element is NaN: code that reads the parameter outside its block's forward pass (an EMA
        of the weights, a weight-norm log, an L2 penalty over model.parameters()) gets NaN,
        which shows, not zeros, which train silently wrong (docs/python-reference.md says how to read
        the values)."""
        if self.zero is None:
            self.zero = torch.full((), float("nan"), dtype=dtype, device=device)
        if self.param.is_meta:  # loaded from offload(weights=) without being materialized
            swap_data(self.param, self.zero.expand(self.shape))
        self.param.data = self.zero.expand(self.shape)
        self.mark = (self.param._version, self.zero._version)

    def check_untouched(self):
        """Values of a streamed parameter live in Strata: a write into its placeholder, or
        other data assigned to it, would be silently lost. Refused when next seen."""
        if self.mark is None:
            return
        p = self.param
        if p.data.data_ptr() != self.zero.data_ptr() or p.shape != self.shape:
            raise RuntimeError(
                "strata.torch: other data was assigned to streamed parameter %r (p.data = ...); "
                "its values live in Strata: set them with model.load_state_dict(...)" % self.name)
        if (p._version, self.zero._version) != self.mark:
            with torch.no_grad():
                self.zero.fill_(float("nan"))  # the write reached the placeholder's element
            self.park(p.dtype, p.device)
            raise RuntimeError(
                "strata.torch: streamed parameter %r was written in place outside its block's "
                "forward pass (fill_, zero_, copy_, nn.init...); its values live in Strata and "
                "the write was lost: set them with model.load_state_dict(...), or before "
                "strata.torch.offload" % self.name)

    @property
    def trainable(self):
        return self.grad is not None


def narrows(values, dtype):
    """Whether `values` lose anything converted to `dtype` (wider values, or fp16 ones into
    bf16): what a build or a write without an optimizer cannot keep (no master)."""
    if values.dtype == dtype or not values.is_floating_point():
        return False
    return not torch.equal(values.to(dtype).to(values.dtype), values)


def fill(tensor, values):
    """`values` (the tensor's dtype and element count, on any device) into a Strata tensor. One
    in DRAM is filled in place by torch's copy_ into a CPU tensor over its memory: from a GPU a
    DMA straight into the pinned arena, on the CPU a threaded copy. (Its DLPack export cannot
    serve: torch refuses kDLCUDAHost.) Elsewhere (NVMe) through host memory."""
    values = values.reshape(-1)
    nbytes = values.numel() * values.element_size()
    if nbytes == 0:
        return
    if tensor.info().tier == core.TIERS["dram"]:
        memory = (ctypes.c_char * nbytes).from_address(tensor.data_pointer())
        view = torch.frombuffer(memory, dtype=torch.uint8).view(values.dtype)
        view.copy_(values)
    else:
        host = values.to("cpu").contiguous()
        tensor.write_pointer(host.data_ptr(), nbytes)


def split_master(values):
    """fp32 values as a split master's halves: the bf16 weight (torch's rounding, nearest even)
    and the signed 16-bit rest, computed where the values are (on a GPU: there, during setup).
    The optimizer's kernels (runtime/optimizer/kernels_impl.h, store_split) do the same on the
    CPU; tests/python/torch/test_torch_offload.py checks the optimizer reads these back as the values.
    A value halfway between two bf16 values that rounded down keeps a rest of 2^15 - 1 (one ulp
    nearer the weight: 2^15 does not fit); a NaN keeps 0."""
    weight = values.to(torch.bfloat16)
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rest = bits - ((weight.view(torch.int16).to(torch.int64) & 0xFFFF) << 16)
    rest.masked_fill_(rest == 0x8000, 0x7FFF)
    rest.masked_fill_(torch.isnan(values), 0)
    return weight, rest.to(torch.int16)
