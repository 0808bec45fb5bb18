"""Which resident masters page, grouped (a resident block's, then the rest), and the bytes a
paged tensor takes: as copied, and as its flat device buffer or host buffer holds it."""

import torch


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


def device_tensors(groups, state, live, device):
    """(key, tensor) for each tensor of `groups` (lists of masters) with memory on `device` now,
    masters first (not those whose ids are in `live`: the model's own parameters), then their
    tensors in `state` (a torch optimizer's), keyed (id(master), name)."""
    for group in groups:
        for m in group:
            if id(m) not in live:
                yield (id(m), "master"), m
            for key, value in sorted(state.get(m, {}).items()):
                if torch.is_tensor(value) and value.device == device and value.numel() > 1:
                    yield (id(m), key), value


def by_group(pairs, counts):
    """`pairs` cut by group: [(group index, its pairs)] from `counts` [(group index, n)]."""
    pieces, at = [], 0
    for g, n in counts:
        pieces.append((g, pairs[at:at + n]))
        at += n
    return pieces


def take(queue, quota):
    """Pop (tensor, host copy) pairs off the front of `queue` until their bytes reach `quota`
    (None: all of them), for one batch of copies either way: (the pairs, their bytes)."""
    batch, taken = [], 0
    while queue and (quota is None or taken < quota):
        pair = queue.pop(0)
        taken += nbytes(pair[1])
        batch.append(pair)
    return batch, taken


def nbytes(t):
    return t.numel() * t.element_size()


def aligned(n):
    """`n` bytes rounded up to 512: where each tensor starts in a flat device or host buffer."""
    return (n + 511) // 512 * 512
