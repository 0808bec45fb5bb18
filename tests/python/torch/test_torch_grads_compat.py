"""strata.torch._grads on torch releases without torch.Tag.inplace (2.11, the GPU machines'):
the rule it falls back to names the same ops as the tag, over every aten op, where the tag
exists. Without the fallback every read of a streamed grad raised AttributeError there."""

import pytest
import torch

from strata.torch import _grads


def _aten_overloads():
    aten = torch.ops.aten
    for name in dir(aten):
        try:
            packet = getattr(aten, name)
        except (AttributeError, RuntimeError):
            continue
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            yield getattr(packet, overload)


def test_the_fallback_names_the_ops_the_inplace_tag_names(monkeypatch):
    """Every op the tag calls in place, the fallback does too; and the ops strata.torch applies
    to streamed grads (_elementwise_inplace) are the same set either way. (The fallback also
    names a few TorchScript list and scalar overloads, aten.add_.t, aten.copy_.int: never
    elementwise on a tensor, so never applied.)"""
    tag = getattr(torch.Tag, "inplace", None)
    if tag is None:
        pytest.skip("this torch has no torch.Tag.inplace to compare with")
    ops = list(_aten_overloads())
    assert len(ops) > 1000
    tagged = {op for op in ops if tag in op.tags}
    applied = {op for op in ops if _grads._elementwise_inplace(op)}
    monkeypatch.setattr(_grads, "_INPLACE_TAG", None)
    named = {op for op in ops if _grads._is_inplace(op)}
    assert tagged <= named, sorted(map(str, tagged - named))[:10]
    applied_without = {op for op in ops if _grads._elementwise_inplace(op)}
    assert applied == applied_without, (sorted(map(str, applied - applied_without))[:10],
                                        sorted(map(str, applied_without - applied))[:10])
    assert torch.ops.aten.clamp_.default in applied


def test_elementwise_inplace_without_the_tag(monkeypatch):
    monkeypatch.setattr(_grads, "_INPLACE_TAG", None)
    aten = torch.ops.aten
    for op in (aten.clamp_.default, aten.mul_.Tensor, aten.nan_to_num_.default,
               aten.copy_.default, aten.fill_.Scalar, aten.add_.Tensor):
        assert _grads._elementwise_inplace(op), op
    for op in (aten.clone.default, aten.mul.out, aten.add.Tensor, aten.detach.default,
               aten.index_put_.default):
        assert not _grads._elementwise_inplace(op), op
