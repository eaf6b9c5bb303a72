"""
Benchmarks: what a training step costs and where its time goes. It times train.py's own step (same flags) on
synthetic tokens; training never imports it.

    python bench.py --preset=tiny                      # ms/step, tokens/s, MFU, memory, phases, components
    python bench.py --preset=tiny --dim=64 --json      # takes every train.py flag
    python bench.py --preset=nano --save=base.json     # a baseline: times, kernels, numbers, versions
    python bench.py --preset=nano --compare=base.json  # after an upgrade: what moved
    torchrun --nproc_per_node=8 bench.py --dp_replicate=2 --ep=4 --global_batch=64
    python bench.py moe --preset=nano --tokens=2048    # one MoE layer: grouped GEMM, per-expert loop, dense
    torchrun --nproc_per_node=2 bench.py moe           # ... and the expert-parallel all-to-all
    python bench.py vs-hf --preset=tiny                # our step vs transformers' AfmoeForCausalLM
    python bench.py data --workers 1 2                 # data.py's tokens/s per core vs tiktoken's

`--compare` exits 0: nothing moved, 1: slower, 3: the numbers moved, 4: both, 2: bad input. On a shared machine
compare ratios from one run (moe_to_dense, speedup) and add `--threads=1 --clock=cpu` (idle threads spin: two on
two busy cores can run 100x slower).
"""

import argparse
import contextlib
import dataclasses
import functools
import importlib.metadata
import itertools
import json
import math
import os
import resource
import statistics
import sys
import time
import unittest.mock
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.distributed.tensor import DTensor

import parallel
import train
from model import (
    PRESETS,
    FeedForward,
    MoE,
    Parser,
    above,
    at_least,
    grouped_mm_supported,
    meta_model,
    parse_bool,
    suggest,
)
from parallel import say

COMMANDS = {"moe": "One MoE layer: grouped GEMM, per-expert loop, dense and expert parallel, forward + backward.",
            "vs-hf": "Our training step vs transformers' AfmoeForCausalLM, timed alternately.",
            "data": "data.py's tokens/s per core vs its tokenizer library's batch encoder."}

# --- Timing, memory and synthetic data

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # CPU time: a busy machine inflates it far less
clock = CLOCKS["wall"]


def timed_ms(fn, device: torch.device, read=None) -> float:
    read = read or clock
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    sync(device)
    t0 = read()
    fn()
    sync(device)
    return (read() - t0) * 1e3


def alternate(fns: dict, device: torch.device, warmup: int, iters: int) -> dict:
    """{name: [ms]}: the functions in turn, reversed on odd steps, so that a drift hits all alike."""
    times = defaultdict(list)
    for i in range(warmup + iters):
        for name, fn in list(fns.items())[::-1 if i % 2 else 1]:
            ms = timed_ms(fn, device)
            if i >= warmup:
                times[name].append(ms)
    return times


def spread(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms), "ms_p25": q[0], "ms_p75": q[2],
            "iters": len(ms)}


def record_times(result: dict, times: dict, flops: dict):
    """Each function's median ms (the slowest rank's) and minimum, shown with its GFLOP/s where `flops` has it."""
    for name, ms in times.items():
        median = result[f"{name}_ms"] = max_over_ranks(statistics.median(ms))
        result[f"{name}_ms_min"] = min(ms)
        rate = f" {flops[name] / median / 1e6:8.1f} GFLOP/s" if name in flops else ""
        say(f"  {name:8s} median {median:9.2f} ms (min {min(ms):.2f}){rate}")


def max_over_ranks(value: float) -> float:
    return max(parallel.gathered(float(value)))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def describe(run: train.Run) -> str:
    c = run.cfg
    return (f"{run.tc.preset} {c.dim}d x {c.n_layers} layers, {c.n_experts} experts of {c.expert_hidden} top-{c.top_k}"
            f", vocab {c.vocab_size}; {run.dtype or torch.float32} on {device_name(run.device)}")


def synthetic_batch(vocab_size: int, global_batch: int, seq_len: int, rank: int, world: int, seed: int):
    """This rank's rows of a random global batch, as train.py's loader gives them: [B, T] tokens, targets, doc ids."""
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(0, vocab_size, (global_batch, seq_len + 1), generator=g)
    starts_BT = torch.zeros(global_batch, seq_len, dtype=torch.long)
    n_cuts = min(4, seq_len) - 1
    if n_cuts > 0:
        starts_BT.scatter_(1, torch.rand(global_batch, seq_len - 1, generator=g).topk(n_cuts, dim=1).indices + 1, 1)
    rows = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
    return tokens_BT[rows, :-1], tokens_BT[rows, 1:], starts_BT.cumsum(1)[rows]


def train_step(model, optimizer, batch, tc, autocast, momentum_LE: torch.Tensor, steps: list[int]) -> dict:
    """One of train.py's steps, every one applied; steps[0] counts them for the LR schedule."""
    for group in optimizer.param_groups:
        group["lr"] = train.lr_at(steps[0], tc)
    out = train.forward_backward(model, batch, tc, autocast)
    with train.phase("optimizer"):
        optimizer.step()
    train.update_biases(model, out["counts_LE"], momentum_LE, tc, steps[0])
    optimizer.zero_grad(set_to_none=True)
    steps[0] += 1
    return out


def stepper(run: train.Run, model, optimizer, batch):
    """train_step on `batch`, as a function of nothing."""
    momentum_LE = torch.zeros(len(model.moe_layers()), run.cfg.n_experts, device=run.device)
    steps = [0]
    return lambda: train_step(model, optimizer, batch, run.tc, run.autocast, momentum_LE, steps)


def model_config(tc: train.TrainConfig, overrides: dict):
    """train.model_config with the preset's vocabulary standing in for a tokenizer's."""
    return train.model_config(tc, overrides, PRESETS[tc.preset].vocab_size)


# --- Where the time goes: profiler ranges around the model's components, attributed forward and backward

