"""
Benchmarks and capacity planning: what a training step costs, where its time goes, and what a layout needs.

bench.py times the exact code path of train.py (train.train_step on a model from parallel.build_model, with the same
flags) on synthetic tokens. It is a tool: training never imports it.

    python bench.py --preset=tiny                        # the train step: ms/step, tokens/s, TFLOP/s, MFU, memory,
                                                         # forward/backward/optimizer split, time per component
    python bench.py --preset=tiny --dim=64 --iters=3 --json   # every train.py flag works (model, layout, --ac ...)
    python bench.py --preset=nano --save=base.json       # a baseline: times, components, kernels, versions
    python bench.py --preset=nano --compare=base.json    # after an upgrade: what moved; exit 1 if the step is slower
    torchrun --nproc_per_node=8 bench.py --dp_replicate=2 --ep=4 --global_batch=64
    python bench.py moe --preset=nano --tokens=2048      # one MoE layer: grouped GEMM vs per-expert loop vs dense
    torchrun --nproc_per_node=2 bench.py moe --preset=tiny   # ... plus the expert-parallel all-to-all path
    python bench.py plan --preset=large --gpus=2048 --dp_replicate=16 --ep=8 --seq=8192 --global_batch=12288 \
        --micro_batch=1 --gpu=b300 --ac=full --tokens=17e12 --mfu=0.4   # memory, traffic, step time, MFU, days and
                                                         # the five fastest layouts that fit; no allocation
    python bench.py plan --net_gbs=50 --tflops=h200.json # another network; compute rate from a saved --json result
    python bench.py vs-hf --preset=tiny                  # our train step vs transformers' AfmoeForCausalLM
    python bench.py vs-hf --dim=512 --n_heads=8 --head_dim=64 --n_experts=128 --top_k=8 --expert_hidden=128 \
        --vocab_size=4096                                # ... at a shape where the routed experts dominate
    python bench.py plot out                             # out/metrics.jsonl -> out/metrics.png (needs matplotlib)

`--json` prints the report as one JSON object on the last line. On a shared machine timings are noisy: compare the
ratios measured side by side in one run (moe_to_dense, speedup), not milliseconds from different runs, and add
`--threads=1 --clock=cpu` (two OpenMP threads on two busy cores can run 100x slower than one).
"""

import argparse
import contextlib
import dataclasses
import difflib
import functools
import importlib.metadata
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
from model import PRESETS, FeedForward, MoE, RMSNorm, grouped_mm_supported, head_chunk_rows, meta_model

COMMANDS = {"moe": "one MoE layer: grouped GEMM vs per-expert loop vs dense SwiGLU (and expert parallel)",
            "plan": "memory, traffic, step time and days for a model on a GPU layout, and the fastest layouts that "
                    "fit, without allocating anything",
            "vs-hf": "our training step vs transformers' AfmoeForCausalLM on the same config",
            "plot": "draw OUT_DIR/metrics.jsonl into OUT_DIR/metrics.png"}
TRAIN_FLAGS = (["--config"] + [f"--{f.name}" for f in dataclasses.fields(train.TrainConfig)]
               + [f"--{n}" for n in train.MODEL_FIELDS])


# ------------------------------------------------------------------------------------------------------------------
# Timing, memory and synthetic data

def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Wall time by default; `--clock=cpu` reads the process's CPU time instead, which a busy shared machine inflates far
# less (use it with --threads=1: idle OpenMP threads spin, and that counts as CPU time too).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def timed_ms(fn, device: torch.device, read=None) -> float:
    read = read or clock
    sync(device)
    t0 = read()
    fn()
    sync(device)
    return (read() - t0) * 1e3


def spread(ms: list[float]) -> dict:
    """Median and spread of per-step times."""
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms), "ms_p25": q[0], "ms_p75": q[2],
            "iters": len(ms)}


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the allocator's peak since the last reset. CPU: the process's peak resident set (Linux reports KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synthetic_batch(vocab_size: int, global_batch: int, seq_len: int, rank: int, world: int, seed: int,
                    docs_per_row: int = 4):
    """This rank's rows of a random global batch, as train.py's loader returns them: (tokens, targets, doc ids), each
    [B, T]; every row holds `docs_per_row` documents split at random positions."""
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(0, vocab_size, (global_batch, seq_len + 1), generator=g)
    starts_BT = torch.zeros(global_batch, seq_len, dtype=torch.long)
    n_cuts = min(docs_per_row, seq_len) - 1
    if n_cuts > 0:
        cuts = torch.rand(global_batch, seq_len - 1, generator=g).topk(n_cuts, dim=1).indices + 1
        starts_BT.scatter_(1, cuts, 1)
    rows = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
    return tokens_BT[rows, :-1], tokens_BT[rows, 1:], starts_BT.cumsum(1)[rows]


def model_config(tc: train.TrainConfig, overrides: dict):
    """train.model_config, with the preset's vocabulary instead of a tokenizer's (--vocab_size overrides it)."""
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

SCOPE = "bench::"
PHASE = "train_step::"  # the ranges train.train_step marks its phases with
COMM_MARKERS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "reducescatter",
                "all_to_all", "alltoall", "record_param_comms", "nccl:", "gloo:", "FSDP::")
STEP_LABELS = ("grad clip", "expert-bias update")  # train_step's phases that are components of their own


def _in_range(fn, name: str):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return run


@contextlib.contextmanager
def wrapped(targets):
    """Wrap each (object, attribute, label) callable in a profiler range `bench::label` for the duration, as an
    instance attribute (the way parallel.apply_ac wraps block.forward), and restore it afterwards."""
    originals = []
    try:
        for obj, attr, label in targets:
            originals.append((obj, attr, attr in vars(obj), getattr(obj, attr)))
            setattr(obj, attr, _in_range(originals[-1][3], SCOPE + label))
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
    # The head's matmul and the cross-entropy are one fused autograd function (model.head_loss): one component.
    # Compiled blocks are fused graphs, not wrapped: their work lands in the model's own range.
    targets = [(model, "forward", "masks, RoPE tables" if blocks else "compiled blocks, masks, RoPE tables"),
               (model.embed, "forward", "embedding"), (model.norm, "forward", "final norm"),
               (model, "head_loss", "output head, cross-entropy")]
    for block in model.layers.values() if blocks else ():
        targets += [(block, "forward", "residual adds"), (block.attn, "forward", "attention")]
        targets += [(norm, "forward", "norms")
                    for norm in (block.attn_norm, block.attn_post_norm, block.ffn_norm, block.ffn_post_norm)]
        targets += moe_targets(block.ffn) if isinstance(block.ffn, MoE) else [(block.ffn, "forward", "dense FFN")]
    return targets


