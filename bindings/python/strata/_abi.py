"""strata.h as Python sees it beyond strata._lib's structs: the constant tables (the test
abi_layout checks every one against the header) and the dump convention every strata_*_dump
follows. strata.core re-exports the public tables."""
import ctypes

from .errors import check

BACKENDS = {"auto": 0, "cuda": 1, "host": 2}
TIERS = {"hbm": 0, "dram": 1, "nvme": 2}
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3, "int8": 4, "uint8": 5,
          "int16": 6, "int32": 7, "int64": 8, "bool": 9}
ROLES = {"weight": 0, "grad": 1, "optimizer_state": 2, "activation": 3, "other": 4}
FORWARD, BACKWARD = 0, 1
VIEW_WEIGHT, VIEW_GRAD, VIEW_ACTIVATION = 0, 1, 2
OPTIMIZERS = {"adamw": 0, "sgd": 1, "adam": 2, "lion": 3, "adagrad": 4}
UPDATE_MODES = {"auto": 0, "explicit": 1}
STATE_PLACEMENTS = {"dram": 0, "planned": 1, "nvme": 2}
STATES = {"master": 0, "exp_avg": 1, "exp_avg_sq": 2, "grad_accum": 3, "master_low": 4}
# How a bf16 weight's fp32 master is kept (strata.h STRATA_MASTER_*): "split" keeps only its low
# halves, the weight being the rest (2 bytes per parameter instead of 4).
MASTER_LAYOUTS = {"separate": 0, "split": 1}
LINKS = ["h2d", "d2h", "nvme_read", "nvme_write"]
# Where grads live (strata.h STRATA_TIER_HBM, STRATA_TIER_DRAM).
GRAD_TIERS = {"hbm": 0, "dram": 1}
# How a param's grad sums the backward passes between two zeroings (strata.h
# STRATA_GRAD_SUM_*): "accumulator" (each pass lands in the grad tensor, zeroed at every backward
# load; the optimizer adds it into an fp32 accumulator in DRAM or on NVMe) or "in_place" (the
# grad tensor, fp32 in HBM, is the sum: the framework adds each pass into it, and it is zeroed
# only at a backward load where the param holds no grad; no accumulator exists).
GRAD_SUMS = {"accumulator": 0, "in_place": 1}


def dump_text(fn, handle, format):
    """A strata_*_dump (plan, placement, step plan) as text: its length asked first, then the text."""
    n = ctypes.c_size_t()
    check(fn(handle, format, None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value + 1)
    check(fn(handle, format, buf, n.value + 1, ctypes.byref(n)))
    return buf.value.decode()
