"""Training throughput of gpt2forge vs `transformers.GPT2LMHeadModel`, side by side in one run.

One training step = forward + loss + backward + optimizer update on one (B, T) batch. Compared:

  ours          gpt2forge as the trainer runs it with `--torch-compile true` (what `make train`
                passes; the default `auto` compiles on CUDA only): `step.train_step` on the
                `torch.compile`d model (default mode), fused AdamW from `optim.build_optimizer`,
                the trainer's default LM loss (`--lm-loss auto`: the fused LM head + loss on the
                CPU, the full logits on a GPU), summed loss / tokens
  transformers  `transformers.GPT2LMHeadModel` (attn_implementation="sdpa"), eager, HF's own loss
                via `labels=`, `torch.optim.AdamW` with its default implementation flags (with
                `--transformers-compiled`, the GPU peer: torch.compile and fused AdamW)

Both start from the same seeded weights (ours, copied into HF's layout) and train on the same
random batch, with the same GPT-2 math (gelu_new, dropout 0.1 as in HF's GPT2Config defaults);
bf16 is `torch.autocast` with fp32 master weights for both (runtime.autocast).

How it is measured: each implementation runs in its own worker process (one per precision), so
peak memory is per implementation: on CPU the worker's peak resident set (VmHWM of its own
address space on Linux, else ru_maxrss; ru_maxrss alone would include the parent's RSS it was
started from), on CUDA torch.cuda.max_memory_allocated. The parent runs the warm-up steps (the
first includes torch.compile; reported separately, never timed) one worker at a time, then the
timed steps interleaved ours, transformers, ours, ... so background load hits both alike.
tokens/s = B*T / median step time. MFU uses ModelConfig.flops_per_token(T) and the best of this
run's matmul peak reads, one before the warm-up and one after each interleaved round, so the peak is
read under the same conditions as the steps (the issue's "peak measured in the same run"): on a CPU a
1024^3 matmul in the precision, never below fp32's; on a GPU the trainer's own read
(`read_gpu_peak_flops`). MFU* is the same against a fixed bar: on a CPU the best this machine has ever
read (kept across runs in ~/.cache/gpt2forge/cpu_peak.json; stricter, since a VM's clock and
neighbours move its reads by 20% from run to run), on a GPU its data sheet's (`device_peak_flops`:
llm.c's and nanoGPT's basis, and the GPU MFU target's). The targets are ratios (STYLE.md: targets are
checked by side-by-side benchmarks, never by timed tests); missing one is reported, not an error.

    .venv/bin/python benchmarks/train_throughput.py                      # B=4, T=256, fp32 + bf16
    # an AVX2-only x86 (no bf16 instructions) emulates bf16, orders of magnitude slower: skipped unless asked
    .venv/bin/python benchmarks/train_throughput.py --precisions bf16 --include-emulated --batch-size 1 --seq-len 32
    .venv/bin/python benchmarks/train_throughput.py --precisions bf16 --steps 5 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback

TARGET = 1.5  # ours / transformers tokens/s, in every precision (GPT-2 small's step target)
MFU_TARGET = 0.70  # ours in fp32, of the fp32 matmul peak measured in this run (the target)
GPU_TARGET, GPU_MFU_TARGET = 1.5, 0.45  # on a GPU: against transformers compiled with fused AdamW; of the data sheet
IMPLS = ("ours", "transformers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (B)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (T)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per implementation and precision")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for a 1-minute load below 0.5 before starting (0: report "
                        "the load at once, with a warning when the machine is not quiet)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps first (the first one compiles ours); at least 1")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    p.add_argument("--model", default="gpt2", help="gpt2forge model preset (config/)")
    p.add_argument("--lm-loss", default="auto", choices=("auto", "fused", "plain"),
                   help="ours: the trainer's --lm-loss (fused: chunked LM head + loss, never the full logits; auto: "
                        "fused on the CPU, plain on a GPU)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=1234, help="seeds the weights, the batch and dropout")
    p.add_argument("--learning-rate", type=float, default=1e-4, help="AdamW learning rate (both)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW decay of matrices (both)")
    p.add_argument("--warm-compile-cache", action="store_true",
                   help="let torch.compile reuse its on-disk caches (as a re-run of the trainer does); by default "
                        "ours compiles into a fresh empty cache directory, so the compile time is a cold one")
    p.add_argument("--include-emulated", action="store_true",
                   help="also run a bf16/fp16 precision this CPU only emulates (~100x slower than fp32: the GPT-2 "
                        "small shape then takes tens of minutes); by default it is skipped with a note")
    p.add_argument("--transformers-compiled", action="store_true",
                   help="the transformers arm under torch.compile with fused AdamW (the GPU peer llm.c and "
                        "nanoGPT are compared with); by default it runs eager with torch's default AdamW")
    p.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    p.add_argument("--profile", metavar="DIR",
                   help="after the timed steps, each implementation runs 2 more steps under torch.profiler and "
                        "writes DIR/<impl>_<precision>.txt: its operators and kernels by self time, the kernel "
                        "launches per step and torch.compile's graph breaks (not timed with the others)")
    args = p.parse_args(argv)
    args.precisions = [s.strip() for s in args.precisions.split(",") if s.strip()]
    problems = [f"--{k.replace('_', '-')} must be >= 1" for k in ("batch_size", "seq_len", "steps", "warmup")
                if getattr(args, k) < 1]
    problems += [f"--precisions: {x!r} is not one of fp32, bf16, fp16" for x in args.precisions
                 if x not in ("fp32", "bf16", "fp16")]
    if not args.precisions:
        problems.append("--precisions is empty")
    if problems:
        p.error("; ".join(problems))
    return args


# ---------------------------------------------------------------------------------------------
# Worker process: builds one implementation in one precision and runs steps on command
# ---------------------------------------------------------------------------------------------


def _model_config(name: str, seq_len: int):
    """The preset with HF GPT2Config's defaults for the knobs that change the math."""
    import dataclasses

    from gpt2forge.model.config import ModelConfig

    cfg = dataclasses.replace(ModelConfig.preset(name), activation_function="gelu_new",
                              resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    cfg.n_positions = seq_len  # as the trainer does for a fresh model (modeling.resolve_model_config)
    return cfg


_WORKER_SETTINGS = contextlib.ExitStack()
"""Process-wide settings a worker enters once and keeps until it exits."""


def _build_ours(args, device, precision, cfg, model):
    """A `step.Run` around the compiled model; returns (step fn, info)."""
    import torch

    from gpt2forge.core.determinism import deterministic_algorithms
    from gpt2forge.core.device import configure_host_allocator
    from gpt2forge.core.loss_scaler import LossScaler
    from gpt2forge.ops.fp_mode import flush_denormals
    from gpt2forge.parallel.data_parallel import DataParallelStrategy
    from gpt2forge.parallel.strategy import ParallelRequest
    from gpt2forge.train.config import TrainConfig
    from gpt2forge.train.memory_features import apply_memory_features
    from gpt2forge.train.optim import build_lr_schedule, build_optimizer
    from gpt2forge.train.step import Run, train_step

    tcfg = TrainConfig.from_flat(dict(
        dataset="generated", model=args.model, max_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
        learning_rate=args.learning_rate, weight_decay=args.weight_decay, device=str(device), precision=precision,
        torch_compile="true", lm_loss=args.lm_loss))
    apply_memory_features(model, tcfg.memory, device)  # the trainer's defaults: the fused LM head + loss
    if device.type == "cpu":
        configure_host_allocator()  # as the trainer does (a no-op when MALLOC_MMAP_MAX_ is set)
        flush_denormals()  # as the trainer does
    # --deterministic auto, as the trainer runs (on for the CPU; for this worker process's life).
    _WORKER_SETTINGS.enter_context(deterministic_algorithms(tcfg.runtime.deterministic, device))
    optimizer = build_optimizer(model, tcfg.optim.optimizer, tcfg.optim.learning_rate, tcfg.optim.weight_decay,
                                device_type=device.type)
    scheduler = build_lr_schedule(optimizer, tcfg.optim.lr_schedule, 1_000_000, 0)
    scaler = LossScaler(precision == "fp16", tcfg.loss_scale.loss_scaling, tcfg.loss_scale.auto_loss_scaling)
    strategy = DataParallelStrategy(model, ParallelRequest(device, compile_mode=tcfg.runtime.torch_compile,
                                                   batch_size=tcfg.parallel.batch_size))  # one process, compiled
    run = Run(tcfg, strategy, optimizer, scheduler, scaler, device, precision, 1)

    def step(batch: torch.Tensor) -> float:
        loss_sum, _, tokens = train_step(run, [batch]).tolist()  # .tolist() syncs, as the trainer's loop
        return loss_sum / tokens

    kind = "fused" if optimizer.defaults.get("fused") else "foreach"
    return step, {"optimizer": f"torch.optim.AdamW ({kind})", "compiled": strategy.forward is not model,
                  "lm_loss": "fused" if model.fused_loss is not None else "plain"}


def _build_transformers(args, device, precision, cfg, model):
    """HF GPT2LMHeadModel holding our initial weights; returns (step fn, info)."""
    import torch
    import transformers

    from gpt2forge.core.precision import autocast
    from gpt2forge.model.checkpoint import to_hf_state_dict
    from gpt2forge.parallel.optimizer_state import param_groups

    hf_cfg = transformers.GPT2Config(**cfg.to_hf_dict(), attn_implementation="sdpa")
    hf = transformers.GPT2LMHeadModel(hf_cfg)
    hf.loss_type = "ForCausalLM"  # what HF falls back to anyway, minus its "unrecognized loss_type" warning
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    hf = hf.to(device).train()
    del model
    # Same lr / decay split as ours; implementation flags (foreach/fused) left at torch's defaults,
    # or fused with --transformers-compiled.
    fused = {"fused": True} if args.transformers_compiled else {}
    optimizer = torch.optim.AdamW(param_groups(hf, args.weight_decay), lr=args.learning_rate,
                                  betas=(0.9, 0.999), eps=1e-6, **fused)
    forward = torch.compile(hf) if args.transformers_compiled else hf

    def step(batch: torch.Tensor) -> float:
        input_ids = batch[:, :-1]  # (B, T); HF shifts the labels itself
        with autocast(device, precision):
            loss = forward(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    if optimizer.defaults.get("fused") or optimizer.defaults.get("foreach"):
        kind = "fused" if optimizer.defaults.get("fused") else "foreach"
    else:  # torch's default: foreach where its kernels exist (CUDA), else the per-tensor loop
        kind = ("foreach" if device.type == "cuda" else "for-loop") + ", torch's default"
    return step, {"optimizer": f"torch.optim.AdamW ({kind})", "compiled": forward is not hf,
                  "attn_implementation": hf.config._attn_implementation}


def _peak_memory(device) -> tuple[float, str]:
    """(peak MiB, how it was measured) for this process."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "torch.cuda.max_memory_allocated"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024, "VmHWM"
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 1024), "ru_maxrss"


def worker(impl: str, precision: str, args: argparse.Namespace, conn) -> None:
    """Process entry: run `_serve`, report any exception to the parent (which exits non-zero)."""
    cache_dir = None
    if impl == "ours" and not args.warm_compile_cache:
        # Read by torch._inductor.config on import, hence before `import torch` (in _serve).
        cache_dir = tempfile.mkdtemp(prefix="gpt2forge-bench-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        _serve(impl, precision, args, conn)
    except EOFError:
        pass  # the parent hung up (it failed or was interrupted): nothing left to report to
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)


def _profile(step, batch, device, name: str, folder: str, steps: int = 2) -> str:
    """Runs `steps` steps under torch.profiler; writes folder/name.txt (operators by self device time,
    kernel launches per step, graph breaks) and returns its path."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(batch)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.txt")
    with open(path, "w") as f:
        f.write(f"{name}: {steps} steps profiled; device kernels per step: {len(kernels) / steps:.0f}; "
                f"graph breaks: {sum(breaks.values())} {breaks}\n\n")
        f.write(prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90))
    return path