def attribute(events, on_device: bool, steps: int) -> tuple[dict, dict, dict]:
    """Self time of every profiled op, attributed to the innermost bench:: range around it (or train_step's grad clip
    and expert-bias update ranges); a backward op to the range of the forward op that created its autograd node
    (matched by sequence number). Returns ({label: {fwd, bwd, total}} in ms per step, {label: {name: [calls, ms]}
    per step}, {phase: ms per step}): the second is each component's fingerprint, the device kernels its ops launched
    (on a GPU) or the CPU ops it ran, by name; the third the same time by train_step's phases, in step order (a
    backward op in "backward" wherever autograd runs it, an op outside every phase in "other")."""
    def self_us(e):
        return e.self_device_time_total if on_device else e.self_cpu_time_total

    def owner(e):
        while e is not None:
            name = e.name
            if name.startswith(SCOPE) or name.startswith(PHASE) and name[len(PHASE):] in STEP_LABELS:
                label = name.split("::", 1)[1]
                return label, "total" if label in STEP_LABELS else "fwd"
            if name.startswith("Optimizer."):
                return "optimizer", "total"
            if any(m in name for m in COMM_MARKERS):
                return "communication", "total"
            if name.startswith("autograd::engine::evaluate_function"):
                return None, e
            e = e.cpu_parent
        return "other", "total"

    def phase(e):
        while e is not None:
            if e.name.startswith(PHASE):
                return e.name[len(PHASE):]
            if e.name.startswith("autograd::engine::evaluate_function"):
                return "backward"
            e = e.cpu_parent
        return "other"

    resolved, forward_of = [], {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        label, where = owner(e)
        if label is not None and e.sequence_nr >= 0:
            # Ops that create no autograd node still record the next sequence number; the op that creates the
            # node is the last one to record it, so later events overwrite earlier ones.
            forward_of[(e.thread, e.sequence_nr)] = label
        resolved.append((e, label, where))
    table = defaultdict(lambda: {"fwd": 0.0, "bwd": 0.0, "total": 0.0})
    ops = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    phases = defaultdict(float)
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
    return dict(table), {label: dict(kernels) for label, kernels in ops.items()}, dict(phases)


def merged(ops: dict, scale: float = 1.0) -> dict:
    """{name: [calls, ms]} summed over the fingerprints {key: {name: [calls, ms]}} and scaled: over a step's
    components, the step's fingerprint; over several profiled steps, with 1/steps, their mean."""
    out = defaultdict(lambda: [0.0, 0.0])
    for kernels in ops.values():
        for name, (calls, ms) in kernels.items():
            out[name][0] += calls * scale
            out[name][1] += ms * scale
    return {name: [round(calls, 3), ms] for name, (calls, ms) in out.items()}


def profile(fn, device: torch.device, targets, steps: int = 1) -> tuple[dict, dict, float, dict]:
    """Run fn `steps` times under the profiler with `targets` wrapped; returns (components, ops, wall ms per step,
    phases)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with wrapped(targets), torch.profiler.profile(activities=activities) as prof:
        wall = sum(timed_ms(fn, device, time.perf_counter) for _ in range(steps)) / steps  # as the profiler's
    table, ops, phases = attribute(prof.events(), device.type == "cuda", steps)
    return table, ops, wall, phases


def median_profile(runs: list) -> tuple[dict, dict, float, dict]:
    """Several profile() results as one: each component's median times, and the median and quartiles of its share of
    the profiled step (profiled times are wall times, which a busy machine stretches in every component alike), each
    kernel's mean calls and time, the median wall time, each phase's median time."""
    zero = {"fwd": 0.0, "bwd": 0.0, "total": 0.0}
    table = {}
    for label in set().union(*(t for t, _, _, _ in runs)):
        rows = [t.get(label, zero) for t, _, _, _ in runs]
        q = spread([t.get(label, zero)["total"] / wall for t, _, wall, _ in runs])
        table[label] = {k: statistics.median(row[k] for row in rows) for k in zero}
        table[label] |= {"share": q["ms_median"], "share_p25": q["ms_p25"], "share_p75": q["ms_p75"]}
    labels = set().union(*(ops for _, ops, _, _ in runs))
    kernels = {label: merged({i: ops.get(label, {}) for i, (_, ops, _, _) in enumerate(runs)}, 1 / len(runs))
               for label in labels}
    order = sorted(dict.fromkeys(label for *_, p in runs for label in p), key=lambda label: label == "other")
    phases = {label: statistics.median(p.get(label, 0.0) for *_, p in runs) for label in order}
    return table, kernels, statistics.median(wall for _, _, wall, _ in runs), phases


def print_components(table: dict, wall_ms: float, say, what: str):
    say(f"where the time goes ({what}; profiler self time per op, a backward op charged to the component whose forward "
        f"created it, recomputation under AC counted as forward; the output head's gradients are made in its "
        f"forward):")
    say(f"  {'component':34s} {'fwd ms':>9s} {'bwd ms':>9s} {'total ms':>9s} {'share':>6s}")
    for label, row in sorted(table.items(), key=lambda kv: -kv[1]["total"]):
        share = 100 * row["total"] / wall_ms
        say(f"  {label:34s} {row['fwd']:9.2f} {row['bwd']:9.2f} {row['total']:9.2f} {share:5.1f}%")
    accounted = sum(row["total"] for row in table.values())
    say(f"  {'(python, gaps: wall - profiled)':34s} {'':9s} {'':9s} {wall_ms - accounted:9.2f}"
        f" {100 * (wall_ms - accounted) / wall_ms:5.1f}%   of {wall_ms:.1f} ms profiled")


# ------------------------------------------------------------------------------------------------------------------
# bench.py [train flags]: the training step

def bench_step(args, tc: train.TrainConfig, overrides: dict) -> dict:
    rank, world, device = parallel.init_distributed()
    torch.manual_seed(tc.seed)
    run = train.Run.on(tc, model_config(tc, overrides), rank, world, device)
    cfg, layout, autocast, dtype, say = run.cfg, run.layout, run.autocast, run.dtype, run.say
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
        f"compile={tc.compile}, {dtype or torch.float32} on {world} x {device.type}")
    say(layout.describe(cfg.n_experts))

    def step():
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(state.step, tc)
        train.train_step(model, optimizer, batch, tc, autocast, state)
        state.step += 1

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = [timed_ms(step, device) for _ in range(args.iters)]
    result = {"command": "step", "preset": tc.preset, "world": world, "device": device_name(device),
              "params": n["total"], "active_params": n["active"], "flops_per_token": flops_per_token,
              "tokens_per_step": tc.global_batch * tc.seq_len, **spread(ms)}
    tok_s = tc.global_batch * tc.seq_len / (result["ms_median"] / 1e3)
    peak = train.peak_tflops(device, tc.peak_tflops)
    tflops = flops_per_token * tok_s / world / 1e12
    result.update(tokens_per_s=tok_s, tokens_per_s_per_device=tok_s / world, tflops_per_device=tflops,
                  mfu=tflops / peak if peak else None, peak_tflops=peak,
                  peak_mem_gib=max_over_ranks(peak_memory_bytes(device)) / 2**30,
                  peak_mem_kind="CUDA max_memory_allocated" if device.type == "cuda" else "process peak RSS")
    say(f"step: median {result['ms_median']:.1f} ms (min {result['ms_min']:.1f}, p25 {result['ms_p25']:.1f}, p75 "
        f"{result['ms_p75']:.1f}, max {result['ms_max']:.1f}) over {args.iters} steps after {args.warmup} warm-up")
    mfu = "n/a" if peak is None else f"{100 * result['mfu']:.1f}% of {peak:g} TFLOP/s"
    say(f"throughput: {tok_s:,.0f} tokens/s in total, {tok_s / world:,.0f} per device; "
        f"{tflops:.3f} TFLOP/s per device; MFU {mfu}")
    say(f"peak memory: {result['peak_mem_gib']:.2f} GiB per device ({result['peak_mem_kind']}, max over ranks)")
    if args.breakdown:
        runs = [profile(step, device, model_targets(model, blocks=not tc.compile)) for _ in range(min(5, args.iters))]
        table, kernels, wall, result["phases_ms"] = median_profile(runs)
        total = sum(result["phases_ms"].values())
        say(f"phases (the median of {len(runs)} profiled training steps: profiler self time per op in each of "
            f"train_step's ranges, backward ops wherever autograd runs them; FSDP all-gathers and reduce-scatters run "
            f"inside forward and backward; forward includes the output head's gradients, which the fused loss "
            f"computes with the loss):")
        for label, v in result["phases_ms"].items():
            say(f"  {label:34s} {v:9.2f} ms {100 * v / total:5.1f}%")
        result.update(components_ms=table, kernels=kernels, step_kernels=merged(kernels))
        print_components(table, wall, say, f"the median of {len(runs)} profiled training steps"
                         + (", the compiled blocks not split" if tc.compile else ""))
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
    for key in ("kernels", "step_kernels"):  # kept in the --save file, too long for the --json line
        result.pop(key, None)
    return result


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


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
    b = torch.backends
    env = {"torch": torch.__version__, "device": device_name(device),
           "float32 matmul precision": torch.get_float32_matmul_precision()}
    env |= {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()
            if (d.metadata["Name"] or "").lower().startswith(("triton", "pytorch-triton", "nvidia-cublas",
                                                             "nvidia-cudnn", "nvidia-nccl"))}
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
    """The kernels ({name: [calls, ms]}) that appeared, disappeared, or changed calls or by at least min_ms; the
    `top` largest of each."""
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
    """The verdict on step result `new` against the baseline `old` of the same configuration. The noise band of a
    median is half of each run's interquartile range, added: either median may sit that far from its truth. exit 1:
    the step is slower by more than both the band and `tolerance`. A component's time is its share of the profiled
    step times the timed step; it moved when that changed by more than its own band (from its shares' quartiles) and
    by more than `tolerance` of the step. Its kernels that appeared, disappeared, or changed calls or by a tenth of
    its change in profiled time are named."""
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

def init_(module: nn.Module, std: float):
    """Truncated normal on [-3σ, 3σ], as Transformer.init_weights does."""
    with torch.no_grad():
        for p in module.parameters():
            nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)


def fwd_bwd(module, x_BTD, dy_BTD, autocast):
    """One forward and backward of a layer, the way training runs it: the MoE's balance losses join the loss."""
    x_BTD = x_BTD.detach().requires_grad_()
    with autocast:
        y_BTD, (_, aux_loss, z_loss) = module(x_BTD) if isinstance(module, MoE) else (module(x_BTD), (None, 0, 0))
        loss = (y_BTD.float() * dy_BTD).sum() + aux_loss + z_loss
    loss.backward()
    return y_BTD.detach(), x_BTD.grad


def bench_moe(args, tc: train.TrainConfig, overrides: dict) -> dict:
    rank, world, device = parallel.init_distributed()
    say = print if rank == 0 else (lambda *a, **k: None)
    autocast, dtype = train.autocast_for(tc, device)
    cfg = model_config(tc, overrides)
    N = args.tokens
    T = min(tc.seq_len, N)
    if N % T:
        raise ValueError(f"--tokens={N} is not a multiple of --seq_len={T}; the balance loss works per sequence.")
    D, E, K, I = cfg.dim, cfg.n_experts, cfg.top_k, cfg.expert_hidden
    shared_hidden = I * cfg.n_shared_experts
    torch.manual_seed(tc.seed)
    if device.type == "cpu":
        with torch.device("meta"):
            parallel.check_host_memory(MoE(cfg), copies=2, what="one MoE layer's weights and their gradients")
    moe = MoE(cfg).to(device)
    init_(moe, cfg.init_std)
    # The dense SwiGLU does about the MoE layer's active matmul FLOPs: k routed experts, the shared expert and the
    # router, whose D x E matmul costs what E/3 more hidden units of a SwiGLU do. Its width is rounded up to a
    # multiple of 128, where bf16 GEMMs run at full speed (an odd width runs several times slower on a GPU), and
    # the ratio below is per FLOP.
    active_hidden = K * I + shared_hidden + E / 3
    dense_hidden = 128 * math.ceil(active_hidden / 128)
    dense = FeedForward(D, dense_hidden).to(device)
    init_(dense, cfg.init_std)
    torch.manual_seed(tc.seed + 1 + rank)  # each rank its own tokens (the expert-parallel path mixes them)
    x_BTD = torch.randn(N // T, T, D, device=device)
    dy_BTD = torch.randn(N // T, T, D, device=device)
    flops = 6 * N * D * 3 * active_hidden  # fwd + bwd of the active matmuls
    say(f"moe: {tc.preset} shapes d_model {D}, {E} experts top-{K}, expert hidden {I}, shared hidden {shared_hidden}; "
        f"{N} tokens ({N // T} x {T}); {dtype or torch.float32} on {device_name(device)}; the same active FLOPs as a "
        f"dense SwiGLU of hidden {active_hidden:.0f} (router {100 * E / (3 * active_hidden):.0f}% of them); the dense "
        f"comparator is {dense_hidden} wide")

    ep_moe = None

    def variant(impl):
        def run():
            if impl in ("grouped", "loop"):
                moe.experts.impl = impl
            module = {"dense": dense, "ep": ep_moe}.get(impl, moe)
            module.zero_grad(set_to_none=True)
            return fwd_bwd(module, x_BTD, dy_BTD, autocast)
        return run

    why_not = grouped_mm_supported(x_BTD.to(dtype or x_BTD.dtype), moe.experts.gate_up_proj, moe.experts.down_proj)
    if why_not:
        raise ValueError(f"the grouped GEMM path cannot run here: {why_not}.")
    variants = ["grouped", "loop", "dense"] if args.loop else ["grouped", "dense"]
    y_g, dx_g = variant("grouped")()
    if args.loop:  # grouped == loop on the same tokens: outputs, input gradients and expert weight gradients
        grads_g = [p.grad.clone() for p in moe.experts.parameters()]
        (y_l, dx_l), grads_l = variant("loop")(), [p.grad.clone() for p in moe.experts.parameters()]
        diff = max((a - b).abs().max().item() for a, b in [(y_g, y_l), (dx_g, dx_l), *zip(grads_g, grads_l)])
        diff /= max(t.abs().max().item() for t in [y_l, dx_l, *grads_l])
    if world > 1:  # expert parallel over all ranks, on the same weights (same seed) and this rank's tokens
        layout = parallel.Layout(world, 1, world)
        layout.check(cfg, world, 1)
        ep_moe = MoE(cfg).to(device)
        ep_moe.load_state_dict(moe.state_dict())
        ep_moe.experts = parallel.ExpertParallelExperts(ep_moe.experts, parallel.build_mesh(layout, device.type)["ep"])
        ep_moe.experts.impl = "grouped"
        y_ep, _ = variant("ep")()
        ep_diff = (y_ep - y_g).abs().max().item()
        variants.append("ep")
    times = defaultdict(list)
    for i in range(args.warmup + args.iters):
        for name in variants:  # alternate, so drifting machine load hits every variant alike
            ms = timed_ms(variant(name), device)
            if i >= args.warmup:
                times[name].append(ms)
    result = {"command": "moe", "preset": tc.preset, "tokens": N, "device": device_name(device),
              "active_hidden": active_hidden, "dense_hidden": dense_hidden}
    for name in variants:
        result[f"{name}_ms"] = max_over_ranks(statistics.median(times[name]))
        result[f"{name}_ms_min"] = min(times[name])
    dense_ms_per_active = result["dense_ms"] * active_hidden / dense_hidden  # the dense time at the MoE's FLOPs
    result["moe_to_dense"] = result["grouped_ms"] / dense_ms_per_active
    for name in variants:
        if name != "ep":
            done = flops * (dense_hidden / active_hidden if name == "dense" else 1)  # the dense one does a bit more
            say(f"  {name:8s} fwd+bwd median {result[f'{name}_ms']:9.2f} ms (min {result[f'{name}_ms_min']:.2f})  "
                f"{done / result[f'{name}_ms'] / 1e6:8.1f} GFLOP/s")
    say(f"MoE (grouped) / dense: {result['moe_to_dense']:.2f}x, the cost of sparsity at these shapes")
    if args.loop:
        result.update(loop_to_dense=result["loop_ms"] / dense_ms_per_active, grouped_vs_loop_max_diff=diff)
        say(f"per-expert loop / dense: {result['loop_to_dense']:.2f}x; grouped == loop to {diff:.1e} (relative)")
    if ep_moe is not None:
        result["ep_overhead"] = result["ep_ms"] / result["grouped_ms"]
        result["ep_vs_local_max_diff"] = max_over_ranks(ep_diff)
        say(f"expert parallel over {world} ranks: {result['ep_ms']:.2f} ms vs {result['grouped_ms']:.2f} ms local on "
            f"the same tokens: dispatch overhead {result['ep_overhead']:.2f}x (max over ranks; outputs agree to "
            f"{result['ep_vs_local_max_diff']:.1e})")
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

# Per GPU kind: dense bf16 peak (TFLOP/s), memory (GiB), NVLink bandwidth per GPU each way and the default network
# bandwidth per GPU each way (GB/s) of an 8-GPU node with one NIC per GPU (line rates; measured NCCL bus bandwidth
# is typically 80-90% of them: pass it with --nvlink_gbs / --net_gbs).
GPUS = {"h100": (train.PEAK_TFLOPS["H100"], 80, 450, 50),    # NVLink 4 (900 GB/s both ways), 400 Gb/s NIC
        "h200": (train.PEAK_TFLOPS["H200"], 141, 450, 50),   # NVLink 4, 400 Gb/s NIC
        "b200": (train.PEAK_TFLOPS["B200"], 180, 900, 50),   # NVLink 5 (1.8 TB/s both ways), 400 Gb/s NIC
        "b300": (train.PEAK_TFLOPS["B300"], 288, 900, 100)}  # NVLink 5, 800 Gb/s NIC (ConnectX-8)
# A plan fits when its prediction leaves 10% of the GPU for what it does not model: the CUDA context, NCCL buffers,
# allocator fragmentation, EP load imbalance.
FIT_FRACTION = 0.9
AG, RS, AR, A2A = "FSDP all-gather", "FSDP reduce-scatter", "HSDP all-reduce across replicas", "EP all-to-all"


def activation_bytes(cfg, seq: int, micro_batch: int, c: int = 2, ep: int = 1) -> dict:
    """Activation bytes of one micro-batch per AC mode: {"saved": kept for backward, "peak": saved plus the largest
    transient (the head's at the loss, or one block re-materialised by AC)}.

    Per token, with c bytes per compute element (2 bf16, 4 fp32), flash-style attention (no T x T matrix; the boolean
    masks of CPU's exact path are not counted) and balanced routing (an EP rank receives K tokens per token):
      RMSNorm of width w             cw + 4  its input and one fp32 scale per row
      attention                      cD (pre-norm output, the q/k/v/gate input) + c(Hd + Gd) + 4(H + G) (q/k norms)
                                     + c(Hd + 2Gd) (q, k, v) + c·Hd + 4H (output, fp32 log-sum-exp)
                                     + 3c·Hd (output reshaped, sigmoid(gate), their product = o_proj input)
      SwiGLU of hidden F             4cF     gate (silu input), silu output, up, product (down input)
      router                         8E      fp32 logits (z-loss) and sigmoid scores (gates, balance loss)
                                     + 4D    its input cast to fp32 (with c = 4 it shares the FFN input)
      routed experts, per K pairs    c(D + 5I) + 20: gathered input, gate_up output (2I), silu output, product,
                                     product x gate (the down input); the fp32 gate; two int64 index vectors
      block                          4 norms of D, cD FFN input, attention, then SwiGLU or router + experts + shared
      head                           cD + 4 + cD   final norm, and the head input's gradient, which
                                     model.head_cross_entropy computes in forward along with the weight's
    and per micro-batch the head weight's fp32 gradient 4VD; at the loss a transient of one chunk of R rows of
    logits (model.head_chunk_rows on a GPU), 4RV fp32, plus with c = 2 the chunk's logits and gradient 2cRV and the
    bf16 weight copy and chunk product of the weight gradient 2cVD.
    selective AC keeps the block input and the outputs of matmuls, attention and all-to-alls (parallel._sac_policy):
      cD + c(2Hd + 2Gd) + c·Hd + 4H + cD, then SwiGLU c(2F + D) or router 4E + experts K·c(2I + D)
      + shared c(2Is + D) + 2K·cD with ep > 1; full AC keeps the block input cD."""
    D, H, G, Dh, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    E, K, I, Is = cfg.n_experts, cfg.top_k, cfg.expert_hidden, cfg.expert_hidden * cfg.n_shared_experts
    Hd, Gd = H * Dh, G * Dh
    attn = c * D + c * (Hd + Gd) + 4 * (H + G) + c * (Hd + 2 * Gd) + c * Hd + 4 * H + 3 * c * Hd
    attn_sel = c * (2 * Hd + 2 * Gd) + c * Hd + 4 * H + c * D
    experts = (4 * D if c == 2 else 0) + 8 * E + K * (c * (D + 5 * I) + 20) + 4 * c * Is
    experts_sel = 4 * E + K * c * (2 * I + D) + c * (2 * Is + D) + (2 * K * c * D if ep > 1 else 0)
    full_layer, sel_layer = [], []
    for layer in range(cfg.n_layers):
        moe = cfg.is_moe(layer)
        full_layer.append(4 * (c * D + 4) + c * D + attn + (experts if moe else 4 * c * cfg.dense_hidden))
        sel_layer.append(c * D + attn_sel + (experts_sel if moe else c * (2 * cfg.dense_hidden + D)))
    tokens = micro_batch * seq
    head = (c * D + 4) + c * D
    R = min(tokens, head_chunk_rows(V, torch.device("cuda")))
    head_transient = 4 * R * V + (2 * c * R * V + 2 * c * V * D if c < 4 else 0)
    saved = {"none": sum(full_layer) + head, "selective": sum(sel_layer) + head,
             "full": cfg.n_layers * c * D + head}
    recompute = max(full_layer)
    kept = {mode: tokens * saved[mode] + 4 * V * D for mode in parallel.AC_MODES}
    return {mode: {"saved": kept[mode], "peak": kept[mode] + max(head_transient, 0 if mode == "none" else
                                                                    tokens * recompute)}
            for mode in parallel.AC_MODES}


@dataclasses.dataclass
class Links:
    """How GPUs talk: nodes of `per_node` GPUs joined by NVLink at `intra` bytes/s per GPU each way, nodes joined by
    the network at `inter` bytes/s per GPU each way (one NIC per GPU), `latency` seconds per step of a collective."""
    per_node: int = 8
    intra: float = 900e9
    inter: float = 100e9
    latency: float = 5e-6

    def span(self, stride: int, size: int) -> tuple[int, int]:
        """(ranks per node, nodes) of a group of `size` ranks `stride` apart, in build_mesh's rank order (row-major
        over [dp_replicate, efsdp, ep]): EP groups are consecutive ranks, FSDP groups consecutive blocks of dp_shard
        ranks, expert FSDP groups every ep-th rank of a block, replicas dp_shard ranks apart."""
        nodes = len({i * stride // self.per_node for i in range(size)})
        return size // nodes, nodes

    def ring_s(self, nbytes: float, group: tuple[int, int]) -> float:
        """An all-gather or reduce-scatter of an `nbytes` buffer (the unsharded size) over a group of k ranks on each
        of m nodes, hierarchically: a ring over NVLink inside each node, then a ring over the m nodes in which each
        of the k GPUs carries 1/k of the buffer through its own NIC (what NCCL's rings over rail-aligned NICs reach:
        a node's k NICs together)."""
        k, m = group
        s = nbytes * (k - 1) / k / self.intra + (k - 1) * self.latency
        return s + (nbytes / k * (m - 1) / m / self.inter + (m - 1) * self.latency if m > 1 else 0)

    def seconds(self, kind: str, nbytes: float, group: tuple[int, int]) -> float:
        """One collective of `kind` on an `nbytes` buffer (an all-reduce: a reduce-scatter, then an all-gather)."""
        if kind == A2A:
            return self.all_to_all_s(nbytes, group)
        return self.ring_s(nbytes, group) * (2 if kind == AR else 1)

    def all_to_all_s(self, nbytes: float, group: tuple[int, int]) -> float:
        """Each rank sends `nbytes` spread evenly over the group's n = km ranks: (k-1)/n of it over NVLink and
        (n-k)/n over the network at the same time, one step per peer."""
        k, m = group
        n = k * m
        return max(nbytes * (k - 1) / n / self.intra, nbytes * (n - k) / n / self.inter) + (n - 1) * self.latency


def sent_bytes(nbytes: float, group: tuple[int, int], kind: str) -> tuple[float, float]:
    """(bytes a GPU sends, of which over the network) for one collective on an `nbytes` buffer (all-reduce: the
    ring reduce-scatter then all-gather, twice a ring's)."""
    k, m = group
    n = k * m
    if kind == A2A:
        return nbytes * (n - 1) / n, nbytes * (n - k) / n
    twice = 2 if kind == AR else 1
    return twice * nbytes * (n - 1) / n, twice * nbytes * (m - 1) / n


_FACTS = {}


@functools.lru_cache(maxsize=None)
def shard(unit: tuple, shards: int) -> int:
    """Elements of one rank's shard of an FSDP unit (its parameter shapes): FSDP2 shards dim 0, padding it to a
    multiple of the shard count."""
    return sum(-(-shape[0] // shards) * math.prod(shape[1:]) for shape in unit)


def model_facts(cfg) -> dict:
    """What planning needs from a meta-device model, built once per config: parameter shapes of each FSDP unit,
    matmul FLOPs per token of each block (attention's at `seq` added later) and of the output head, counts."""
    key = repr(cfg)
    if key not in _FACTS:
        model = meta_model(cfg)
        norms = {id(p) for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
        share = cfg.top_k / cfg.n_experts  # a token passes through k of the E routed experts

        def matmul_flops(block):  # 6 per weight a token touches: forward 2, backward 4
            return 6 * sum(p.numel() * (share if ".experts." in f".{n}" else 1)
                           for n, p in block.named_parameters() if id(p) not in norms)

        blocks = list(model.layers.values())
        _FACTS[key] = {
            "root": tuple(tuple(p.shape) for name, p in model.named_parameters() if not name.startswith("layers.")),
            "blocks": [tuple(tuple(p.shape) for name, p in b.named_parameters() if ".experts." not in f".{name}")
                       for b in blocks],
            "experts": [tuple(tuple(p.shape) for p in (b.ffn.experts.gate_up_proj, b.ffn.experts.down_proj))
                        if isinstance(b.ffn, MoE) else () for b in blocks],
            "block_flops": [matmul_flops(b) for b in blocks],
            "params": model.num_params(), "flops_per_token": functools.lru_cache(model.flops_per_token)}
    return _FACTS[key]


def plan(cfg, layout: parallel.Layout, seq: int, micro_batch: int, global_batch: int, ac: str = "none",
         compute_bytes: int = 2, grad_sync: str = "every", keep_gathered: bool = False,
         links: Links | None = None, detail: bool = True) -> dict:
    """Per-GPU memory (bytes), FLOPs per token, the collectives of one optimizer step and the bytes they send for
    `cfg` on `layout`, as parallel.py shards it: FSDP units are each block's dense parameters and the root
    (embedding, final norm, head) over dp_shard = S ranks, and each MoE layer's routed experts, E/ep per EP rank,
    over efsdp = S/ep ranks; replicated dp_replicate times. Mixed precision as train.py on GPU: fp32 master weights,
    gradients and AdamW state; compute copies in `compute_bytes`; gradients reduced in fp32. `grad_sync`: "every" as
    train.train_step does (reduce-scatter each micro-batch, all-reduce across replicas on the last), "last" (FSDP2's
    set_requires_gradient_sync on the last micro-batch only, which keeps every unit's unsharded fp32 gradients
    between micro-batches). `keep_gathered`: train.py --keep_gathered (parameters gathered once per step and kept
    until the last micro-batch's backward) instead of FSDP2's default (a block gathered in forward, freed, gathered
    again in backward, every micro-batch; the root kept from forward to backward). detail=False stops after the
    memory (the search's first filter). Each unit's collectives come with their seconds on `links`."""
    layout.check(cfg, global_batch, micro_batch)
    facts, links = model_facts(cfg), links or Links()
    W, R, S, Fs, ep = layout.world, layout.dp_replicate, layout.dp_shard, layout.efsdp, layout.ep
    c, accum = compute_bytes, layout.accumulation_steps(global_batch, micro_batch)

    experts = [tuple((cfg.n_experts // ep, *s[1:]) for s in unit) for unit in facts["experts"]]
    params = shard(facts["root"], S) + sum(shard(u, S) for u in facts["blocks"]) + sum(shard(u, Fs) for u in experts)
    # Unsharded elements of each unit as FSDP gathers it (every shard padded alike): dense units over S, experts
    # over Fs.
    root_full = S * shard(facts["root"], S)
    block_full = [S * shard(u, S) for u in facts["blocks"]]
    expert_full = [Fs * shard(u, Fs) for u in experts]
    largest = max(block_full + expert_full)
    memory = {"parameters (fp32 master shards)": 4 * params, "gradients (fp32 shards)": 4 * params,
              "optimizer (AdamW m, v in fp32)": 8 * params}
    if W > 1:
        if keep_gathered:
            memory["every unit gathered (compute copies)"] = c * (root_full + sum(block_full) + sum(expert_full))
        else:  # FSDP2 keeps the root unsharded from forward to backward; a block gathered while the next is prefetched
            memory["FSDP all-gather buffers (compute copies)"] = c * (root_full + 2 * largest)
        # Backward: a unit's unsharded gradients in compute dtype plus their fp32 copy for the reduce-scatter.
        memory["FSDP reduce-scatter buffers"] = (c + 4) * max(root_full, largest)
        if grad_sync == "last" and accum > 1:
            memory["unsharded gradients held across micro-batches"] = 4 * (root_full + sum(block_full)
                                                                           + sum(expert_full))
    acts = activation_bytes(cfg, seq, micro_batch, c, ep)
    memory[f"activations (ac={ac}, peak)"] = acts[ac]["peak"]
    if not detail:
        return {"memory_bytes": memory, "memory_total_bytes": sum(memory.values())}

    # The collectives, per FSDP unit in forward order (the root first): (kind, buffer bytes, (ranks per node, nodes)).
    g_dense, g_expert = links.span(1, S), links.span(ep, Fs)
    g_replica, g_ep = links.span(S, R), links.span(1, ep)
    tokens = micro_batch * seq
    # One MoE layer's all-to-alls in one direction: tokens out and results back (D wide, compute dtype) and the
    # fp32 gates with the tokens; forward also sends the int64 counts first.
    pairs = tokens * cfg.top_k
    a2a = [pairs * cfg.dim * c, pairs * 4, pairs * cfg.dim * c]
    attn_flops = 12 * cfg.n_heads * cfg.head_dim  # per token and context position
    units, made = [], {}  # units of the same sizes share their collectives (most blocks are alike)
    for full, unit_expert, (i, block_flops) in zip([root_full] + block_full, [0] + expert_full,
                                                   [(-1, 0)] + list(enumerate(facts["block_flops"]))):
        if (full, unit_expert) not in made:
            moe = unit_expert > 0
            comm = made[full, unit_expert] = {
                "gather": [(AG, c * full, g_dense)] + ([(AG, c * unit_expert, g_expert)] if moe else []),
                "reduce": [(RS, 4 * full, g_dense)] + ([(RS, 4 * unit_expert, g_expert)] if moe else []),
                "all_reduce": [(AR, 4 * full // S, g_replica)] + ([(AR, 4 * unit_expert // Fs, g_replica)]
                                                                  if moe else []),
                "a2a_fwd": [(A2A, b, g_ep) for b in [8 * cfg.n_experts] + a2a] if moe and ep > 1 else [],
                "a2a_bwd": [(A2A, b, g_ep) for b in a2a] if moe and ep > 1 else []}
            for part in list(comm):
                comm[f"{part}_s"] = sum(links.seconds(*collective) for collective in comm[part])
        ctx = 0 if i < 0 else (seq if cfg.is_global(i) else min(cfg.window, seq))
        units.append({**made[full, unit_expert], "flops": block_flops + attn_flops * ctx})
    model_flops = facts["flops_per_token"](seq)
    head_flops = model_flops - sum(u["flops"] for u in units)  # the output head's matmuls (the root's)

    # How often each happens in one optimizer step.
    counts = {"gather": accum if not keep_gathered else 1, "regather": 0 if keep_gathered else accum,
              "reduce": accum if grad_sync == "every" else 1, "all_reduce": 1,
              "a2a": accum * (2 if ac == "full" else 1)}  # full AC repeats the forward's in backward
    times = {"gather": counts["gather"] + counts["regather"], "reduce": counts["reduce"],
             "all_reduce": counts["all_reduce"], "a2a_fwd": counts["a2a"], "a2a_bwd": accum}
    traffic = defaultdict(lambda: [0.0, 0.0])  # kind -> [bytes sent, of which over the network]
    alike = Counter(zip(block_full, expert_full))  # each kind of block counted once, times its number
    for comm, uses, root in [(made[root_full, 0], 1, True)] + [(made[key], k, False) for key, k in alike.items()]:
        for part, n in times.items():
            n = counts["gather"] if root and part == "gather" else n  # FSDP2 keeps the root gathered for backward
            for kind, nbytes, group in comm[part]:
                for side, b in enumerate(sent_bytes(nbytes, group, kind)):
                    traffic[kind][side] += uses * n * b
    count = facts["params"]
    return {"world": W, "dp_replicate": R, "dp_shard": S, "efsdp": Fs, "ep": ep, "accumulation_steps": accum,
            "micro_batch": micro_batch, "seq": seq, "ac": ac, "keep_gathered": keep_gathered, "grad_sync": grad_sync,
            "params_total": count["total"], "params_active": count["active"], "params_per_gpu": params,
            "flops_per_token": model_flops, "head_flops_per_token": head_flops, "memory_bytes": memory,
            "memory_total_bytes": sum(memory.values()),
            "activations_by_ac": {mode: acts[mode]["peak"] for mode in parallel.AC_MODES},
            "traffic_bytes_per_step": {k: v[0] for k, v in traffic.items()},
            "network_bytes_per_step": {k: v[1] for k, v in traffic.items()},
            "groups": {"dp_shard": g_dense, "efsdp": g_expert, "dp_replicate": g_replica, "ep": g_ep},
            "units": units}


class Timeline:
    """One GPU's optimizer step on two resources: the compute stream, and the links, one queue for every FSDP
    collective (all-gathers and reduce-scatters share the same NVLink and NICs). The EP all-to-all runs on the
    compute stream: the experts wait for their tokens. Counts, per kind, the seconds compute waits for the links."""

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


def micro_batch_on(tl: Timeline, p: dict, flops_s: float, first: bool, last: bool):
    """One micro-batch of train.train_step on the timeline. Forward: the root's all-gather (embedding), then each
    block's, issued when the block before it starts computing (FSDP2's prefetch, one block ahead); the head at the
    end. Backward from the last block: each re-gathered one block ahead (unless kept gathered) and its gradients
    reduce-scattered (on the last micro-batch also all-reduced across replicas) as soon as its backward ends."""
    tokens, units = p["micro_batch"] * p["seq"], p["units"]
    gather, regather = first or not p["keep_gathered"], not p["keep_gathered"]
    recompute = 2 if p["ac"] == "full" else 1  # full AC runs each block's forward again in backward

    def a2a(seconds):  # on the compute stream
        if seconds:
            tl.compute(seconds, kind=A2A)
            tl.link_s[A2A] += seconds

    ready = [tl.comm(AG, units[0]["gather_s"], tl.compute_end) if gather else 0.0] + [0.0] * (len(units) - 1)
    for j, u in enumerate(units):
        start = tl.compute(u["flops"] / 3 * tokens / flops_s, ready[j])
        if gather and j + 1 < len(units):
            ready[j + 1] = tl.comm(AG, units[j + 1]["gather_s"], start)
        a2a(u["a2a_fwd_s"])
    tl.compute(p["head_flops_per_token"] * tokens / flops_s)  # the fused loss makes the head's gradients too
    blocks = units[:0:-1]
    ready = [tl.comm(AG, blocks[0]["gather_s"], tl.compute_end) if regather else 0.0] + [0.0] * len(blocks)
    for j, u in enumerate(blocks + [units[0]]):
        if u is not units[0]:
            start = tl.compute(u["flops"] / 3 * (1 + recompute) * tokens / flops_s, ready[j])
            if regather and j + 1 < len(blocks):
                ready[j + 1] = tl.comm(AG, blocks[j + 1]["gather_s"], start)
            a2a((u["a2a_fwd_s"] if recompute == 2 else 0.0) + u["a2a_bwd_s"])
        if p["grad_sync"] == "every" or last:
            tl.comm(RS, u["reduce_s"], tl.compute_end)
        if last and p["dp_replicate"] > 1:
            tl.comm(AR, u["all_reduce_s"], tl.compute_end)


def project(p: dict, flops_s: float, peak_tflops: float, tokens_budget: float = 17e12) -> dict:
    """Step time of plan `p` when the GPU computes at `flops_s` FLOP/s: a timeline of the first, one middle and the
    last micro-batch, the middle one's time repeated for the others. Returns seconds per step, compute, exposed
    communication by kind, link time by kind, tokens/s per GPU, projected MFU and days for `tokens_budget`."""
    tl, accum = Timeline(), p["accumulation_steps"]
    marks = []
    for i in range(min(accum, 3)):
        micro_batch_on(tl, p, flops_s, first=i == 0, last=i == min(accum, 3) - 1)
        marks.append((tl.compute_end, dict(tl.seconds), dict(tl.link_s)))
    tl.compute(0.0, tl.link_end)  # the optimizer waits for the last reductions
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
            "mfu": mfu, "days": tokens_budget / (tokens * p["world"]) * step_s / 86400}


def search(cfg, gpus: int, seq: int, global_batch: int, gpu: str, links: Links, flops_s: float, top: int = 5):
    """Every layout train.py can run for this model, GPU count and global batch (dp_replicate x dp_shard, ep,
    micro-batch and so accumulation, AC mode, --keep_gathered), projected; the `top` fastest that fit in memory and
    the numbers tried and fitting."""
    peak, mem_gib = GPUS[gpu][:2]
    rows = global_batch // gpus
    found, tried = [], 0
    for R in parallel._divisors(gpus):
        S = gpus // R
        eps = [e for e in parallel._divisors(S) if cfg.n_experts % e == 0] if cfg.n_dense_layers < cfg.n_layers \
            else [1]
        for ep in eps:
            for micro in parallel._divisors(rows):
                for ac in parallel.AC_MODES:
                    for keep in (False, True):
                        tried += 1
                        args = (cfg, parallel.Layout(gpus, R, ep), seq, micro, global_batch, ac, 2, "every", keep,
                                links)
                        if plan(*args, detail=False)["memory_total_bytes"] <= FIT_FRACTION * mem_gib * 2**30:
                            p = plan(*args)
                            found.append((p, project(p, flops_s, peak)))
    found.sort(key=lambda f: (f[1]["step_s"], f[0]["memory_total_bytes"]))
    return found[:top], tried, len(found)


def layout_flags(p: dict) -> str:
    """The train.py flags of a plan's layout."""
    return (f"--dp_replicate={p['dp_replicate']} --ep={p['ep']} --micro_batch={p['micro_batch']} --ac={p['ac']}"
            + (" --keep_gathered=true" if p["keep_gathered"] else ""))


def why_slower(t: dict, best: dict) -> str:
    """The part of the step that grew most against the best layout's."""
    if t["step_s"] <= 1.005 * best["step_s"]:
        return "ties with the fastest (within 0.5%)"
    parts = set(t["seconds"]) | set(best["seconds"])
    worst = max(parts, key=lambda k: t["seconds"].get(k, 0.0) - best["seconds"].get(k, 0.0))
    return f"{worst} {t['seconds'].get(worst, 0.0):.3g} s vs {best['seconds'].get(worst, 0.0):.3g} s"


def read_tflops(text: str) -> tuple[float, str]:
    """--tflops: a number, or a saved `bench.py --json` result (its last line) whose tflops_per_device is used."""
    try:
        return float(text), "given"
    except ValueError:
        pass
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


def bench_plan(args, tc: train.TrainConfig, overrides: dict) -> dict:
    peak, mem_gib, nvlink_gbs, net_gbs = GPUS[args.gpu]
    links = Links(args.gpus_per_node, (args.nvlink_gbs or nvlink_gbs) * 1e9, (args.net_gbs or net_gbs) * 1e9,
                  args.latency_us * 1e-6)
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
              "network_gb_s": links.inter / 1e9, "latency_us": links.latency * 1e6, "compute_tflops": tflops}
    try:
        p = plan(cfg, layout, seq, args.micro_batch, global_batch, args.ac, 2, args.grad_sync, tc.keep_gathered,
                 links)
    except ValueError as e:
        return {**result, "fits": False, "reason": str(e), "exit": 2}
    t = project(p, tflops * 1e12, peak, args.tokens)
    gib = lambda b: b / 2**30  # noqa: E731
    total_gib, budget = gib(p["memory_total_bytes"]), FIT_FRACTION * mem_gib
    tokens_per_step = global_batch * seq
    traffic, network = p["traffic_bytes_per_step"], p["network_bytes_per_step"]
    result.update(params_per_gpu=p["params_per_gpu"], memory_gib_per_gpu=total_gib,
                  memory_gib={k: gib(v) for k, v in p["memory_bytes"].items()},
                  activations_gib_by_ac={k: gib(v) for k, v in p["activations_by_ac"].items()},
                  flops_per_token=p["flops_per_token"], params_total=p["params_total"],
                  params_active=p["params_active"], accumulation_steps=p["accumulation_steps"],
                  traffic_gb_per_step_per_gpu={k: v / 1e9 for k, v in traffic.items()},
                  network_gb_per_step_per_gpu={k: v / 1e9 for k, v in network.items()},
                  step_seconds=t["step_s"], seconds_per_step=t["seconds"], link_seconds_per_step=t["link_s"],
                  tokens_per_s_per_gpu=t["tokens_per_s_per_gpu"], mfu=t["mfu"], tokens=args.tokens, days=t["days"],
                  fits=total_gib <= budget)
    print(f"plan: {tc.preset} on {args.gpus} x {args.gpu} ({mem_gib} GiB, {peak:g} TFLOP/s dense bf16); "
          f"seq {seq}, micro-batch {args.micro_batch}, global batch {global_batch} "
          f"({p['accumulation_steps']} micro-batch(es) per step), ac={args.ac}, grad_sync={args.grad_sync}, "
          f"keep_gathered={tc.keep_gathered}")
    print(layout.describe(cfg.n_experts))
    print(f"parameters: {p['params_total'] / 1e9:.2f}B total, {p['params_active'] / 1e9:.2f}B active; "
          f"{p['params_per_gpu'] / 1e9:.3f}B per GPU (sharded over {p['dp_shard']}, replicated {p['dp_replicate']}x)")
    print("memory per GPU:")
    for k, v in result["memory_gib"].items():
        print(f"  {k:48s} {v:9.2f} GiB")
    print(f"  {'total':48s} {total_gib:9.2f} GiB of {mem_gib} ({100 * FIT_FRACTION:.0f}% usable: {budget:.0f})")
    print("  activation peak by AC mode: " + ", ".join(f"{k} {v:.1f} GiB"
                                                       for k, v in result["activations_gib_by_ac"].items()))
    print(f"FLOPs per token at seq {seq}: {p['flops_per_token'] / 1e9:.2f} GFLOP (6 x active matmul weights + "
          f"attention)")
    spans = ", ".join(f"{name} {k * m} = {k} x {m}" for name, (k, m) in p["groups"].items())
    print(f"links: {links.per_node} GPUs per node, NVLink {links.intra / 1e9:g} GB/s and network "
          f"{links.inter / 1e9:g} GB/s per GPU each way, {links.latency * 1e6:g} us per collective step; groups "
          f"(ranks per node x nodes): {spans}")
    print(f"bytes each GPU sends per optimizer step, and the time they take on the links:")
    for k, v in traffic.items():
        print(f"  {k:40s} {v / 1e9:9.1f} GB ({network[k] / 1e9:7.1f} GB over the network) "
              f"{t['link_s'].get(k, 0.0):7.2f} s")
    print(f"time per step ({rate_from}: compute at {tflops:g} TFLOP/s; all-gathers prefetched one block ahead, "
          f"reduce-scatters overlapping backward, the EP all-to-all in line):")
    for k, v in sorted(t["seconds"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:48s} {v:9.2f} s")
    print(f"  {'step':48s} {t['step_s']:9.2f} s: {t['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU "
          f"{100 * t['mfu']:.1f}%")
    print(f"time: {args.tokens:.3g} tokens on {args.gpus} x {args.gpu}: {t['days']:.1f} days "
          f"({args.tokens / tokens_per_step:,.0f} steps of {tokens_per_step / 1e6:.1f}M tokens)")
    if args.search:
        best, tried, fit = search(cfg, args.gpus, seq, global_batch, args.gpu, links, tflops * 1e12)
        result["search"] = {"tried": tried, "fit": fit, "best": [
            {"flags": layout_flags(q), "step_seconds": r["step_s"], "mfu": r["mfu"], "days": r["days"],
             "memory_gib_per_gpu": gib(q["memory_total_bytes"]), "seconds_per_step": r["seconds"]}
            for q, r in best]}
        print(f"fastest layouts that fit ({fit} of {tried} fit; global batch {global_batch} x {seq} kept):"
              + ("" if best else " none; use more GPUs or a smaller model"))
        for i, (q, r) in enumerate(best):
            lose = "fastest" if i == 0 else f"+{100 * (r['step_s'] / best[0][1]['step_s'] - 1):.1f}%: " \
                                               f"{why_slower(r, best[0][1])}"
            print(f"  {i + 1}. {layout_flags(q):76s} {r['step_s']:#7.3g} s  MFU {100 * r['mfu']:4.1f}%  "
                  f"{r['days']:5.1f} days  {gib(q['memory_total_bytes']):5.0f} GiB  {lose}")
        if best:
            print(f"  this layout: {t['step_s']:.3g} s; vs the fastest: {why_slower(t, best[0][1])}")
            print(f"  the fastest with train.py ({args.gpus} ranks): train.py --preset={tc.preset} --seq_len={seq} "
                  f"--global_batch={global_batch} {layout_flags(best[0][0])}")
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
    cfg, autocast, dtype = run.cfg, run.autocast, run.dtype
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
          f"{n_micro} micro-batch(es); {dtype or torch.float32} on {device_name(device)}; transformers "
          f"{transformers.__version__} with attention={hf_impl[0]}, experts={hf_impl[1]}")

    losses = {}

    def step_ours():
        losses["ours"] = train.train_step(ours, opt_ours, batch, tc, autocast, state)["lm_loss"]

    def step_hf():  # the same work: micro-batches, clipping, AdamW; no balance losses or bias update (HF has none)
        tokens_BT, targets_BT, _ = (t.to(device) for t in batch)
        total = 0.0
        for i in range(n_micro):
            rows = slice(i * tc.micro_batch, (i + 1) * tc.micro_batch)
            with autocast:
                logits_BTV = hf(input_ids=tokens_BT[rows], use_cache=False).logits
                loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT[rows].flatten())
            (loss / n_micro).backward()
            total += loss.item() / n_micro
        torch.nn.utils.clip_grad_norm_(hf.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf"))
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)
        losses["hf"] = total

    step_ours()
    step_hf()
    first_diff = abs(losses["ours"] - losses["hf"])
    times = defaultdict(list)
    for i in range(args.warmup + args.iters):
        pair = (("ours", step_ours), ("hf", step_hf))
        for name, fn in pair if i % 2 == 0 else pair[::-1]:  # alternate who goes first
            ms = timed_ms(fn, device)
            if i >= args.warmup:
                times[name].append(ms)
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
# Command line

class _Parser(train._Parser):
    """train.py's parser (a mistyped flag names the closest one), but a bad value is reported as such."""

    def error(self, message):
        if message.startswith("argument "):  # "argument --gpu: invalid choice: ...": the flag exists
            self.exit(2, f"{self.prog}: error: {message}\n")
        super().error(message)


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    return _Parser(prog=f"bench.py {command}".rstrip(), description=description, allow_abbrev=False,
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         epilog="Also takes every train.py flag (python train.py --help): --preset, model overrides "
                                "such as --dim=512, and the layout, batch and precision flags.")


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


def _timing_flags(parser, warmup: int, iters: int):
    parser.add_argument("--warmup", type=_bounded(int, 0), default=warmup, help="untimed steps first")
    parser.add_argument("--iters", type=_bounded(int, 1), default=iters, help="timed steps")
    parser.add_argument("--threads", type=_bounded(int, 0), default=0,
                        help="CPU threads for torch (0: torch's default); 1 gives steadier ratios on a machine others "
                             "are using")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="wall time, or the process's CPU time (CPU only; steadier when the machine is shared)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")


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
    train_defaults = []
    if command == "plot":
        parser = _parser("plot", COMMANDS["plot"])
        parser.add_argument("out_dir", help="a train.py --out_dir holding metrics.jsonl")
        return command, parser.parse_args(argv), None, {}
    if command == "step":
        parser = _parser("", "Time train.py's training step on synthetic tokens. Other commands: "
                             + ", ".join(COMMANDS) + " (bench.py COMMAND --help).")
        _timing_flags(parser, 2, 5)
        parser.add_argument("--save", default="", metavar="PATH",
                            help="write this run (times, components, kernel fingerprint, environment) as a baseline")
        parser.add_argument("--compare", default="", metavar="PATH",
                            help="compare this run with a --save baseline of the same flags; exit 1 when the step "
                                 "is slower beyond the noise band and --tolerance")
        parser.add_argument("--tolerance", type=_bounded(float, 0), default=0.05,
                            help="with --compare: the step slowdown accepted (a fraction) when the noise is smaller")
    elif command == "moe":
        parser = _parser("moe", COMMANDS["moe"] + ", forward + backward on one preset's shapes.")
        _timing_flags(parser, 1, 5)
        parser.add_argument("--tokens", type=_bounded(int, 1), default=2048,
                            help="tokens through the layer (seq_len per row)")
        parser.add_argument("--loop", type=train._parse_bool, nargs="?", const=True, default=True,
                            help="also time the per-expert loop (--loop=false: skip it, it is slow at large shapes)")
    elif command == "vs-hf":
        parser = _parser("vs-hf", COMMANDS["vs-hf"] + " (forward, backward, clipping, AdamW), timed alternately.")
        _timing_flags(parser, 1, 9)
        train_defaults = ["--global_batch=4", "--micro_batch=4"]
    else:
        parser = _parser("plan", COMMANDS["plan"] + " (the preset defaults to large).")
        parser.add_argument("--gpus", type=_bounded(int, 1), default=2048, help="world size")
        parser.add_argument("--dp_replicate", type=_bounded(int, 1), default=16, help="HSDP replicas")
        parser.add_argument("--ep", type=_bounded(int, 1), default=8, help="expert-parallel degree")
        parser.add_argument("--seq", "--seq_len", type=_bounded(int, 0), default=0,
                            help="sequence length (0: the preset's)")
        parser.add_argument("--global_batch", type=_bounded(int, 0), default=0,
                            help="sequences per step (0: one per GPU)")
        parser.add_argument("--micro_batch", type=_bounded(int, 1), default=1, help="sequences per GPU per forward")
        parser.add_argument("--gpu", choices=GPUS, default="b300",
                            help="GPU kind: peak bf16 TFLOP/s, memory, NVLink and default network bandwidth")
        parser.add_argument("--ac", choices=parallel.AC_MODES, default="none", help="activation checkpointing")
        parser.add_argument("--grad_sync", choices=("last", "every"), default="every",
                            help="gradient reduce-scatter under accumulation: every micro-batch (as train.py does) "
                                 "| last (unsharded gradients held between micro-batches; not searched: train.py "
                                 "cannot run it)")
        parser.add_argument("--tokens", type=_bounded(float, 0, low_open=True), default=17e12,
                            help="training token budget")
        parser.add_argument("--mfu", type=_bounded(float, 0, 1, low_open=True), default=0.4,
                            help="the GPU's compute rate while it computes, as a fraction of its peak (communication "
                                 "is added by the time model)")
        parser.add_argument("--tflops", default="",
                            help="compute rate in TFLOP/s, or a saved `bench.py --json` result measured on the GPU "
                                 "(its tflops_per_device); overrides --mfu")
        parser.add_argument("--gpus_per_node", type=_bounded(int, 1), default=8, help="GPUs joined by NVLink")
        parser.add_argument("--nvlink_gbs", type=_bounded(float, 0), default=0,
                            help="NVLink GB/s per GPU each way (0: the GPU kind's)")
        parser.add_argument("--net_gbs", type=_bounded(float, 0), default=0,
                            help="network GB/s per GPU each way between nodes (0: the GPU kind's default, "
                                 "h100/h200/b200 50, b300 100)")
        parser.add_argument("--latency_us", type=_bounded(float, 0), default=5.0,
                            help="microseconds per step of a collective")
        parser.add_argument("--search", type=train._parse_bool, nargs="?", const=True, default=True,
                            help="also list the five fastest layouts that fit (--search=false: skip)")
        parser.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
        train_defaults = ["--preset=large"]
    if command in ("step", "moe"):
        parser.add_argument("--breakdown", type=train._parse_bool, nargs="?", const=True, default=True,
                            help="also time the phases and profile the components (--breakdown=false: skip)")
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
