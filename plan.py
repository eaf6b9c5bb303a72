"""
Plan a run before it starts: memory per GPU, bytes per collective, step time, MFU and days of a model on a GPU
layout, the fastest layouts that fit, and what failures cost; arithmetic on a meta-device model, no GPU needed. It
reads train.py's flags and config files as train.py does; its own flags say what training does not know.

    python plan.py --config=large.toml --gpu=b300       # large.toml's run, on its world_size GPUs
    python plan.py --preset=large --gpus=2048 --dp_replicate=16 --ep=8 --seq_len=8192 --global_batch=12288 \
        --micro_batch=1 --ac=full --optimizer=muon --steps=168000   # the same run from flags
    python plan.py --config=large.toml --seq_len=65536 --global_batch=1536 --cp=4  # long context
    python plan.py --config=large.toml --net_gbs=50 --tflops=450 --mtbf_hours=4096  # slower links, more failures

Exit 1: the plan does not fit the GPU; exit 2: a layout or value train.py would refuse.
"""

import argparse
import dataclasses
import functools
import itertools
import json
import math
import shlex
import sys
from collections import Counter, defaultdict

import torch

import checkpoint
import parallel
import train
from model import PRESETS, MoE, Parser, RMSNorm, Rule, above, at_least, config_file, head_chunks, meta_model, parse_bool

# --- GPUs, and the memory a layout needs

# Per GPU kind: bf16 peak TFLOP/s, GiB, NVLink and network GB/s per GPU each way (line rates: NCCL's, 80-90% of
# them, go in --nvlink_gbs / --net_gbs), HBM TB/s. 8 GPUs and NICs a node.
GPUS = {"h100": (parallel.PEAK_TFLOPS["H100"], 80, 450, 50, 3.35),   # NVLink 4 (900 GB/s both ways), 400 Gb/s NIC
        "h200": (parallel.PEAK_TFLOPS["H200"], 141, 450, 50, 4.8),   # NVLink 4, 400 Gb/s NIC
        "b200": (parallel.PEAK_TFLOPS["B200"], 180, 900, 50, 8.0),   # NVLink 5 (1.8 TB/s both ways), 400 Gb/s NIC
        "b300": (parallel.PEAK_TFLOPS["B300"], 288, 900, 100, 8.0)}  # NVLink 5, 800 Gb/s NIC (ConnectX-8)
FIT_FRACTION = 0.9  # 10% left for the CUDA context, NCCL buffers, fragmentation, EP load imbalance
AG = "FSDP all-gather"
RS = "FSDP reduce-scatter"
AR = "HSDP all-reduce across replicas"
A2A = "EP all-to-all"
CP_A2A = "CP all-to-all"
MUON_A2A = "Muon all-to-all"
NS = "optimizer Newton-Schulz"
OPT_HBM = "optimizer memory passes"
# HBM bytes per fp32 element of an optimizer step. Fused AdamW reads param, grad, m, v and writes param, m, v.
ADAMW_BYTES = 28
# Muon: momentum (read buf, grad; write buf), Nesterov (read grad, buf; write u), weight decay (read, write param),
# the update (read param, the orthogonalised u; write param) (bf16 casts and Newton-Schulz's norm not counted).
MUON_BYTES = 44
# The train.py flags of a layout (and --keep_gathered), which the search varies.
LAYOUT_FLAGS = ("dp_replicate", "ep", "cp", "micro_batch", "ac")
# The search tries --cp>1 from this --seq_len on (or when the GPUs cannot each read whole rows): below it a row's
# activations fit and attention is a small share of the FLOPs, so splitting rows only adds all-to-alls.
CP_FROM = 32768


def activation_bytes(cfg, seq: int, micro_batch: int, c: int = 2, ep: int = 1, cp: int = 1) -> dict:
    """{AC mode: {"saved": bytes kept for backward, "peak": plus the largest transient (the loss's chunk, or a block
    AC recomputes)}} of one micro-batch; c bytes per element, flash attention, balanced routing."""
    D = cfg.dim
    H = cfg.n_heads
    G = cfg.n_kv_heads
    V = cfg.vocab_size
    E = cfg.n_experts
    K = cfg.top_k
    I = cfg.expert_hidden
    Is = I * cfg.n_shared_experts
    Hd = H * cfg.head_dim
    Gd = G * cfg.head_dim
    # Per token. Attention: its input, q/k/v/gate, fp32 q/k norm scales, normed q, k, v, the output and its fp32
    # log-sum-exp, the output reshaped, sigmoid(gate) and their product (o_proj's input). Selective AC keeps matmul,
    # attention and all-to-all outputs (parallel.py's policy).
    attn = c * D + c * (Hd + Gd) + 4 * (H + G) + c * (Hd + 2 * Gd) + c * Hd + 4 * H + 3 * c * Hd
    attn_sel = c * (2 * Hd + 2 * Gd) + c * Hd + 4 * H + c * D
    # With cp, attention sees all of a row's tokens for 1/cp of the heads: as many elements as the rank's own tokens
    # of every head, so the counts hold per local token, plus the output the all-to-all returns (selective AC: plus
    # the all-to-alls' q, k, v and output).
    if cp > 1:
        attn += c * Hd
        attn_sel += c * (2 * Hd + 2 * Gd)
    # Router: its fp32 input (c = 4: the FFN input), fp32 logits and scores. Per routed pair: the gathered input,
    # gate_up output (2I), silu output, product, product x gate, fp32 gate, two int64 indices. A SwiGLU: 4c per unit.
    experts = (4 * D if c == 2 else 0) + 8 * E + K * (c * (D + 5 * I) + 20) + 4 * c * Is
    experts_sel = 4 * E + K * c * (2 * I + D) + c * (2 * Is + D) + (2 * K * c * D if ep > 1 else 0)
    # A block: four RMSNorm inputs (and an fp32 scale per row), the FFN input, attention, the FFN.
    full_layer = [4 * (c * D + 4) + c * D + attn + (experts if cfg.is_moe(i) else 4 * c * cfg.dense_hidden)
                  for i in range(cfg.n_layers)]
    sel_layer = [c * D + attn_sel + (experts_sel if cfg.is_moe(i) else c * (2 * cfg.dense_hidden + D))
                 for i in range(cfg.n_layers)]
    tokens = micro_batch * seq // cp
    head = (c * D + 4) + c * D  # the final norm, and the head input's gradient the fused loss makes in forward
    # At the loss: a chunk of R rows of fp32 logits; in bf16 instead its bf16 logits, the gradient of a group of Rg
    # rows, the weight's bf16 copy and the group's product for the weight gradient.
    R, Rg = head_chunks(tokens, V, torch.device("cuda"))
    head_transient = 4 * R * V if c == 4 else c * (R + Rg) * V + 2 * c * V * D
    saved = {"none": sum(full_layer) + head, "selective": sum(sel_layer) + head, "full": cfg.n_layers * c * D + head}
    kept = {mode: tokens * saved[mode] + 4 * V * D for mode in parallel.AC_MODES}  # + the head weight's fp32 gradient
    return {mode: {"saved": kept[mode], "peak": kept[mode] + max(head_transient, 0 if mode == "none" else
                                                                    tokens * max(full_layer))}
            for mode in parallel.AC_MODES}


