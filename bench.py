"""
Benchmarks and capacity planning: what a training step costs, where its time goes, and what a layout needs. It times
train.py's own step (train.train_step, same flags) on synthetic tokens; training never imports it.

    python bench.py --preset=tiny                        # ms/step, tokens/s, TFLOP/s, MFU, memory, phases, components
    python bench.py --preset=tiny --dim=64 --iters=3 --json   # every train.py flag works (model, layout, --ac ...)
    python bench.py --preset=nano --save=base.json       # a baseline: times, components, kernels, versions
    python bench.py --preset=nano --compare=base.json    # after an upgrade: what moved; exit 1 if the step is slower
    torchrun --nproc_per_node=8 bench.py --dp_replicate=2 --ep=4 --global_batch=64
    python bench.py moe --preset=nano --tokens=2048      # one MoE layer: grouped GEMM vs per-expert loop vs dense
    torchrun --nproc_per_node=2 bench.py moe --preset=tiny   # ... plus the expert-parallel all-to-all path
    python bench.py plan --preset=large --gpus=2048 --dp_replicate=16 --ep=8 --seq=8192 --global_batch=12288 \
        --micro_batch=1 --gpu=b300 --ac=full    # memory, traffic, step time, MFU, days; the fastest layouts that fit
    python bench.py plan --net_gbs=50 --tflops=h200.json # another network; compute rate from a saved --json result
    python bench.py vs-hf --preset=tiny                  # our train step vs transformers' AfmoeForCausalLM
    python bench.py plot out                             # out/metrics.jsonl -> out/metrics.png (needs matplotlib)
    python bench.py data --workers 1 2                   # data.py's tokens/s per core vs tiktoken's batch encoder

`--json` prints the report as one JSON object on the last line. On a shared machine compare ratios measured in one
run (moe_to_dense, speedup) and add `--threads=1 --clock=cpu` (two threads on two busy cores can run 100x slower).
"""

import argparse
import contextlib
import dataclasses
import difflib
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
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import DeviceType

import parallel
import train
from model import PRESETS, FeedForward, MoE, RMSNorm, grouped_mm_supported, head_chunks, meta_model

COMMANDS = {"moe": "one MoE layer: grouped GEMM vs per-expert loop vs dense SwiGLU (and expert parallel)",
            "plan": "memory, traffic, step time and days for a model on a GPU layout, and the fastest layouts that "
                    "fit, without allocating anything",
            "vs-hf": "our training step vs transformers' AfmoeForCausalLM on the same config",
            "plot": "draw OUT_DIR/metrics.jsonl into OUT_DIR/metrics.png",
            "data": "data.py's tokens/s per core against its tokenizer library's batch encoder on the same text"}
TRAIN_FLAGS = ["--config"] + [f"--{f.name}" for f in dataclasses.fields(train.TrainConfig)] + [
    f"--{n}" for n in train.MODEL_FIELDS]


# ------------------------------------------------------------------------------------------------------------------
# Timing, memory and synthetic data

# --clock=cpu: the process's CPU time, which a busy machine inflates far less (use --threads=1: idle threads spin).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def timed_ms(fn, device: torch.device, read=None) -> float:
    read = read or clock
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    sync(device)
    t0 = read()
    fn()
    sync(device)
    return (read() - t0) * 1e3


def alternate(fns: dict, device: torch.device, warmup: int, iters: int, flip: bool = False) -> dict:
    """{name: [ms per timed step]}, the functions run in turn (drifting load hits all alike); `flip`: reversed on odd
    iterations."""
    times = defaultdict(list)
    for i in range(warmup + iters):
        for name, fn in list(fns.items())[::-1 if flip and i % 2 else 1]:
            ms = timed_ms(fn, device)
            if i >= warmup:
                times[name].append(ms)
    return times


def spread(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms), "ms_p25": q[0], "ms_p75": q[2],
            "iters": len(ms)}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def synthetic_batch(vocab_size: int, global_batch: int, seq_len: int, rank: int, world: int, seed: int,
                    docs_per_row: int = 4):
    """This rank's rows of a random global batch as train.py's loader gives them: (tokens, targets, doc ids), each
    [B, T], every row `docs_per_row` documents split at random positions."""
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(0, vocab_size, (global_batch, seq_len + 1), generator=g)
    starts_BT = torch.zeros(global_batch, seq_len, dtype=torch.long)
    n_cuts = min(docs_per_row, seq_len) - 1
    if n_cuts > 0:
        starts_BT.scatter_(1, torch.rand(global_batch, seq_len - 1, generator=g).topk(n_cuts, dim=1).indices + 1, 1)
    rows = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
    return tokens_BT[rows, :-1], tokens_BT[rows, 1:], starts_BT.cumsum(1)[rows]


def model_config(tc: train.TrainConfig, overrides: dict):
    """train.model_config with the preset's vocabulary instead of a tokenizer's (--vocab_size overrides it)."""
    overrides = dict(overrides)
    return train.model_config(tc, overrides, overrides.pop("vocab_size", PRESETS[tc.preset].vocab_size))


def max_over_ranks(value: float) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([float(value)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ------------------------------------------------------------------------------------------------------------------
# Where the time goes: profiler ranges around the model's components, attributed forward and backward

SCOPE, PHASE = "bench::", "train_step::"  # our ranges; train.train_step's ranges around its phases
COMM_MARKERS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "reducescatter",
                "all_to_all", "alltoall", "record_param_comms", "nccl:", "gloo:", "FSDP::")
STEP_LABELS = ("grad clip", "expert-bias update")  # train_step's phases that are components of their own


@contextlib.contextmanager
def wrapped(targets):
    """Each (object, attribute, label) callable wrapped in a profiler range `bench::label` for the duration, as an
    instance attribute (the way parallel.apply_ac wraps block.forward)."""
    originals = []
    try:
        for obj, attr, label in targets:
            originals.append((obj, attr, attr in vars(obj), getattr(obj, attr)))
            setattr(obj, attr, torch.profiler.record_function(SCOPE + label)(originals[-1][3]))
        yield
    finally:
        for obj, attr, own, fn in reversed(originals):
            if own:
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr)


def moe_targets(moe: MoE) -> list:
    # The z-loss and the sort/gather/scatter are written inline in MoE.forward: they land in its own range.
    targets = [(moe, "forward", "MoE permutation, combine, z-loss"), (moe, "route", "router"),
               (moe, "balance_loss", "router"), (moe.experts, "forward", "routed experts")]
    return targets + ([(moe.shared, "forward", "shared expert")] if moe.shared is not None else [])


def model_targets(model, blocks: bool = True) -> list:
    # The head's matmul and cross-entropy are one fused autograd function (model.head_loss): one component. Compiled
    # blocks are fused graphs, not wrapped: their work lands in the model's own range.
    targets = [(model, "forward", "masks, RoPE tables" if blocks else "compiled blocks, masks, RoPE tables"),
               (model.embed, "forward", "embedding"), (model.norm, "forward", "final norm"),
               (model, "head_loss", "output head, cross-entropy")]
    for block in model.layers.values() if blocks else ():
        targets += [(block, "forward", "residual adds"), (block.attn, "forward", "attention")]
        targets += [(norm, "forward", "norms")
                    for norm in (block.attn_norm, block.attn_post_norm, block.ffn_norm, block.ffn_post_norm)]
        targets += moe_targets(block.ffn) if isinstance(block.ffn, MoE) else [(block.ffn, "forward", "dense FFN")]
    return targets


def profile(fn, device: torch.device, targets, steps: int = 1) -> tuple[dict, dict, float, dict]:
    """fn run `steps` times under the profiler, `targets` wrapped. Per step: {label: {fwd, bwd, total} ms} (an op's self
    time charged to the innermost bench:: or step-label range around it, a backward op to its forward op's), {label:
    {op or kernel: [calls, ms]}} (a component's fingerprint), the wall ms and {train_step phase: ms}."""
    on_device = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_device else [])
    with wrapped(targets), torch.profiler.profile(activities=activities) as prof:
        wall = sum(timed_ms(fn, device, time.perf_counter) for _ in range(steps)) / steps  # as the profiler's

    def self_us(e):
        return e.self_device_time_total if on_device else e.self_cpu_time_total

    def owner(e):
        while e is not None:
            if e.name.startswith(SCOPE) or e.name.startswith(PHASE) and e.name[len(PHASE):] in STEP_LABELS:
                label = e.name.split("::", 1)[1]
                return label, "total" if label in STEP_LABELS else "fwd"
            if e.name.startswith("Optimizer."):
                return "optimizer", "total"
            if any(m in e.name for m in COMM_MARKERS):
                return "communication", "total"
            if e.name.startswith("autograd::engine::evaluate_function"):
                return None, e
            e = e.cpu_parent
        return "other", "total"

    def phase(e):
        while e is not None and not e.name.startswith(PHASE):
            if e.name.startswith("autograd::engine::evaluate_function"):
                return "backward"
            e = e.cpu_parent
        return "other" if e is None else e.name[len(PHASE):]

    resolved, forward_of = [], {}
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        label, where = owner(e)
        if label is not None and e.sequence_nr >= 0:
            # Ops that make no autograd node record the next sequence number too; the last to record it made it.
            forward_of[(e.thread, e.sequence_nr)] = label
        resolved.append((e, label, where))
    table = defaultdict(lambda: {"fwd": 0.0, "bwd": 0.0, "total": 0.0})
    ops, phases = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0])), defaultdict(float)
    for e, label, where in resolved:
        if on_device and e.device_type != DeviceType.CPU:
            continue  # a kernel: its time is already in the self device time of the CPU op that launched it
        phases[phase(e)] += self_us(e) / 1e3 / steps
        if e.name.startswith(PHASE) and e.name[len(PHASE):] not in STEP_LABELS:
            continue  # a phase's own time (python between its ops) belongs to no component
        if label is None:  # inside a backward node
            label = forward_of.get((where.fwd_thread, where.sequence_nr),
                                   "gradient accumulation into .grad" if "AccumulateGrad" in where.name else "other")
            where = "bwd"
        table[label][where] += self_us(e) / 1e3 / steps
        for name, us in [(k.name, k.duration) for k in e.kernels] if on_device else [(e.name, self_us(e))]:
            ops[label][name][0] += 1 / steps
            ops[label][name][1] += us / 1e3 / steps
    for row in table.values():
        row["total"] += row["fwd"] + row["bwd"]
    return dict(table), {label: dict(kernels) for label, kernels in ops.items()}, wall, dict(phases)


def merged(ops: dict, scale: float = 1.0) -> dict:
    """{name: [calls, ms]} summed over fingerprints {key: {name: [calls, ms]}} and scaled (1/n: the mean of n)."""
    out = defaultdict(lambda: [0.0, 0.0])
    for kernels in ops.values():
        for name, (calls, ms) in kernels.items():
            out[name][0] += calls * scale
            out[name][1] += ms * scale
    return {name: [round(calls, 3), ms] for name, (calls, ms) in out.items()}