SCOPE = "bench::"  # our ranges
PHASE = "train_step::"  # train.phase's ranges
BACKWARD = "autograd::engine::evaluate_function"  # a backward node's range
COMM_MARKERS = ("allreduce", "allgather", "reducescatter", "alltoall", "recordparamcomms", "nccl:", "gloo:", "fsdp::")
STEP_LABELS = ("grad clip", "expert-bias update")  # the step's phases that are components of their own
STEP_RANGES = tuple(PHASE + label for label in STEP_LABELS)


@contextlib.contextmanager
def wrapped(targets):
    """Each (object, attribute, label) callable in a profiler range `bench::label` for the duration."""
    with contextlib.ExitStack() as patches:
        for obj, attr, label in targets:
            in_range = torch.profiler.record_function(SCOPE + label)(getattr(obj, attr))
            patches.enter_context(unittest.mock.patch.object(obj, attr, in_range))
        yield


def moe_targets(moe: MoE) -> list:
    # The z-loss and the sort/gather/scatter are inline in MoE.forward: they land in its own range.
    targets = [(moe, "forward", "MoE permutation, combine, z-loss"), (moe, "route", "router"),
               (moe, "balance_loss", "router"), (moe.experts, "forward", "routed experts")]
    return targets + ([(moe.shared, "forward", "shared expert")] if moe.shared is not None else [])


def model_targets(model, blocks: bool = True) -> list:
    # The fused head and loss are one component; compiled blocks (fused graphs) land in the model's range.
    targets = [(model, "forward", "masks, RoPE tables" if blocks else "compiled blocks, masks, RoPE tables"),
               (model.embed, "forward", "embedding"), (model.norm, "forward", "final norm"),
               (model, "head_loss", "output head, cross-entropy")]
    for block in model.layers.values() if blocks else ():
        targets += [(block, "forward", "residual adds"), (block.attn, "forward", "attention")]
        targets += [(norm, "forward", "norms")
                    for norm in (block.attn_norm, block.attn_post_norm, block.ffn_norm, block.ffn_post_norm)]
        targets += moe_targets(block.ffn) if isinstance(block.ffn, MoE) else [(block.ffn, "forward", "dense FFN")]
    return targets


def profile(fn, device: torch.device, targets) -> tuple[dict, dict, float, dict]:
    """fn with `targets` wrapped: {label: {fwd, bwd, total} ms}, {label: {op: [calls, ms]}}, wall ms, {phase: ms}.
    An op's self time goes to its innermost range, a backward op's to its forward's."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with wrapped(targets), torch.profiler.profile(activities=activities) as prof:
        wall = timed_ms(fn, device, time.perf_counter)  # the profiler's clock

    def self_ms(e):
        return (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3

    def owner(e):
        while e is not None:
            if e.name.startswith(SCOPE) or e.name in STEP_RANGES:
                label = e.name.split("::", 1)[1]
                return label, "total" if label in STEP_LABELS else "fwd"
            if e.name.startswith("Optimizer."):
                return "optimizer", "total"
            name = e.name.lower().replace("_", "")
            if any(m in name for m in COMM_MARKERS):
                return "communication", "total"
            if e.name.startswith(BACKWARD):
                return None, e
            e = e.cpu_parent
        return "other", "total"

    def phase(e):
        while e is not None and not e.name.startswith(PHASE):
            if e.name.startswith(BACKWARD):
                return "backward"
            e = e.cpu_parent
        return "other" if e is None else e.name[len(PHASE):]

    table = defaultdict(lambda: {"fwd": 0.0, "bwd": 0.0, "total": 0.0})
    ops = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    phases = defaultdict(float)
    forward_of = {}
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):  # a node's forward op before its backward
        label, where = owner(e)
        if label is not None and e.sequence_nr >= 0:
            # Ops that make no autograd node record the next sequence number too; the last to record it made it.
            forward_of[(e.thread, e.sequence_nr)] = label
        if cuda and e.device_type != DeviceType.CPU:
            continue  # a kernel: already in the self device time of the CPU op that launched it
        phases[phase(e)] += self_ms(e)
        if e.name.startswith(PHASE) and e.name not in STEP_RANGES:
            continue  # a phase's own time (python between its ops): no component's
        if label is None:  # inside a backward node
            label = forward_of.get((where.fwd_thread, where.sequence_nr),
                                   "gradient accumulation into .grad" if "AccumulateGrad" in where.name else "other")
            where = "bwd"
        table[label][where] += self_ms(e)
        for name, ms in [(k.name, k.duration / 1e3) for k in e.kernels] if cuda else [(e.name, self_ms(e))]:
            ops[label][name][0] += 1
            ops[label][name][1] += ms
    for row in table.values():
        row["total"] += row["fwd"] + row["bwd"]
    return dict(table), {label: dict(kernels) for label, kernels in ops.items()}, wall, dict(phases)


def merged(ops: dict, scale: float = 1.0) -> dict:
    """{name: [calls, ms]} summed over {key: {name: [calls, ms]}} and scaled (1/n: the mean of n)."""
    out = defaultdict(lambda: [0.0, 0.0])
    for kernels in ops.values():
        for name, (calls, ms) in kernels.items():
            out[name][0] += calls * scale
            out[name][1] += ms * scale
    return {name: [round(calls, 3), ms] for name, (calls, ms) in out.items()}


def median_profile(runs: list) -> tuple[dict, dict, float, dict]:
    """profile() runs as one: medians, kernel means, each share's quartiles (a busy machine stretches all alike)."""
    zero = {"fwd": 0.0, "bwd": 0.0, "total": 0.0}
    tables, opss, walls, phasess = zip(*runs)
    table = {}
    for label in set().union(*tables):
        q = spread([t.get(label, zero)["total"] / wall for t, wall in zip(tables, walls)])
        table[label] = {k: statistics.median(t.get(label, zero)[k] for t in tables) for k in zero}
        table[label] |= {"share": q["ms_median"], "share_p25": q["ms_p25"], "share_p75": q["ms_p75"]}
    kernels = {label: merged({i: ops.get(label, {}) for i, ops in enumerate(opss)}, 1 / len(runs))
               for label in set().union(*opss)}
    order = sorted(dict.fromkeys(label for p in phasess for label in p), key=lambda label: label == "other")
    phases = {label: statistics.median(p.get(label, 0.0) for p in phasess) for label in order}
    return table, kernels, statistics.median(walls), phases


