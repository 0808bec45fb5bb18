"""strata.step_plan: the library's step-memory plan through the Python binding (the rules'
cases are C++ unit tests, tests/unit/test_step_plan.cpp; the C ABI's promises are
tests/abi/test_step_plan_abi.cpp). Here: the binding passes every field and reads every choice
back, refuses what it does not know, and the library's refusals arrive as errors naming the
field."""

import json

import pytest

from strata import step_plan
from strata.errors import StrataError

GB = 1 << 30


def test_residency_from_the_device():
    """Residency is chosen when every block says "choose": 40% of the device beside the rest
    of the model, at least one block streams; the dump says why."""
    plan = step_plan.plan_step([step_plan.Block(100) for _ in range(4)],
                               device_total_bytes=100_000, device_free_bytes=10_000,
                               resident_bytes_per_param=16)
    assert plan.resident_blocks == 2 and plan.residency_planned
    assert [b["residency"] for b in plan.blocks] == ["resident"] * 2 + ["streamed"] * 2
    assert not plan.checkpoints_planned and not plan.keep_planned
    assert "residency: 2 of 4 blocks resident" in plan.text
    dumped = json.loads(plan.json)
    assert dumped["resident_blocks"] == 2 and len(dumped["blocks"]) == 4


def test_checkpoint_homes_and_kept_activations_in_one_plan():
    """A batch's tokens plan checkpoint homes, a measured step kept activations; each block's
    choice comes back (the first blocks' checkpoints to DRAM)."""
    blocks = [step_plan.Block(1000, residency="resident", keep_whole_bytes=GB,
                              keep_selective_bytes=GB // 4)] * 2
    blocks += [step_plan.Block(1000, residency="streamed", keep_selective_bytes=GB // 2)] * 6
    plan = step_plan.plan_step(
        blocks, device_total_bytes=100 * GB, device_free_bytes=100 * GB, plan_checkpoints=True,
        tokens=4096, checkpoint_bytes=10 * GB, block_saved_bytes=4 * GB,
        block_saved_measured=True, in_use_bytes=20 * GB)
    assert plan.checkpoints_planned and plan.spilled_checkpoints == 7 and plan.fits
    assert [b["checkpoint"] for b in plan.blocks] == ["dram"] * 7 + ["hbm"]
    assert plan.restore_depth == 2 and plan.predicted_peak_bytes > 0
    timeline = [("f", g, 10 * GB, 10 * GB) for g in range(8)]
    timeline += [("b", g, 20 * GB, 20 * GB) for g in range(8)] + [("end", 0, 20 * GB, 20 * GB)]
    kept = step_plan.plan_step(blocks, timeline, device_total_bytes=100 * GB,
                               device_free_bytes=60 * GB, framework_held_bytes=40 * GB,
                               plan_kept=True, step_allocated_peak_bytes=20 * GB,
                               step_reserved_peak_bytes=20 * GB)
    assert kept.keep_planned and kept.kept_blocks == 8 and kept.whole_blocks == 2
    assert kept.keeps()[:2] == ["whole", "whole"] and kept.keeps()[2:] == ["selective"] * 6
    assert "in the intervals where it is alive" in kept.text


def test_the_mlp_is_tiled_only_when_the_step_is_short():
    """The MLP's bytes a token split one block's working set: at 128k tokens of an 8B's shape
    the plan keeps the MLP whole where the step fits (80 GiB), tiles it where it does not
    (48 GiB: 2 tiles), and a given count comes back as given; every block's tiles and the
    dump's reason come back through the binding."""
    figures = dict(plan_checkpoints=True, tokens=131072, checkpoint_bytes=GB,
                   block_saved_bytes=18 * GB, block_saved_measured=True,
                   mlp_token_bytes=112 * 1024, in_use_bytes=20 * GB)
    blocks = [step_plan.Block(1000, residency="streamed")] * 32
    whole = step_plan.plan_step(blocks, device_total_bytes=80 * GB, device_free_bytes=80 * GB,
                                **figures)
    assert whole.mlp_tiles == 1 and whole.mlp_tile_tokens == 131072
    assert {b["mlp_tiles"] for b in whole.blocks} == {1}
    assert "fits whole" in whole.text
    short = step_plan.plan_step(blocks, device_total_bytes=48 * GB, device_free_bytes=48 * GB,
                                **figures)
    assert short.fits and short.mlp_tiles == 2 and short.mlp_tile_tokens == 65536
    assert {b["mlp_tiles"] for b in short.blocks} == {2}
    assert "MLP over 2 tiles of 65536 tokens" in short.text
    assert json.loads(short.json)["mlp_tiles"] == 2
    given = step_plan.plan_step(blocks, device_total_bytes=80 * GB, device_free_bytes=80 * GB,
                                mlp_tiles=4, **figures)
    assert given.mlp_tiles == 4 and "(given)" in given.text
    with pytest.raises(StrataError, match="mlp_tiles 131073"):
        step_plan.plan_step(blocks, device_total_bytes=80 * GB, device_free_bytes=80 * GB,
                            mlp_tiles=131073, **figures)


def test_the_optimizer_state_tier_comes_back():
    """Where the host's room holds fewer checkpoints than the step wants, the plan advises how
    much of the streamed blocks' optimizer state an NVMe tier should take (the unit cases count
    it: 14 wanted, 6 of room, 8 to move), its reason's name and the group it gives; planned
    again with the state moved, nothing more moves."""
    figures = dict(plan_checkpoints=True, tokens=1024, checkpoint_bytes=GB,
                   block_saved_bytes=4 * GB, block_saved_measured=True, in_use_bytes=24 * GB,
                   device_total_bytes=40 * GB, device_free_bytes=40 * GB, max_group_blocks=4)
    blocks = [step_plan.Block(1000, residency="streamed")] * 16
    plan = step_plan.plan_step(blocks, host_room_bytes=6 * GB, state_dram_bytes=20 * GB,
                               nvme_free_bytes=100 * GB, **figures)
    assert plan.checkpoint_group_blocks == 3
    assert plan.state_tier == "move" and plan.state_nvme_bytes == 8 * GB
    assert plan.state_nvme_group_blocks == 1
    assert json.loads(plan.json)["state_tier_reason"] == "move"
    assert "advised: 8.00 GiB of optimizer state to NVMe" in plan.text
    again = step_plan.plan_step(blocks, host_room_bytes=14 * GB, state_dram_bytes=12 * GB,
                                nvme_free_bytes=92 * GB, **figures)
    assert again.checkpoint_group_blocks == 1 and again.state_tier == "room"
    assert again.state_nvme_bytes == 0
    none = step_plan.plan_step(blocks, host_room_bytes=6 * GB, state_dram_bytes=20 * GB,
                               **figures)
    assert none.state_tier == "no_nvme" and "no NVMe tier" in none.text


def test_transfers_against_compute_come_back():
    """A block's forward FLOPs a token and the rates reach the library (the rates as C
    doubles); each streamed block's judgement comes back (the unit cases count them: 100M
    parameters at 16k tokens, 25 GB/s, 400 TFLOP/s: dense computes longer than it loads, an MoE
    block's routed share of 31.25 MFLOP a token not), and a negative rate is the library's
    error naming it."""
    blocks = [step_plan.Block(100_000_000, residency="streamed"),
              step_plan.Block(100_000_000, residency="streamed", active_flops=31_250_000)]
    rates = dict(tokens=16384, h2d_bytes_per_second=25e9, device_flops_per_second=400e12,
                 weight_bytes_per_param=2)
    plan = step_plan.plan_step(blocks, **rates)
    assert [b["transfer_bound"] for b in plan.blocks] == [False, True]
    assert plan.transfer_bound_blocks == 1
    assert "transfers: 1 of 2 streamed blocks" in plan.text
    with pytest.raises(StrataError, match="h2d_bytes_per_second"):
        step_plan.plan_step(blocks, **dict(rates, h2d_bytes_per_second=-1.0))


def test_the_host_budget_and_the_loss_chunk_need_no_blocks():
    plan = step_plan.plan_step([], arena_bytes=600, host_available_bytes=1000, vocab=128256)
    assert plan.host_total_bytes == 1100 and plan.loss_chunk_tokens == 2088
    assert plan.blocks == []


def test_unknown_fields_and_names_are_refused():
    with pytest.raises(ValueError, match="unknown profile field"):
        step_plan.plan_step([], devise_free_bytes=1)
    with pytest.raises(ValueError, match="residency 'resdent' is not one of"):
        step_plan.plan_step([step_plan.Block(1, residency="resdent")])
    with pytest.raises(ValueError, match="point 'x' is not one of"):
        step_plan.plan_step([step_plan.Block(1)], [("x", 0, 0, 0)], plan_kept=True)
    # A value its C field cannot hold is refused, not wrapped by ctypes.
    with pytest.raises(ValueError, match="ranks_on_host is 4294967296, not a 32-bit"):
        step_plan.plan_step([], ranks_on_host=1 << 32)
    with pytest.raises(ValueError, match="block 0's elements is -1"):
        step_plan.plan_step([step_plan.Block(-1)])


@pytest.mark.parametrize("blocks,fields,message", [
    ([step_plan.Block(1, residency="streamed"), step_plan.Block(1, residency="resident")], {},
     "resident after a streamed block"),
    ([step_plan.Block(1), step_plan.Block(1, residency="streamed")],
     dict(resident_bytes_per_param=16), "CHOOSE and others' fixed"),
    ([step_plan.Block(1, rank_elements=2)], dict(resident_bytes_per_param=16), "rank_elements 2 is more than its elements"),
    ([step_plan.Block(1, residency="streamed")],
     dict(plan_checkpoints=True, tokens=5, checkpoint_bytes=1), "needs a device"),
    ([], dict(plan_checkpoints=True, tokens=5, checkpoint_bytes=1, device_total_bytes=1),
     r"blocks \(0\)"),
    ([step_plan.Block(1, residency="streamed")], dict(device_total_bytes=1, device_free_bytes=2),
     "device_free"),
    ([step_plan.Block(1)], dict(resident_bytes_per_param=65), "resident_bytes_per_param 65"),
    ([step_plan.Block(1)], dict(resident_bytes_per_param=0), "resident_bytes_per_param 0"),
    ([step_plan.Block(1, residency="streamed")],
     dict(plan_kept=True, device_total_bytes=1, step_allocated_peak_bytes=2,
          step_reserved_peak_bytes=1), "below step_allocated_peak"),
])
def test_the_library_refuses_a_bad_profile_naming_it(blocks, fields, message):
    with pytest.raises(StrataError, match=message):
        step_plan.plan_step(blocks, **fields)
