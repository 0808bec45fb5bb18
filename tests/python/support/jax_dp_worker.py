"""One rank of strata.jax's data-parallel tests (tests/python/jax/test_jax_data_parallel.py): a
process of a jax.distributed job on the CPU (gloo collectives) that trains the tiny Llama of
jax_parity_models through strata.jax.Trainer on its rows of every step's batch (the rows of all
ranks: jax_parity_models.batches at --rows x --world), and writes its losses, its evaluate() of
the first batch after training, the final parameters (gathered: every rank calls get_params),
the bytes of block state its runtime holds and the plan's checkpoint homes to OUT.rankR.npz.
--clip, --accumulation: strata.jax.AdamW's max_grad_norm and accumulation; --step-memory: the
device bytes the step plan plans within, so that it sends the checkpoints to host memory;
--fail-at N: the last rank exits (status 3) before step N, as a rank that dies mid-job."""
import argparse
import os
import sys


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=2, help="rows per rank")
    p.add_argument("--shard-size", type=int, default=0, help="0: DataParallel's default")
    p.add_argument("--fail-at", type=int, default=-1)
    p.add_argument("--clip", type=float, default=0.0, help="max_grad_norm (0: none)")
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--step-memory", type=int, default=0,
                   help="the device bytes the step plan plans within (0: none, the CPU's)")
    args = p.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize("127.0.0.1:%d" % args.port, args.world, args.rank)
    jax.config.update("jax_default_matmul_precision", "highest")
    import numpy as np
    import optax

    import jax_parity_models as api
    import strata.jax as sj

    blocks, residents = api.llama_params()
    data = api.batches(args.steps, shape=(args.rows * args.world, 32))
    mine = slice(args.rank * args.rows, (args.rank + 1) * args.rows)
    trainer = sj.Trainer(api.block_fn, blocks, residents, embed_fn=api.embed_fn,
                         loss_fn=api.loss_fn, optimizer=optax.adamw(api.LR, weight_decay=api.WD),
                         block_optimizer=sj.AdamW(api.LR, weight_decay=api.WD,
                                                  max_grad_norm=args.clip or None,
                                                  accumulation=args.accumulation),
                         step_memory=args.step_memory or None,
                         data_parallel=sj.DataParallel(shard_size=args.shard_size or None))
    losses = []
    for step, ids in enumerate(data):
        if step == args.fail_at and args.rank == args.world - 1:
            print("rank %d exits before step %d" % (args.rank, step), flush=True)
            os._exit(3)
        losses.append(trainer.step(ids[mine]))
        print("step %d loss %.6f" % (step, losses[-1]), flush=True)
    print("plan: %s" % ([b["checkpoint"] for b in trainer.plan.blocks],), flush=True)
    evaluated = trainer.evaluate(data[0][mine])  # collective: the mean of the ranks' losses
    got_blocks, got_res = trainer.get_params()
    held = sum(int(w.info().nbytes) for ws in trainer.weights for w in ws)
    leaves = jax.tree_util.tree_leaves((got_blocks, got_res))
    np.savez("%s.rank%d.npz" % (args.out, args.rank), losses=np.asarray(losses),
             evaluated=evaluated,
             held=held, describe=trainer.data_parallel.describe(),
             homes=np.asarray([b["checkpoint"] for b in trainer.plan.blocks]),
             **{"leaf%d" % i: np.asarray(a, np.float32) for i, a in enumerate(leaves)})
    trainer.close()
    jax.distributed.shutdown()


def entry(argv, log):
    """A rank started by multiprocessing: its output goes to the file `log`."""
    import rank_launch
    rank_launch.redirect_output(log)
    sys.exit(main(argv))


if __name__ == "__main__":
    sys.exit(main())
