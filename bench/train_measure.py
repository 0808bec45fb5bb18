"""What bench/train_bench.py measures of one configuration: its steps timed (warm-up, then the
measured ones, each step's phases on the host and the device), and what it reports of them
(tokens/s, TFLOPS, peaks, the placement, the plan's reasons, the step Strata's model predicts)."""
import os
import statistics
import sys
import time

from compute_probe import probe_compute
from host_memory import peak_host_bytes

PROGRESS = "progress: "  # stderr lines that are not a failed run's error


def start_profiler(mode, preset, cuda):
    """torch.profiler started for one step (host ops, and kernels on a GPU) when
    STRATA_BENCH_PROFILE (--profile) names where its trace goes; None otherwise. The profiler's
    own overhead makes that step's time not comparable: it is the last measured one."""
    if not os.environ.get("STRATA_BENCH_PROFILE"):
        return None
    import torch
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.__enter__()
    return profiler


def write_profile(profiler, mode, preset):
    import gzip
    import shutil
    path = "%s-%s-%s.json" % (os.environ["STRATA_BENCH_PROFILE"], preset, mode)
    profiler.export_chrome_trace(path)
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
    print("%sprofile of the last step: %s.gz" % (PROGRESS, path), file=sys.stderr, flush=True)


def measure(out, mode, preset, config, model, step, data, device, cuda, marks, steps, warmup,
             batch, seq, trace, nvme, opt):
    """train_bench.run_one's measured steps and what it reports of them."""
    import torch
    from llama_zoo.torch_llama import flops_per_token
    times, losses, every = [], [], []  # every: each step's seconds, the warm-up ones too
    phases = {}  # name -> [(host seconds, device seconds) since the step's start], per step
    for i in range(warmup + steps):
        marks.clear()
        if i == warmup and trace and mode == "strata":
            model.strata.runtime.trace_start()
        ids = data[i % 2].to(device, non_blocking=True)
        # The training loop's stream, not the whole device: work a step leaves on other
        # streams for the next one (strata.torch.paging's copies out, which the next forward
        # pass overlaps) is paid where the next step waits for it, as in a real loop.
        if cuda:
            torch.cuda.current_stream().synchronize()
        profiler = start_profiler(mode, preset, cuda) if i == warmup + steps - 1 else None
        t0 = time.perf_counter()
        loss = step(ids)
        losses.append(float(loss.detach()) if hasattr(loss, "detach") else float(loss))
        if cuda:
            torch.cuda.current_stream().synchronize()
        every.append(time.perf_counter() - t0)
        if profiler is not None:
            profiler.__exit__(None, None, None)
            write_profile(profiler, mode, preset)
        # Progress on stderr (a slow configuration's steps take minutes; seen with --one).
        spill = getattr(getattr(model, "strata", None), "spill", None)
        print("%s%s %s step %d: %.2f s, loss %.4f%s" % (
            PROGRESS, mode, preset, i, every[-1], losses[-1],
            "" if spill is None else ", checkpoints spilled %d (predicted to fit: %s, %d "
            "decisions, device memory at the forward's start %.1f GB, peak %.1f GB)" % (
                spill.count, spill.fits, spill.decisions, spill.base / 1e9,
                model.strata.activations.max_allocated() / 1e9)),
              file=sys.stderr, flush=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            for name, host, event in marks[1:]:
                phases.setdefault(name, []).append(
                    (host - marks[0][1], marks[0][2].elapsed_time(event) / 1e3 if cuda else 0.0))
    if mode == "strata":
        opt.synchronize()
        if trace:
            model.strata.runtime.trace_flush(trace)
    # Median per phase: when the host got past it and when the device did (the device's times
    # say where the GPU waited; the host's where Python waited on Strata or the GPU).
    out["phases"] = {name: [statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)]
                     for name, v in phases.items()}
    out["phases_every_step"] = phases  # (host s, device s) per measured step
    t = statistics.median(times)
    tokens = batch * seq
    six_p, full = flops_per_token(config, seq)
    out.update(step_seconds=t, every_step_seconds=every, tokens_per_second=tokens / t,
               tflops_6pt=six_p * tokens / t / 1e12,
               tflops_done=full * tokens / t / 1e12, losses=losses,
               peak_host_gb=peak_host_bytes() / 1e9,
               peak_device_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
               peak_reserved_device_gb=torch.cuda.max_memory_reserved() / 1e9 if cuda else 0.0,
               # cudaMalloc failures the allocator retried after freeing its cache (each a
               # device synchronization): memory planned too close to full shows here.
               alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0)
    if mode == "strata" and cuda:
        # The step Strata's model predicts, from rates measured apart from the steps above.
        try:
            from strata.torch._chunked_loss import installed
            probe = probe_compute(config, batch, seq, device, out["impl"],
                                  chunked_loss=installed(model) is not None)
        except torch.cuda.OutOfMemoryError:
            probe = None
        if probe is not None:
            # The resident blocks run on the device beside the streamed ones: each checkpointed,
            # kept selectively or kept wholly (the backward it runs), and the resident
            # parameters' update (theirs and the embedding's and head's).
            fwd, bwd, rest = probe["forward"], probe["backward"], probe["rest"]
            resident = len(model.strata.resident_blocks)
            keeper = getattr(model.strata, "activations", None)
            count = keeper.count if keeper is not None else 0
            whole = keeper.whole if keeper is not None else 0
            streamed = {id(p) for b in model.strata.blocks for p in b.parameters()}
            resident_params = sum(p.numel() for p in model.parameters() if id(p) not in streamed)
            other = rest + resident * fwd + (resident - count) * bwd \
                + (count - whole) * probe["backward_selective"] \
                + whole * probe["backward_whole"] + resident_params * probe["update_per_param"]
            # Streamed blocks keeping selectively: their backward is a selectively kept
            # block's (their matrix products served from the forward's outputs), not the
            # recompute's that the step model counts for every streamed block.
            streamed_kept = keeper.kept_streamed if keeper is not None else 0
            other += streamed_kept * (probe["backward_selective"] - bwd)
            predicted = model.strata.predict(fwd, bwd, other)
            out.update(probe=probe, probe_seconds=[fwd, bwd, rest],
                       predicted_step_seconds=predicted.info["predicted_step_seconds"],
                       predicted_over_measured=predicted.info["predicted_step_seconds"] / t,
                       update_rate_measured_at_start=predicted.info["update_elements_per_second"],
                       prediction=predicted.text)
    if mode == "strata":
        own = model.strata.runtime.capabilities().tier_budget_bytes[0] / 1e9
        out["peak_device_gb"] += own
        out["peak_reserved_device_gb"] += own
        out["placement"] = model.strata.placement()  # after the steps: kept activations known
        keeper = getattr(model.strata, "activations", None)
        out["kept_activations"] = keeper.count if keeper is not None else 0
        out["kept_whole"] = keeper.whole if keeper is not None else 0
        # Streamed blocks keeping their matrix products' and attention's outputs (issue 36).
        out["kept_streamed"] = keeper.kept_streamed if keeper is not None else 0
        if keeper is not None:  # one block's saved bytes, kept wholly and selectively
            out["kept_block_gb"] = [None if b is None else b / 1e9
                                    for b in (keeper.block_bytes, keeper.selective_bytes)]
            # The last streamed block's bytes kept selectively (every costly op's output).
            streamed_bytes = keeper.measures.streamed_bytes(len(keeper.streamed_blocks) - 1)
            out["kept_streamed_block_gb"] = None if streamed_bytes is None \
                else streamed_bytes / 1e9
            out["kept_measure_seconds"] = keeper.measures.measure_seconds
            out["kept_backed_off"] = keeper.backed_off  # blocks dropped for allocation retries
            # The plan's inputs (usable, peak, margin, each block's bytes): why it kept what
            # it kept (an H200 at 32 x 1024 kept no streamed block with 55 GB unused).
            out["kept_decision"] = keeper.decision
        spill = getattr(model.strata, "spill", None)
        if spill is not None:  # the library's step plan of checkpoint homes, with its reasons
            out["spill_plan"] = spill.plan_text
        out["plan"] += " (%d keep activations, %d of them wholly; %d streamed keep " \
            "selectively)" % (out["kept_activations"], out["kept_whole"], out["kept_streamed"])
        pager = getattr(opt, "_pager", None)
        if pager is not None:  # bytes paged a step; steps whose copies ran late
            out["paged_state"] = dict(gb=pager.paged_bytes / 1e9, late_out=pager.late_out,
                                      late_in=pager.late_in, groups=pager.active,
                                      of=len(pager.groups), auto=pager.decision)
            out["plan"] += ", %.1f GB of optimizer state paged (%d of %d groups; late out %d, " \
                "in %d)" % (pager.paged_bytes / 1e9, pager.active, len(pager.groups),
                            pager.late_out, pager.late_in)
        stats = model.strata.optimizer.stats()
        out["optimizer_seconds_per_step"] = stats["update_seconds"] / (warmup + steps)
        if nvme:
            n = warmup + steps
            out.update(nvme_state_gb=stats["nvme_state_bytes"] / 1e9,
                       dram_state_gb=(stats["state_bytes"] - stats["staging_bytes"]) / 1e9,
                       nvme_read_gb_per_step=stats["nvme_read_bytes"] / n / 1e9,
                       nvme_write_gb_per_step=stats["nvme_write_bytes"] / n / 1e9,
                       stage_wait_seconds_per_step=stats["stage_wait_seconds"] / n)
        # What Strata's DRAM arena holds per streamed parameter (grads, weights left in DRAM,
        # state, staging, buffers), against the 16 bytes of DRAM-only training.
        streamed = sum(p.numel() for b in model.strata.blocks for p in b.parameters())
        dram = model.strata.runtime.tier_usage("dram")
        used = dram["used"]
        out.update(dram_used_gb=used / 1e9, dram_bytes_per_streamed_param=used / streamed)
        # The arena's pinned part (C ABI 1.5: only what the GPU's copies touch is registered)
        # and its use, and the GPU-touched blocks that went to the unpinned part for want of
        # pinned room (> 0: some transfers are pageable copies; state that went the other way
        # only takes pinned room and is not counted).
        out.update(dram_pinned_gb=[dram["pinned_used"] / 1e9, dram["pinned_budget"] / 1e9],
                   dram_fallbacks=dram["dram_fallbacks"])
    return out
