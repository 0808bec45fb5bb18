"""A rank's chunk of a streamed parameter under data parallelism (ShardedParam), and its values
read, written and gathered from every rank's chunk (collective: every rank calls)."""

import torch

from .._streamed import StreamedParam


class ShardedParam(StreamedParam):
    # chunk: this rank's chunk's elements; piece: what this rank registers of it (the chunk,
    # or with pieces across the replicas 1/pieces of it); offset: in the gathered block;
    # chunk_offset: in the block's chunks (pieces only).
    __slots__ = ("numel", "chunk", "piece", "offset", "chunk_offset")


def own_range(mesh, sp):
    """[lo, hi): this rank's elements of the flattened parameter (its chunk, or with pieces
    its replica's piece of it)."""
    lo = mesh.shard_rank * sp.chunk
    if mesh.pieces > 1:
        lo += mesh.replica * sp.piece
    lo = min(lo, sp.numel)
    return lo, min(lo + sp.piece, sp.numel)


def own_chunk(mesh, sp, values):
    """This rank's chunk (or piece) of a parameter's values (zero past the end)."""
    flat = values.detach().reshape(-1)
    out = torch.zeros(sp.piece, dtype=flat.dtype, device=flat.device)
    lo, hi = own_range(mesh, sp)
    if hi > lo:
        out[:hi - lo] = flat[lo:hi]
    return out


def gather_values(mesh, sp, chunk):
    """A parameter-shaped tensor from every shard's `chunk` of it (on the CPU); with pieces
    `chunk` is this rank's piece, first gathered across the replicas into its chunk."""
    what = "gathering the values of %s" % sp.name
    chunk = chunk.to(mesh.comm_device())
    if mesh.pieces > 1:
        piece = chunk
        chunk = torch.empty(sp.chunk, dtype=piece.dtype, device=piece.device)
        mesh.wait(mesh.gather_pieces(chunk, piece, what), what)
    out = torch.empty(mesh.shard_size * sp.chunk, dtype=chunk.dtype, device=chunk.device)
    mesh.wait(mesh.all_gather(out, chunk, what), what)
    return out[:sp.numel].view(sp.shape).cpu()


def read_chunk(tensor, sp, dtype):
    """This rank's chunk (or piece) of a tensor of the parameter's."""
    host = torch.empty(sp.piece, dtype=dtype)
    tensor.read_pointer(host.data_ptr(), host.numel() * host.element_size())
    return host


def write_chunk(mesh, tensor, sp, values, dtype):
    """This rank's chunk (or piece) of `values` written to a tensor of the parameter's."""
    chunk = own_chunk(mesh, sp, values.detach().to("cpu", dtype))
    tensor.write_pointer(chunk.data_ptr(), chunk.numel() * chunk.element_size())


def write_master(mesh, optimizer, sp, values):
    """This rank's chunk (or piece) of `values` written to the parameter's fp32 master (and
    its weight, rounded from it)."""
    chunk = own_chunk(mesh, sp, values.detach().to("cpu", torch.float32))
    optimizer.master_write(sp.weight, chunk.data_ptr(), chunk.numel())
