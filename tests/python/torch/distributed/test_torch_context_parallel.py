"""Context parallelism (issue 53 item 2) on the CPU: ranks are processes under a gloo group, each
running tests/python/support/torch_cp_worker.py (st.context_parallel + st.offload + st.AdamW,
the clip binding every step), against one process training the whole batch with the model's own
SDPA attention.

- 2 ranks sharing each sequence (Llama, through strata.torch's chunked loss and through the
  model's own; Qwen3 with a sequence that does not divide, padded),
  4 ranks as 2 data-parallel groups x 2 context-parallel ranks, and 4 ranks sharing each
  sequence with 2 key/value heads (repeated to one per query head): losses within 1e-6
  relative and every parameter within 1e-6 of one process (measured: 6.6e-7, the head sums of
  attention and the data-parallel mean rounding in another order; padded, a few elements
  further: see the test). Not caught at any
  tolerance: a loss scale wrong by a constant (the clip binds and AdamW is scale-free); the
  losses themselves, reported through full_loss, catch that.
- shard(): the labels shifted once over the whole sequence (a shard's last label is the next
  shard's first token), global position ids, padding with ignored labels.
- Refused with a clear error: heads that do not divide by the size, layers other than full
  attention, a size that is not a positive integer, no torch.distributed group; at run time an
  attention mask, a sliding window shorter than the sequence, soft-capping; a model whose
  attention does not go through transformers' registry, at its first forward pass."""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")
if not dist.is_available():
    pytest.skip("torch without distributed support", allow_module_level=True)
import torch_cp_worker as worker  # noqa: E402
import rank_launch  # noqa: E402
import strata.torch as st  # noqa: E402
from torch_parity_models import assert_losses_close, assert_state_close  # noqa: E402

def run(tmp_path, name, world, limit=120, **options):
    """`world` ranks of the worker; rank 0's output. A rank still running at `limit` s is a
    hang: killed, and the test fails."""
    out = str(tmp_path / name)
    argv = ["--world", str(world), "--port", str(rank_launch.free_port()), "--out", out]
    for k, v in options.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    ctx = rank_launch.forkserver("torch", "torch.distributed", "torch._dynamo", "transformers",
                                 "strata.torch", "torch_cp_worker")
    codes, texts, _ = rank_launch.launch(ctx, worker.entry, argv, world, out, limit)
    assert codes == [0] * world, "ranks failed: %s\n%s" % (codes, "\n".join(
        t[-2000:] for t in texts))
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("world,cp,options", [
    (2, 2, {"arch": "llama"}),  # through Strata's chunked loss (offload's default)
    (2, 2, {"arch": "llama", "own_loss": 1}),  # through the model's own ForCausalLMLoss
    (2, 2, {"arch": "qwen3", "seq": 15}),  # 15 tokens: padded to 2 x 8
    (4, 2, {"arch": "llama"}),  # 2 data-parallel groups x 2 context-parallel ranks
    (4, 4, {"arch": "qwen3"}),  # 2 key/value heads over 4 ranks: repeated per query head
], ids=["llama-cp2", "llama-cp2-own-loss", "qwen3-cp2-padded", "llama-dp2xcp2",
        "qwen3-cp4-gqa-repeat"])
def test_context_parallel_trains_like_one_process_on_the_whole_sequence(tmp_path, world, cp,
                                                                        options):
    got = run(tmp_path, "cp.pt", world, cp=cp, **options)
    expected = run(tmp_path, "one.pt", 1, **options)
    assert got["losses"][-1] < got["losses"][0] - 0.1  # it learns
    assert_losses_close(got["losses"], expected["losses"])
    # Padded, each weight's grad sums over 16 token rows (the pad's are exact zeros) where
    # the reference sums over 15: the products block and round otherwise, and AdamW magnifies
    # that where a grad is near zero. Measured: 1-2 elements of a few weights off by up to
    # 7.2e-6 after 3 steps, the rest within 6.6e-7 (unpadded, every element within 6.6e-7).
    outliers = (2, 1e-5) if "seq" in options else (0, 0.0)
    assert_state_close(got["state"], expected["state"], outliers=outliers[0],
                       outlier_atol=outliers[1])


