"""The device side of the paged state: while paging, a group's paged tensors are views of one
flat device buffer, so that freeing them leaves one hole per group the loss's large transients
fit in (freed one by one, the holes between the blocks' activations stranded as much memory as
was paged: an 8B's reserved peak stayed at 139 GB with 91 GB allocated). One buffer per group,
not one for all: the copies back allocate a group at a time, as the backward pass frees room
(one buffer for all needed the whole state's bytes free at the first streamed block's
backward, where a large batch's checkpoints still hold the device: an 8B at 148 x 1024 ran out
of memory there). Their storage is resized to nothing while out and back to its size when in,
as FSDP frees its unsharded parameters: the tensors keep their identity."""

import torch

from .groups import aligned, nbytes


class FlatBuffers:
    """The flat device buffer of each paged group on `device`, by group index."""

    def __init__(self, device):
        self.device = device
        self.flats = {}  # group index -> its flat buffer
        self.layouts = {}  # group index -> [(id(tensor), offset)] of its tensors in it

    def allocate(self, g, pairs):
        """Device memory for group `g`'s paged tensors `pairs` [(tensor, host copy)]: its flat
        buffer at its size again when they are its views, else a new one they become views of
        (the first page-in, and after the tensors changed: the moments that the first step
        made, a load)."""
        offsets, total = [], 0
        for t, h in pairs:
            offsets.append(total)
            total += aligned(nbytes(h))
        layout = [(id(t), o) for (t, _), o in zip(pairs, offsets)]
        flat = self.flats.get(g)
        if flat is not None and self.layouts.get(g) == layout:
            flat.untyped_storage().resize_(total)
            return
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        for (t, h), offset in zip(pairs, offsets):
            t.data = flat[offset:offset + nbytes(h)].view(h.dtype).view(h.shape)
        self.flats[g], self.layouts[g] = flat, layout

    def pointers(self):
        """The data pointers of the flat buffers that hold memory now."""
        return {f.untyped_storage().data_ptr() for f in self.flats.values()
                if f.untyped_storage().nbytes() > 0}

    def holds(self, tensors):
        """Whether every tensor of `tensors` is a view of a flat buffer holding memory."""
        bases = self.pointers()
        return all(t.untyped_storage().data_ptr() in bases for t in tensors)

    def free(self, g):
        """Free group `g`'s flat buffer, if it has one (its storage resized to nothing)."""
        flat = self.flats.get(g)
        if flat is not None:
            flat.untyped_storage().resize_(0)

    def free_all(self, tensors):
        """Free every flat buffer, and the memory of those of `tensors` that are not (yet)
        views of one (the first page-out's, a load's)."""
        bases = self.pointers()
        for t in tensors:
            if t.untyped_storage().data_ptr() not in bases:
                t.untyped_storage().resize_(0)
        for flat in self.flats.values():
            flat.untyped_storage().resize_(0)

    def clear(self):
        """Nothing pages any more: the tensors stay views of their flat buffers, which are
        never freed again (cloning them out would hold the state twice at once)."""
        self.flats, self.layouts = {}, {}

    def unflatten(self, groups):
        """The groups that stay in HBM from now on leave their flat buffers, a group at a
        time: `groups` {group index: its tensors}."""
        for g, tensors in groups.items():
            if g not in self.flats:
                continue
            base = self.flats[g].untyped_storage().data_ptr()
            for t in tensors:
                if t.untyped_storage().data_ptr() == base:
                    t.data = t.data.clone()
            del self.flats[g], self.layouts[g]