def print_components(table: dict, wall_ms: float, what: str):
    say(f"where the time goes ({what}; self time per op, backward in its forward's component, AC's recomputation "
        f"as forward, the output head's gradients in its forward):")
    say(f"  {'component':34s} {'fwd ms':>9s} {'bwd ms':>9s} {'total ms':>9s} {'share':>6s}")
    for label, row in sorted(table.items(), key=lambda kv: -kv[1]["total"]):
        say(f"  {label:34s} {row['fwd']:9.2f} {row['bwd']:9.2f} {row['total']:9.2f} "
            f"{100 * row['total'] / wall_ms:5.1f}%")
    gap = wall_ms - sum(row["total"] for row in table.values())
    say(f"  {'(python, gaps: wall - profiled)':54s} {gap:9.2f} {100 * gap / wall_ms:5.1f}%   of {wall_ms:.1f} ms")


# --- bench.py [train flags]: the training step

def bench_step(args, tc: train.TrainConfig, overrides: dict) -> dict:
    rank, world, device = parallel.init_distributed()
    torch.manual_seed(tc.seed)
    run = train.make_run(tc, model_config(tc, overrides), rank, world, device)
    tc = run.tc  # --micro_batch=0 resolved to each rank's share, as train.py does
    cfg = run.cfg
    config = step_config(tc, cfg, world, args.clock)
    baseline = load_baseline(args.compare, config) if args.compare else None  # refused before anything is built
    # An unwritable baseline (a folder, read-only, no such folder) fails now, not after the benchmark.
    writable = os.path.isfile(args.save) and os.access(args.save, os.W_OK) or not os.path.exists(args.save) and \
        os.access(os.path.dirname(os.path.abspath(args.save)), os.W_OK | os.X_OK)
    if args.save and not writable:
        raise FileNotFoundError(f"--save={args.save} cannot be written; pass a file path in a folder you can write to.")
    model, optimizer = train.build(run)
    rows, chunk = run.layout.data_rank(rank)  # with --cp, a group's ranks take chunks of the same rows
    batch = synthetic_batch(cfg.vocab_size, tc.global_batch, tc.seq_len, rows, run.layout.dp, tc.seed)
    columns = slice(chunk * tc.seq_len // tc.cp, (chunk + 1) * tc.seq_len // tc.cp)
    step = stepper(run, model, optimizer, tuple(t[:, columns] for t in batch))
    twin = meta_model(cfg)
    n = twin.num_params()
    flops_per_token = twin.flops_per_token(tc.seq_len)
    low = f"; blocks' matmuls in {tc.precision} (MFU of the bf16 peak)" if tc.precision != "bf16" else ""
    say(f"bench: {describe(run)}, {world} rank(s); {n['total'] / 1e6:.1f}M params ({n['active'] / 1e6:.1f}M active), "
        f"{flops_per_token / 1e6:.1f} MFLOP/token; {tc.global_batch} x {tc.seq_len} tokens, micro-batch "
        f"{tc.micro_batch}, ac={tc.ac}, compile={tc.compile}{low}")
    say(run.layout.describe(cfg.n_experts))
    # The first steps from the seeded initialisation, which --compare checks (they warm up too).
    trajectory = record_trajectory(step, model, run.dtype) if args.save or args.compare else None
    for _ in range(args.warmup):
        step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    result = {"command": "step", "preset": tc.preset, "world": world, "device": device_name(device),
              "params": n["total"], "active_params": n["active"], "flops_per_token": flops_per_token,
              "tokens_per_step": tc.global_batch * tc.seq_len}
    result |= spread([timed_ms(step, device) for _ in range(args.iters)])
    say(f"step: median {result['ms_median']:.1f} ms (min {result['ms_min']:.1f}, p25 {result['ms_p25']:.1f}, p75 "
        f"{result['ms_p75']:.1f}, max {result['ms_max']:.1f}) over {args.iters} steps")
    tok_s = result["tokens_per_step"] / (result["ms_median"] / 1e3)
    peak = parallel.peak_tflops(device)
    tflops = flops_per_token * tok_s / world / 1e12
    # CUDA: the allocator's peak since the reset; CPU: the process's peak resident set (Linux: KiB)
    mem = torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result.update(tokens_per_s=tok_s, tokens_per_s_per_device=tok_s / world, tflops_per_device=tflops,
                  mfu=tflops / peak if peak else None, peak_tflops=peak, peak_mem_gib=max_over_ranks(mem) / 2**30,
                  peak_mem_kind="CUDA max_memory_allocated" if cuda else "process peak RSS")
    mfu = "n/a" if peak is None else f"{100 * result['mfu']:.1f}% of {peak:g} TFLOP/s"
    say(f"throughput: {tok_s:,.0f} tokens/s, {tok_s / world:,.0f} per device; {tflops:.3f} TFLOP/s per device; "
        f"MFU {mfu}")
    say(f"peak memory: {result['peak_mem_gib']:.2f} GiB per device ({result['peak_mem_kind']}, max over ranks)")
    if args.breakdown:
        runs = [profile(step, device, model_targets(model, blocks=not tc.compile)) for _ in range(min(5, args.iters))]
        table, kernels, wall, phases = median_profile(runs)
        what = f"the median of {len(runs)} profiled steps" + (", compiled blocks not split" if tc.compile else "")
        say(f"phases ({what}; FSDP's collectives in forward and backward):")
        for label, v in phases.items():
            say(f"  {label:34s} {v:9.2f} ms {100 * v / sum(phases.values()):5.1f}%")
        print_components(table, wall, what)
        result.update(phases_ms=phases, components_ms=table, kernels=kernels, step_kernels=merged(kernels))
    result.update(config=config, environment=environment(device))
    if trajectory:
        result["trajectory"] = trajectory
    if args.save and rank == 0:
        with open(args.save, "w") as f:
            json.dump(result, f, indent=1)
        say(f"saved the baseline {args.save}; compare a later run with --compare={args.save}")
    if baseline is not None:
        verdict = compare(baseline, result, args.tolerance)
        numerics = compare_numerics(baseline.get("trajectory"), trajectory, args.numerics_tolerance)
        for line in verdict.pop("lines") + numerics.pop("lines"):
            say(line)
        moved = numerics["moved"] is not None
        result.update(compare=verdict, numerics=numerics, exit=verdict["exit"] + 3 * moved)  # 1 slower, 3 moved, 4 both
    return {k: v for k, v in result.items() if k not in ("kernels", "step_kernels")}  # too long for --json


# --- bench.py --save / --compare: a guard for upgrades (a new torch can silently pick a slower kernel)

STEP_FIELDS = ("seq_len", "doc_mask", "global_batch", "micro_batch", "dtype", "ac", "compile", "dp_replicate", "ep",
               "optimizer", "grad_clip", "balance")  # the train.py flags that change the step's work


def step_config(tc: train.TrainConfig, cfg, world: int, clock_name: str) -> dict:
    """What was timed: two runs compare only if these agree (as JSON stores them)."""
    config = {f"model.{k}": v for k, v in dataclasses.asdict(cfg).items()}
    config |= {k: getattr(tc, k) for k in STEP_FIELDS} | {"world": world, "clock": clock_name}
    return json.loads(json.dumps(config))


def environment(device: torch.device) -> dict:
    """What picks a step's kernels: library versions, the device, the backend switches."""
    b = torch.backends
    kernel_libraries = ("triton", "pytorch-triton", "nvidia-cublas", "nvidia-cudnn", "nvidia-nccl")
    env = {"torch": torch.__version__, "device": device_name(device),
           "float32 matmul precision": torch.get_float32_matmul_precision()}
    env |= {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()
            if (d.metadata["Name"] or "").lower().startswith(kernel_libraries)}
    if device.type == "cuda":
        env |= {"cuda": torch.version.cuda, "cudnn": b.cudnn.version(),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
                "matmul tf32": b.cuda.matmul.allow_tf32, "cudnn tf32": b.cudnn.allow_tf32,
                "bf16 reduced-precision reduction": b.cuda.matmul.allow_bf16_reduced_precision_reduction,
                "fp16 reduced-precision reduction": b.cuda.matmul.allow_fp16_reduced_precision_reduction,
                "blas": str(b.cuda.preferred_blas_library())}
    else:
        env |= {"cpu capability": b.cpu.get_cpu_capability(), "mkldnn": b.mkldnn.enabled}
    sdpa = ("flash", "mem_efficient", "math", "cudnn")
    return env | {f"sdpa {k}": getattr(b.cuda, f"{k}_sdp_enabled")() for k in sdpa}


def differences(old: dict, new: dict) -> list[str]:
    return [f"{k} {old.get(k, 'absent')} -> {new.get(k, 'absent')}" for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k)]