@functools.lru_cache(maxsize=None)
def shard(unit: tuple, shards: int) -> int:
    """Elements of one rank's shard of an FSDP unit (parameter shapes); FSDP2 pads dim 0 to the shard count."""
    return sum(-(-shape[0] // shards) * math.prod(shape[1:]) for shape in unit)


def shapes(params) -> tuple:
    return tuple(tuple(p.shape) for p in params)


_FACTS = {}  # by repr(cfg): one meta-device model per config


def model_facts(cfg) -> dict:
    """A meta-device model's FSDP units (parameter shapes), its blocks' matmul FLOPs per token, its counts."""
    if repr(cfg) in _FACTS:
        return _FACTS[repr(cfg)]
    model = meta_model(cfg)
    norms = {id(p) for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    share = cfg.top_k / cfg.n_experts  # a token passes through k of the E routed experts
    blocks = list(model.layers.values())
    muon = parallel.build_optimizer(model, train.TrainConfig(optimizer="muon"), fused=False)
    _FACTS[repr(cfg)] = {
        # Muon's 2-D matrices in its order (FSDP shards them by rows); the 3-D ones are the routed experts
        "muon_dense": shapes(p for g in muon.param_groups if g["muon"] for p in g["params"] if p.dim() == 2),
        "root": shapes(p for name, p in model.named_parameters() if not name.startswith("layers.")),
        "blocks": [shapes(p for name, p in b.named_parameters() if ".experts." not in f".{name}") for b in blocks],
        "experts": [shapes(b.ffn.experts.parameters()) if isinstance(b.ffn, MoE) else () for b in blocks],
        # 6 FLOPs per weight a token touches: forward 2, backward 4
        "block_flops": [6 * sum(p.numel() * (share if ".experts." in f".{n}" else 1)
                                for n, p in b.named_parameters() if id(p) not in norms) for b in blocks],
        "params": model.num_params(), "flops_per_token": functools.lru_cache(model.flops_per_token)}
    return _FACTS[repr(cfg)]


def fsdp_memory(world: int, params: int, full: dict, c: int, keep_gathered: bool, muon_elements: int | None) -> dict:
    """Bytes per GPU of fp32 shards, optimizer state (Muon's one moment for `muon_elements`), FSDP's buffers."""
    memory = {"parameters (fp32 master shards)": 4 * params, "gradients (fp32 shards)": 4 * params}
    if muon_elements is None:
        memory["optimizer (AdamW m, v in fp32)"] = 8 * params
    else:
        memory["optimizer (Muon momentum, AdamW m, v; fp32)"] = 8 * params - 4 * muon_elements
    if world == 1:
        return memory
    largest = max(full["blocks"] + full["experts"])
    if keep_gathered:
        memory["every unit gathered (compute copies)"] = c * (full["root"] + sum(full["blocks"]) + sum(full["experts"]))
    else:  # FSDP2 keeps the root unsharded from forward to backward; a block gathered while the next is prefetched
        memory["FSDP all-gather buffers (compute copies)"] = c * (full["root"] + 2 * largest)
    # Backward: a unit's gradients in compute dtype and their fp32 copy to reduce-scatter (each micro-batch: none kept).
    memory["FSDP reduce-scatter buffers"] = (c + 4) * max(full["root"], largest)
    return memory


# --- Links and collectives

@dataclasses.dataclass
class Links:
    """Nodes of `per_node` GPUs on NVLink at `intra` bytes/s per GPU each way, joined by the network at `inter` (a NIC
    per GPU); `latency` seconds per step of a collective; `hbm` bytes/s of a GPU's memory."""
    per_node: int = 8
    intra: float = 900e9
    inter: float = 100e9
    latency: float = 5e-6
    hbm: float = 8e12

    def span(self, stride: int, size: int) -> tuple[int, int]:
        """(ranks per node, nodes) of `size` ranks `stride` apart."""
        nodes = len({i * stride // self.per_node for i in range(size)})
        return size // nodes, nodes

    def seconds(self, kind: str, nbytes: float, group: tuple[int, int]) -> float:
        """A collective's time: sent_bytes' on their links, a latency per step."""
        k, m = group
        sent, network = sent_bytes(nbytes, group, kind)
        if kind in (A2A, CP_A2A):  # NVLink and the network at once
            return max((sent - network) / self.intra, network / self.inter) + (k * m - 1) * self.latency
        return (sent - network) / self.intra + network / self.inter + (k + m - 2) * (1 + (kind == AR)) * self.latency


def sent_bytes(nbytes: float, group: tuple[int, int], kind: str) -> tuple[float, float]:
    """(bytes a GPU sends, of which over the network) in a collective of `nbytes` over k ranks on each of m nodes: an
    all-to-all; or a ring in each node, then rail-aligned rings over the nodes, each GPU carrying 1/k through its own
    NIC (an all-reduce: a reduce-scatter, then an all-gather)."""
    k, m = group
    n = k * m
    if kind in (A2A, CP_A2A):
        return nbytes * (n - 1) / n, nbytes * (n - k) / n
    twice = 2 if kind == AR else 1
    return twice * nbytes * (n - 1) / n, twice * nbytes * (m - 1) / n


def unit_collectives(cfg, layout: parallel.Layout, links: Links, groups: dict, c: int, tokens: int, full: int,
                     expert_full: int, attention: bool) -> dict:
    """An FSDP unit's collectives (kind, bytes, group) by part of the step, and their seconds; `full`, `expert_full`:
    its unsharded dense and routed-expert elements."""
    moe = expert_full > 0
    # Each way: tokens out and results back (D wide) and the fp32 gates; forward sends the int64 counts first.
    pairs = tokens * cfg.top_k
    a2a = [pairs * cfg.dim * c, pairs * 4, pairs * cfg.dim * c] if moe and layout.ep > 1 else []
    # CP, each way: q, k, v out to the ranks of their heads and the output back (backward: their gradients).
    heads = (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads, cfg.n_heads) if attention and layout.cp > 1 else ()
    sharded = [(full, groups["dp_shard"])] + ([(expert_full, groups["efsdp_cp"])] if moe else [])
    comm = {"gather": [(AG, c * n, group) for n, group in sharded],
            "reduce": [(RS, 4 * n, group) for n, group in sharded],
            "all_reduce": [(AR, 4 * n // math.prod(group), groups["dp_replicate"]) for n, group in sharded],
            "a2a_fwd": [(A2A, b, groups["ep"]) for b in ([8 * cfg.n_experts] if a2a else []) + a2a],
            "a2a_bwd": [(A2A, b, groups["ep"]) for b in a2a],
            "cp": [(CP_A2A, c * tokens * h * cfg.head_dim, groups["cp"]) for h in heads]}
    return comm | {f"{part}_s": sum(links.seconds(*one) for one in comm[part]) for part in comm}


# --- The optimizer step

@functools.lru_cache(maxsize=None)
def ns_flops(shape: tuple, steps: int = parallel.NS_STEPS) -> int:
    """parallel.newton_schulz's matmul FLOPs on [..., O, F] turned Q x W (min, max) wide; per step A = X Xᵀ 2Q²W,
    B = b·A + c·A·A 2Q³, X = a·X + B·X 2Q²W."""
    *stack, O, F = shape
    Q = min(O, F)
    W = max(O, F)
    return math.prod(stack) * steps * (4 * Q * Q * W + 2 * Q ** 3)


@functools.lru_cache(maxsize=None)
def muon_deal(hidden: tuple, S: int) -> tuple[list, int, int]:
    """parallel.Muon's deal of row-sharded matrices (shapes) over S ranks, one per rank a round: (FLOPs per rank, the
    sum over rounds of the round's most, rounds)."""
    owned = [[ns_flops(hidden[i]) for i in mine] for mine in parallel.deal([math.prod(s) for s in hidden], S)]
    return [sum(o) for o in owned], sum(map(max, itertools.zip_longest(*owned, fillvalue=0))), max(map(len, owned))


def muon_work(hidden: tuple, experts: list, S: int, Fs: int, ep: int, links: Links, group: tuple, c: int) -> dict:
    """parallel.Muon on an FSDP group: dense matrices dealt over its S ranks, each gathered whole on its owner by an
    all-to-all and sent back, one a round; expert shards on their Fs expert-FSDP ranks, ep apart."""
    dense, dense_critical, rounds = muon_deal(hidden, S)  # S = 1: all on the one rank, no traffic
    L = next((u[0][0] for u in experts if u), 0)  # routed experts per EP rank
    per_expert = sum(ns_flops(s[1:]) for u in experts for s in u)
    chunk = -(-L // Fs)  # expert-FSDP rank j holds experts j*chunk .. (torch.chunk)
    by_efsdp = [per_expert * max(0, min(chunk, L - j * chunk)) for j in range(Fs)]
    flops = [dense[r] + by_efsdp[r // ep] for r in range(S)]
    nbytes = c * shard(hidden, S)  # the rows a rank holds go out, the rows it owns come back
    return {"flops_by_rank": flops, "flops": max(flops), "flops_mean": sum(flops) / S,
            "critical_flops": max(by_efsdp) + dense_critical,
            "a2a_bytes": [2 * b for b in sent_bytes(nbytes, group, A2A)],
            "a2a_s": 2 * rounds * links.seconds(A2A, nbytes / rounds, group) if rounds else 0.0,
            "elements": shard(hidden, S) + sum(shard(u, Fs) for u in experts)}


# --- The plan of one layout

def estimate(cfg, tc: train.TrainConfig, world: int, links: Links | None = None) -> dict:
    """The plan of training `cfg` as train.py does with `tc` on `world` ranks: memory per GPU (bytes), FLOPs per
    token, each unit's collectives and their bytes per step, the optimizer's work, a checkpoint's bytes."""
    layout = parallel.Layout.for_world(world, tc.dp_replicate, tc.dp_shard, tc.ep, tc.cp)
    layout.check(cfg, tc.global_batch, tc.micro_batch)
    facts = model_facts(cfg)
    links = links or Links()
    c = 4 if tc.dtype == "fp32" else 2
    cp = layout.cp
    S = layout.dp_shard * cp  # FSDP's groups: a cp rank holds a shard as a data-parallel rank does
    Fs = layout.efsdp * cp
    accum = layout.accumulation_steps(tc.global_batch, tc.micro_batch)
    tokens = tc.micro_batch * tc.seq_len // cp  # a micro-batch's, on one GPU
    experts = [tuple((cfg.n_experts // layout.ep, *s[1:]) for s in unit) for unit in facts["experts"]]
    # Unsharded elements of each unit as FSDP gathers it (every shard padded alike).
    full = {"root": S * shard(facts["root"], S), "blocks": [S * shard(u, S) for u in facts["blocks"]],
            "experts": [Fs * shard(u, Fs) for u in experts]}
    params = (full["root"] + sum(full["blocks"])) // S + sum(full["experts"]) // Fs
    # build_mesh's order [dp_replicate, efsdp, cp, ep]
    groups = {"dp_shard": links.span(1, S), "efsdp_cp": links.span(layout.ep, Fs), "cp": links.span(layout.ep, cp),
              "dp_replicate": links.span(S, layout.dp_replicate), "ep": links.span(1, layout.ep)}
    muon = muon_work(facts["muon_dense"], experts, S, Fs, layout.ep, links, groups["dp_shard"], c) \
        if tc.optimizer == "muon" else None
    memory = fsdp_memory(world, params, full, c, tc.keep_gathered, muon and muon["elements"])
    # What a checkpoint holds: the fp32 shards and the optimizer state, not the gradients
    checkpointed = sum(v for k, v in memory.items() if k.startswith(("parameters", "optimizer")))
    acts = activation_bytes(cfg, tc.seq_len, tc.micro_batch, c, layout.ep, cp)
    memory[f"activations (ac={tc.ac}, peak)"] = acts[tc.ac]["peak"]
    root = (full["root"], 0, False)
    blocks = [(n, e, True) for n, e in zip(full["blocks"], full["experts"])]
    made = {key: unit_collectives(cfg, layout, links, groups, c, tokens, *key)
            for key in dict.fromkeys([root] + blocks)}  # units of the same sizes share their collectives
    attn_flops = 12 * cfg.n_heads * cfg.head_dim  # per token and context position (with cp: the whole row's)
    units = [{**made[root], "flops": 0}] + [
        {**made[key], "flops": flops + attn_flops * (tc.seq_len if cfg.is_global(i) else min(cfg.window, tc.seq_len))}
        for i, (key, flops) in enumerate(zip(blocks, facts["block_flops"]))]
    model_flops = facts["flops_per_token"](tc.seq_len)
    # How often each part runs in one optimizer step (full AC runs the forward's all-to-alls again in backward).
    gathers = 1 if tc.keep_gathered else accum
    again = tc.ac == "full"
    times = {"gather": gathers + (0 if tc.keep_gathered else accum), "reduce": accum, "all_reduce": 1,
             "a2a_fwd": accum * (1 + again), "a2a_bwd": accum, "cp": accum * (2 + again)}
    traffic = defaultdict(lambda: [0.0, 0.0])  # kind -> [bytes sent, of which over the network]
    for key, uses in Counter([root] + blocks).items():
        for part, n in times.items():
            n = gathers if key == root and part == "gather" else n  # FSDP2 keeps the root gathered for backward
            for kind, nbytes, group in made[key][part]:
                for side, b in enumerate(sent_bytes(nbytes, group, kind)):
                    traffic[kind][side] += uses * n * b
    step = muon or {"elements": 0}
    step["hbm_bytes"] = ADAMW_BYTES * (params - step["elements"]) + MUON_BYTES * step["elements"]
    step["hbm_s"] = step["hbm_bytes"] / links.hbm
    if muon and muon["a2a_bytes"][0]:
        traffic[MUON_A2A] = muon["a2a_bytes"]
    return {"world": world, "layout": layout, "tokens": tokens, "ac": tc.ac, "accumulation_steps": accum,
            "keep_gathered": tc.keep_gathered, "params_total": facts["params"]["total"],
            "params_active": facts["params"]["active"], "params_per_gpu": params, "memory_bytes": memory,
            "memory_total_bytes": sum(memory.values()),
            "activations_by_ac": {mode: acts[mode]["peak"] for mode in parallel.AC_MODES}, "groups": groups,
            # DCP writes each replicated shard once, the writes spread over the replicas; a restart reads it whole
            "checkpoint": {"write_bytes": checkpointed / layout.dp_replicate, "read_bytes": checkpointed},
            "flops_per_token": model_flops, "units": units,
            "head_flops_per_token": model_flops - sum(u["flops"] for u in units),  # the output head's matmuls
            "traffic_bytes_per_step": {k: v[0] for k, v in traffic.items()},
            "network_bytes_per_step": {k: v[1] for k, v in traffic.items()}, "optimizer": step}


# --- Time: one GPU's step on a timeline

class Timeline:
    """One GPU's step on the compute stream (with the all-to-alls: the next op waits for their tokens) and its links."""

    def __init__(self):
        self.compute_end = 0.0
        self.link_end = 0.0
        self.busy = []                      # (start, end, kind) on the links, in order
        self.first_busy = 0                 # the first of them not over when compute last ended
        self.seconds = defaultdict(float)   # compute stream and exposed waits, by kind
        self.link_s = defaultdict(float)

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
        """Work on the compute stream, if any; an all-to-all there is link time too."""
        if seconds:
            self.compute(seconds, kind=kind)
            if kind in (A2A, CP_A2A, MUON_A2A):
                self.link_s[kind] += seconds


def micro_batch_on(tl: Timeline, p: dict, flops_s: float, first: bool, last: bool):
    """One micro-batch of train.train_step: each unit gathered as the one before starts (FSDP2's prefetch), the head;
    backward from the last block, re-gathered one ahead (unless kept), each unit's gradients reduce-scattered (on the
    last micro-batch also all-reduced across replicas) once its backward ends."""
    tokens = p["tokens"]
    units = p["units"]
    gather = first or not p["keep_gathered"]
    regather = not p["keep_gathered"]
    recompute = 2 if p["ac"] == "full" else 1  # full AC runs each block's forward again in backward
    ready = [tl.comm(AG, units[0]["gather_s"], tl.compute_end) if gather else 0.0] + [0.0] * (len(units) - 1)
    for j, u in enumerate(units):
        start = tl.compute(u["flops"] / 3 * tokens / flops_s, ready[j])
        if gather and j + 1 < len(units):
            ready[j + 1] = tl.comm(AG, units[j + 1]["gather_s"], start)
        tl.in_line(CP_A2A, u["cp_s"])
        tl.in_line(A2A, u["a2a_fwd_s"])
    tl.compute(p["head_flops_per_token"] * tokens / flops_s)  # the fused loss makes the head's gradients too
    blocks = units[:0:-1]
    ready = [tl.comm(AG, blocks[0]["gather_s"], tl.compute_end) if regather else 0.0] + [0.0] * len(blocks)
    for j, u in enumerate(blocks + [units[0]]):
        if u is not units[0]:
            start = tl.compute(u["flops"] / 3 * (1 + recompute) * tokens / flops_s, ready[j])
            if regather and j + 1 < len(blocks):
                ready[j + 1] = tl.comm(AG, blocks[j + 1]["gather_s"], start)
            tl.in_line(CP_A2A, recompute * u["cp_s"])
            tl.in_line(A2A, (u["a2a_fwd_s"] if recompute == 2 else 0.0) + u["a2a_bwd_s"])
        tl.comm(RS, u["reduce_s"], tl.compute_end)
        if last and p["layout"].dp_replicate > 1:
            tl.comm(AR, u["all_reduce_s"], tl.compute_end)


def optimizer_on(tl: Timeline, p: dict, flops_s: float):
    """The optimizer step, after the last reductions."""
    tl.compute(0.0, tl.link_end)
    o = p["optimizer"]
    for kind, seconds in ((NS, o.get("critical_flops", 0) / flops_s), (MUON_A2A, o.get("a2a_s", 0.0)),
                          (OPT_HBM, o["hbm_s"])):
        tl.in_line(kind, seconds)


def project(p: dict, flops_s: float, peak_tflops: float, steps: int) -> dict:
    """Plan `p` at `flops_s` FLOP/s: the first, a middle (repeated) and the last micro-batch on a timeline."""
    tl = Timeline()
    accum = p["accumulation_steps"]
    marks = []
    for i in range(min(accum, 3)):
        micro_batch_on(tl, p, flops_s, first=i == 0, last=i == min(accum, 3) - 1)
        marks.append((tl.compute_end, dict(tl.seconds), dict(tl.link_s)))
    optimizer_on(tl, p, flops_s)
    step_s = tl.compute_end
    seconds = dict(tl.seconds)
    link_s = dict(tl.link_s)
    if accum > 3:  # the middle micro-batches repeat the second one
        more = accum - 3
        step_s += more * (marks[1][0] - marks[0][0])
        for total, now, before in ((seconds, marks[1][1], marks[0][1]), (link_s, marks[1][2], marks[0][2])):
            for k in now:
                total[k] = total.get(k, 0.0) + more * (now[k] - before.get(k, 0.0))
    tokens = accum * p["tokens"]  # per GPU per step
    mfu = p["flops_per_token"] * tokens / step_s / (peak_tflops * 1e12)
    return {"step_s": step_s, "seconds": seconds, "link_s": link_s, "tokens_per_s_per_gpu": tokens / step_s,
            "mfu": mfu, "days": steps * step_s / 86400,
            "optimizer_s": sum(seconds.get(k, 0.0) for k in (NS, MUON_A2A, OPT_HBM))}


# --- The fastest layouts that fit

def search(cfg, tc: train.TrainConfig, world: int, gpu: str, links: Links, flops_s: float, top: int = 5):
    """The `top` fastest (TrainConfig, plan, projection) of `tc`'s layouts that fit; how many were tried, fit."""
    peak, mem_gib = GPUS[gpu][:2]
    found = []
    tried = 0
    moe = cfg.n_dense_layers < cfg.n_layers
    long = tc.seq_len >= CP_FROM or tc.global_batch % world
    cps = [cp for cp in parallel.divisors(math.gcd(cfg.n_kv_heads, tc.seq_len, world)) if cp == 1 or long]
    for R, cp in itertools.product(parallel.divisors(world), cps):
        if world // R % cp or tc.global_batch % (world // cp):
            continue
        eps = [e for e in parallel.divisors(world // R // cp) if cfg.n_experts % e == 0] if moe else [1]
        micro_batches = parallel.divisors(tc.global_batch // (world // cp))
        for ep, micro, ac, keep in itertools.product(eps, micro_batches, parallel.AC_MODES, (False, True)):
            tried += 1
            candidate = dataclasses.replace(tc, dp_replicate=R, dp_shard=0, ep=ep, cp=cp, micro_batch=micro, ac=ac,
                                            keep_gathered=keep)
            p = estimate(cfg, candidate, world, links)
            if p["memory_total_bytes"] <= FIT_FRACTION * mem_gib * 2**30:
                found.append((candidate, p, project(p, flops_s, peak, tc.steps)))
    found.sort(key=lambda f: (f[2]["step_s"], f[1]["memory_total_bytes"]))
    return found[:top], tried, len(found)


def flag(name: str, value) -> str:
    """--name=value as train.py's parser reads it back."""
    return f"--{name}={str(value).lower() if isinstance(value, bool) else value}"


def layout_flags(tc: train.TrainConfig) -> str:
    names = LAYOUT_FLAGS + (("keep_gathered",) if tc.keep_gathered else ())
    return " ".join(flag(name, getattr(tc, name)) for name in names)


def train_command(tc: train.TrainConfig, overrides: dict, config: str, world: int) -> str:
    """The train.py command of `tc` and `overrides`: the config file, the layout, what else changed."""
    base = [flag("config", config)] if config else []
    base_tc, base_overrides = train_args(base, world)
    flags = base + [flag(name, getattr(tc, name)) for name in LAYOUT_FLAGS]
    flags += [flag(f.name, getattr(tc, f.name)) for f in dataclasses.fields(tc)
              if f.name not in LAYOUT_FLAGS and getattr(tc, f.name) != getattr(base_tc, f.name)]
    flags += [flag(name, value) for name, value in overrides.items() if base_overrides.get(name) != value]
    return " ".join(["train.py"] + [shlex.quote(f) for f in flags])


def why_slower(t: dict, best: dict) -> str:
    """The part of the step that grew most against the best layout's."""
    if t["step_s"] <= 1.005 * best["step_s"]:
        return "ties with the fastest (within 0.5%)"
    worst = max(set(t["seconds"]) | set(best["seconds"]),
                key=lambda k: t["seconds"].get(k, 0.0) - best["seconds"].get(k, 0.0))
    return f"{worst} {t['seconds'].get(worst, 0.0):.3g} s vs {best['seconds'].get(worst, 0.0):.3g} s"


# --- Failures: the time they cost

def lost_fraction(interval_s: float, checkpoint_s: float, down_s: float, mtbf_s: float) -> float:
    """The fraction of time lost, to first order in (interval, downtime) / MTBF: a checkpoint per interval; per
    failure, the work since the last one (half an interval on average) and the downtime."""
    return checkpoint_s / interval_s + (interval_s / 2 + down_s) / mtbf_s


def failure_costs(p: dict, tc: train.TrainConfig, step_s: float, args) -> dict:
    """Goodput of plan `p`, restarted by hand or elastic, at Young's interval and at train.py's."""
    mtbf_s = args.mtbf_hours * 3600 / p["world"]  # independent failures: the job fails `world` times as often
    write_s = p["checkpoint"]["write_bytes"] / (args.storage_gbs * 1e9)
    read_s = p["checkpoint"]["read_bytes"] / (args.storage_gbs * 1e9)
    restart_s = args.restart_minutes * 60 + read_s
    timeout_s = max(60, tc.step_timeout or 1800)  # train.py's collective timeout: when survivors see a lost peer
    down_s = {"by hand": args.repair_minutes * 60 + restart_s,
              # the survivors restart without the node at once; its return is a second, planned restart
              "elastic": timeout_s + 2 * restart_s}
    best_s = math.sqrt(2 * write_s * mtbf_s)
    periods = [s for s in (tc.ckpt_every * step_s, tc.ckpt_minutes * 60) if s > 0]
    configured_s = min(periods) if periods else math.inf  # no periodic checkpoint: a failure loses the whole run
    goodput = {name: {way: max(0.0, 1 - lost_fraction(interval, write_s, down, mtbf_s)) for way, down in down_s.items()}
               for name, interval in (("best", best_s), ("configured", configured_s))}
    return {"mtbf_hours_job": mtbf_s / 3600,
            "checkpoint_write_bytes": p["checkpoint"]["write_bytes"], "checkpoint_write_s": write_s,
            "checkpoint_read_bytes": p["checkpoint"]["read_bytes"], "checkpoint_read_s": read_s, "timeout_s": timeout_s,
            "downtime_s": down_s, "interval_s": best_s, "interval_steps": max(1, round(best_s / step_s)),
            "configured_interval_s": configured_s, "goodput": goodput}


# --- The report

def print_plan(r: dict, tc: train.TrainConfig, p: dict, t: dict, links: Links, layout: str):
    print(f"plan: {tc.preset} on {r['gpus']} x {r['gpu']}, {layout_flags(tc)} --optimizer={tc.optimizer}: "
          f"{p['accumulation_steps']} micro-batches a step of {tc.global_batch} x {tc.seq_len} tokens")
    print(layout)
    print(f"parameters: {p['params_total'] / 1e9:.2f}B, {p['params_active'] / 1e9:.2f}B active, "
          f"{p['params_per_gpu'] / 1e9:.3f}B per GPU; FLOPs per token {p['flops_per_token'] / 1e9:.2f} G")
    print("memory per GPU:")
    for k, v in r["memory_gib"].items():
        print(f"  {k:48s} {v:9.2f} GiB")
    print(f"  {'total':48s} {r['memory_gib_per_gpu']:9.2f} GiB of {FIT_FRACTION * GPUS[r['gpu']][1]:.0f} usable; "
          + "activations by --ac: " + ", ".join(f"{k} {v:.1f}" for k, v in r["activations_gib_by_ac"].items()) + " GiB")
    spans = ", ".join(f"{name} {k} x {m}" for name, (k, m) in p["groups"].items())
    print(f"links: NVLink {links.intra / 1e9:g} GB/s x {links.per_node}, network {links.inter / 1e9:g} GB/s, "
          f"{links.latency * 1e6:g} us a step; groups (ranks per node x nodes): {spans}")
    print("bytes each GPU sends a step (over the network) and their time on the links:")
    for k, v in p["traffic_bytes_per_step"].items():
        print(f"  {k:40s} {v / 1e9:9.1f} GB ({p['network_bytes_per_step'][k] / 1e9:7.1f}) "
              f"{t['link_s'].get(k, 0.0):7.2f} s")
    o = r["optimizer_step"]
    muon = f"Newton-Schulz {o['muon_flops_per_gpu'] / 1e12:.1f} TFLOP on the busiest rank, all-to-all " \
           f"{o['muon_all_to_all_bytes_per_gpu'] / 1e9:.2f} GB, " if tc.optimizer == "muon" else ""
    print(f"optimizer step: {muon}memory passes {o['hbm_bytes_per_gpu'] / 1e9:.1f} GB; {o['seconds']:.3g} s")
    print(f"time per step (compute at {r['compute_tflops']:g} TFLOP/s):")
    for k, v in sorted(t["seconds"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:48s} {v:9.2f} s")
    print(f"  {'step':48s} {t['step_s']:9.2f} s: {t['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU "
          f"{100 * t['mfu']:.1f}%, {t['days']:.1f} days for {tc.steps:,} steps")


def print_failures(f: dict, t: dict):
    down = f["downtime_s"]
    best = f["goodput"]["best"]
    configured = f["goodput"]["configured"]
    days = {way: t["days"] / g if g else math.inf for way, g in best.items()}
    print(f"failures: one every {f['mtbf_hours_job']:.3g} h, {down['by hand'] / 60:.1f} min down by hand, "
          f"{down['elastic'] / 60:.1f} elastic; a checkpoint writes {f['checkpoint_write_bytes'] / 2**30:.2f} GiB "
          f"per GPU in {f['checkpoint_write_s']:.3g} s, a restart reads {f['checkpoint_read_bytes'] / 2**30:.1f} GiB")
    print(f"  checkpoint every {f['interval_s'] / 60:.3g} min (--ckpt_every={f['interval_steps']}): goodput "
          f"{100 * best['by hand']:.1f}% by hand, {100 * best['elastic']:.1f}% elastic ({days['by hand']:.1f} and "
          f"{days['elastic']:.1f} days; {100 * configured['by hand']:.1f}% and {100 * configured['elastic']:.1f}% "
          f"as configured)")


def print_search(best: list, tried: int, fit: int, t: dict, command: str, tc: train.TrainConfig, world: int):
    print(f"fastest layouts that fit ({fit} of {tried}; global batch {tc.global_batch} x {tc.seq_len}):"
          + ("" if best else " none; use more GPUs or a smaller model"))
    for i, (candidate, planned, projected) in enumerate(best):
        lose = f"+{100 * (projected['step_s'] / best[0][2]['step_s'] - 1):.1f}%: {why_slower(projected, best[0][2])}"
        print(f"  {i + 1}. {layout_flags(candidate):76s} {projected['step_s']:#7.3g} s  MFU "
              f"{100 * projected['mfu']:4.1f}%  {projected['days']:5.1f} days  "
              f"{planned['memory_total_bytes'] / 2**30:5.0f} GiB  {lose if i else 'fastest'}")
    if best:
        print(f"  this layout: {t['step_s']:.3g} s; vs the fastest: {why_slower(t, best[0][2])}")
        print(f"  the fastest on {world} ranks: {command}")


def plan_run(args, tc: train.TrainConfig, overrides: dict) -> dict:
    """Plan and print the run `tc` describes on args.gpus GPUs; the result as a dict."""
    peak, mem_gib, nvlink_gbs, net_gbs, hbm_tbs = GPUS[args.gpu]
    links = Links(args.gpus_per_node, (args.nvlink_gbs or nvlink_gbs) * 1e9, (args.net_gbs or net_gbs) * 1e9,
                  args.latency_us * 1e-6, args.hbm_gbs * 1e9 or hbm_tbs * 1e12)
    tflops = args.tflops or args.mfu * peak
    # The vocabulary is the preset's (train.py takes the data's, which need not be here): --vocab_size plans another.
    cfg = dataclasses.replace(checkpoint.hf_config(tc.init_from_hf), **overrides) if tc.init_from_hf else \
        train.model_config(tc, overrides, PRESETS[tc.preset].vocab_size)
    result = {"command": "plan", "preset": tc.preset, "gpu": args.gpu, "gpus": args.gpus, "seq": tc.seq_len,
              **{k: getattr(tc, k) for k in ("global_batch", "steps", "optimizer", "keep_gathered", *LAYOUT_FLAGS)},
              "gpus_per_node": links.per_node, "nvlink_gb_s": links.intra / 1e9, "network_gb_s": links.inter / 1e9,
              "latency_us": links.latency * 1e6, "hbm_gb_s": links.hbm / 1e9, "compute_tflops": tflops}
    try:
        p = estimate(cfg, tc, args.gpus, links)
    except ValueError as e:
        return {**result, "fits": False, "reason": str(e), "exit": 2}
    t = project(p, tflops * 1e12, peak, tc.steps)
    total_gib = p["memory_total_bytes"] / 2**30
    budget = FIT_FRACTION * mem_gib
    per = lambda d, unit: {k: v / unit for k, v in d.items()}  # noqa: E731
    o = p["optimizer"]
    result.update({k: p[k] for k in ("params_total", "params_active", "params_per_gpu", "flops_per_token",
                                     "accumulation_steps")},
                  memory_gib_per_gpu=total_gib, memory_gib=per(p["memory_bytes"], 2**30),
                  activations_gib_by_ac=per(p["activations_by_ac"], 2**30),
                  traffic_gb_per_step_per_gpu=per(p["traffic_bytes_per_step"], 1e9),
                  network_gb_per_step_per_gpu=per(p["network_bytes_per_step"], 1e9),
                  step_seconds=t["step_s"], seconds_per_step=t["seconds"], link_seconds_per_step=t["link_s"],
                  tokens_per_s_per_gpu=t["tokens_per_s_per_gpu"], mfu=t["mfu"], days=t["days"],
                  fits=total_gib <= budget, failures=failure_costs(p, tc, t["step_s"], args),
                  optimizer_step={"seconds": t["optimizer_s"], "hbm_bytes_per_gpu": o["hbm_bytes"]} | (
                      {"muon_flops_per_gpu": o["flops"], "muon_flops_mean": o["flops_mean"],
                       "muon_all_to_all_bytes_per_gpu": o["a2a_bytes"][0]} if tc.optimizer == "muon" else {}))
    print_plan(result, tc, p, t, links, p["layout"].describe(cfg.n_experts))
    print_failures(result["failures"], t)
    if args.search:
        best, tried, fit = search(cfg, tc, args.gpus, args.gpu, links, tflops * 1e12)
        command = train_command(best[0][0], overrides, args.config, args.gpus) if best else None
        print_search(best, tried, fit, t, command, tc, args.gpus)
        result["search"] = {"tried": tried, "fit": fit, "command": command, "best": [
            {"flags": layout_flags(candidate), "step_seconds": projected["step_s"], "mfu": projected["mfu"],
             "days": projected["days"], "memory_gib_per_gpu": planned["memory_total_bytes"] / 2**30,
             "seconds_per_step": projected["seconds"]} for candidate, planned, projected in best]}
    if not result["fits"]:
        result["reason"] = (f"the plan needs {total_gib:.1f} GiB per GPU but a {args.gpu} offers {budget:.0f}; try "
                            f"--ac=full, a smaller --micro_batch, a lower --dp_replicate or a higher --cp")
        result["exit"] = 1
    return result


# --- Command line: plan.py's own flags, then train.py's

def plan_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="plan.py", description=__doc__.split("\n\n")[0].strip(), allow_abbrev=False,
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                    epilog="Also takes every train.py flag (python train.py --help).")
    add = parser.add_argument
    number = at_least(0).parse(float)
    add("--config", default="", help="the run's config file")
    add("--gpus", type=at_least(0).parse(int), default=0, help="world size (0: --config's world_size, else 1)")
    add("--gpu", choices=GPUS, default="b300", help="GPU kind: its peak, memory and link speeds")
    add("--tokens", type=number, default=0, help="token budget: sets --steps (0: train.py's --steps)")
    add("--mfu", type=Rule(lambda v, _: 0 < v <= 1, "above 0 and at most 1").parse(float), default=0.4,
        help="the compute rate, a fraction of the bf16 peak (communication comes on top)")
    add("--tflops", type=number, default=0, help="the compute rate in TFLOP/s, e.g. bench.py's (0: --mfu's)")
    add("--gpus_per_node", type=at_least(1).parse(int), default=8, help="GPUs joined by NVLink")
    add("--nvlink_gbs", type=number, default=0, help="NVLink GB/s per GPU each way (0: the GPU's)")
    add("--net_gbs", type=number, default=0, help="network GB/s per GPU each way (0: the GPU's)")
    add("--latency_us", type=number, default=5.0, help="microseconds per step of a collective")
    add("--hbm_gbs", type=number, default=0, help="HBM GB/s, for the optimizer (0: the GPU's)")
    add("--mtbf_hours", type=above(0).parse(float), default=8192.0,
        help="mean hours between failures of one GPU (and its share of the rest)")
    add("--repair_minutes", type=number, default=30.0, help="minutes from a failure to a relaunch by hand")
    add("--restart_minutes", type=number, default=5.0, help="minutes from a launch to the first step, reads aside")
    add("--storage_gbs", type=above(0).parse(float), default=2.0, help="checkpoint GB/s per GPU")
    add("--search", type=parse_bool, nargs="?", const=True, default=True,
        help="also list the five fastest layouts that fit")
    add("--json", action="store_true", help="print the result as JSON on the last line")
    return parser


def train_args(argv: list[str], world: int) -> tuple[train.TrainConfig, dict]:
    """train.parse_args as train.py resolves it on `world` ranks (--micro_batch=0: a rank's share)."""
    tc, overrides = train.parse_args(argv)
    layout = parallel.Layout.for_world(world, tc.dp_replicate, tc.dp_shard, tc.ep, tc.cp)
    return train.with_micro_batch(tc, layout.dp), overrides


def parse(argv: list[str]) -> tuple[argparse.Namespace, train.TrainConfig, dict]:
    """(plan.py's flags, TrainConfig, model overrides); args.gpus resolved."""
    parser = plan_parser()
    args, rest = train.parse_tool_args(parser, argv)
    config = [flag("config", args.config)] if args.config else []
    try:
        if args.config and not args.gpus:  # the world size a run's config.json records (a TOML file may)
            args.gpus = config_file(args.config).get("world_size", 0)
            if not isinstance(args.gpus, int) or args.gpus < 0:
                raise ValueError(f"--config={args.config} sets world_size to {args.gpus!r}; make it a GPU count or "
                                 f"pass --gpus.")
        args.gpus = args.gpus or 1
        tc, overrides = train_args(config + rest, args.gpus)
    except ValueError as e:
        parser.error(str(e))
    if args.tokens:
        tc = dataclasses.replace(tc, steps=math.ceil(args.tokens / (tc.global_batch * tc.seq_len)))
    return args, tc, overrides


def main(argv: list[str] | None = None) -> int:
    args, tc, overrides = parse(sys.argv[1:] if argv is None else argv)
    try:
        result = plan_run(args, tc, overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    code = result.pop("exit", 0)
    if code:
        print(f"error: {result['reason']}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, default=float))
    return code


if __name__ == "__main__":
    sys.exit(main())