def _serve(impl: str, precision: str, args: argparse.Namespace, conn) -> None:
    """Build, then answer ("step", None) with one step's times and ("finish", None) with peak memory."""
    import torch

    from gpt2forge.core.device import resolve_device, synchronize
    from gpt2forge.core.precision import configure_matmul
    from gpt2forge.model.gpt2 import GPT2LMHeadModel

    device = resolve_device(args.device)
    configure_matmul(device, precision, half_partials=False)
    cfg = _model_config(args.model, args.seq_len)
    model = GPT2LMHeadModel(cfg)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    model = model.to(device).train()
    build = _build_ours if impl == "ours" else _build_transformers
    step, info = build(args, device, precision, cfg, model)
    gen = torch.Generator().manual_seed(args.seed)
    batch = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
    torch.manual_seed(args.seed)  # dropout
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    conn.send(("ready", {**info, "threads": torch.get_num_threads(), "torch": torch.__version__}))
    peak = None
    while True:
        cmd, _ = conn.recv()
        if cmd == "step":
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = synchronize(device)
            loss = step(batch)
            t1 = synchronize(device)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
            conn.send(("step", {"seconds": t1 - t0, "cpu_seconds": cpu, "loss": loss}))
        elif cmd == "profile":
            peak = _peak_memory(device)  # the steps' peak, before the profiler's own buffers
            try:  # a profiler failure costs the table, not the run's figures
                conn.send(("profile", {"path": _profile(step, batch, device, f"{impl}_{precision}", args.profile)}))
            except Exception:
                conn.send(("profile", {"path": None, "error": traceback.format_exc(limit=3)}))
        elif cmd == "finish":
            mib, how = peak or _peak_memory(device)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)
            conn.send(("finish", {"peak_mib": mib, "memory_source": how, "ru_maxrss_mib": rss}))
            return