def load_baseline(path: str, config: dict) -> dict:
    """The baseline at `path`, refused unless bench.py --save wrote it for the same `config`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--compare={path} does not exist; record a baseline first with --save={path}.")
    try:
        with open(path) as f:
            old = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError):
        old = None
    if not isinstance(old, dict) or not isinstance(old.get("config"), dict):
        raise ValueError(f"--compare={path} is not a baseline written by bench.py --save.")
    moved = differences(old["config"], config)
    if moved:
        raise ValueError(f"the baseline was measured with other flags ({', '.join(moved)}); use its flags or --save "
                         f"a new baseline.")
    return old


def kernel_changes(old: dict, new: dict, min_ms: float) -> dict:
    """The three largest kernels {name: [calls, ms]} that appeared, went, or changed calls or by min_ms."""
    def largest(kernels: dict, size) -> dict:
        return dict(sorted(kernels.items(), key=lambda kv: -size(kv[1]))[:3])

    changed = {n: [old[n], new[n]] for n in old.keys() & new.keys()
               if old[n][0] != new[n][0] or abs(new[n][1] - old[n][1]) >= min_ms}
    return {"appeared": largest({n: new[n] for n in new.keys() - old.keys()}, lambda k: k[1]),
            "disappeared": largest({n: old[n] for n in old.keys() - new.keys()}, lambda k: k[1]),
            "changed": largest(changed, lambda ab: abs(ab[1][1] - ab[0][1]))}


def describe_kernels(changes: dict) -> str:
    def one(kernel):
        return f"{kernel[0]:g}x {kernel[1]:.2f} ms"
    return "; ".join([f"new {n} {one(k)}" for n, k in changes["appeared"].items()]
                     + [f"gone {n} {one(k)}" for n, k in changes["disappeared"].items()]
                     + [f"{n} {one(a)} -> {one(b)}" for n, (a, b) in changes["changed"].items()])


def compare(old: dict, new: dict, tolerance: float) -> dict:
    """`new` against the baseline `old`: exit 1 when slower beyond both the noise band (half of each interquartile
    range, added) and `tolerance`; each component that moved so is named with its kernels."""
    change = (new["ms_median"] - old["ms_median"]) / old["ms_median"]
    band = (old["ms_p75"] - old["ms_p25"] + new["ms_p75"] - new["ms_p25"]) / 2 / old["ms_median"]
    limit = max(band, tolerance)
    verdict = "SLOWER beyond both: exit 1" if change > limit else "faster" if change < -limit else "within them"
    mfu = f", MFU {100 * old['mfu']:.1f}% -> {100 * new['mfu']:.1f}%" if old["mfu"] and new["mfu"] else ""
    lines = [f"against the baseline: step {old['ms_median']:.1f} -> {new['ms_median']:.1f} ms median{mfu} "
             f"({100 * change:+.1f}%; noise band {100 * band:.1f}%, tolerance {100 * tolerance:.1f}%): {verdict}"]
    zero = {"total": 0.0, "share": 0.0, "share_p25": 0.0, "share_p75": 0.0}
    profiled = "kernels" in old and "kernels" in new  # not with --breakdown=false
    moved = {}
    for label in sorted(old["components_ms"].keys() | new["components_ms"].keys() if profiled else ()):
        a = old["components_ms"].get(label, zero)
        b = new["components_ms"].get(label, zero)
        ms_a = a["share"] * old["ms_median"]
        ms_b = b["share"] * new["ms_median"]
        noise = ((a["share_p75"] - a["share_p25"]) * old["ms_median"]
                 + (b["share_p75"] - b["share_p25"]) * new["ms_median"]) / 2
        if abs(ms_b - ms_a) > max(noise, tolerance * old["ms_median"]):  # a smaller move cannot fail the step
            kernels = kernel_changes(old["kernels"].get(label, {}), new["kernels"].get(label, {}),
                                     abs(b["total"] - a["total"]) / 10)
            moved[label] = {"ms": [ms_a, ms_b], "noise_ms": noise, **kernels}
            pct = f"{100 * (ms_b - ms_a) / ms_a:+.0f}%" if ms_a else "new"
            lines.append(f"  {label}: {ms_a:.2f} -> {ms_b:.2f} ms of the step ({pct}, noise {noise:.2f} ms)"
                         + (f": {describe_kernels(kernels)}" if any(kernels.values()) else ""))
    # A kernel swap that moved no component's time by much still shows, once, in the step's fingerprint.
    named = {n for label in moved for r in (old, new) for n in r["kernels"].get(label, {})}
    unnamed = [{n: k for n, k in r["step_kernels"].items() if n not in named} if profiled else {} for r in (old, new)]
    step_kernels = kernel_changes(*unnamed, math.inf) | {"changed": {}}
    if step_kernels["appeared"] or step_kernels["disappeared"]:
        lines.append(f"  kernels of the whole step: {describe_kernels(step_kernels)}")
    if abs(new["peak_mem_gib"] - old["peak_mem_gib"]) > tolerance * old["peak_mem_gib"]:
        lines.append(f"  peak memory {old['peak_mem_gib']:.2f} -> {new['peak_mem_gib']:.2f} GiB")
    env = differences(old.get("environment", {}), new["environment"])
    if env:
        lines.append(f"warning: the environment differs from the baseline's: {'; '.join(env)}")
    return {"exit": int(change > limit), "step_change": change, "noise_band": band, "tolerance": tolerance,
            "components": moved, "step_kernels": step_kernels, "environment": env, "lines": lines}


# A new torch, CUDA or kernel can also compute differently. The first steps from the seeded initialisation on the
# fixed batch are deterministic up to rounding: --save records them.

NUMERICS_STEPS = 3
NUMERICS_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2}  # relative: far above fp32 rounding; bf16 keeps 8 bits


def layer_weights(model) -> dict:
    """{layer: [sum, norm]} of each layer's weights in float64 (embed, layers.0, ..., head), on all ranks."""
    sums = defaultdict(lambda: [0.0, 0.0])
    for name, p in model.named_parameters():
        parts = name.split(".")
        layer = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
        w = p.detach().double()
        for i, total in enumerate((w.sum(), w.square().sum())):
            sums[layer][i] += (total.full_tensor() if isinstance(total, DTensor) else total).item()
    return {layer: [total, math.sqrt(squares)] for layer, (total, squares) in sums.items()}