def median_profile(runs: list) -> tuple[dict, dict, float, dict]:
    """profile() results as one: each component's median times and the quartiles of its share of the profiled step (a
    busy machine stretches all alike), each kernel's mean, the median wall time, each phase's median."""
    zero = {"fwd": 0.0, "bwd": 0.0, "total": 0.0}
    table = {}
    for label in set().union(*(t for t, _, _, _ in runs)):
        q = spread([t.get(label, zero)["total"] / wall for t, _, wall, _ in runs])
        table[label] = {k: statistics.median(t.get(label, zero)[k] for t, _, _, _ in runs) for k in zero}
        table[label] |= {"share": q["ms_median"], "share_p25": q["ms_p25"], "share_p75": q["ms_p75"]}
    kernels = {label: merged({i: ops.get(label, {}) for i, (_, ops, _, _) in enumerate(runs)}, 1 / len(runs))
               for label in set().union(*(ops for _, ops, _, _ in runs))}
    order = sorted(dict.fromkeys(label for *_, p in runs for label in p), key=lambda label: label == "other")
    phases = {label: statistics.median(p.get(label, 0.0) for *_, p in runs) for label in order}
    return table, kernels, statistics.median(wall for _, _, wall, _ in runs), phases


def print_components(table: dict, wall_ms: float, say, what: str):
    say(f"where the time goes ({what}; profiler self time per op, a backward op charged to the component whose forward "
        f"created it, recomputation under AC counted as forward; the output head's gradients are made in its "
        f"forward):")
    say(f"  {'component':34s} {'fwd ms':>9s} {'bwd ms':>9s} {'total ms':>9s} {'share':>6s}")
    for label, row in sorted(table.items(), key=lambda kv: -kv[1]["total"]):
        say(f"  {label:34s} {row['fwd']:9.2f} {row['bwd']:9.2f} {row['total']:9.2f} "
            f"{100 * row['total'] / wall_ms:5.1f}%")
    gap = wall_ms - sum(row["total"] for row in table.values())
    say(f"  {'(python, gaps: wall - profiled)':34s} {'':9s} {'':9s} {gap:9.2f} {100 * gap / wall_ms:5.1f}%   of "
        f"{wall_ms:.1f} ms profiled")


# ------------------------------------------------------------------------------------------------------------------
# bench.py [train flags]: the training step

def bench_step(args, tc: train.TrainConfig, overrides: dict) -> dict:
    rank, world, device = parallel.init_distributed()
    torch.manual_seed(tc.seed)
    run = train.Run.on(tc, model_config(tc, overrides), rank, world, device)
    cfg, say = run.cfg, run.say
    config = step_config(tc, cfg, world, args.clock)
    baseline = load_baseline(args.compare, config) if args.compare else None  # refused before anything is built
    if args.save and not os.path.isdir(os.path.dirname(os.path.abspath(args.save))):
        raise FileNotFoundError(f"--save={args.save}: its folder does not exist; create it or save elsewhere.")
    model, optimizer = train.build(run)
    state = train.TrainState.fresh(model, device)
    batch = synthetic_batch(cfg.vocab_size, tc.global_batch, tc.seq_len, rank, world, tc.seed)
    twin = meta_model(cfg)
    n, flops_per_token = twin.num_params(), twin.flops_per_token(tc.seq_len)
    say(f"bench: {tc.preset} {cfg.dim}d x {cfg.n_layers} layers, {cfg.n_experts} experts top-{cfg.top_k}, "
        f"{n['total'] / 1e6:.1f}M params ({n['active'] / 1e6:.1f}M active), {flops_per_token / 1e6:.1f} MFLOP/token; "
        f"seq {tc.seq_len}, global batch {tc.global_batch}, micro-batch {tc.micro_batch}, ac={tc.ac}, "
        f"compile={tc.compile}, {run.dtype or torch.float32} on {world} x {device.type}")
    say(run.layout.describe(cfg.n_experts))

    def step():
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(state.step, tc)
        train.train_step(model, optimizer, batch, tc, run.autocast, state)
        state.step += 1

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = [timed_ms(step, device) for _ in range(args.iters)]
    result = {"command": "step", "preset": tc.preset, "world": world, "device": device_name(device),
              "params": n["total"], "active_params": n["active"], "flops_per_token": flops_per_token,
              "tokens_per_step": tc.global_batch * tc.seq_len, **spread(ms)}
    say(f"step: median {result['ms_median']:.1f} ms (min {result['ms_min']:.1f}, p25 {result['ms_p25']:.1f}, p75 "
        f"{result['ms_p75']:.1f}, max {result['ms_max']:.1f}) over {args.iters} steps after {args.warmup} warm-up")
    tok_s, peak = tc.global_batch * tc.seq_len / (result["ms_median"] / 1e3), train.peak_tflops(device, tc.peak_tflops)
    tflops = flops_per_token * tok_s / world / 1e12
    result.update(tokens_per_s=tok_s, tokens_per_s_per_device=tok_s / world, tflops_per_device=tflops,
                  mfu=tflops / peak if peak else None, peak_tflops=peak,
                  # CUDA: the allocator's peak since the reset; CPU: the process's peak resident set (Linux: KiB)
                  peak_mem_gib=max_over_ranks(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else
                                              resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30,
                  peak_mem_kind="CUDA max_memory_allocated" if device.type == "cuda" else "process peak RSS")
    mfu = "n/a" if peak is None else f"{100 * result['mfu']:.1f}% of {peak:g} TFLOP/s"
    say(f"throughput: {tok_s:,.0f} tokens/s in total, {tok_s / world:,.0f} per device; {tflops:.3f} TFLOP/s per "
        f"device; MFU {mfu}")
    say(f"peak memory: {result['peak_mem_gib']:.2f} GiB per device ({result['peak_mem_kind']}, max over ranks)")
    if args.breakdown:  # the median of up to five profiled steps
        runs = [profile(step, device, model_targets(model, blocks=not tc.compile)) for _ in range(min(5, args.iters))]
        table, kernels, wall, phases = median_profile(runs)
        say(f"phases (the median of {len(runs)} profiled training steps: profiler self time per op in each of "
            f"train_step's ranges, backward ops wherever autograd runs them; FSDP all-gathers and reduce-scatters run "
            f"inside forward and backward; forward includes the output head's gradients, which the fused loss "
            f"computes with the loss):")
        for label, v in phases.items():
            say(f"  {label:34s} {v:9.2f} ms {100 * v / sum(phases.values()):5.1f}%")
        print_components(table, wall, say, f"the median of {len(runs)} profiled training steps"
                         + (", the compiled blocks not split" if tc.compile else ""))
        result.update(phases_ms=phases, components_ms=table, kernels=kernels, step_kernels=merged(kernels))
    result.update(config=config, environment=environment(device))
    if args.save and rank == 0:
        with open(args.save, "w") as f:
            json.dump(result, f, indent=1)
        say(f"saved this run as a baseline: {args.save} (compare a later run with --compare={args.save})")
    if baseline is not None:
        verdict = compare(baseline, result, args.tolerance)
        for line in verdict.pop("lines"):
            say(line)
        result.update(compare=verdict, exit=verdict["exit"])
    return {k: v for k, v in result.items() if k not in ("kernels", "step_kernels")}  # too long for --json


# ------------------------------------------------------------------------------------------------------------------
# bench.py --save / --compare: a throughput guard for upgrades (a new torch can move a matmul to a slower kernel
# without an error; only the step time and the kernels that ran show it)

STEP_FIELDS = ("seq_len", "doc_mask", "global_batch", "micro_batch", "dtype", "ac", "compile", "dp_replicate", "ep",
               "optimizer", "grad_clip", "balance")  # the train.py flags that change the step's work


def step_config(tc: train.TrainConfig, cfg, world: int, clock_name: str) -> dict:
    """What was timed: two runs compare only if these agree (as JSON stores them)."""
    config = {f"model.{k}": v for k, v in dataclasses.asdict(cfg).items()}
    config |= {k: getattr(tc, k) for k in STEP_FIELDS} | {"world": world, "clock": clock_name}
    return json.loads(json.dumps(config))


def environment(device: torch.device) -> dict:
    """What decides which kernels a step runs: library versions, the device and the backend switches."""
    b, kernel_libraries = torch.backends, ("triton", "pytorch-triton", "nvidia-cublas", "nvidia-cudnn", "nvidia-nccl")
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
    return env | {f"sdpa {k}": getattr(b.cuda, f"{k}_sdp_enabled")() for k in ("flash", "mem_efficient", "math",
                                                                                 "cudnn")}


def differences(old: dict, new: dict) -> list[str]:
    return [f"{k} {old.get(k, 'absent')} -> {new.get(k, 'absent')}" for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k)]


def check_config(old: dict, new: dict):
    if differences(old, new):
        raise ValueError(f"the baseline was measured on another configuration ({', '.join(differences(old, new))}); "
                         f"run with the baseline's flags, or --save a new baseline.")


def load_baseline(path: str, config: dict) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--compare={path} does not exist; record a baseline first with --save={path}.")
    try:
        with open(path) as f:
            old = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError):
        old = None
    if not isinstance(old, dict) or not isinstance(old.get("config"), dict):
        raise ValueError(f"--compare={path} is not a baseline written by bench.py --save.")
    check_config(old["config"], config)
    return old


def kernel_changes(old: dict, new: dict, min_ms: float, top: int = 3) -> dict:
    """The `top` largest kernels ({name: [calls, ms]}) that appeared, disappeared, or changed calls or by min_ms."""
    def largest(kernels: dict, size) -> dict:
        return dict(sorted(kernels.items(), key=lambda kv: -size(kv[1]))[:top])

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
    """The verdict on step result `new` against the baseline `old`: exit 1 when the step is slower beyond both the
    noise band (half of each run's interquartile range, added) and `tolerance`. A component (its share of the profiled
    step times the step) moved beyond its own band and `tolerance` is named with its kernels that changed."""
    check_config(old["config"], new["config"])
    change = (new["ms_median"] - old["ms_median"]) / old["ms_median"]
    band = (old["ms_p75"] - old["ms_p25"] + new["ms_p75"] - new["ms_p25"]) / 2 / old["ms_median"]
    limit = max(band, tolerance)
    verdict = "SLOWER beyond both: exit 1" if change > limit else "faster" if change < -limit else "within them"
    mfu = f", MFU {100 * old['mfu']:.1f}% -> {100 * new['mfu']:.1f}%" if old["mfu"] and new["mfu"] else ""
    lines = [f"against the baseline: step {old['ms_median']:.1f} -> {new['ms_median']:.1f} ms median{mfu} "
             f"({100 * change:+.1f}%; noise band {100 * band:.1f}%, tolerance {100 * tolerance:.1f}%): {verdict}"]
    zero = {"total": 0.0, "share": 0.0, "share_p25": 0.0, "share_p75": 0.0}
    profiled = "kernels" in old and "kernels" in new  # not with --breakdown=false
    comps_old, comps_new = (old["components_ms"], new["components_ms"]) if profiled else ({}, {})
    moved = {}
    for label in sorted(comps_old.keys() | comps_new.keys()):
        a, b = comps_old.get(label, zero), comps_new.get(label, zero)
        ms_a, ms_b = a["share"] * old["ms_median"], b["share"] * new["ms_median"]
        noise = ((a["share_p75"] - a["share_p25"]) * old["ms_median"]
                 + (b["share_p75"] - b["share_p25"]) * new["ms_median"]) / 2
        if abs(ms_b - ms_a) > max(noise, tolerance * old["ms_median"]):  # a smaller move cannot fail the step
            profiled_change = abs(b["total"] - a["total"])
            kernels = kernel_changes(old["kernels"].get(label, {}), new["kernels"].get(label, {}), profiled_change / 10)
            moved[label] = {"ms": [ms_a, ms_b], "noise_ms": noise, **kernels}
            pct = f"{100 * (ms_b - ms_a) / ms_a:+.0f}%" if ms_a else "new"
            lines.append(f"  {label}: {ms_a:.2f} -> {ms_b:.2f} ms of the step ({pct}, noise {noise:.2f} ms)"
                         + (f": {describe_kernels(kernels)}" if any(kernels.values()) else ""))
    # A kernel swap that moved no component's time by much still shows, once, in the step's fingerprint.
    named = {n for label in moved for r in (old, new) for n in r["kernels"].get(label, {})}
    step_old, step_new = ({n: k for n, k in r.get("step_kernels", {}).items() if n not in named and profiled}
                          for r in (old, new))
    step_kernels = kernel_changes(step_old, step_new, math.inf) | {"changed": {}}
    if step_kernels["appeared"] or step_kernels["disappeared"]:
        lines.append(f"  kernels of the whole step: {describe_kernels(step_kernels)}")
    if abs(new["peak_mem_gib"] - old["peak_mem_gib"]) > tolerance * old["peak_mem_gib"]:
        lines.append(f"  peak memory {old['peak_mem_gib']:.2f} -> {new['peak_mem_gib']:.2f} GiB")
    env = differences(old.get("environment", {}), new["environment"])
    if env:
        lines.append(f"warning: the environment differs from the baseline's: {'; '.join(env)}")
    return {"exit": int(change > limit), "step_change": change, "noise_band": band, "tolerance": tolerance,
            "components": moved, "step_kernels": step_kernels, "environment": env, "lines": lines}