def test_shard_shifts_labels_across_the_shards_and_pads():
    ids = torch.arange(10, 17).reshape(1, 7)  # 7 tokens over 2 ranks: padded to 8
    labels = ids.clone()
    labels[0, 3] = -100
    shards = [st.ContextParallel(2, None, r, 0, 1).shard(ids, labels=labels) for r in range(2)]
    assert shards[0]["input_ids"].tolist() == [[10, 11, 12, 13]]
    assert shards[1]["input_ids"].tolist() == [[14, 15, 16, 0]]
    # Token t's label is token t + 1's: rank 0's last label is rank 1's first token.
    assert shards[0]["shift_labels"].tolist() == [[11, 12, -100, 14]]
    assert shards[1]["shift_labels"].tolist() == [[15, 16, -100, -100]]
    assert shards[0]["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert shards[1]["position_ids"].tolist() == [[4, 5, 6, 7]]
    # Position ids of the user's (offset here) are cut the same way, the pad continuing them.
    offset = st.ContextParallel(2, None, 1, 0, 1).shard(ids, position_ids=torch.arange(7) + 100)
    assert offset["position_ids"].tolist() == [[104, 105, 106, 107]]
    # 5 labels in the sequence; each rank divides its sum by 5 / 2 (the group's grads sum to
    # 2 x the sequence's, which the mean over all ranks divides back).
    assert all(s["num_items_in_batch"].item() == 2.5 for s in shards)


def test_bad_configurations_are_refused():
    # The model's shape (checked after the process group and the world: _check_model).
    from strata.torch._context_parallel import _check_model
    with pytest.raises(st.ContextParallelError, match="3 attention heads do not divide among 2"):
        _check_model(worker.build("llama", heads=3, kv_heads=1), 2)
    model = worker.build("llama")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(st.ContextParallelError, match="linear_attention layers"):
        _check_model(model, 2)
    with pytest.raises(st.ContextParallelError, match="size must be a positive integer"):
        st.context_parallel(worker.build("llama"), 0)
    with pytest.raises(st.ContextParallelError, match="torch.distributed is not initialized"):
        st.context_parallel(worker.build("llama"), 2)
    with pytest.raises(st.ContextParallelError, match="no label"):
        st.ContextParallel(2, None, 0, 0, 1).shard(torch.ones(1, 4, dtype=torch.long),
                                                   labels=torch.full((1, 4), -100))


def test_attention_refuses_what_it_cannot_shard():
    # At run time, before any collective: a padding mask, a sliding window shorter than the
    # sequence, soft-capping; and a module context_parallel() did not set up.
    from strata.torch._ulysses import ulysses_attention
    module = torch.nn.Module()
    module.strata_context_parallel = st.ContextParallel(2, None, 0, 0, 1)
    q = torch.zeros(1, 4, 8, 16)
    kv = torch.zeros(1, 2, 8, 16)
    with pytest.raises(st.ContextParallelError, match="attention masks are not supported"):
        ulysses_attention(module, q, kv, kv, torch.zeros(1, 1, 8, 8))
    with pytest.raises(st.ContextParallelError, match="window 8 of a 16-token sequence"):
        ulysses_attention(module, q, kv, kv, None, sliding_window=8)
    with pytest.raises(st.ContextParallelError, match="softcap"):
        ulysses_attention(module, q, kv, kv, None, softcap=30.0)
    with pytest.raises(st.ContextParallelError, match="did not set up"):
        ulysses_attention(torch.nn.Module(), q, kv, kv, None)


def test_attention_on_fake_tensors_joins_no_collective():
    # strata.torch measures a block's activations by a forward on fake tensors
    # (strata.torch._measure): there the attention must give the real step's shapes without a
    # collective (no group exists here: one would raise).
    from torch._subclasses.fake_tensor import FakeTensorMode
    from strata.torch._ulysses import ulysses_attention
    module = torch.nn.Module()
    module.strata_context_parallel = st.ContextParallel(2, None, 0, 0, 1)
    with FakeTensorMode() as mode:
        q = mode.from_tensor(torch.zeros(1, 4, 8, 16))
        kv = mode.from_tensor(torch.zeros(1, 2, 8, 16))
        out, weights = ulysses_attention(module, q, kv, kv, None)
    assert tuple(out.shape) == (1, 8, 4, 16) and weights is None


def test_a_model_whose_attention_bypasses_the_registry_is_refused_at_its_forward(tmp_path):
    # One rank, size 1, in this process: a model that does not read
    # config._attn_implementation (here: set back to "sdpa" after context_parallel) would
    # attend within each shard only; its first forward pass raises instead.
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "rendezvous"),
                            rank=0, world_size=1)
    try:
        model = worker.build("llama")
        cp = st.context_parallel(model, 1)
        ids = torch.randint(3, worker.VOCAB, (1, 8))
        model(**cp.shard(ids))  # through the registry: counted
        assert cp.attention_calls == model.config.num_hidden_layers
        for sub in model.modules():
            if getattr(sub, "config", None) is not None:
                sub.config._attn_implementation = "sdpa"
        with pytest.raises(st.ContextParallelError, match="never called"):
            model(**cp.shard(ids))
    finally:
        dist.destroy_process_group()


def test_a_users_mistakes_are_refused_and_its_config_left_alone(tmp_path):
    # One rank, size 1, in this process (a world of 1): whole sequences with labels but no
    # shard(), a padding mask, a size the world does not take (before the heads' check), and
    # the config the model was built from, which must still build a model of plain attention.
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "rendezvous"),
                            rank=0, world_size=1)
    try:
        cfg = worker.config("llama")
        before = cfg._attn_implementation
        from transformers import LlamaForCausalLM
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        with pytest.raises(st.ContextParallelError, match="not a multiple of size=3"):
            st.context_parallel(model, 3)  # 4 heads do not divide by 3 either: the world first
        cp = st.context_parallel(model, 1)
        assert cfg._attn_implementation == before  # the model's configs are its own copies
        assert model.config._attn_implementation == "strata_ulysses"
        ids = torch.randint(3, worker.VOCAB, (1, 8))
        with pytest.raises(st.ContextParallelError, match="labels without shift_labels"):
            model(ids, labels=ids)
        padded = torch.ones(1, 8, dtype=torch.long)
        padded[0, 6:] = 0
        with pytest.raises(st.ContextParallelError, match="attention_mask with padding"):
            model(**cp.shard(ids), attention_mask=padded)
        model(**cp.shard(ids), attention_mask=torch.ones(1, 8, dtype=torch.long))  # no padding
        reference = LlamaForCausalLM(cfg)  # built from the user's config: plain attention
        reference(ids, labels=ids).loss.backward()
    finally:
        dist.destroy_process_group()