def record_trajectory(step, model, dtype: torch.dtype | None) -> dict:
    """The layers' weights, then each of NUMERICS_STEPS steps' loss, gradient norm and layers after it."""
    initial = layer_weights(model)
    steps = []
    for _ in range(NUMERICS_STEPS):
        out = step()
        steps.append({"loss": out["loss"], "grad_norm": out["grad_norm"], "layers": layer_weights(model)})
    return {"dtype": "bf16" if dtype == torch.bfloat16 else "fp32", "initial": initial, "steps": steps}


def relative(change: float, scale: float) -> float:
    """change / scale, where no change is 0 whatever the scale and a NaN or Inf is infinitely far."""
    ratio = change / scale if scale else (0.0 if change == 0 else math.inf)
    return ratio if math.isfinite(ratio) else math.inf


def compare_numerics(old: dict | None, new: dict, tolerance: float) -> dict:
    """The first step (0: the initial weights) where `new` moved from `old` beyond `tolerance` (0: the dtype's),
    relative to the layer's norm: rounding moves fp32 ~1e-7, a changed norm epsilon 1e-4 and more."""
    tolerance = tolerance or NUMERICS_TOLERANCE[new["dtype"]]
    verdict = {"moved": None, "tolerance": tolerance}
    if not old:
        return verdict | {"lines": ["numerics: the baseline has no trajectory (an older bench.py); not compared"]}
    for i, (a, b) in enumerate(zip([{"layers": old["initial"]}] + old["steps"],
                                   [{"layers": new["initial"]}] + new["steps"])):
        changes = {key: relative(abs(b[key] - a[key]), abs(a[key])) for key in ("loss", "grad_norm") if key in a}
        for layer, (total, norm) in a["layers"].items():
            new_total, new_norm = b["layers"].get(layer, (math.nan, math.nan))
            changes[layer] = relative(max(abs(new_total - total), abs(new_norm - norm)), norm)
        moved = {key: change for key, change in changes.items() if change > tolerance}
        if not moved:
            continue
        layers = [key for key in moved if key in a["layers"]]
        most = max(layers, key=moved.get, default=None)
        verdict["moved"] = {"step": i, "first_layer": layers[0] if layers else None, "most_moved_layer": most,
                            "changes": moved}
        scalars = [f"{key.replace('_', ' ')} {a[key]:.6g} -> {b[key]:.6g} ({moved[key]:.1e})"
                   for key in ("loss", "grad_norm") if key in moved]
        where = (f"first layer {layers[0]} ({moved[layers[0]]:.1e}), most {most} ({moved[most]:.1e}), {len(layers)} of "
                 f"{len(a['layers'])} layers moved" if layers else "no layer's weights moved yet")
        when = f"step {i} of {len(new['steps'])}" if i else "the initial weights"
        return verdict | {"lines": [f"numerics MOVED beyond {tolerance:.0e} (relative) at {when}: "
                                    f"{'; '.join(scalars + [where])}: exit 3"]}
    matched = f"the initial weights and the first {len(new['steps'])} steps match the baseline's within {tolerance:.0e}"
    return verdict | {"lines": [f"numerics: {matched} (relative): loss, gradient norm, every layer's weights"]}


