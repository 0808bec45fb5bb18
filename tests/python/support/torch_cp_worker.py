"""One rank of the context-parallel tests (tests/python/torch/distributed/
test_torch_context_parallel.py): a tiny Hugging Face Llama or Qwen3 trained on the CPU through
strata.torch (st.offload, st.AdamW, a binding clip) under a gloo group of --world ranks, as
(world / --cp) data-parallel groups x --cp context-parallel ranks, each rank on its shard of its
group's sequences; --cp 0 is the reference, one process training the whole batch with the
model's own SDPA attention. Rank 0 writes the losses (the sequences' losses, averaged over the
data-parallel groups) and the final parameters to --out."""
import argparse
import sys

import torch
import torch.distributed as dist

VOCAB, LR, WD = 128, 2e-3, 0.1


def config(arch, heads=4, kv_heads=2):
    import transformers
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    cfg = cls(vocab_size=VOCAB, hidden_size=16 * heads, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              **extra)
    cfg._attn_implementation = "sdpa"
    return cfg


def build(arch, seed=0, heads=4, kv_heads=2):
    import transformers
    cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(config(arch, heads, kv_heads))
    model.train()
    return model


def batches(steps, rows, seq):
    """Every step's global batch, two fixed batches in turn (the loss falls within a few
    steps); labels ignored on a few tokens, so the label count is not rows x seq."""
    g = torch.Generator().manual_seed(0)
    pair = []
    for _ in range(2):
        ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
        labels = ids.clone()
        labels[:, :2] = -100
        pair.append((ids, labels))
    return [pair[i % 2] for i in range(steps)]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--cp", type=int, default=0, help="context-parallel size (0: reference)")
    p.add_argument("--arch", default="llama")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--clip", type=float, default=0.05)
    p.add_argument("--own-loss", type=int, default=0,
                   help="1: the model's own loss (offload(chunked_loss=False)), not Strata's "
                        "chunked loss")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    import strata.torch as st
    if args.world > 1:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % args.port,
                                rank=args.rank, world_size=args.world)
    model = build(args.arch, seed=args.rank, heads=args.heads, kv_heads=args.kv_heads)
    cp = st.context_parallel(model, args.cp) if args.cp else None
    # Rank 0's weights are broadcast to every rank.
    model = st.offload(model, device="cpu", resident_blocks=0,
                       chunked_loss=False if args.own_loss else None)
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for ids, labels in batches(args.steps, args.rows, args.seq):
        if cp is None:
            out = model(input_ids=ids, labels=labels)
            loss = out.loss.item()
        else:
            per = ids.shape[0] // cp.data_world
            mine = slice(cp.data_rank * per, (cp.data_rank + 1) * per)
            out = model(**cp.shard(ids[mine], labels=labels[mine]))
            loss = torch.tensor(cp.full_loss(out.loss), dtype=torch.float64)
            dist.all_reduce(loss)  # every rank of a group holds its sequences' loss
            loss = loss.item() / args.world
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    opt.synchronize()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if args.rank == 0:
        torch.save({"losses": losses, "state": state}, args.out)
    if args.world > 1:
        dist.barrier()
    model.strata.close()
    if args.world > 1:
        dist.destroy_process_group()


def entry(argv, log):
    """A rank started by multiprocessing: its output goes to the file `log`."""
    from rank_launch import redirect_output
    redirect_output(log)
    main(argv)


if __name__ == "__main__":
    sys.exit(main())