# ---------------------------------------------------------------------------------------------
# Parent: schedule, interleave, report
# ---------------------------------------------------------------------------------------------


class Worker:
    def __init__(self, ctx, impl: str, precision: str, args: argparse.Namespace):
        self.impl = impl
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(impl, precision, args, child), name=f"{impl}-{precision}")
        self.proc.start()
        child.close()

    def ask(self, cmd: str) -> dict:
        if cmd != "ready":
            self.conn.send((cmd, None))
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.impl} worker died (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"{self.impl} worker failed:\n{payload}")
        return payload

    def close(self) -> None:
        self.conn.close()  # a worker still waiting for a command sees EOF and exits
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


def bench_precision(ctx, precision: str, args: argparse.Namespace, log, read_peak_flops=None) -> dict:
    """Both implementations in `precision`: warm-up one at a time, then interleaved timed steps.
    `read_peak_flops()`, when given, is called before the warm-up and after each timed round (the workers
    idle meanwhile); its reads are returned as res["peak_flops_reads"]."""
    workers: dict[str, Worker] = {}
    res = {impl: {"warmup_s": [], "step_s": [], "step_cpu_s": [], "losses": []} for impl in IMPLS}
    peak_flops_reads = res["peak_flops_reads"] = []
    try:
        if read_peak_flops:
            peak_flops_reads.append(read_peak_flops())
        for impl in IMPLS:  # start and warm up one at a time, so neither's setup or compile is shared
            workers[impl] = w = Worker(ctx, impl, precision, args)
            res[impl].update(w.ask("ready"))
            for i in range(args.warmup):
                r = w.ask("step")
                res[impl]["warmup_s"].append(r["seconds"])
                res[impl]["losses"].append(r["loss"])
                log(f"  {precision} {impl:12s} warm-up {i + 1}/{args.warmup}: {r['seconds']:7.2f} s "
                    f"(loss {r['loss']:.4f})")
        for i in range(args.steps):  # A, B, A, B, ...
            for impl, w in workers.items():
                r = w.ask("step")
                res[impl]["step_s"].append(r["seconds"])
                res[impl]["step_cpu_s"].append(r["cpu_seconds"])
                res[impl]["losses"].append(r["loss"])
                log(f"  {precision} {impl:12s} step {i + 1}/{args.steps}:    {r['seconds']:7.2f} s "
                    f"(CPU time {r['cpu_seconds']:.2f} s)")
            if read_peak_flops:
                peak_flops_reads.append(read_peak_flops())
                log(f"  {precision} matmul peak read: {peak_flops_reads[-1] / 1e9:.1f} GFLOP/s")
        if args.profile:
            for impl, w in workers.items():
                r = w.ask("profile")
                log(f"  {precision} {impl:12s} profiled: {r['path'] or 'failed: ' + r['error']}")
        for impl, w in workers.items():
            res[impl].update(w.ask("finish"))
    finally:
        for w in workers.values():
            w.close()
    return res