# --- bench.py moe: one MoE layer, three ways

def init_(module: nn.Module, std: float) -> nn.Module:
    """Truncated normal on [-3σ, 3σ], as Transformer.init_weights does."""
    for p in module.parameters():
        nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)
    return module


def say_ratios(result: dict, world: int):
    """The grouped MoE layer's time against the dense layer's at the same FLOPs; the loop's and EP's, where timed."""
    dense_ms_per_active = result["dense_ms"] * result["active_hidden"] / result["dense_hidden"]
    result["moe_to_dense"] = result["grouped_ms"] / dense_ms_per_active
    say(f"MoE (grouped) / dense: {result['moe_to_dense']:.2f}x, the cost of sparsity at these shapes")
    if "loop_ms" in result:
        result["loop_to_dense"] = result["loop_ms"] / dense_ms_per_active
        say(f"per-expert loop / dense: {result['loop_to_dense']:.2f}x; grouped == loop to "
            f"{result['grouped_vs_loop_max_diff']:.1e} (relative)")
    if "ep_ms" in result:
        result["ep_overhead"] = result["ep_ms"] / result["grouped_ms"]
        say(f"expert parallel over {world} ranks / local: {result['ep_overhead']:.2f}x; outputs agree to "
            f"{result['ep_vs_local_max_diff']:.1e}")


