"""With pieces across the replicas (DataParallel(state_across_hosts=True)), the weights stay
replicated per host: each rank keeps its block chunks in DRAM between a forward gather, which
writes them, and the backward gather, which reads them instead of using the network again."""

import torch

from .. import _planning


class HostReplica:
    """With pieces: the block chunks of this rank, in DRAM (one copy per rank, so the host holds
    every weight once): written by each forward gather, read by the backward gather. A host
    buffer of the session's runtime (strata.h "Host buffers"), pinned by it on a GPU, so both
    copies are asynchronous on the communication stream, and charged against its one host
    budget (`budget`: strata.torch._planning.HostBudget, which made it with the budget: its
    `beside`). Without a budget (a layout outside a session) torch's own unpinned memory."""

    def __init__(self, counts, dtype, budget):
        self.host_bytes = 0
        memory = torch.empty(0, dtype=dtype)
        nbytes = sum(counts) * _planning.element_bytes(dtype)
        if nbytes and budget is None:  # a layout outside a session (the tests' fakes)
            memory = torch.empty(sum(counts), dtype=dtype)
            self.host_bytes = nbytes
        elif nbytes:
            buf, why = budget.take_beside(), None  # made with the budget (HostBudget's beside)
            if buf is None or buf.nbytes != nbytes:
                buf, why = budget.allocate(nbytes, "host replica of the weights")
            if buf is None:
                raise RuntimeError(
                    "strata.torch: no host memory for the host replica of the weights (%d "
                    "bytes): %s" % (nbytes, "host_budget has %d bytes of room left; raise it"
                                    % budget.room() if why == "budget" else
                                    "the machine's memory would have dropped below the "
                                    "runtime's reserve, or pinning failed"))
            self.host_bytes = buf.charged
            memory = _planning.tensor(buf).view(dtype)
        self.memory = memory
        self.blocks, start = [], 0
        for n in counts:
            self.blocks.append(self.memory[start:start + n])
            start += n
