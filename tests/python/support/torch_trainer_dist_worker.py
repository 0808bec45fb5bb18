"""One rank of tests/python/torch/distributed/test_torch_trainer_distributed.py: the Hugging Face Trainer over the
tiny Hugging Face Llama of torch_parity_models, on the CPU, as a torchrun script writes it:
torchrun's environment variables (set here), then TrainingArguments (accelerate creates the
gloo process group from them), then the model. --mode strata: st.offload and st.AdamW under
strata.torch.StrataTrainer; plain: the model as it is, torch's AdamW, transformers.Trainer (DDP
under several processes: the oracle); refused: the offloaded model under transformers.Trainer;
unshared: StrataTrainer over a model offloaded with data_parallel=False (each refusal's
traceback goes to the output as 'error'). Rank 0 writes the micro-batches' losses (each
the ranks' mean), the logged grad norms and the final weights to --out."""
import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def everyone(value, world):
    """`value` of every rank, in rank order."""
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=["strata", "plain", "refused", "unshared"],
                   default="strata")
    p.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--clip", type=float, default=0.0, help="max_grad_norm (0: none)")
    p.add_argument("--save", action="store_true",
                   help="trainer.save_model(<out>.model) after training: 'reloaded' in the "
                        "output is from_pretrained's state of it")
    p.add_argument("--checkpoint-at", type=int, default=None,
                   help="the Trainer saves a checkpoint after this many steps; after the run a "
                        "fresh model (another seed) resumes from it: 'resumed' and "
                        "'resumed_state' in the output are its losses and final weights")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.world > 1:  # what torchrun sets
        os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(args.world),
                          LOCAL_RANK=str(args.rank), LOCAL_WORLD_SIZE=str(args.world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    import transformers
    import strata.torch as st
    from torch_parity_models import (LR, WD, Tokens, build, model_class, plain_adamw, recording,
                                     snapshot, synchronize)

    rows = args.steps * args.accumulate * args.batch * args.world
    saving = {"save_strategy": "no"} if args.checkpoint_at is None else {
        "save_strategy": "steps", "save_steps": args.checkpoint_at}
    training = transformers.TrainingArguments(
        args.out + ".trainer", max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate, max_grad_norm=args.clip,
        lr_scheduler_type="cosine", warmup_steps=1, learning_rate=LR, weight_decay=WD, seed=0,
        use_cpu=True, report_to=[], logging_steps=1, dataloader_num_workers=0,
        disable_tqdm=True, ddp_timeout=60, **saving)
    assert dist.is_initialized() == (args.world > 1)  # TrainingArguments made the group

    def trainer_of(seed):
        model = build("llama", seed=seed)
        if args.mode == "plain":
            opt, cls = plain_adamw(model.parameters()), transformers.Trainer
        else:
            model = st.offload(model, device="cpu", resident_blocks=0,
                               data_parallel=False if args.mode == "unshared" else None)
            opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
            cls = transformers.Trainer if args.mode == "refused" else st.StrataTrainer
        return model, opt, recording(cls)(model=model, args=training,
                                          train_dataset=Tokens(rows), optimizers=(opt, None))

    out = {}
    if args.mode in ("refused", "unshared"):
        model = None
        try:
            model, opt, trainer = trainer_of(0)
            trainer.train()
            out["error"] = None
        except Exception:
            out["error"] = traceback.format_exc()
    else:
        model, opt, trainer = trainer_of(0)
        trainer.train()
        synchronize(opt)
        every = everyone(trainer.losses, args.world)
        out["rank_losses"] = every
        out["losses"] = [sum(ls) / args.world for ls in zip(*every)]
        out["norms"] = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
        out["state"] = snapshot(model)  # collective under strata.torch's data parallelism
        if args.save:
            trainer.save_model(args.out + ".model")
            if args.world > 1:
                dist.barrier()
            reloaded = model_class("llama").from_pretrained(args.out + ".model")
            out["reloaded"] = {k: v.clone() for k, v in reloaded.state_dict().items()}
        if args.checkpoint_at is not None:
            fresh, fresh_opt, resumed = trainer_of(1)
            resumed.train(resume_from_checkpoint="%s.trainer/checkpoint-%d" % (
                args.out, args.checkpoint_at))
            synchronize(fresh_opt)
            every = everyone(resumed.losses, args.world)
            out["resumed"] = [sum(ls) / args.world for ls in zip(*every)]
            out["resumed_state"] = snapshot(fresh)
            if args.mode != "plain":
                fresh.strata.close()
    if args.rank == 0:
        torch.save(out, args.out)
    if args.world > 1:
        dist.barrier()
    if getattr(model, "strata", None) is not None:
        model.strata.close()
    if args.world > 1:
        dist.destroy_process_group()


def entry(argv, log):
    """A rank started by multiprocessing: its output goes to the file `log`."""
    import rank_launch
    rank_launch.redirect_output(log)
    main(argv)


if __name__ == "__main__":
    sys.exit(main())