def summarize(res: dict, precision: str, args: argparse.Namespace, fpt: float, peak_flops: float | None,
              best_peak_flops: float | None = None) -> dict:
    """`peak_flops`: this run's (the target's); `best_peak_flops`: the best this machine has shown (reported)."""
    tokens = args.batch_size * args.seq_len
    peak_flops_reads = res.pop("peak_flops_reads", [])
    for r in res.values():
        r["median_step_s"] = statistics.median(r["step_s"])
        r["median_step_cpu_s"] = statistics.median(r["step_cpu_s"])
        r["tokens_per_s"] = tokens / r["median_step_s"]
        r["mfu"] = r["tokens_per_s"] * fpt / peak_flops if peak_flops else None
        r["mfu_best_peak"] = r["tokens_per_s"] * fpt / best_peak_flops if best_peak_flops else None
        # First step minus a steady step: the torch.compile time (None for eager).
        r["compile_s"] = max(0.0, r["warmup_s"][0] - r["median_step_s"]) if r["compiled"] else None
    ratio = res["ours"]["tokens_per_s"] / res["transformers"]["tokens_per_s"]
    mfu = res["ours"].get("mfu")
    return {"precision": precision, "impls": res, "ratio": ratio, "target_met": ratio >= TARGET,
            "mfu_target_met": (mfu is not None and mfu >= MFU_TARGET) if precision == "fp32" else None,
            "device_peak_flops": peak_flops, "peak_reads_flops": peak_flops_reads,
            "best_peak_flops": best_peak_flops}