def bench_moe(args, tc: train.TrainConfig, overrides: dict) -> dict:
    rank, world, device = parallel.init_distributed()
    cfg = model_config(tc, overrides)
    # For its dtype and device; the layer's own batch flags are --tokens and --seq_len.
    one_row_each = dataclasses.replace(tc, dp_replicate=1, ep=1, cp=1, global_batch=world, micro_batch=1)
    run = train.make_run(one_row_each, cfg, rank, world, device)
    N = args.tokens
    T = min(tc.seq_len, N)
    if N % T:
        raise ValueError(f"--tokens={N} is not a multiple of --seq_len={T}; the balance loss works per sequence.")
    torch.manual_seed(tc.seed)
    if device.type == "cpu":
        with torch.device("meta"):
            parallel.check_host_memory(MoE(cfg), copies=2, what="one MoE layer's weights and their gradients")
    moe = init_(MoE(cfg).to(device), cfg.init_std)
    # The dense SwiGLU does the MoE layer's active matmul FLOPs (k routed experts, the shared ones, the router's D x E
    # as E/3 hidden units), rounded up to a multiple of 128 wide for full-speed bf16 GEMMs; the ratios are per FLOP.
    active_hidden = (cfg.top_k + cfg.n_shared_experts) * cfg.expert_hidden + cfg.n_experts / 3
    dense_hidden = 128 * math.ceil(active_hidden / 128)
    dense = init_(FeedForward(cfg.dim, dense_hidden).to(device), cfg.init_std)
    torch.manual_seed(tc.seed + 1 + rank)  # each rank its own tokens (the expert-parallel path mixes them)
    x_BTD = torch.randn(N // T, T, cfg.dim, device=device)
    dy_BTD = torch.randn(N // T, T, cfg.dim, device=device)
    router = 100 * cfg.n_experts / 3 / active_hidden
    say(f"moe: {describe(run)}; shared hidden {cfg.n_shared_experts * cfg.expert_hidden}; {N} tokens ({N // T} x "
        f"{T}); dense layer {dense_hidden} wide for {active_hidden:.0f} active (the router {router:.0f}%)")
    why_not = grouped_mm_supported(x_BTD.to(run.dtype or x_BTD.dtype), moe.experts.gate_up_proj, moe.experts.down_proj)
    if why_not:
        raise ValueError(f"the grouped GEMM path cannot run here: {why_not}.")
    layers = {"grouped": moe, "loop": moe, "dense": dense}

    def variant(name):
        def fwd_bwd():  # as training runs the layer: the MoE's balance losses join the loss
            layer = layers[name]
            if name in ("grouped", "loop"):
                moe.experts.impl = name
            layer.zero_grad(set_to_none=True)
            x = x_BTD.detach().requires_grad_()
            with run.autocast:
                y_BTD, (_, aux_loss, z_loss) = layer(x) if isinstance(layer, MoE) else (layer(x), (None, 0, 0))
                loss = (y_BTD.float() * dy_BTD).sum() + aux_loss + z_loss
            loss.backward()
            return y_BTD.detach(), x.grad
        return fwd_bwd

    def outputs(name) -> list:  # the output, the input's gradient and the experts' weight gradients
        return [*variant(name)(), *(p.grad.clone() for p in moe.experts.parameters())]

    result = {"command": "moe", "preset": tc.preset, "tokens": N, "device": device_name(device),
              "active_hidden": active_hidden, "dense_hidden": dense_hidden}
    grouped = outputs("grouped")
    if args.loop:  # grouped == loop on the same tokens
        loop = outputs("loop")
        diff = max((a - b).abs().max().item() for a, b in zip(grouped, loop))
        result["grouped_vs_loop_max_diff"] = diff / max(t.abs().max().item() for t in loop)
    else:
        del layers["loop"]
    if world > 1:  # expert parallel over all ranks, on the same weights and this rank's tokens
        layout = parallel.Layout(world, 1, world)
        layout.check(cfg, world, 1)
        ep = layers["ep"] = MoE(cfg).to(device)
        ep.load_state_dict(moe.state_dict())
        ep.experts = parallel.ExpertParallelExperts(ep.experts, parallel.build_mesh(layout, device.type)["ep"])
        ep.experts.impl = "grouped"
        result["ep_vs_local_max_diff"] = max_over_ranks((variant("ep")()[0] - grouped[0]).abs().max().item())
    times = alternate({name: variant(name) for name in layers}, device, args.warmup, args.iters)
    flops = 6 * N * cfg.dim * 3 * active_hidden  # forward and backward of the active matmuls
    record_times(result, times, {"grouped": flops, "loop": flops, "dense": flops * dense_hidden / active_hidden})
    say_ratios(result, world)
    if args.breakdown:
        runs = [profile(variant("grouped"), device, moe_targets(moe)) for _ in range(max(1, args.iters // 2))]
        table, kernels, wall, _ = median_profile(runs)
        result["components_ms"] = table
        print_components(table, wall, f"the grouped MoE layer, median of {len(runs)}")
        top = sorted(merged(kernels).items(), key=lambda kv: -kv[1][1])[:10]
        result["top_ops_ms"] = {name: ms for name, (_, ms) in top}
        say("  busiest ops (self ms): " + ", ".join(f"{name} {ms:.2f}" for name, (_, ms) in top))
    return result


# --- bench.py vs-hf: our train step against transformers' AfmoeForCausalLM

def bench_vs_hf(args, tc: train.TrainConfig, overrides: dict) -> dict:
    import transformers

    import checkpoint

    _, _, device = parallel.init_distributed()
    # One process (whatever the layout flags say), and AfmoeForCausalLM has no intra-document masking.
    tc = dataclasses.replace(tc, doc_mask=False, dp_replicate=1, ep=1)
    run = train.make_run(tc, model_config(tc, overrides), 0, 1, device)
    tc = run.tc
    cfg = run.cfg
    torch.manual_seed(tc.seed)
    ours, opt_ours = train.build(run, copies=2 * train.STATE_COPIES[tc.optimizer])  # and transformers' as much again
    hf = transformers.AfmoeForCausalLM(transformers.AfmoeConfig(**cfg.to_hf(), use_cache=False)).to(device).train()
    hf.load_state_dict(checkpoint.to_hf_state_dict(ours.state_dict()), strict=True)
    # The same optimizer for both: fused AdamW, also transformers' Trainer default (adamw_torch_fused).
    opt_hf = parallel.build_optimizer(hf, tc)
    batch = synthetic_batch(cfg.vocab_size, tc.global_batch, tc.seq_len, 0, 1, tc.seed)
    n_micro = tc.global_batch // tc.micro_batch
    attention = hf.config._attn_implementation
    experts = getattr(hf.config, "_experts_implementation", None)
    say(f"vs-hf: {describe(run)}; {tc.global_batch} x {tc.seq_len} tokens in {n_micro} micro-batch(es); "
        f"transformers {transformers.__version__} with attention={attention}, experts={experts}")
    step = stepper(run, ours, opt_ours, batch)
    losses = {}

    def step_ours():
        losses["ours"] = step()["lm_loss"]

    def step_hf():  # the same work: micro-batches, clipping, AdamW; no balance losses or bias update (HF has none)
        tokens_BT, targets_BT, _ = (t.to(device) for t in batch)
        losses["hf"] = 0.0
        for i in range(n_micro):
            rows = slice(i * tc.micro_batch, (i + 1) * tc.micro_batch)
            with run.autocast:
                logits_BTV = hf(input_ids=tokens_BT[rows]).logits
                loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT[rows].flatten())
            (loss / n_micro).backward()
            losses["hf"] += loss.item() / n_micro
        torch.nn.utils.clip_grad_norm_(hf.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf"))
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)

    step_ours()
    step_hf()
    first_diff = abs(losses["ours"] - losses["hf"])
    times = alternate({"ours": step_ours, "hf": step_hf}, device, args.warmup, args.iters)
    result = {"command": "vs-hf", "preset": tc.preset, "device": device_name(device), "hf_attention": attention,
              "hf_experts": experts, "tokens_per_step": tc.global_batch * tc.seq_len, "first_loss_diff": first_diff}
    record_times(result, times, {})
    result["speedup"] = result["hf_ms"] / result["ours_ms"]
    # Each iteration times the two back to back: their ratio shares whatever else the machine was doing.
    result["speedup_paired"] = statistics.median(hf / ours for hf, ours in zip(times["hf"], times["ours"]))
    say(f"speedup (hf / ours): {result['speedup']:.2f}x of the medians, {result['speedup_paired']:.2f}x the median "
        f"of {len(times['hf'])} back-to-back pairs; first-step LM losses agree to {first_diff:.1e}")
    return result


# --- bench.py data: data.py's prepare against its tokenizer library's own batch encoder

def bench_data(args) -> dict:
    """data.prepare's tokens/s on JSONL vs the library's batch encoder's in memory, per --workers and per core."""
    import tempfile

    import data
    enc = data.get_encoding(args.tokenizer)
    hf = isinstance(enc, data.HFTokenizer)
    if hf:  # tokenizers' thread pool, sized before its first use
        os.environ["RAYON_NUM_THREADS"] = str(max(args.workers))
    docs = []
    chars = 0
    for path in itertools.cycle(data.stdlib_files()):  # cut as data.py cuts plain text; repeated up to --mb
        with open(path, encoding="utf-8", errors="replace") as f:
            docs += data.paragraph_documents(f, args.doc_chars)
        chars += os.path.getsize(path)
        if chars >= args.mb * 1e6:
            break

    def cpu_s() -> float:  # user and system seconds of this process and its finished children (the workers)
        usage = map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return sum(u.ru_utime + u.ru_stime for u in usage)

    library = "tokenizers encode_batch_fast" if hf else "tiktoken encode_ordinary_batch"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        with open(corpus, "w") as f:
            f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
        for workers in args.workers:
            times = {"prepare": (math.inf, math.inf), "library": (math.inf, math.inf)}  # the best (wall, CPU) seconds
            for repeat, who in itertools.product(range(args.repeat), times):  # alternated: both see the same load
                enc = data.get_encoding(args.tokenizer)  # a new one each time: no cache warmed by an earlier run
                wall = time.perf_counter()
                cpu = cpu_s()
                if who == "prepare":
                    manifest = data.prepare([corpus], os.path.join(tmp, f"out_{workers}_{repeat}"), args.tokenizer,
                                            val_fraction=0, workers=workers, quiet=True)
                elif hf:
                    os.environ["TOKENIZERS_PARALLELISM"] = str(workers > 1).lower()
                    tokens = sum(len(e.ids) for e in enc.tokenizer.encode_batch_fast(docs, add_special_tokens=False))
                else:
                    tokens = sum(map(len, enc.encode_ordinary_batch(docs, num_threads=workers)))
                times[who] = tuple(map(min, times[who], (time.perf_counter() - wall, cpu_s() - cpu)))
            row = {"workers": workers, "per_core_ratio": times["library"][1] / times["prepare"][1]}
            for who, (best_wall, best_cpu) in times.items():
                row |= {f"{who}_tokens_per_s": tokens / best_wall, f"{who}_tokens_per_cpu_s": tokens / best_cpu}
            rows.append(row)
    print(f"data: {tokens:,} {enc.name.removesuffix('_offline')} tokens of standard-library source ({chars / 1e6:.1f} "
          f"MB, {len(docs):,} documents) on {os.cpu_count()} cores; per core: tokens per CPU-second of all processes")
    for r in rows:
        print(f"  {r['workers']} workers: prepare {r['prepare_tokens_per_s'] / 1e6:.2f}M tok/s, "
              f"{r['prepare_tokens_per_cpu_s'] / 1e6:.2f}M per core; {library} {r['library_tokens_per_s'] / 1e6:.2f}M, "
              f"{r['library_tokens_per_cpu_s'] / 1e6:.2f}M per core; per-core ratio {r['per_core_ratio']:.3f}")
    # the same text: prepare's tokens less each document's closing end-of-text are the library's
    return {"command": "data", "tokenizer": args.tokenizer, "library": library, "tokens": tokens,
            "prepare_tokens": manifest["tokens"]["train"] - manifest["documents"]["train"], "rows": rows}


# --- Command line

def parse(argv: list[str]) -> tuple[str, argparse.Namespace, train.TrainConfig, dict]:
    """(command, bench flags, TrainConfig, model overrides) from the command line."""
    command = argv[0] if argv and not argv[0].startswith("-") else "step"
    if command != "step":
        argv = argv[1:]
        if command not in COMMANDS:
            close = suggest(command, COMMANDS)
            hint = f"; did you mean {close}?" if close else ""
            raise SystemExit(f"bench.py: error: unknown command {command!r}{hint} (commands: {', '.join(COMMANDS)})")
    description = COMMANDS.get(command, f"Time train.py's step. Other commands: {', '.join(COMMANDS)} (--help).")
    parser = Parser(prog=f"bench.py {command if command != 'step' else ''}".rstrip(), description=description,
                    allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                    epilog="Also takes every train.py flag (python train.py --help).")
    add = parser.add_argument
    switch = functools.partial(add, type=parse_bool, nargs="?", const=True, default=True)  # --flag[=false]
    count = at_least(1).parse(int)
    add("--json", action="store_true", help="print the result as one JSON object on the last line")
    if command == "data":
        add("--tokenizer", default="cl100k_base", help="a tiktoken encoding or a tokenizer folder")
        add("--workers", type=count, nargs="+", default=[1, 2], help="worker (and encoder thread) counts")
        add("--mb", type=above(0).parse(float), default=16, help="megabytes of the standard library's source")
        add("--doc_chars", type=count, default=4096, help="a document's most characters")
        add("--repeat", type=count, default=3, help="runs of each, alternated; the best counts")
        return command, parser.parse_args(argv), None, {}
    warmup, iters = {"step": (2, 5), "moe": (1, 5), "vs-hf": (1, 9)}[command]
    add("--warmup", type=at_least(0).parse(int), default=warmup, help="untimed steps first")
    add("--iters", type=count, default=iters, help="timed steps")
    add("--threads", type=at_least(0).parse(int), default=0, help="torch's CPU threads (0: its default; 1: steadier)")
    add("--clock", choices=CLOCKS, default="wall", help="wall time, or the process's CPU time (CPU only, steadier)")
    if command == "step":
        add("--save", default="", metavar="PATH", help="write this run's times, kernels and numbers as a baseline")
        add("--compare", default="", metavar="PATH", help="compare with a --save baseline of the same flags")
        add("--tolerance", type=at_least(0).parse(float), default=0.05, help="the slowdown (a fraction) accepted")
        add("--numerics_tolerance", type=at_least(0).parse(float), default=0.0,
            help="the relative change of the first steps' numbers accepted (0: 1e-4 fp32, 1e-2 bf16)")
    if command == "moe":
        add("--tokens", type=count, default=2048, help="tokens through the layer, seq_len per row")
        switch("--loop", help="also time the per-expert loop (slow at large shapes)")
    if command in ("step", "moe"):
        switch("--breakdown", help="also time the phases and profile the components")
    args, rest = train.parse_tool_args(parser, argv)
    tc, overrides = train.parse_args((["--global_batch=4", "--micro_batch=4"] if command == "vs-hf" else []) + rest)
    return command, args, tc, overrides


def main(argv: list[str] | None = None) -> int:
    global clock
    command, args, tc, overrides = parse(sys.argv[1:] if argv is None else argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(getattr(args, "threads", 0) or threads)
    clock = CLOCKS[getattr(args, "clock", "wall")]  # bench.py data times whole processes
    try:
        if clock is not CLOCKS["wall"] and parallel.use_cuda():
            raise ValueError("--clock=cpu measures CPU work; on a GPU use --clock=wall.")
        run = {"step": bench_step, "moe": bench_moe, "vs-hf": bench_vs_hf}
        result = bench_data(args) if command == "data" else run[command](args, tc, overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # main() may run inside another program (the tests)
    code = result.pop("exit", 0)
    if args.json:
        say(json.dumps(result, default=float))
    return code


if __name__ == "__main__":
    sys.exit(parallel.finish(main()))  # after main returned: the command's model is out of scope