# ------------------------------------------------------------------------------------------------------------------
# bench.py moe: one MoE layer, three ways

def init_(module: nn.Module, std: float) -> nn.Module:
    """Truncated normal on [-3σ, 3σ], as Transformer.init_weights does."""
    with torch.no_grad():
        for p in module.parameters():
            nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)
    return module


def fwd_bwd(module, x_BTD, dy_BTD, autocast):
    """One forward and backward of a layer, the way training runs it: the MoE's balance losses join the loss."""
    x_BTD = x_BTD.detach().requires_grad_()
    with autocast:
        y_BTD, (_, aux_loss, z_loss) = module(x_BTD) if isinstance(module, MoE) else (module(x_BTD), (None, 0, 0))
        loss = (y_BTD.float() * dy_BTD).sum() + aux_loss + z_loss
    loss.backward()
    return y_BTD.detach(), x_BTD.grad


def moe_report(result: dict, times: dict, flops: float, world: int, say):
    """Adds and prints the medians, GFLOP/s and the ratios to the dense layer at the MoE's active FLOPs."""
    active, dense = result["active_hidden"], result["dense_hidden"]
    for name in times:
        result[f"{name}_ms"] = max_over_ranks(statistics.median(times[name]))
        result[f"{name}_ms_min"] = min(times[name])
    dense_ms_per_active = result["dense_ms"] * active / dense  # the dense time at the MoE's FLOPs
    result["moe_to_dense"] = result["grouped_ms"] / dense_ms_per_active
    for name in [name for name in times if name != "ep"]:
        done = flops * (dense / active if name == "dense" else 1)  # the dense one does a bit more
        say(f"  {name:8s} fwd+bwd median {result[f'{name}_ms']:9.2f} ms (min {result[f'{name}_ms_min']:.2f})  "
            f"{done / result[f'{name}_ms'] / 1e6:8.1f} GFLOP/s")
    say(f"MoE (grouped) / dense: {result['moe_to_dense']:.2f}x, the cost of sparsity at these shapes")
    if "loop" in times:
        result.update(loop_to_dense=result["loop_ms"] / dense_ms_per_active,
                      grouped_vs_loop_max_diff=result.pop("grouped_vs_loop_max_diff"))
        say(f"per-expert loop / dense: {result['loop_to_dense']:.2f}x; grouped == loop to "
            f"{result['grouped_vs_loop_max_diff']:.1e} (relative)")
    if "ep" in times:
        result["ep_overhead"] = result["ep_ms"] / result["grouped_ms"]
        result["ep_vs_local_max_diff"] = max_over_ranks(result.pop("ep_vs_local_max_diff"))
        say(f"expert parallel over {world} ranks: {result['ep_ms']:.2f} ms vs {result['grouped_ms']:.2f} ms local on "
            f"the same tokens: dispatch overhead {result['ep_overhead']:.2f}x (max over ranks; outputs agree to "
            f"{result['ep_vs_local_max_diff']:.1e})")


