"""strata-train's run: data, model, optimizer and schedule set up, then the training loop
(micro-batches accumulated into optimizer steps, the loss over the step's completion tokens as
the Hugging Face Trainer computes it: each micro-batch's summed loss divided by the step's
token count, num_items_in_batch), evaluation, checkpoints and the export.

Under torchrun (WORLD_SIZE > 1) it joins the process group (nccl on GPUs, gloo on the CPU) and
st.offload trains data parallel: each rank reads its slice of every global micro-batch, the
token count is summed over the ranks, and each rank's loss is scaled by the world size so that
the ranks' averaged grads are the grads of the whole step's loss (as the Trainer does)."""

import math
import os
import sys
import time

import torch

from . import checkpoints, config, data, export, model as model_setup
from .metrics import Metrics


class Distributed:
    """This process's place: rank and world, the process group started under torchrun."""

    def __init__(self, device):
        import torch.distributed as dist
        self.dist = dist
        self.started = False
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            self.started = True
        on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if on else 0
        self.world = dist.get_world_size() if on else 1

    def sum(self, value, device):
        """`value` (a number or tensor) summed over the ranks."""
        t = torch.as_tensor(value, device=device).clone()
        if self.world > 1:
            self.dist.all_reduce(t)
        return t

    def close(self):
        if self.started:
            self.dist.destroy_process_group()


def device_of(options):
    if options.device:
        return torch.device(options.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def prepare_data(options, tokenizer, world):
    """(training rows, evaluation rows or None, the format)."""
    train = data.load(options.data, options.data_split)
    fmt = data.detect_format(train.column_names, options.format)
    evaluation = None
    if options.eval_data:
        evaluation = data.load(options.eval_data, options.data_split, "--eval-data")
        data.detect_format(evaluation.column_names, fmt, "--eval-data")
    elif options.eval_split:
        parts = train.train_test_split(test_size=options.eval_split, seed=options.seed)
        train, evaluation = parts["train"], parts["test"]
    encode = lambda rows, what: data.encode(  # noqa: E731
        rows, tokenizer, fmt, options.seq_len, options.packing, options.train_on_prompt, what)
    train = encode(train, "--data")
    if evaluation is not None:
        evaluation = encode(evaluation, "--eval-data" if options.eval_data else "--eval-split")
        # Every rank evaluates as many micro-batches (the forward passes are collective).
        evaluation = evaluation.select(range(len(evaluation) - len(evaluation) % world))
    return train, evaluation, fmt


def label_count(batch):
    """The tokens a micro-batch's loss is over (labels after the causal shift, not -100)."""
    return int((batch["labels"][:, 1:] != data.IGNORE).sum())


def train_step(model, opt, sched, batches, options, place, device):
    """One optimizer step over --accumulation micro-batches: (loss, grad norm or None)."""
    micro = [batches.next() for _ in range(options.accumulation)]
    count = int(place.sum(sum(label_count(b) for b in micro), "cpu"))
    total = torch.zeros((), dtype=torch.float64)
    for batch in micro:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch, num_items_in_batch=count).loss
        (loss * place.world).backward()
        total += loss.detach().double().cpu()
    norm = None
    if options.clip > 0:
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), options.clip))
    opt.step()
    sched.step()
    opt.zero_grad()
    return float(place.sum(total, "cpu")), norm


@torch.no_grad()
def evaluate(model, rows, options, place, device, pad_id):
    """The mean loss over the evaluation rows' completion tokens (every rank its share)."""
    mine = rows.select(range(place.rank, len(rows), place.world))
    loss_sum, count = torch.zeros((), dtype=torch.float64), 0
    model.eval()
    try:
        for batch in data.all_batches(mine, options.micro_batch, pad_id):
            n = label_count(batch)
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = model(**batch).loss
            if n:
                loss_sum += loss.double().cpu() * n
            count += n
    finally:
        model.train()
    loss_sum, count = place.sum(loss_sum, "cpu"), int(place.sum(count, "cpu"))
    return float(loss_sum / count) if count else float("nan")


def total_steps(options, batches):
    if options.max_steps:
        return options.max_steps
    return max(1, math.ceil(options.epochs * batches.per_epoch / options.accumulation))


