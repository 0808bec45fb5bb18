"""One rank of test_torch_vlm_distributed.py: a tiny vision-language model
(torch_vlm_models) trained data parallel through strata.torch under a gloo process group, this
rank's batches its own (rank 0 image+text, rank 1 text only, then the other way round: the
vision tower gets grads on one rank only). Rank 0 writes its losses and final state_dict."""
import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist


def main(rank, world, port, family, steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import strata.torch as st
        import torch_vlm_models as vlm
        from torch_parity_models import LR, WD, snapshot
        model = st.offload(vlm.build(family), device="cpu", resident_blocks=0,
                           chunked_loss=False)
        opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        losses = vlm.train(model, opt, rank_batches(family, rank, steps))
        opt.synchronize()
        state = snapshot(model)  # collective: the streamed weights gathered from the shards
        if rank == 0:
            torch.save({"losses": losses, "state": state}, out)
        model.strata.close()
    finally:
        dist.destroy_process_group()


def rank_batches(family, rank, steps):
    """Rank `rank`'s batches: image+text where (step + rank) is even, else text only."""
    import torch_vlm_models as vlm
    image, text = vlm.image_batch(family), vlm.text_batch()
    return [image if (i + rank) % 2 == 0 else text for i in range(steps)]


def entry(argv, log):
    """The process's target (rank_launch.launch: argv is --rank R --world W --port P --family F
    --steps S --out PATH): its output, and a failure's traceback, to `log` (the test shows
    it); a failure exits with status 1."""
    f = open(log, "w", buffering=1)
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
    sys.stdout = sys.stderr = f
    try:
        parser = argparse.ArgumentParser()
        for name in ("--rank", "--world", "--port", "--steps"):
            parser.add_argument(name, type=int, required=True)
        for name in ("--family", "--out"):
            parser.add_argument(name, required=True)
        a = parser.parse_args(argv)
        main(a.rank, a.world, a.port, a.family, a.steps, a.out)
    except BaseException:
        traceback.print_exc()
        f.flush()
        os._exit(1)