def bench_moe(args, tc: train.TrainConfig, overrides: dict) -> dict:
    rank, world, device = parallel.init_distributed()
    say = print if rank == 0 else (lambda *a, **k: None)
    autocast, dtype = train.autocast_for(tc, device)
    cfg = model_config(tc, overrides)
    N, T = args.tokens, min(tc.seq_len, args.tokens)
    if N % T:
        raise ValueError(f"--tokens={N} is not a multiple of --seq_len={T}; the balance loss works per sequence.")
    D, E, K, I = cfg.dim, cfg.n_experts, cfg.top_k, cfg.expert_hidden
    shared_hidden = I * cfg.n_shared_experts
    torch.manual_seed(tc.seed)
    if device.type == "cpu":
        with torch.device("meta"):
            parallel.check_host_memory(MoE(cfg), copies=2, what="one MoE layer's weights and their gradients")
    moe = init_(MoE(cfg).to(device), cfg.init_std)
    # The dense SwiGLU does about the MoE layer's active matmul FLOPs: k routed experts, the shared expert and the
    # router, whose D x E matmul costs what E/3 more hidden units do. Its width is rounded up to a multiple of 128,
    # where bf16 GEMMs run at full speed, and the ratios are per FLOP.
    active_hidden = K * I + shared_hidden + E / 3
    dense_hidden = 128 * math.ceil(active_hidden / 128)
    dense = init_(FeedForward(D, dense_hidden).to(device), cfg.init_std)
    torch.manual_seed(tc.seed + 1 + rank)  # each rank its own tokens (the expert-parallel path mixes them)
    x_BTD, dy_BTD = torch.randn(N // T, T, D, device=device), torch.randn(N // T, T, D, device=device)
    say(f"moe: {tc.preset} shapes d_model {D}, {E} experts top-{K}, expert hidden {I}, shared hidden {shared_hidden}; "
        f"{N} tokens ({N // T} x {T}); {dtype or torch.float32} on {device_name(device)}; the same active FLOPs as a "
        f"dense SwiGLU of hidden {active_hidden:.0f} (router {100 * E / (3 * active_hidden):.0f}% of them); the dense "
        f"comparator is {dense_hidden} wide")
    why_not = grouped_mm_supported(x_BTD.to(dtype or x_BTD.dtype), moe.experts.gate_up_proj, moe.experts.down_proj)
    if why_not:
        raise ValueError(f"the grouped GEMM path cannot run here: {why_not}.")
    layers = {"grouped": moe, "loop": moe, "dense": dense}

    def variant(impl):
        def run():
            if impl in ("grouped", "loop"):
                moe.experts.impl = impl
            layers[impl].zero_grad(set_to_none=True)
            return fwd_bwd(layers[impl], x_BTD, dy_BTD, autocast)
        return run

    result = {"command": "moe", "preset": tc.preset, "tokens": N, "device": device_name(device),
              "active_hidden": active_hidden, "dense_hidden": dense_hidden}
    y_g, dx_g = variant("grouped")()
    if args.loop:  # grouped == loop on the same tokens: outputs, input gradients and expert weight gradients
        grads_g = [p.grad.clone() for p in moe.experts.parameters()]
        (y_l, dx_l), grads_l = variant("loop")(), [p.grad.clone() for p in moe.experts.parameters()]
        diff = max((a - b).abs().max().item() for a, b in [(y_g, y_l), (dx_g, dx_l), *zip(grads_g, grads_l)])
        result["grouped_vs_loop_max_diff"] = diff / max(t.abs().max().item() for t in [y_l, dx_l, *grads_l])
    else:
        del layers["loop"]
    if world > 1:  # expert parallel over all ranks, on the same weights and this rank's tokens
        layout = parallel.Layout(world, 1, world)
        layout.check(cfg, world, 1)
        layers["ep"] = MoE(cfg).to(device)
        layers["ep"].load_state_dict(moe.state_dict())
        layers["ep"].experts = parallel.ExpertParallelExperts(layers["ep"].experts,
                                                              parallel.build_mesh(layout, device.type)["ep"])
        layers["ep"].experts.impl = "grouped"
        result["ep_vs_local_max_diff"] = (variant("ep")()[0] - y_g).abs().max().item()
    times = alternate({name: variant(name) for name in layers}, device, args.warmup, args.iters)
    moe_report(result, times, 6 * N * D * 3 * active_hidden, world, say)  # fwd + bwd of the active matmuls
    if args.breakdown:
        table, ops, wall, _ = profile(variant("grouped"), device, moe_targets(moe), steps=max(1, args.iters // 2))
        result["components_ms"] = table
        print_components(table, wall, say, "the grouped MoE layer")
        top = sorted(merged(ops).items(), key=lambda kv: -kv[1][1])[:10]
        result["top_ops_ms"] = {name: ms for name, (_, ms) in top}
        say("  busiest ops (self ms): " + ", ".join(f"{name} {ms:.2f}" for name, (_, ms) in top))
    return result


# ------------------------------------------------------------------------------------------------------------------
# bench.py plan: memory, traffic and time for a layout, by arithmetic on a meta-device model

# Per GPU kind: dense bf16 peak TFLOP/s, GiB, NVLink and default network GB/s per GPU each way, 8 GPUs and NICs a node
# (line rates; NCCL's measured bus bandwidth, typically 80-90% of them, goes in --nvlink_gbs / --net_gbs), HBM TB/s.
GPUS = {"h100": (train.PEAK_TFLOPS["H100"], 80, 450, 50, 3.35),   # NVLink 4 (900 GB/s both ways), 400 Gb/s NIC
        "h200": (train.PEAK_TFLOPS["H200"], 141, 450, 50, 4.8),   # NVLink 4, 400 Gb/s NIC
        "b200": (train.PEAK_TFLOPS["B200"], 180, 900, 50, 8.0),   # NVLink 5 (1.8 TB/s both ways), 400 Gb/s NIC
        "b300": (train.PEAK_TFLOPS["B300"], 288, 900, 100, 8.0)}  # NVLink 5, 800 Gb/s NIC (ConnectX-8)
FIT_FRACTION = 0.9  # 10% left for the CUDA context, NCCL buffers, fragmentation, EP load imbalance
AG, RS, AR, A2A = "FSDP all-gather", "FSDP reduce-scatter", "HSDP all-reduce across replicas", "EP all-to-all"
MUON_A2A, NS, OPT_HBM = "Muon all-to-all", "optimizer Newton-Schulz", "optimizer memory passes"
# HBM bytes per fp32 element of one optimizer step. Fused AdamW reads param, grad, m, v and writes param, m, v: 7 x 4.
# Muon: momentum (read buf, grad; write buf), Nesterov (read grad, buf; write u), weight decay (read, write param),
# the update (read param, the orthogonalised u; write param): 11 x 4 (bf16 casts and Newton-Schulz's norm not counted).
ADAMW_BYTES, MUON_BYTES = 28, 44


def activation_bytes(cfg, seq: int, micro_batch: int, c: int = 2, ep: int = 1) -> dict:
    """Activation bytes of one micro-batch per AC mode: {"saved": kept for backward, "peak": plus the largest transient
    (the head's chunk at the loss, or a block AC re-materialises)}; c bytes per element, flash attention, balanced
    routing. Selective AC keeps block inputs and matmul, attention, all-to-all outputs (parallel._sac_policy)."""
    D, H, G, Dh, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    E, K, I, Is = cfg.n_experts, cfg.top_k, cfg.expert_hidden, cfg.expert_hidden * cfg.n_shared_experts
    Hd, Gd = H * Dh, G * Dh
    # Per token. Attention: its input, q/k/v/gate, fp32 q/k norm scales, normed q, k, v, the output and its fp32
    # log-sum-exp, the output reshaped, sigmoid(gate) and their product (o_proj's input).
    attn = c * D + c * (Hd + Gd) + 4 * (H + G) + c * (Hd + 2 * Gd) + c * Hd + 4 * H + 3 * c * Hd
    attn_sel = c * (2 * Hd + 2 * Gd) + c * Hd + 4 * H + c * D
    # Router: its fp32 input (c = 4: the FFN input), fp32 logits and scores. Per routed pair: the gathered input,
    # gate_up output (2I), silu output, product, product x gate, fp32 gate, two int64 indices. A SwiGLU: 4c per unit.
    experts = (4 * D if c == 2 else 0) + 8 * E + K * (c * (D + 5 * I) + 20) + 4 * c * Is
    experts_sel = 4 * E + K * c * (2 * I + D) + c * (2 * Is + D) + (2 * K * c * D if ep > 1 else 0)
    # A block: four RMSNorm inputs (and an fp32 scale per row), the FFN input, attention, the FFN.
    full_layer = [4 * (c * D + 4) + c * D + attn + (experts if cfg.is_moe(i) else 4 * c * cfg.dense_hidden)
                  for i in range(cfg.n_layers)]
    sel_layer = [c * D + attn_sel + (experts_sel if cfg.is_moe(i) else c * (2 * cfg.dense_hidden + D))
                 for i in range(cfg.n_layers)]
    tokens = micro_batch * seq
    head = (c * D + 4) + c * D  # the final norm, and the head input's gradient the fused loss makes in forward
    # At the loss: a chunk of R rows of fp32 logits; in bf16 instead its bf16 logits, the gradient of a group of Rg
    # rows, the weight's bf16 copy and the group's product for the weight gradient.
    R, Rg = head_chunks(tokens, V, torch.device("cuda"))
    head_transient = 4 * R * V if c == 4 else c * (R + Rg) * V + 2 * c * V * D
    saved = {"none": sum(full_layer) + head, "selective": sum(sel_layer) + head,
             "full": cfg.n_layers * c * D + head}
    kept = {mode: tokens * saved[mode] + 4 * V * D for mode in parallel.AC_MODES}  # + the head weight's fp32 gradient
    return {mode: {"saved": kept[mode], "peak": kept[mode] + max(head_transient, 0 if mode == "none" else
                                                                    tokens * max(full_layer))}
            for mode in parallel.AC_MODES}


@dataclasses.dataclass
class Links:
    """Nodes of `per_node` GPUs on NVLink at `intra` bytes/s per GPU each way, joined by the network at `inter`
    (one NIC per GPU); `latency` seconds per step of a collective; `hbm` bytes/s of each GPU's own memory."""
    per_node: int = 8
    intra: float = 900e9
    inter: float = 100e9
    latency: float = 5e-6
    hbm: float = 8e12

    def span(self, stride: int, size: int) -> tuple[int, int]:
        """(ranks per node, nodes) of `size` ranks `stride` apart (build_mesh's order: [dp_replicate, efsdp, ep])."""
        nodes = len({i * stride // self.per_node for i in range(size)})
        return size // nodes, nodes

    def ring_s(self, nbytes: float, group: tuple[int, int]) -> float:
        """An all-gather or reduce-scatter of `nbytes` (unsharded) over k ranks on each of m nodes: a ring in each
        node, then one over the nodes, each of the k GPUs carrying 1/k through its own NIC (rail-aligned rings)."""
        k, m = group
        s = nbytes * (k - 1) / k / self.intra + (k - 1) * self.latency
        return s + (nbytes / k * (m - 1) / m / self.inter + (m - 1) * self.latency if m > 1 else 0)

    def seconds(self, kind: str, nbytes: float, group: tuple[int, int]) -> float:
        """One collective (an all-reduce: a reduce-scatter, then an all-gather)."""
        if kind == A2A:
            return self.all_to_all_s(nbytes, group)
        return self.ring_s(nbytes, group) * (2 if kind == AR else 1)

    def all_to_all_s(self, nbytes: float, group: tuple[int, int]) -> float:
        """Each rank sends `nbytes` over n = km ranks: (k-1)/n over NVLink while (n-k)/n crosses the network."""
        k, m = group
        n = k * m
        return max(nbytes * (k - 1) / n / self.intra, nbytes * (n - k) / n / self.inter) + (n - 1) * self.latency


def sent_bytes(nbytes: float, group: tuple[int, int], kind: str) -> tuple[float, float]:
    """(bytes a GPU sends, of which over the network) in one collective (an all-reduce: twice a ring's)."""
    k, m = group
    n = k * m
    if kind == A2A:
        return nbytes * (n - 1) / n, nbytes * (n - k) / n
    twice = 2 if kind == AR else 1
    return twice * nbytes * (n - 1) / n, twice * nbytes * (m - 1) / n


@functools.lru_cache(maxsize=None)
def shard(unit: tuple, shards: int) -> int:
    """Elements of one rank's shard of an FSDP unit (parameter shapes); FSDP2 pads dim 0 to the shard count."""
    return sum(-(-shape[0] // shards) * math.prod(shape[1:]) for shape in unit)


_FACTS = {}  # by repr(cfg): one meta-device model per config


def model_facts(cfg) -> dict:
    """From a meta-device model: each FSDP unit's parameter shapes, each block's matmul FLOPs per token, counts."""
    if repr(cfg) in _FACTS:
        return _FACTS[repr(cfg)]
    model = meta_model(cfg)
    norms = {id(p) for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    share = cfg.top_k / cfg.n_experts  # a token passes through k of the E routed experts
    blocks = list(model.layers.values())
    shapes = lambda params: tuple(tuple(p.shape) for p in params)  # noqa: E731
    muon = parallel.build_optimizer(model, train.TrainConfig(optimizer="muon"), fused=False)
    _FACTS[repr(cfg)] = {
        # Muon's 2-D matrices in its order (FSDP shards them by rows); the 3-D ones are the routed experts
        "muon_dense": shapes(p for g in muon.param_groups if g["muon"] for p in g["params"] if p.dim() == 2),
        "root": shapes(p for name, p in model.named_parameters() if not name.startswith("layers.")),
        "blocks": [shapes(p for name, p in b.named_parameters() if ".experts." not in f".{name}") for b in blocks],
        "experts": [shapes((b.ffn.experts.gate_up_proj, b.ffn.experts.down_proj)) if isinstance(b.ffn, MoE) else ()
                    for b in blocks],
        # 6 FLOPs per weight a token touches: forward 2, backward 4
        "block_flops": [6 * sum(p.numel() * (share if ".experts." in f".{n}" else 1)
                                for n, p in b.named_parameters() if id(p) not in norms) for b in blocks],
        "params": model.num_params(), "flops_per_token": functools.lru_cache(model.flops_per_token)}
    return _FACTS[repr(cfg)]


@functools.lru_cache(maxsize=None)
def ns_flops(shape: tuple, steps: int = parallel.NS_STEPS) -> int:
    """parallel.newton_schulz's matmul FLOPs on [..., O, F] turned Q x W (min, max) wide; per step A = X Xᵀ 2Q²W,
    B = b·A + c·A·A 2Q³, X = a·X + B·X 2Q²W."""
    *stack, O, F = shape
    Q, W = min(O, F), max(O, F)
    return math.prod(stack) * steps * (4 * Q * Q * W + 2 * Q ** 3)


@functools.lru_cache(maxsize=None)
def muon_deal(hidden: tuple, S: int) -> tuple[list, int, int]:
    """parallel.Muon's deal of row-sharded matrices (shapes) over S ranks (parallel.deal), one per rank a round:
    (FLOPs per rank, the sum over rounds of the round's most, rounds)."""
    owned = [[ns_flops(hidden[i]) for i in mine] for mine in parallel.deal([math.prod(s) for s in hidden], S)]
    rounds = max(map(len, owned))
    return [sum(o) for o in owned], sum(max(o[j] if j < len(o) else 0 for o in owned) for j in range(rounds)), rounds


def muon_work(hidden: tuple, experts: list, layout: parallel.Layout, links: Links, group: tuple, c: int) -> dict:
    """parallel.Muon on an FSDP group: dense matrices dealt over its S ranks, each gathered whole on its owner by an
    all-to-all and sent back, one a round; expert shards where they live. Newton-Schulz FLOPs (per rank, critical
    path), all-to-all bytes a rank sends (sent, over the network) and seconds, elements updated on the busiest rank."""
    S, Fs = layout.dp_shard, layout.efsdp
    dense, dense_critical, rounds = muon_deal(hidden, S)  # S = 1: all on the one rank, no traffic
    L, per_expert = next((u[0][0] for u in experts if u), 0), sum(ns_flops(s[1:]) for u in experts for s in u)
    chunk = -(-L // Fs)  # expert-FSDP rank j holds experts j*chunk .. (torch.chunk)
    by_efsdp = [per_expert * max(0, min(chunk, L - j * chunk)) for j in range(Fs)]
    flops = [dense[r] + by_efsdp[r // layout.ep] for r in range(S)]
    nbytes = c * shard(hidden, S)  # the rows a rank holds go out, the rows it owns come back
    return {"flops_by_rank": flops, "flops": max(flops), "flops_mean": sum(flops) / S,
            "critical_flops": max(by_efsdp) + dense_critical,
            "a2a_bytes": [2 * b for b in sent_bytes(nbytes, group, A2A)],
            "a2a_s": 2 * rounds * links.all_to_all_s(nbytes / rounds, group) if rounds else 0.0,
            "elements": shard(hidden, S) + sum(shard(u, Fs) for u in experts)}


def fsdp_memory(world: int, params: int, full: dict, c: int, accum: int, grad_sync: str, keep_gathered: bool,
                muon_elements: int | None = None) -> dict:
    """Bytes per GPU of fp32 shards, optimizer state (AdamW's m, v; Muon's one momentum for its `muon_elements`) and
    FSDP's buffers; `full`: each unit's unsharded elements."""
    memory = {"parameters (fp32 master shards)": 4 * params, "gradients (fp32 shards)": 4 * params}
    if muon_elements is None:
        memory["optimizer (AdamW m, v in fp32)"] = 8 * params
    else:
        memory["optimizer (Muon momentum, AdamW m, v; fp32)"] = 8 * params - 4 * muon_elements
    if world == 1:
        return memory
    every, largest = full["root"] + sum(full["blocks"]) + sum(full["experts"]), max(full["blocks"] + full["experts"])
    if keep_gathered:
        memory["every unit gathered (compute copies)"] = c * every
    else:  # FSDP2 keeps the root unsharded from forward to backward; a block gathered while the next is prefetched
        memory["FSDP all-gather buffers (compute copies)"] = c * (full["root"] + 2 * largest)
    # Backward: a unit's unsharded gradients in compute dtype plus their fp32 copy for the reduce-scatter.
    memory["FSDP reduce-scatter buffers"] = (c + 4) * max(full["root"], largest)
    if grad_sync == "last" and accum > 1:
        memory["unsharded gradients held across micro-batches"] = 4 * every
    return memory


def unit_collectives(cfg, layout: parallel.Layout, links: Links, groups: dict, c: int, tokens: int, full: int,
                     expert_full: int) -> dict:
    """One FSDP unit's collectives (kind, buffer bytes, (ranks per node, nodes)) by part of the step, and their
    seconds (part_s); `full`, `expert_full`: its unsharded dense and routed-expert elements."""
    moe = expert_full > 0
    g_dense, g_expert, g_replica, g_ep = (groups[k] for k in ("dp_shard", "efsdp", "dp_replicate", "ep"))
    # Each way: tokens out and results back (D wide) and the fp32 gates; forward sends the int64 counts first.
    pairs = tokens * cfg.top_k
    a2a = [pairs * cfg.dim * c, pairs * 4, pairs * cfg.dim * c] if moe and layout.ep > 1 else []
    comm = {"gather": [(AG, c * full, g_dense)] + ([(AG, c * expert_full, g_expert)] if moe else []),
            "reduce": [(RS, 4 * full, g_dense)] + ([(RS, 4 * expert_full, g_expert)] if moe else []),
            "all_reduce": [(AR, 4 * full // layout.dp_shard, g_replica)]
                          + ([(AR, 4 * expert_full // layout.efsdp, g_replica)] if moe else []),
            "a2a_fwd": [(A2A, b, g_ep) for b in ([8 * cfg.n_experts] if a2a else []) + a2a],
            "a2a_bwd": [(A2A, b, g_ep) for b in a2a]}
    return comm | {f"{part}_s": sum(links.seconds(*one) for one in comm[part]) for part in comm}


def plan(cfg, layout: parallel.Layout, seq: int, micro_batch: int, global_batch: int, ac: str = "none",
         compute_bytes: int = 2, grad_sync: str = "every", keep_gathered: bool = False,
         links: Links | None = None, optimizer: str = "adamw", detail: bool = True) -> dict:
    """Per-GPU memory (bytes), FLOPs per token, one optimizer step's collectives (bytes, seconds on `links`) and the
    optimizer's work for `cfg` sharded as parallel.py does: dense parameters over dp_shard, routed experts (E/ep per
    EP rank) over efsdp. grad_sync "last" holds unsharded gradients to the last micro-batch; detail=False: memory."""
    layout.check(cfg, global_batch, micro_batch)
    facts, links = model_facts(cfg), links or Links()
    R, S, Fs, ep, c = layout.dp_replicate, layout.dp_shard, layout.efsdp, layout.ep, compute_bytes
    accum = layout.accumulation_steps(global_batch, micro_batch)
    experts = [tuple((cfg.n_experts // ep, *s[1:]) for s in unit) for unit in facts["experts"]]
    params = shard(facts["root"], S) + sum(shard(u, S) for u in facts["blocks"]) + sum(shard(u, Fs) for u in experts)
    # Unsharded elements of each unit as FSDP gathers it (every shard padded alike).
    full = {"root": S * shard(facts["root"], S), "blocks": [S * shard(u, S) for u in facts["blocks"]],
            "experts": [Fs * shard(u, Fs) for u in experts]}
    groups = {"dp_shard": links.span(1, S), "efsdp": links.span(ep, Fs), "dp_replicate": links.span(S, R),
              "ep": links.span(1, ep)}
    muon = muon_work(facts["muon_dense"], experts, layout, links, groups["dp_shard"], c) if optimizer == "muon" \
        else None
    memory = fsdp_memory(layout.world, params, full, c, accum, grad_sync, keep_gathered, muon and muon["elements"])
    acts = activation_bytes(cfg, seq, micro_batch, c, ep)
    memory[f"activations (ac={ac}, peak)"] = acts[ac]["peak"]
    if not detail:
        return {"memory_bytes": memory, "memory_total_bytes": sum(memory.values())}

    root, blocks = (full["root"], 0), list(zip(full["blocks"], full["experts"]))
    made = {key: unit_collectives(cfg, layout, links, groups, c, micro_batch * seq, *key)
            for key in dict.fromkeys([root] + blocks)}  # units of the same sizes share their collectives
    attn_flops = 12 * cfg.n_heads * cfg.head_dim  # per token and context position
    units = [{**made[root], "flops": 0}] + [
        {**made[key], "flops": flops + attn_flops * (seq if cfg.is_global(i) else min(cfg.window, seq))}
        for i, (key, flops) in enumerate(zip(blocks, facts["block_flops"]))]
    model_flops = facts["flops_per_token"](seq)
    # How often each part runs in one optimizer step; each kind of unit counted once, times its number.
    gathers = 1 if keep_gathered else accum
    times = {"gather": gathers + (0 if keep_gathered else accum), "reduce": accum if grad_sync == "every" else 1,
             "all_reduce": 1, "a2a_fwd": accum * (2 if ac == "full" else 1),  # full AC repeats them in backward
             "a2a_bwd": accum}
    traffic = defaultdict(lambda: [0.0, 0.0])  # kind -> [bytes sent, of which over the network]
    for key, uses, is_root in [(root, 1, True)] + [(key, k, False) for key, k in Counter(blocks).items()]:
        for part, n in times.items():
            n = gathers if is_root and part == "gather" else n  # FSDP2 keeps the root gathered for backward
            for kind, nbytes, group in made[key][part]:
                for side, b in enumerate(sent_bytes(nbytes, group, kind)):
                    traffic[kind][side] += uses * n * b
    step = muon or {"elements": 0}
    step["hbm_bytes"] = ADAMW_BYTES * (params - step["elements"]) + MUON_BYTES * step["elements"]
    step["hbm_s"] = step["hbm_bytes"] / links.hbm
    if muon and muon["a2a_bytes"][0]:
        traffic[MUON_A2A] = muon["a2a_bytes"]
    return {"world": layout.world, "dp_replicate": R, "dp_shard": S, "efsdp": Fs, "ep": ep,
            "accumulation_steps": accum, "micro_batch": micro_batch, "seq": seq, "ac": ac,
            "keep_gathered": keep_gathered, "grad_sync": grad_sync, "params_total": facts["params"]["total"],
            "params_active": facts["params"]["active"], "params_per_gpu": params, "flops_per_token": model_flops,
            "head_flops_per_token": model_flops - sum(u["flops"] for u in units),  # the output head's matmuls
            "memory_bytes": memory, "memory_total_bytes": sum(memory.values()),
            "activations_by_ac": {mode: acts[mode]["peak"] for mode in parallel.AC_MODES},
            "traffic_bytes_per_step": {k: v[0] for k, v in traffic.items()},
            "network_bytes_per_step": {k: v[1] for k, v in traffic.items()}, "groups": groups, "units": units,
            "optimizer": {"name": optimizer, **step}}


class Timeline:
    """One GPU's step on the compute stream (the EP all-to-all too: experts wait for their tokens) and the links (one
    queue for every FSDP collective); `seconds` counts, by kind, the time compute waits for the links."""

    def __init__(self):
        self.compute_end = self.link_end = 0.0
        self.busy, self.first_busy = [], 0  # (start, end, kind) on the links, in order
        self.seconds = defaultdict(float)   # compute and EP all-to-all time, and exposed waits by kind
        self.link_s = defaultdict(float)    # link time by kind

    def comm(self, kind: str, seconds: float, ready: float) -> float:
        start = max(self.link_end, ready)
        self.link_end = start + seconds
        self.busy.append((start, self.link_end, kind))
        self.link_s[kind] += seconds
        return self.link_end

    def compute(self, seconds: float, ready: float = 0.0, kind: str = "compute") -> float:
        start = max(self.compute_end, ready)
        # The wait, charged to the collectives the links are busy with meanwhile.
        while self.first_busy < len(self.busy) and self.busy[self.first_busy][1] <= self.compute_end:
            self.first_busy += 1
        for s, e, k in self.busy[self.first_busy:]:
            if s >= start:
                break
            self.seconds[f"exposed {k}"] += min(e, start) - max(s, self.compute_end)
        self.compute_end = start + seconds
        self.seconds[kind] += seconds
        return start

    def in_line(self, kind: str, seconds: float):
        """Work on the compute stream, if any; an all-to-all there (experts wait for their tokens) is link time too."""
        if seconds:
            self.compute(seconds, kind=kind)
            if kind in (A2A, MUON_A2A):
                self.link_s[kind] += seconds


def micro_batch_on(tl: Timeline, p: dict, flops_s: float, first: bool, last: bool):
    """One micro-batch of train.train_step: each unit gathered as the one before starts (FSDP2's prefetch), the head;
    backward from the last block, re-gathered one ahead (unless kept), its gradients reduce-scattered (on the last
    micro-batch also all-reduced across replicas) as soon as its backward ends."""
    tokens, units = p["micro_batch"] * p["seq"], p["units"]
    gather, regather = first or not p["keep_gathered"], not p["keep_gathered"]
    recompute = 2 if p["ac"] == "full" else 1  # full AC runs each block's forward again in backward
    ready = [tl.comm(AG, units[0]["gather_s"], tl.compute_end) if gather else 0.0] + [0.0] * (len(units) - 1)
    for j, u in enumerate(units):
        start = tl.compute(u["flops"] / 3 * tokens / flops_s, ready[j])
        if gather and j + 1 < len(units):
            ready[j + 1] = tl.comm(AG, units[j + 1]["gather_s"], start)
        tl.in_line(A2A, u["a2a_fwd_s"])
    tl.compute(p["head_flops_per_token"] * tokens / flops_s)  # the fused loss makes the head's gradients too
    blocks = units[:0:-1]
    ready = [tl.comm(AG, blocks[0]["gather_s"], tl.compute_end) if regather else 0.0] + [0.0] * len(blocks)
    for j, u in enumerate(blocks + [units[0]]):
        if u is not units[0]:
            start = tl.compute(u["flops"] / 3 * (1 + recompute) * tokens / flops_s, ready[j])
            if regather and j + 1 < len(blocks):
                ready[j + 1] = tl.comm(AG, blocks[j + 1]["gather_s"], start)
            tl.in_line(A2A, (u["a2a_fwd_s"] if recompute == 2 else 0.0) + u["a2a_bwd_s"])
        if p["grad_sync"] == "every" or last:
            tl.comm(RS, u["reduce_s"], tl.compute_end)
        if last and p["dp_replicate"] > 1:
            tl.comm(AR, u["all_reduce_s"], tl.compute_end)


def optimizer_on(tl: Timeline, p: dict, flops_s: float):
    """The optimizer step once the last reductions are in: Newton-Schulz and its all-to-alls (Muon), then the
    elementwise passes at HBM speed."""
    tl.compute(0.0, tl.link_end)
    o = p["optimizer"]
    for kind, seconds in ((NS, o.get("critical_flops", 0) / flops_s), (MUON_A2A, o.get("a2a_s", 0.0)),
                          (OPT_HBM, o["hbm_s"])):
        tl.in_line(kind, seconds)


def project(p: dict, flops_s: float, peak_tflops: float, tokens_budget: float = 17e12) -> dict:
    """Plan `p` at `flops_s` FLOP/s: the first, a middle (repeated for the others) and the last micro-batch on a
    timeline; step seconds, compute and exposed waits and link time by kind, tokens/s per GPU, MFU, days."""
    tl, accum = Timeline(), p["accumulation_steps"]
    marks = []
    for i in range(min(accum, 3)):
        micro_batch_on(tl, p, flops_s, first=i == 0, last=i == min(accum, 3) - 1)
        marks.append((tl.compute_end, dict(tl.seconds), dict(tl.link_s)))
    optimizer_on(tl, p, flops_s)
    step_s, seconds, link_s = tl.compute_end, dict(tl.seconds), dict(tl.link_s)
    if accum > 3:  # the middle micro-batches repeat the second one
        more = accum - 3
        step_s += more * (marks[1][0] - marks[0][0])
        for total, now, before in ((seconds, marks[1][1], marks[0][1]), (link_s, marks[1][2], marks[0][2])):
            for k in now:
                total[k] = total.get(k, 0.0) + more * (now[k] - before.get(k, 0.0))
    tokens = accum * p["micro_batch"] * p["seq"]  # per GPU per step
    mfu = p["flops_per_token"] * tokens / step_s / (peak_tflops * 1e12)
    return {"step_s": step_s, "seconds": seconds, "link_s": link_s, "tokens_per_s_per_gpu": tokens / step_s,
            "mfu": mfu, "days": tokens_budget / (tokens * p["world"]) * step_s / 86400,
            "optimizer_s": sum(seconds.get(k, 0.0) for k in (NS, MUON_A2A, OPT_HBM))}


def search(cfg, gpus: int, seq: int, global_batch: int, gpu: str, links: Links, flops_s: float, top: int = 5,
           optimizer: str = "adamw"):
    """The `top` fastest layouts train.py can run that fit (replicas, ep, micro-batch, AC, --keep_gathered), with the
    numbers tried and fitting."""
    peak, mem_gib = GPUS[gpu][:2]
    found, tried = [], 0
    moe = cfg.n_dense_layers < cfg.n_layers
    for R in parallel._divisors(gpus):
        for ep in [e for e in parallel._divisors(gpus // R) if cfg.n_experts % e == 0] if moe else [1]:
            for micro, ac, keep in itertools.product(parallel._divisors(global_batch // gpus), parallel.AC_MODES,
                                                     (False, True)):
                tried += 1
                args = (cfg, parallel.Layout(gpus, R, ep), seq, micro, global_batch, ac, 2, "every", keep, links,
                        optimizer)
                if plan(*args, detail=False)["memory_total_bytes"] <= FIT_FRACTION * mem_gib * 2**30:
                    p = plan(*args)
                    found.append((p, project(p, flops_s, peak)))
    found.sort(key=lambda f: (f[1]["step_s"], f[0]["memory_total_bytes"]))
    return found[:top], tried, len(found)


def layout_flags(p: dict) -> str:
    return (f"--dp_replicate={p['dp_replicate']} --ep={p['ep']} --micro_batch={p['micro_batch']} --ac={p['ac']}"
            + (" --keep_gathered=true" if p["keep_gathered"] else ""))


def why_slower(t: dict, best: dict) -> str:
    """The part of the step that grew most against the best layout's."""
    if t["step_s"] <= 1.005 * best["step_s"]:
        return "ties with the fastest (within 0.5%)"
    worst = max(set(t["seconds"]) | set(best["seconds"]),
                key=lambda k: t["seconds"].get(k, 0.0) - best["seconds"].get(k, 0.0))
    return f"{worst} {t['seconds'].get(worst, 0.0):.3g} s vs {best['seconds'].get(worst, 0.0):.3g} s"


def read_tflops(text: str) -> tuple[float, str]:
    """--tflops: a number, or a saved `bench.py --json` output whose last line gives tflops_per_device."""
    with contextlib.suppress(ValueError):
        return float(text), "given"
    if not os.path.isfile(text):
        raise ValueError(f"--tflops={text} is neither a number nor a file; pass TFLOP/s or a saved bench.py --json "
                         f"output.")
    with open(text) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1])
        return float(result["tflops_per_device"]), f"measured by bench.py on {result.get('device', '?')} ({text})"
    except (IndexError, ValueError, KeyError, TypeError):
        raise ValueError(f"{text} does not end with a bench.py --json result holding tflops_per_device; save the "
                         f"output of `python bench.py --json ...` on the GPU.") from None


def print_plan(r: dict, p: dict, t: dict, links: Links, layout: str, rate_from: str):
    """The plan's report: layout, parameters, memory, FLOPs, links, traffic, the step's time and the run's days."""
    peak, mem_gib = GPUS[r["gpu"]][:2]
    tokens_per_step = r["global_batch"] * r["seq"]
    print(f"plan: {r['preset']} on {r['gpus']} x {r['gpu']} ({mem_gib} GiB, {peak:g} TFLOP/s dense bf16); "
          f"seq {r['seq']}, micro-batch {r['micro_batch']}, global batch {r['global_batch']} "
          f"({p['accumulation_steps']} micro-batch(es) per step), ac={r['ac']}, grad_sync={r['grad_sync']}, "
          f"keep_gathered={r['keep_gathered']}")
    print(layout)
    print(f"parameters: {p['params_total'] / 1e9:.2f}B total, {p['params_active'] / 1e9:.2f}B active; "
          f"{p['params_per_gpu'] / 1e9:.3f}B per GPU (sharded over {p['dp_shard']}, replicated {p['dp_replicate']}x)")
    print("memory per GPU:")
    for k, v in r["memory_gib"].items():
        print(f"  {k:48s} {v:9.2f} GiB")
    print(f"  {'total':48s} {r['memory_gib_per_gpu']:9.2f} GiB of {mem_gib} ({100 * FIT_FRACTION:.0f}% usable: "
          f"{FIT_FRACTION * mem_gib:.0f})")
    print("  activation peak by AC mode: " + ", ".join(f"{k} {v:.1f} GiB"
                                                       for k, v in r["activations_gib_by_ac"].items()))
    print(f"FLOPs per token at seq {r['seq']}: {p['flops_per_token'] / 1e9:.2f} GFLOP (6 x active matmul weights + "
          f"attention)")
    spans = ", ".join(f"{name} {k * m} = {k} x {m}" for name, (k, m) in p["groups"].items())
    print(f"links: {links.per_node} GPUs per node, NVLink {links.intra / 1e9:g} GB/s and network "
          f"{links.inter / 1e9:g} GB/s per GPU each way, {links.latency * 1e6:g} us per collective step; groups "
          f"(ranks per node x nodes): {spans}")
    print("bytes each GPU sends per optimizer step, and the time they take on the links:")
    for k, v in p["traffic_bytes_per_step"].items():
        print(f"  {k:40s} {v / 1e9:9.1f} GB ({p['network_bytes_per_step'][k] / 1e9:7.1f} GB over the network) "
              f"{t['link_s'].get(k, 0.0):7.2f} s")
    o, s = r["optimizer_step"], t["seconds"]
    muon = (f"Newton-Schulz {o['muon_flops_per_gpu'] / 1e12:.1f} TFLOP on the busiest rank (mean "
            f"{o['muon_flops_mean'] / 1e12:.1f}), {s[NS]:.3g} s on the ranks' critical path; all-to-all "
            f"{o['muon_all_to_all_bytes_per_gpu'] / 1e9:.2f} GB, {s.get(MUON_A2A, 0.0):.3g} s; ") \
        if r["optimizer"] == "muon" else ""
    print(f"optimizer step ({r['optimizer']}) per GPU: {muon}elementwise passes {o['hbm_bytes_per_gpu'] / 1e9:.1f} GB "
          f"at {r['hbm_gb_s']:g} GB/s, {s[OPT_HBM]:.3g} s; {o['seconds']:.3g} s after the last reductions")
    print(f"time per step ({rate_from}: compute at {r['compute_tflops']:g} TFLOP/s; all-gathers prefetched one block "
          f"ahead, reduce-scatters overlapping backward, the EP all-to-all in line):")
    for k, v in sorted(t["seconds"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:48s} {v:9.2f} s")
    print(f"  {'step':48s} {t['step_s']:9.2f} s: {t['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU "
          f"{100 * t['mfu']:.1f}%")
    print(f"time: {r['tokens']:.3g} tokens on {r['gpus']} x {r['gpu']}: {t['days']:.1f} days "
          f"({r['tokens'] / tokens_per_step:,.0f} steps of {tokens_per_step / 1e6:.1f}M tokens)")


def bench_plan(args, tc: train.TrainConfig, overrides: dict) -> dict:
    peak, mem_gib, nvlink_gbs, net_gbs, hbm_tbs = GPUS[args.gpu]
    links = Links(args.gpus_per_node, (args.nvlink_gbs or nvlink_gbs) * 1e9, (args.net_gbs or net_gbs) * 1e9,
                  args.latency_us * 1e-6, args.hbm_gbs * 1e9 or hbm_tbs * 1e12)
    tflops, rate_from = read_tflops(args.tflops) if args.tflops else (args.mfu * peak, f"{100 * args.mfu:g}% of peak")
    if tflops <= 0:
        raise ValueError(f"--tflops={args.tflops} must be above 0.")
    seq = args.seq or PRESETS[tc.preset].max_seq_len
    global_batch = args.global_batch or args.gpus * args.micro_batch
    cfg = model_config(dataclasses.replace(tc, seq_len=seq), overrides)
    layout = parallel.Layout(args.gpus, args.dp_replicate, args.ep)
    result = {"command": "plan", "preset": tc.preset, "gpu": args.gpu, "gpus": args.gpus, "seq": seq,
              "micro_batch": args.micro_batch, "global_batch": global_batch, "ac": args.ac, "grad_sync": args.grad_sync,
              "keep_gathered": tc.keep_gathered, "gpus_per_node": links.per_node, "nvlink_gb_s": links.intra / 1e9,
              "network_gb_s": links.inter / 1e9, "latency_us": links.latency * 1e6, "hbm_gb_s": links.hbm / 1e9,
              "compute_tflops": tflops, "optimizer": tc.optimizer}
    try:
        p = plan(cfg, layout, seq, args.micro_batch, global_batch, args.ac, 2, args.grad_sync, tc.keep_gathered,
                 links, tc.optimizer)
    except ValueError as e:
        return {**result, "fits": False, "reason": str(e), "exit": 2}
    t = project(p, tflops * 1e12, peak, args.tokens)
    total_gib, budget = p["memory_total_bytes"] / 2**30, FIT_FRACTION * mem_gib
    result.update(params_per_gpu=p["params_per_gpu"], memory_gib_per_gpu=total_gib,
                  memory_gib={k: v / 2**30 for k, v in p["memory_bytes"].items()},
                  activations_gib_by_ac={k: v / 2**30 for k, v in p["activations_by_ac"].items()},
                  flops_per_token=p["flops_per_token"], params_total=p["params_total"],
                  params_active=p["params_active"], accumulation_steps=p["accumulation_steps"],
                  traffic_gb_per_step_per_gpu={k: v / 1e9 for k, v in p["traffic_bytes_per_step"].items()},
                  network_gb_per_step_per_gpu={k: v / 1e9 for k, v in p["network_bytes_per_step"].items()},
                  step_seconds=t["step_s"], seconds_per_step=t["seconds"], link_seconds_per_step=t["link_s"],
                  tokens_per_s_per_gpu=t["tokens_per_s_per_gpu"], mfu=t["mfu"], tokens=args.tokens, days=t["days"],
                  fits=total_gib <= budget)
    o = p["optimizer"]  # its seconds by part are in seconds_per_step
    result["optimizer_step"] = {"seconds": t["optimizer_s"], "hbm_bytes_per_gpu": o["hbm_bytes"]} | (
        {"muon_flops_per_gpu": o["flops"], "muon_flops_mean": o["flops_mean"],
         "muon_all_to_all_bytes_per_gpu": o["a2a_bytes"][0]} if tc.optimizer == "muon" else {})
    print_plan(result, p, t, links, layout.describe(cfg.n_experts), rate_from)
    if args.search:
        best, tried, fit = search(cfg, args.gpus, seq, global_batch, args.gpu, links, tflops * 1e12,
                                  optimizer=tc.optimizer)
        print(f"fastest layouts that fit ({fit} of {tried} fit; global batch {global_batch} x {seq} kept):"
              + ("" if best else " none; use more GPUs or a smaller model"))
        for i, (q, s) in enumerate(best):
            lose = "fastest" if i == 0 else f"+{100 * (s['step_s'] / best[0][1]['step_s'] - 1):.1f}%: " \
                                            f"{why_slower(s, best[0][1])}"
            print(f"  {i + 1}. {layout_flags(q):76s} {s['step_s']:#7.3g} s  MFU {100 * s['mfu']:4.1f}%  "
                  f"{s['days']:5.1f} days  {q['memory_total_bytes'] / 2**30:5.0f} GiB  {lose}")
        if best:
            print(f"  this layout: {t['step_s']:.3g} s; vs the fastest: {why_slower(t, best[0][1])}")
            print(f"  the fastest with train.py ({args.gpus} ranks): train.py --preset={tc.preset} --seq_len={seq} "
                  f"--global_batch={global_batch} {layout_flags(best[0][0])}")
        result["search"] = {"tried": tried, "fit": fit, "best": [
            {"flags": layout_flags(q), "step_seconds": s["step_s"], "mfu": s["mfu"], "days": s["days"],
             "memory_gib_per_gpu": q["memory_total_bytes"] / 2**30, "seconds_per_step": s["seconds"]}
            for q, s in best]}
    if not result["fits"]:
        hint = ("; most of it is the unsharded fp32 gradients FSDP holds between micro-batches with "
                "--grad_sync=last (train.py reduce-scatters every micro-batch: --grad_sync=every)"
                if "unsharded gradients held across micro-batches" in p["memory_bytes"] else
                "; try --ac=full or --ac=selective, more GPUs per replica (lower --dp_replicate), or a smaller "
                "--micro_batch")
        result["reason"] = (f"the plan needs {total_gib:.1f} GiB per GPU but a {args.gpu} offers {budget:.0f} of its "
                            f"{mem_gib} GiB{hint}")
        result["exit"] = 1
    return result


# ------------------------------------------------------------------------------------------------------------------
# bench.py vs-hf: our train step against transformers' AfmoeForCausalLM

def bench_vs_hf(args, tc: train.TrainConfig, overrides: dict) -> dict:
    import transformers

    import checkpoint

    _, _, device = parallel.init_distributed()
    # One process (whatever the layout flags say), and AfmoeForCausalLM has no intra-document masking.
    tc = dataclasses.replace(tc, doc_mask=False, dp_replicate=1, ep=1)
    run = train.Run.on(tc, model_config(tc, overrides), 0, 1, device)
    cfg, autocast = run.cfg, run.autocast
    torch.manual_seed(tc.seed)
    ours, opt_ours = train.build(run, copies=2 * train.state_copies(tc))  # and transformers' model as much again
    hf_cfg = transformers.AfmoeConfig(**{k: v for k, v in cfg.to_hf().items()
                                         if k not in ("model_type", "architectures")}, use_cache=False)
    hf = transformers.AfmoeForCausalLM(hf_cfg).to(device).train()
    hf.load_state_dict(checkpoint.to_hf_state_dict(ours.state_dict(), cfg), strict=True)
    # The same optimizer for both: fused AdamW, also transformers' Trainer default (adamw_torch_fused).
    opt_hf = parallel.build_optimizer(hf, tc)
    state = train.TrainState.fresh(ours, device)
    batch = synthetic_batch(cfg.vocab_size, tc.global_batch, tc.seq_len, 0, 1, tc.seed)
    n_micro = tc.global_batch // tc.micro_batch
    hf_impl = (hf.config._attn_implementation, getattr(hf.config, "_experts_implementation", None))
    print(f"vs-hf: {tc.preset} {cfg.dim}d x {cfg.n_layers} layers, {cfg.n_experts} experts top-{cfg.top_k}, expert "
          f"hidden {cfg.expert_hidden}, vocab {cfg.vocab_size}; {tc.global_batch} x {tc.seq_len} tokens per step in "
          f"{n_micro} micro-batch(es); {run.dtype or torch.float32} on {device_name(device)}; transformers "
          f"{transformers.__version__} with attention={hf_impl[0]}, experts={hf_impl[1]}")
    losses = {}

    def step_ours():
        losses["ours"] = train.train_step(ours, opt_ours, batch, tc, autocast, state)["lm_loss"]

    def step_hf():  # the same work: micro-batches, clipping, AdamW; no balance losses or bias update (HF has none)
        tokens_BT, targets_BT, _ = (t.to(device) for t in batch)
        losses["hf"] = 0.0
        for i in range(n_micro):
            rows = slice(i * tc.micro_batch, (i + 1) * tc.micro_batch)
            with autocast:
                logits_BTV = hf(input_ids=tokens_BT[rows], use_cache=False).logits
                loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT[rows].flatten())
            (loss / n_micro).backward()
            losses["hf"] += loss.item() / n_micro
        torch.nn.utils.clip_grad_norm_(hf.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf"))
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)

    step_ours()
    step_hf()
    first_diff = abs(losses["ours"] - losses["hf"])
    times = alternate({"ours": step_ours, "hf": step_hf}, device, args.warmup, args.iters, flip=True)
    result = {"command": "vs-hf", "preset": tc.preset, "device": device_name(device), "hf_attention": hf_impl[0],
              "hf_experts": hf_impl[1], "tokens_per_step": tc.global_batch * tc.seq_len,
              "ours_ms": statistics.median(times["ours"]), "hf_ms": statistics.median(times["hf"]),
              "ours_ms_min": min(times["ours"]), "hf_ms_min": min(times["hf"]), "first_loss_diff": first_diff}
    result["speedup"] = result["hf_ms"] / result["ours_ms"]
    # Each iteration times the two steps back to back, so their ratio shares whatever else the machine was doing.
    result["speedup_paired"] = statistics.median(hf / ours for hf, ours in zip(times["hf"], times["ours"]))
    print(f"  ours        median {result['ours_ms']:9.1f} ms (min {result['ours_ms_min']:.1f})")
    print(f"  transformers median {result['hf_ms']:9.1f} ms (min {result['hf_ms_min']:.1f})")
    print(f"speedup (transformers / ours): {result['speedup']:.2f}x on the medians, {result['speedup_paired']:.2f}x "
          f"the median of the {len(times['hf'])} back-to-back pairs; first-step LM losses agree to {first_diff:.1e}")
    return result


# ------------------------------------------------------------------------------------------------------------------
# bench.py plot: metrics.jsonl -> metrics.png

def bench_plot(out_dir: str) -> dict:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist; pass the --out_dir of a train.py run.")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("bench.py plot draws with matplotlib, which is not installed here: pip install matplotlib")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]

    series = lambda key: [(r["step"], r[key]) for r in rows if r.get(key) is not None]  # noqa: E731
    fig, (ax_loss, ax_grad, ax_vio) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for key, style in (("loss", "-"), ("lm_loss", "-"), ("val_loss", "o-")):
        if series(key):
            ax_loss.plot(*zip(*series(key)), style, label=key, markersize=3)
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    if series("grad_norm"):
        ax_grad.plot(*zip(*series("grad_norm")), label="grad norm (before clipping)")
        ax_grad.set_yscale("log")
        ax_grad.legend()
    ax_grad.set_ylabel("grad norm")
    vio = series("max_vio_layers")
    first_moe = 0  # name the curves by block index when the run's config.json says where the MoE layers start
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        with open(os.path.join(out_dir, "config.json")) as f:
            first_moe = json.load(f).get("model", {}).get("n_dense_layers", 0)
    for i in range(len(vio[0][1]) if vio else 0):
        ax_vio.plot([s for s, _ in vio], [v[i] for _, v in vio], label=f"layer {first_moe + i}")
    if vio:
        ax_vio.legend(ncol=4, fontsize="small")
    ax_vio.set_ylabel("MaxVio (max load / mean - 1)")
    ax_vio.set_xlabel("step")
    fig.tight_layout()
    out = os.path.join(out_dir, "metrics.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(f"wrote {out} ({len(rows)} steps)")
    return {"command": "plot", "png": out, "steps": len(rows)}


# ------------------------------------------------------------------------------------------------------------------
# bench.py data: data.py's prepare against its tokenizer library's own batch encoder

def bench_data(args) -> dict:
    """Tokens/s of data.prepare on standard-library source written as JSONL against the tokenizer library's batch
    encoder on the same documents already in memory, for each --workers. Per core is tokens per CPU-second of every
    process and thread, which other work on the machine inflates far less than wall time."""
    import tempfile

    import data
    enc = data.get_encoding(args.tokenizer)
    hf = isinstance(enc, data.HFTokenizer)
    if hf:  # sizes tokenizers' thread pool, before its first use
        os.environ["RAYON_NUM_THREADS"] = str(max(args.workers))
    docs, chars = [], 0
    for path in itertools.cycle(data._stdlib_files()):  # cut as data.py cuts plain text; repeated up to --mb
        with open(path, encoding="utf-8", errors="replace") as f:
            docs += data._paragraph_documents(f, args.doc_chars)
        chars += os.path.getsize(path)
        if chars >= args.mb * 1e6:
            break
    cpu_s = lambda: sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF,  # noqa: E731
                        resource.RUSAGE_CHILDREN) for field in ("ru_utime", "ru_stime"))
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
                wall, cpu = time.perf_counter(), cpu_s()
                if who == "prepare":
                    manifest = data.prepare([corpus], os.path.join(tmp, f"out_{workers}_{repeat}"), args.tokenizer,
                                            val_fraction=0, workers=workers, quiet=True)
                elif hf:
                    os.environ["TOKENIZERS_PARALLELISM"] = str(workers > 1).lower()
                    tokens = sum(len(e.ids) for e in enc.tokenizer.encode_batch_fast(docs, add_special_tokens=False))
                else:
                    tokens = sum(map(len, enc.encode_ordinary_batch(docs, num_threads=workers)))
                times[who] = tuple(map(min, times[who], (time.perf_counter() - wall, cpu_s() - cpu)))
            (prepare_wall, prepare_cpu), (library_wall, library_cpu) = times["prepare"], times["library"]
            rows.append({"workers": workers, "prepare_tokens_per_s": tokens / prepare_wall,
                         "prepare_tokens_per_cpu_s": tokens / prepare_cpu, "library_tokens_per_s": tokens / library_wall,
                         "library_tokens_per_cpu_s": tokens / library_cpu, "per_core_ratio": library_cpu / prepare_cpu})
    print(f"data: {tokens:,} {enc.name.removesuffix('_offline')} tokens of standard-library source ({chars / 1e6:.1f} "
          f"MB, {len(docs):,} documents of up to {args.doc_chars} characters) on {os.cpu_count()} CPU cores; per "
          f"core: tokens per CPU-second of all processes and threads")
    print(f"{'workers':>7} | {'prepare tok/s':>13} | {'per core':>8} | {library + ' tok/s':>36} | {'per core':>8} | "
          f"per-core ratio")
    for r in rows:
        print(f"{r['workers']:>7} | {r['prepare_tokens_per_s'] / 1e6:12.2f}M | {r['prepare_tokens_per_cpu_s'] / 1e6:7.2f}"
              f"M | {r['library_tokens_per_s'] / 1e6:35.2f}M | {r['library_tokens_per_cpu_s'] / 1e6:7.2f}M | "
              f"{r['per_core_ratio']:.3f}")
    # the same text: prepare's tokens but for the end-of-text closing each document are the library's
    return {"command": "data", "tokenizer": args.tokenizer, "library": library, "tokens": tokens,
            "prepare_tokens": manifest["tokens"]["train"] - manifest["documents"]["train"], "rows": rows}


# ------------------------------------------------------------------------------------------------------------------
# Command line

class _Parser(train._Parser):
    """train.py's parser (a mistyped flag names the closest one), but a bad value is reported as such."""

    def error(self, message):
        if message.startswith("argument "):  # "argument --gpu: invalid choice: ...": the flag exists
            self.exit(2, f"{self.prog}: error: {message}\n")
        super().error(message)


def _bounded(kind, low: float, high: float = math.inf, low_open: bool = False):
    """An argparse type: `kind` of the text, refused with the range it must be in."""
    def parse(text: str):
        value = kind(text)
        if not (low < value if low_open else low <= value) or value > high:
            bounds = f"{'above' if low_open else 'at least'} {low:g}" + (f" and at most {high:g}" if high < math.inf
                                                                          else "")
            raise argparse.ArgumentTypeError(f"{text} must be {bounds}")
        return value
    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


def _command_parser(command: str) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of a command's own flags, and the train.py flags it defaults to."""
    description = {"step": "Time train.py's training step on synthetic tokens. Other commands: "
                           + ", ".join(COMMANDS) + " (bench.py COMMAND --help).",
                   "moe": COMMANDS["moe"] + ", forward + backward on one preset's shapes.",
                   "vs-hf": COMMANDS["vs-hf"] + " (forward, backward, clipping, AdamW), timed alternately.",
                   "plan": COMMANDS["plan"] + " (the preset defaults to large).", "plot": COMMANDS["plot"],
                   "data": COMMANDS["data"] + ", for 1 and 2 workers."}[command]
    parser = _Parser(prog=f"bench.py {command if command != 'step' else ''}".rstrip(), description=description,
                     allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                     epilog="Also takes every train.py flag (python train.py --help): --preset, model overrides such "
                            "as --dim=512, and the layout, batch and precision flags.")
    add = parser.add_argument
    switch = functools.partial(add, type=train._parse_bool, nargs="?", const=True, default=True)  # --flag[=false]
    if command == "plot":
        add("out_dir", help="a train.py --out_dir holding metrics.jsonl")
        return parser, []
    if command == "data":
        add("--tokenizer", default="cl100k_base", help="a tiktoken encoding or a Hugging Face tokenizer folder")
        add("--workers", type=_bounded(int, 1), nargs="+", default=[1, 2], help="the worker counts to measure; the "
            "library's batch encoder runs on as many threads")
        add("--mb", type=_bounded(float, 0, low_open=True), default=16, help="megabytes of text (the standard "
            "library's source, repeated as needed)")
        add("--doc_chars", type=_bounded(int, 1), default=4096, help="the text is cut into documents of whole "
            "paragraphs of up to this many characters, as data.py cuts plain text")
        add("--repeat", type=_bounded(int, 1), default=3, help="runs of each, alternated; the best counts")
        add("--json", action="store_true", help="print the result as one JSON object on the last line")
        return parser, []
    if command == "plan":
        add("--gpus", type=_bounded(int, 1), default=2048, help="world size")
        add("--dp_replicate", type=_bounded(int, 1), default=16, help="HSDP replicas")
        add("--ep", type=_bounded(int, 1), default=8, help="expert-parallel degree")
        add("--seq", "--seq_len", type=_bounded(int, 0), default=0, help="sequence length (0: the preset's)")
        add("--global_batch", type=_bounded(int, 0), default=0, help="sequences per step (0: one per GPU)")
        add("--micro_batch", type=_bounded(int, 1), default=1, help="sequences per GPU per forward")
        add("--gpu", choices=GPUS, default="b300",
            help="GPU kind: peak bf16 TFLOP/s, memory, NVLink, default network and HBM bandwidth")
        add("--ac", choices=parallel.AC_MODES, default="none", help="activation checkpointing")
        add("--grad_sync", choices=("last", "every"), default="every",
            help="gradient reduce-scatter under accumulation: every micro-batch (as train.py does) | last (unsharded "
                 "gradients held between micro-batches; not searched: train.py cannot run it)")
        add("--tokens", type=_bounded(float, 0, low_open=True), default=17e12, help="training token budget")
        add("--mfu", type=_bounded(float, 0, 1, low_open=True), default=0.4,
            help="the GPU's compute rate while it computes, as a fraction of its peak (communication is added by the "
                 "time model)")
        add("--tflops", default="", help="compute rate in TFLOP/s, or a saved `bench.py --json` result measured on "
            "the GPU (its tflops_per_device); overrides --mfu")
        add("--gpus_per_node", type=_bounded(int, 1), default=8, help="GPUs joined by NVLink")
        add("--nvlink_gbs", type=_bounded(float, 0), default=0, help="NVLink GB/s per GPU each way (0: the GPU kind's)")
        add("--net_gbs", type=_bounded(float, 0), default=0, help="network GB/s per GPU each way between nodes (0: "
            "the GPU kind's default, h100/h200/b200 50, b300 100)")
        add("--latency_us", type=_bounded(float, 0), default=5.0, help="microseconds per step of a collective")
        add("--hbm_gbs", type=_bounded(float, 0), default=0, help="GPU memory GB/s, for the optimizer's elementwise "
            "passes (0: the GPU kind's, h100 3350, h200 4800, b200/b300 8000)")
        switch("--search", help="also list the five fastest layouts that fit (--search=false: skip)")
    else:
        warmup, iters = {"step": (2, 5), "moe": (1, 5), "vs-hf": (1, 9)}[command]
        add("--warmup", type=_bounded(int, 0), default=warmup, help="untimed steps first")
        add("--iters", type=_bounded(int, 1), default=iters, help="timed steps")
        add("--threads", type=_bounded(int, 0), default=0, help="CPU threads for torch (0: torch's default); 1 gives "
            "steadier ratios on a machine others are using")
        add("--clock", choices=CLOCKS, default="wall",
            help="wall time, or the process's CPU time (CPU only; steadier when the machine is shared)")
    add("--json", action="store_true", help="print the result as one JSON object on the last line")
    if command == "step":
        add("--save", default="", metavar="PATH",
            help="write this run (times, components, kernel fingerprint, environment) as a baseline")
        add("--compare", default="", metavar="PATH", help="compare this run with a --save baseline of the same "
            "flags; exit 1 when the step is slower beyond the noise band and --tolerance")
        add("--tolerance", type=_bounded(float, 0), default=0.05,
            help="with --compare: the step slowdown accepted (a fraction) when the noise is smaller")
    if command == "moe":
        add("--tokens", type=_bounded(int, 1), default=2048, help="tokens through the layer (seq_len per row)")
        switch("--loop", help="also time the per-expert loop (--loop=false: skip it, it is slow at large shapes)")
    if command in ("step", "moe"):
        switch("--breakdown", help="also time the phases and profile the components (--breakdown=false: skip)")
    return parser, {"vs-hf": ["--global_batch=4", "--micro_batch=4"], "plan": ["--preset=large"]}.get(command, [])


def parse(argv: list[str]) -> tuple[str, argparse.Namespace, train.TrainConfig | None, dict]:
    """(command, bench flags, TrainConfig, model overrides) from the command line."""
    command = argv[0] if argv and not argv[0].startswith("-") else "step"
    if command != "step":
        argv = argv[1:]
        if command not in COMMANDS:
            close = difflib.get_close_matches(command, list(COMMANDS), n=1)
            raise SystemExit(f"bench.py: error: unknown command {command!r}"
                             f"{f'; did you mean {close[0]}?' if close else ''} (commands: {', '.join(COMMANDS)}, "
                             f"or none for the training step)")
    parser, train_defaults = _command_parser(command)
    if command in ("plot", "data"):
        return command, parser.parse_args(argv), None, {}
    args, rest = parser.parse_known_args(argv)
    own = [s for action in parser._actions for s in action.option_strings]
    for word in rest:
        flag = word.split("=")[0]
        if word.startswith("--") and flag not in TRAIN_FLAGS:
            close = difflib.get_close_matches(flag, own + TRAIN_FLAGS, n=1, cutoff=0.5)
            parser.exit(2, f"{parser.prog}: error: unknown flag {flag}"
                           f"{f'; did you mean {close[0]}?' if close else '; see --help'}\n")
    tc, overrides = train.parse_args(train_defaults + rest)
    return command, args, tc, overrides


def main(argv: list[str] | None = None) -> int:
    global clock
    command, args, tc, overrides = parse(sys.argv[1:] if argv is None else argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(getattr(args, "threads", 0) or threads)
    clock = CLOCKS[getattr(args, "clock", "wall")]
    try:
        if clock is not CLOCKS["wall"] and parallel.use_cuda():
            raise ValueError("--clock=cpu measures CPU work; on a GPU use the default --clock=wall.")
        if command == "plot":
            result = bench_plot(args.out_dir)
        elif command == "data":
            result = bench_data(args)
        else:
            run = {"step": bench_step, "moe": bench_moe, "plan": bench_plan, "vs-hf": bench_vs_hf}[command]
            result = run(args, tc, overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # main() may run inside another program (the tests)
    code = result.pop("exit", 0)
    if code and "reason" in result:
        print(f"error: {result['reason']}", file=sys.stderr)
    if getattr(args, "json", False) and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result, default=float))
    return code


if __name__ == "__main__":
    sys.exit(parallel.finish(main()))  # after main returned: the command's model is out of scope
