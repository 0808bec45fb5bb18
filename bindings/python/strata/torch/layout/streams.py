"""The sharded layout's side streams (None on the CPU, where everything runs in order)."""

import contextlib

import torch


def on(stream):
    """Run on `stream` (nothing to switch on the CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def handle(stream):
    """The stream's handle for the executor (None: its default)."""
    return stream.cuda_stream if stream is not None else None


def record(stream):
    """An event after what `stream` has queued so far (None on the CPU)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