def run(options):
    """Train as `options` say (strata.train.config); returns the output directory."""
    config.check(options)
    if options.threads:
        torch.set_num_threads(options.threads)
    device = device_of(options)
    place = Distributed(device)
    lead = place.rank == 0
    try:
        directory = model_setup.resolve(options.model)
        model_config = model_setup.load_config(options, directory)  # refused before the data
        tokenizer = model_setup.load_tokenizer(options.tokenizer or directory)
        train_rows, eval_rows, fmt = prepare_data(options, tokenizer, place.world)
        batches = data.Batches(train_rows, options.micro_batch, options.seed, place.rank,
                               place.world, tokenizer.pad_token_id)
        steps = total_steps(options, batches)
        model = model_setup.build(options, directory, model_config, device,
                                  place.world > 1)
        opt = model_setup.optimizer(options, model)
        sched = model_setup.scheduler(options, opt, steps)
        step = 0
        if options.resume:
            path = checkpoints.find(options.resume, options.output)
            state = checkpoints.load(path, model, opt, options, place.world)
            step = state["step"]
            batches.load_state_dict(state["batches"])
            sched.load_state_dict(state["scheduler"])
        metrics = Metrics(options.output, options.report_to, config.to_dict(options)) \
            if lead else None
        if lead:
            print("strata-train: %s (%.2fM parameters, %d streamed blocks, %s on %s), %d %s "
                  "rows of %d tokens at most, %d steps of %d rows (micro-batch %d x "
                  "accumulation %d x ranks %d)%s"
                  % (options.model, sum(p.numel() for p in model.parameters()) / 1e6,
                     len(model.strata.blocks), str(model.strata.dtype).replace("torch.", ""),
                     device, len(train_rows), fmt, options.seq_len, steps,
                     options.micro_batch * options.accumulation * place.world, options.micro_batch,
                     options.accumulation, place.world,
                     ", resumed at step %d" % step if step else ""), file=sys.stderr)
        step = loop(model, opt, sched, batches, eval_rows, options, place, device, tokenizer,
                    metrics, step, steps)
        if step < steps and lead:
            print("strata-train: stopped at step %d of %d (--stop-after %d), nothing exported; "
                  "continue with --resume latest%s"
                  % (step, steps, options.stop_after,
                     "" if options.save_every else " (no checkpoint was saved: give "
                     "--save-every to resume from one)"), file=sys.stderr)
        if options.export and step == steps:
            out = os.path.join(options.output, "model")
            export.export(model, out, tokenizer, options.export_shard_size, write=lead)
            if lead:
                print("strata-train: exported to %s (AutoModelForCausalLM.from_pretrained)"
                      % out, file=sys.stderr)
            if options.verify_export and lead:
                diff = export.compare_logits(model, out, batches_for_check(train_rows, tokenizer))
                metrics.write(step=steps, export_max_logit_diff=diff)
                print("strata-train: the export reloaded with from_pretrained: logits differ "
                      "from Strata's by at most %.3g" % diff, file=sys.stderr)
        if metrics is not None:
            metrics.close()
        model.strata.close()
    finally:
        place.close()
    return options.output


def batches_for_check(rows, tokenizer):
    return next(data.all_batches(rows.select(range(min(4, len(rows)))), 4,
                                 tokenizer.pad_token_id))


def loop(model, opt, sched, batches, eval_rows, options, place, device, tokenizer, metrics,
         step, steps):
    from tqdm.auto import tqdm
    lead = place.rank == 0
    last = steps if not options.stop_after else min(steps, step + options.stop_after)
    bar = tqdm(total=steps, initial=step, desc="strata-train", unit="step", disable=not lead,
               dynamic_ncols=True)
    started, rows, first = time.perf_counter(), 0, step
    losses = []
    while step < last:
        loss, norm = train_step(model, opt, sched, batches, options, place, device)
        step += 1
        losses.append(loss)
        rows += options.micro_batch * options.accumulation * place.world
        lr = sched.get_last_lr()[0]
        bar.update(1)
        bar.set_postfix(loss="%.4f" % loss, lr="%.2e" % lr)
        if lead and (step % options.log_every == 0 or step == last):
            metrics.write(step, loss=loss, lr=lr, grad_norm=norm, epoch=batches.epoch,
                          rows_per_s=rows / (time.perf_counter() - started))
        if eval_rows is not None and ((options.eval_every and step % options.eval_every == 0)
                                      or step == steps):
            value = evaluate(model, eval_rows, options, place, device, tokenizer.pad_token_id)
            if lead:
                metrics.write(step, eval_loss=value)
                bar.write("step %d: eval loss %.4f" % (step, value))
        if options.save_every and (step % options.save_every == 0 or step == last):
            state = {"step": step, "batches": batches.state_dict(),
                     "scheduler": sched.state_dict(), "options": config.to_dict(options),
                     "world": place.world}
            path = checkpoints.save(options.output, step, model, opt, state, write=lead)
            if lead:
                bar.write("step %d: checkpoint %s" % (step, path))
    bar.close()
    if lead and losses:
        print("strata-train: loss %.4f at step %d, %.4f at step %d"
              % (losses[0], first + 1, losses[-1], step), file=sys.stderr)
    return step


def main(argv=None):
    """The strata-train command: returns its exit status (2 for a usage error, named)."""
    try:
        options = config.resolve(argv)
        run(options)
    except config.UsageError as e:
        print("strata-train: error: %s" % e, file=sys.stderr)
        return 2
    return 0