def _gpu_peak_flops_read(device, precision: str) -> float:
    """One read of this GPU's matmul peak in `precision` (fp32: TF32 tensor cores, as the trainer sets
    them): the trainer's own read (`read_gpu_peak_flops`, the one its step line shows beside the data sheet)."""
    import torch

    from gpt2forge.train.metrics.peak_flops import read_gpu_peak_flops

    torch.backends.cuda.matmul.allow_tf32 = True
    return read_gpu_peak_flops(device, precision)


def _cpu_peak_flops_read(precision: str) -> float:
    """One read of this CPU's matmul peak in `precision` (never below fp32's: autocast training does
    much of its work in fp32, and an emulated bf16 matmul is slower than fp32)."""
    from gpt2forge.train.metrics.peak_flops import measure_cpu_peak_flops

    fp32 = measure_cpu_peak_flops("fp32")
    return fp32 if precision == "fp32" else max(fp32, measure_cpu_peak_flops(precision))


def print_table(summaries: list[dict]) -> None:
    head = (f"{'precision':9s} {'impl':12s} {'tokens/s':>9s} {'step s':>7s} {'min-max s':>13s} {'CPU s':>6s} "
            f"{'MFU':>6s} {'MFU*':>6s} {'peak MiB':>9s} {'1st step s':>10s} {'compile s':>9s} {'ratio':>6s}")
    print(head)
    print("-" * len(head))
    for s in summaries:
        for impl, r in s["impls"].items():
            mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "  n/a"
            mfu_best = f"{100 * r['mfu_best_peak']:5.1f}%" if r.get("mfu_best_peak") is not None else "  n/a"
            spread = f"{min(r['step_s']):.2f}-{max(r['step_s']):.2f}"
            ratio = f"{s['ratio']:5.2f}x" if impl == "ours" else ""
            compile_s = f"{r['compile_s']:9.1f}" if r["compile_s"] is not None else f"{'-':>9s}"
            print(f"{s['precision']:9s} {impl:12s} {r['tokens_per_s']:9.1f} {r['median_step_s']:7.2f} "
                  f"{spread:>13s} {r['median_step_cpu_s']:6.2f} {mfu:>6s} {mfu_best:>6s} {r['peak_mib']:9.0f} "
                  f"{r['warmup_s'][0]:10.1f} {compile_s} {ratio:>6s}")


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    from gpt2forge.tools.machine_report import wait_for_quiet
    wait_for_quiet(args.wait_quiet)
    import torch

    from gpt2forge.core.device import resolve_device
    from gpt2forge.train.metrics.peak_flops import device_peak_flops, remember_cpu_peak_flops

    try:
        device = resolve_device(args.device)
        cfg = _model_config(args.model, args.seq_len)
    except ValueError as exc:  # gpt2forge's UsageError: a one-line message for the user
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fpt = cfg.flops_per_token(args.seq_len)
    print(f"GPT-2 training throughput: model {args.model} ({cfg.num_params() / 1e6:.1f}M params), "
          f"B={args.batch_size}, T={args.seq_len}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"device {device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
          f"torch {torch.__version__}")
    from gpt2forge.core.precision import cpu_half_matmul_is_emulated

    emulated = [x for x in args.precisions if device.type == "cpu" and cpu_half_matmul_is_emulated(x)]
    action = "measured anyway (--include-emulated)" if args.include_emulated else "skipped; --include-emulated runs it"
    for precision in emulated:
        print(f"note: this CPU has no {precision} matmul kernels, so both implementations' {precision} "
              f"matmuls are emulated (far slower than fp32): {action}")
    if not args.include_emulated:
        args.precisions = [x for x in args.precisions if x not in emulated]
    if not args.precisions:
        return 0
    ctx = mp.get_context("spawn")
    summaries = []
    for precision in args.precisions:
        log = lambda m: print(m, flush=True)  # noqa: E731
        if device.type == "cpu":
            res = bench_precision(ctx, precision, args, log,
                                  read_peak_flops=lambda p=precision: _cpu_peak_flops_read(p))
            peak_flops = max(res["peak_flops_reads"])
            best = remember_cpu_peak_flops(precision, peak_flops)
            summaries.append(summarize(res, precision, args, fpt, peak_flops, best))
        else:  # a GPU: the peak read in this run; its data sheet's figure for MFU* (llm.c's and nanoGPT's basis)
            res = bench_precision(ctx, precision, args, log,
                                  read_peak_flops=lambda p=precision: _gpu_peak_flops_read(device, p))
            summaries.append(summarize(res, precision, args, fpt, max(res["peak_flops_reads"]),
                                       device_peak_flops(device, precision)))
    wall = time.perf_counter() - t_start

    print()
    print_table(summaries)
    for s in summaries:
        if s["peak_reads_flops"]:
            reads = ", ".join(f"{x / 1e9:.0f}" for x in s["peak_reads_flops"])
            print(f"{s['precision']} matmul peak reads in this run (GFLOP/s): {reads}; best "
                  f"{s['device_peak_flops'] / 1e9:.1f}, the best this machine has shown "
                  f"{s['best_peak_flops'] / 1e9:.1f}")
    print(f"\nstep s = median wall time of the interleaved timed steps (tokens/s = B*T / step s); CPU s = its "
          f"user + system CPU time;\nMFU = tokens/s x {fpt / 1e6:.1f} MFLOP/token / the best matmul peak read in this "
          f"run; MFU* = the same against the best peak this machine has shown (a GPU: its data sheet's); peak MiB = "
          f"{summaries[0]['impls']['ours']['memory_source']} of each worker process (compilation included); "
          f"compile s = first step - step s; ratio = ours / transformers")
    o, t = summaries[0]["impls"]["ours"], summaries[0]["impls"]["transformers"]
    print(f"ours: {'torch.compile (--torch-compile true)' if o['compiled'] else 'eager'}, {o['optimizer']}, "
          f"{o['lm_loss']} LM loss; transformers: {'torch.compile' if t['compiled'] else 'eager'}, "
          f"attn_implementation={t['attn_implementation']}, {t['optimizer']}")
    for s in summaries:
        o, t = s["impls"]["ours"], s["impls"]["transformers"]
        print(f"{s['precision']}: ours {o['tokens_per_s']:.1f} tokens/s, transformers {t['tokens_per_s']:.1f} "
              f"tokens/s, ratio {s['ratio']:.2f}x")
    verdicts = ", ".join(f"{s['precision']} {'met' if s['target_met'] else 'NOT met'}" for s in summaries)
    print(f"target ours >= {TARGET}x transformers: {verdicts}")
    verdicts = ", ".join(f"{s['precision']} {'met' if s['mfu_target_met'] else 'NOT met'}" for s in summaries
                         if s["precision"] == "fp32")
    if verdicts:
        print(f"target ours >= {MFU_TARGET:.0%} MFU of the peak measured in this run: {verdicts} (other "
              f"precisions' MFU, against their own matmul peak, is reported, not targeted)")
    for s in summaries:
        best = s["impls"]["ours"].get("mfu_best_peak")
        if s["precision"] == "fp32" and best is not None:
            print(f"ours against the best peak this machine has shown: {best:.1%} MFU "
                  f"({'at or above' if best >= MFU_TARGET else 'below'} {MFU_TARGET:.0%})")
    if device.type == "cuda":  # the GPU issue's targets: llm.c reports 38-56% MFU, nanoGPT about 37%
        for s in summaries:
            o = s["impls"]["ours"]
            sheet = o["mfu_best_peak"] or 0
            print(f"GPU targets, {s['precision']}: ours >= {GPU_MFU_TARGET:.0%} MFU of the data sheet: "
                  f"{'met' if sheet >= GPU_MFU_TARGET else 'NOT met'} ({100 * sheet:.1f}%; of the peak read in this "
                  f"run: {100 * (o['mfu'] or 0):.1f}%); "
                  f">= {GPU_TARGET}x transformers: {'met' if s['ratio'] >= GPU_TARGET else 'NOT met'} "
                  f"({s['ratio']:.2f}x)")
    print(f"total benchmark wall time: {wall:.0f} s")
    if args.json:
        out = {"args": vars(args), "device": str(device), "torch": torch.__version__, "target": TARGET,
               "mfu_target": MFU_TARGET, "flops_per_token": fpt, "wall_s": wall, "results": summaries}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
