"""
Pre-train an AfMoE model, from one CPU to thousands of GPUs: the same file runs alone or under torchrun.

    python train.py                                       # tiny model on the embedded corpus (CPU, minutes)
    python train.py --preset=tiny --steps=500 --lr=3e-3   # flags are TrainConfig fields; model fields too
    torchrun --nproc_per_node=8 train.py --dp_replicate=2 --ep=4 --global_batch=64
    python train.py --help

Each optimizer step: the rank's slice of the global batch, split into micro-batches with gradient accumulation,
gradient clipping over the whole model, one optimizer step, then one expert-bias update from the tokens-per-expert
counts of the whole global batch (SPEC §4). Logs go to the console and to OUT_DIR/metrics.jsonl.

Under `torchrun --max-restarts=N`, a job whose rank dies restarts and resumes from the newest complete checkpoint by
itself (--resume=auto). Launch it with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch >= 2.5 keeps torchrun's store
across restarts, where a restarted rank can read a dead one's address and fail to connect (pytorch/pytorch#135712).
"""

import argparse
import contextlib
import dataclasses
import difflib
import faulthandler
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

import checkpoint
import data
import parallel
from model import PRESETS, ModelConfig, max_vio, meta_model, pad_vocab, update_expert_bias


def _flag(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # model and data
    preset: str = _flag("tiny", f"model preset: {', '.join(PRESETS)}; any ModelConfig field can be overridden too, "
                                f"e.g. --n_layers=8")
    data: str = _flag(data.DEFAULT_DATA_DIR, "prepared data directory (python data.py); the default corpus is "
                                             "prepared automatically when absent")
    tokenizer: str = _flag("cl100k_base", "tiktoken encoding the data was prepared with; sizes the vocabulary")
    seq_len: int = _flag(128, "tokens per sequence")
    doc_mask: bool = _flag(True, "intra-document attention masking (a token sees only its own document)")
    # batch and schedule
    steps: int = _flag(150, "optimizer steps")
    global_batch: int = _flag(8, "sequences per optimizer step, whatever the number of ranks")
    micro_batch: int = _flag(8, "sequences per rank per forward; accumulation steps are derived")
    lr: float = _flag(5e-3, "peak learning rate")
    min_lr_ratio: float = _flag(0.1, "final LR as a fraction of the peak")
    warmup_steps: int = _flag(20, "linear warmup steps")
    decay: str = _flag("cosine", "LR decay after warmup: cosine | linear | wsd (constant, then linear over the "
                                 "last --wsd_decay_frac of steps)")
    wsd_decay_frac: float = _flag(0.2, "fraction of steps spent decaying with --decay=wsd")
    weight_decay: float = _flag(0.1, "AdamW weight decay on matrices (not norms or biases)")
    beta1: float = _flag(0.9, "AdamW beta1")
    beta2: float = _flag(0.95, "AdamW beta2")
    optimizer: str = _flag("adamw", "adamw | muon: Muon for the hidden matrices (attention, dense FFN, shared and "
                                    "routed experts) and AdamW at --lr for the embedding, head, router and norms "
                                    "(SPEC §5)")
    muon_lr: float = _flag(5e-2, "peak LR of the Muon matrices, on --lr's schedule; each matrix's step is scaled "
                                 "by sqrt(max(1, fan_out/fan_in))")
    muon_momentum: float = _flag(0.95, "Muon momentum (Nesterov)")
    grad_clip: float = _flag(1.0, "clip the global gradient norm to this (0: off)")
    seed: int = _flag(0, "seed for initialisation and data order")
    # expert load balancing (SPEC §4)
    balance: str = _flag("smebu", "expert-bias update once per step: smebu | sign | none")
    smebu_lambda: float = _flag(5e-4, "SMEBU step size λ")
    smebu_beta: float = _flag(0.5, "SMEBU momentum β")
    smebu_kappa: float = _flag(2.0, "SMEBU tanh sharpness κ")
    sign_gamma: float = _flag(1e-3, "sign-rule step size γ")
    bias_freeze_step: int = _flag(-1, "stop expert-bias updates from this step on (-1: never)")
    # parallelism and precision (parallel.py)
    dp_replicate: int = _flag(1, "HSDP replicas R: world = R x S, parameters sharded over S = world / R")
    ep: int = _flag(1, "expert-parallel degree: divides S; routed experts split over ep consecutive ranks")
    ac: str = _flag("none", "activation checkpointing: none | full | selective")
    keep_gathered: bool = _flag(False, "FSDP keeps every unit's parameters gathered from the first micro-batch's "
                                       "forward to the last one's backward: one all-gather per step instead of two "
                                       "per micro-batch, for the memory of the unsharded model in compute dtype")
    compile: bool = _flag(False, "torch.compile each transformer block")
    dtype: str = _flag("auto", "compute dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32")
    # logging and evaluation
    out_dir: str = _flag("out", "where metrics.jsonl, config.json and checkpoints go")
    log_every: int = _flag(10, "log every N steps")
    eval_every: int = _flag(50, "validate every N steps (and at the end; 0: only at the end)")
    eval_batches: int = _flag(4, "validation batches (of global_batch sequences) per evaluation")
    peak_tflops: float = _flag(0.0, "device bf16 peak for MFU; 0: from the device table (unknown: n/a)")
    sample_tokens: int = _flag(48, "tokens sampled from a prompt at the end (0: none)")
    # checkpoints and fault tolerance (checkpoint.py)
    ckpt_every: int = _flag(0, "checkpoint every N steps (0: only at the end and on preemption)")
    keep_ckpts: int = _flag(3, "keep the newest K complete checkpoints")
    async_ckpt: bool = _flag(True, "write checkpoints in the background while training continues")
    resume: str = _flag("auto", "auto: continue from the newest complete checkpoint in OUT_DIR/checkpoints; "
                                "none: start fresh; or a checkpoint directory")
    init_from_hf: str = _flag("", "start from a Hugging Face afmoe folder (python checkpoint.py export ...)")
    step_timeout: float = _flag(600.0, "watchdog: dump stacks and exit non-zero if no step completes in this many "
                                       "seconds (0: off); also the collective timeout")
    max_bad_steps: int = _flag(5, "stop after this many non-finite (NaN/Inf) steps in a row")
    crash_at_step: int = _flag(-1, "fault drill: the last rank dies after this step (first launch only)")
    stall_at_step: int = _flag(-1, "fault drill: this step hangs, for the watchdog (first launch only)")
    nan_at_step: int = _flag(-1, "fault drill: this step's loss is NaN, for the non-finite guard")
    skew_router: float = _flag(0.0, "collapse drill: a fresh run starts with this selection bias on the first "
                                    "2*top_k experts of every MoE layer, a router collapsed onto a few experts")

    def __post_init__(self):
        problems = [f"--{name}={getattr(self, name)} must be {requirement}"
                    for name, ok, requirement in FLAG_RANGES if not ok(getattr(self, name))]
        if problems:
            raise ValueError("; ".join(problems) + ".")


# The numeric flags' valid ranges, checked when a TrainConfig is made (a value outside fails with one sentence
# each, before anything runs). Sizes, batches and the layout are checked where they are used (data.py, parallel.py).
FLAG_RANGES = [
    ("steps", lambda v: v >= 1, "at least 1"),
    ("lr", lambda v: v >= 0, "0 or more"),
    ("min_lr_ratio", lambda v: 0 <= v <= 1, "between 0 and 1"),
    ("warmup_steps", lambda v: v >= 0, "0 or more"),
    ("wsd_decay_frac", lambda v: 0 < v <= 1, "above 0 and at most 1"),
    ("weight_decay", lambda v: v >= 0, "0 or more"),
    ("beta1", lambda v: 0 <= v < 1, "at least 0 and below 1"),
    ("beta2", lambda v: 0 <= v < 1, "at least 0 and below 1"),
    ("muon_lr", lambda v: v >= 0, "0 or more"),
    ("muon_momentum", lambda v: 0 <= v < 1, "at least 0 and below 1"),
    ("grad_clip", lambda v: v >= 0, "0 (no clipping) or more"),
    ("smebu_lambda", lambda v: v >= 0, "0 or more"),
    ("smebu_beta", lambda v: 0 <= v < 1, "at least 0 and below 1"),
    ("smebu_kappa", lambda v: v > 0, "above 0"),
    ("sign_gamma", lambda v: v >= 0, "0 or more"),
    ("bias_freeze_step", lambda v: v >= -1, "-1 (never) or a step number"),
    ("log_every", lambda v: v >= 1, "at least 1"),
    ("eval_every", lambda v: v >= 0, "0 (only at the end) or more"),
    ("eval_batches", lambda v: v >= 1, "at least 1"),
    ("peak_tflops", lambda v: v >= 0, "0 (from the device table) or more"),
    ("sample_tokens", lambda v: v >= 0, "0 (no sample) or more"),
    ("ckpt_every", lambda v: v >= 0, "0 (only at the end) or more"),
    ("keep_ckpts", lambda v: v >= 1, "at least 1"),
    ("step_timeout", lambda v: v >= 0, "0 (off) or more"),
    ("max_bad_steps", lambda v: v >= 1, "at least 1"),
]


# --- command line: every TrainConfig field and every ModelConfig field is a --flag=value option

MODEL_FIELDS = {f.name: f for f in fields(ModelConfig)}


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        flags = [a for action in self._actions for a in action.option_strings]
        for word in ([] if message.startswith("argument ") else message.replace(",", " ").split()):
            if word.startswith("--") and word.split("=")[0] not in flags:
                close = difflib.get_close_matches(word.split("=")[0], flags, n=1, cutoff=0.5)
                if close:
                    message = f"unknown flag {word.split('=')[0]}; did you mean {close[0]}?"
                    break
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, dict]:
    """Returns the TrainConfig and the model-field overrides given on the command line."""
    parser = _Parser(description=__doc__.split("\n\n")[0].strip(), allow_abbrev=False,
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(TrainConfig):
        kind = _parse_bool if f.type is bool or f.type == "bool" else type(f.default)
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=f.metadata["help"],
                            **({"nargs": "?", "const": True} if kind is _parse_bool else {}))
    group = parser.add_argument_group("model overrides (default: the preset's value)")
    for f in MODEL_FIELDS.values():
        kind = _parse_bool if f.type is bool or f.type == "bool" else type(f.default)
        group.add_argument(f"--{f.name}", type=kind, default=None, help=f"ModelConfig.{f.name}",
                           **({"nargs": "?", "const": True} if kind is _parse_bool else {}))
    args = vars(parser.parse_args(argv))
    overrides = {k: args.pop(k) for k in MODEL_FIELDS if args.get(k) is not None}
    try:
        tc = TrainConfig(**{k: v for k, v in args.items() if k in {f.name for f in fields(TrainConfig)}})
    except ValueError as e:  # a numeric flag out of range (FLAG_RANGES)
        parser.error(str(e))
    for name, allowed in (("preset", PRESETS), ("decay", ("cosine", "linear", "wsd")),
                          ("balance", ("smebu", "sign", "none")), ("ac", ("none", "full", "selective")),
                          ("dtype", ("auto", "bf16", "fp32")), ("optimizer", ("adamw", "muon"))):
        if getattr(tc, name) not in allowed:
            parser.error(f"--{name}={getattr(tc, name)} is not one of {', '.join(allowed)}")
    return tc, overrides


def model_config(tc: TrainConfig, overrides: dict, vocab_size: int) -> ModelConfig:
    """The preset, sized to the tokenizer's vocabulary (padded to a multiple of 128), then the user's overrides."""
    preset = PRESETS[tc.preset]
    cfg = dataclasses.replace(preset, **{"vocab_size": pad_vocab(vocab_size), "max_seq_len": max(tc.seq_len, 1),
                                         **overrides})
    if cfg.max_seq_len < tc.seq_len:
        raise ValueError(f"--max_seq_len={cfg.max_seq_len} is below --seq_len={tc.seq_len}: the model would train on "
                         f"positions its exported config says it does not have; raise it or leave it unset.")
    return cfg


# --- schedule and metrics helpers

def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    floor = tc.lr * tc.min_lr_ratio
    if tc.decay == "wsd":
        decay_start = int(tc.steps * (1 - tc.wsd_decay_frac))
        progress = max(0.0, (step - decay_start) / max(1, tc.steps - 1 - decay_start))
        return tc.lr - (tc.lr - floor) * progress
    progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.steps - 1 - tc.warmup_steps))
    if tc.decay == "linear":
        return tc.lr - (tc.lr - floor) * progress
    return floor + (tc.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# Dense bf16 peaks (SPEC §7). B300's gains are in FP4, not bf16.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "B300": 2250.0, "A100": 312.0}


def peak_tflops(device: torch.device, override: float = 0.0) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def build_optimizer(model, tc: TrainConfig, fused: bool = True):
    """--optimizer=adamw: AdamW; weight decay on matrices only (embeddings, projections, experts), not on norms.
    --optimizer=muon (SPEC §5): parallel.Muon with Muon at --muon_lr for the hidden matrices of every block, each
    routed expert's two matrices orthogonalised separately, and AdamW at --lr for the embedding, the head, the norms
    and the router: a small [E, D] matrix whose rows are the experts' score vectors, which orthogonalisation would
    couple and equalise whatever each expert's load (AdamW keeps them independent).
    `fused`: torch's one-pass AdamW kernel, on CUDA and CPU alike (on CPU about 3x faster than the per-tensor loop
    torch picks by default there, which with 256 experts per layer is a large part of a small step)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if tc.optimizer == "adamw":
        decay = [p for _, p in params if p.dim() >= 2]
        no_decay = [p for _, p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), fused=fused)
    if tc.optimizer != "muon":
        raise ValueError(f"--optimizer={tc.optimizer} is not one of adamw, muon.")
    if tc.lr <= 0:
        raise ValueError(f"--lr={tc.lr} must be positive with --optimizer=muon: the Muon LR is set relative to it.")
    hidden = [p for n, p in params if n.startswith("layers.") and p.dim() >= 2 and ".router." not in n]
    ids = {id(p) for p in hidden}
    groups = [{"params": hidden, "muon": True, "lr_scale": tc.muon_lr / tc.lr, "weight_decay": tc.weight_decay},
              {"params": [p for _, p in params if p.dim() >= 2 and id(p) not in ids], "muon": False,
               "weight_decay": tc.weight_decay},
              {"params": [p for _, p in params if p.dim() < 2], "muon": False, "weight_decay": 0.0}]
    return parallel.Muon(groups, lr=tc.lr, momentum=tc.muon_momentum, betas=(tc.beta1, tc.beta2), fused=fused)


def state_copies(tc: TrainConfig) -> int:
    """fp32 copies of the weights that training keeps at least: the weights, their gradients and the optimizer's
    moments (AdamW two; Muon one for the hidden matrices, which are nearly all of them)."""
    return 4 if tc.optimizer == "adamw" else 3


def moe_layers(model) -> list:
    return model.moe_layers()


@torch.no_grad()
def evaluate(model, loader, n_batches: int, micro_batch: int, autocast) -> float:
    """Mean LM loss over the first n validation batches (the same rows every time), averaged over ranks."""
    model.eval()
    total, count = torch.zeros((), device=loader_device(model)), 0
    for tokens_BT, targets_BT, doc_ids_BT in loader.val_batches(n_batches):
        for i in range(0, tokens_BT.shape[0], micro_batch):
            tok, tgt, doc = (t[i:i + micro_batch].to(total.device) for t in (tokens_BT, targets_BT, doc_ids_BT))
            with autocast:
                loss = model(tok, targets_BT=tgt, doc_ids_BT=doc)
            total += loss.float()
            count += 1
    model.train()
    return parallel.all_reduce_sum_(total / max(count, 1)).item() / world_size()


def loader_device(model) -> torch.device:
    return next(model.parameters()).device


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# --- one optimizer step: the piece bench.py times as well

def train_step(model, optimizer, batch, tc: TrainConfig, autocast, state: dict, poison: bool = False) -> dict:
    """Forward/backward over the rank's micro-batches, global gradient clipping, optimizer step, expert-bias
    update. `state` holds the balancing momentum ("momentum": [L, E]) and the bad-step counter. Returns metrics
    (losses averaged over the global batch, global tokens-per-expert counts)."""
    device = loader_device(model)
    tokens_BT, targets_BT, doc_ids_BT = (t.to(device, non_blocking=True) for t in batch)
    n_micro = tokens_BT.shape[0] // tc.micro_batch
    layers = moe_layers(model)
    counts_LE = torch.zeros(len(layers), model.cfg.n_experts, device=device)
    losses = torch.zeros(3, device=device)  # lm, aux, z
    if tc.keep_gathered and hasattr(model, "set_reshard_after_forward"):
        model.set_reshard_after_forward(False)  # the root too (FSDP2 keeps only the root's gathered by default)
    for i in range(n_micro):
        rows = slice(i * tc.micro_batch, (i + 1) * tc.micro_batch)
        if hasattr(model, "set_requires_all_reduce"):
            # FSDP reduce-scatters every micro-batch (holding unsharded gradients across micro-batches would cost
            # a full model of fp32 gradients per GPU) and all-reduces across HSDP replicas on the last one only.
            model.set_requires_all_reduce(i == n_micro - 1)
            if tc.keep_gathered:  # the optimizer updates the shards: the last micro-batch frees the gathered copies
                model.set_reshard_after_backward(i == n_micro - 1)
        with autocast:
            lm_loss = model(tokens_BT[rows], targets_BT=targets_BT[rows],
                            doc_ids_BT=doc_ids_BT[rows] if tc.doc_mask else None)
            balance_loss = model.balance_loss()
            if poison:
                lm_loss = lm_loss * float("nan")
        ((lm_loss + balance_loss) / n_micro).backward()
        # Read right after the forward: activation checkpointing re-runs forward in backward and overwrites these
        # with identical values, so each token is counted exactly once.
        for l, moe in enumerate(layers):
            counts_LE[l] += moe.counts_E
        zero = torch.zeros((), device=device)
        losses += torch.stack([lm_loss.detach().float(),
                               sum((m.aux_loss.detach() for m in layers if m.aux_loss is not None), zero),
                               sum((m.z_loss.detach() for m in layers if m.z_loss is not None), zero)]) / n_micro
    # The global batch: counts summed over ranks, losses averaged.
    parallel.all_reduce_sum_(counts_LE)
    parallel.all_reduce_sum_(losses)
    losses /= world_size()
    grad_norm = parallel.clip_grad_norm_(model, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
    finite = bool(torch.isfinite(grad_norm)) and bool(torch.isfinite(losses).all())
    if finite:
        optimizer.step()
        state["bad_steps"] = 0
    else:  # a NaN/Inf step changes nothing: no update, no bias move
        state["bad_steps"] = state.get("bad_steps", 0) + 1
        state["skipped"] = state.get("skipped", 0) + 1
    optimizer.zero_grad(set_to_none=True)
    if finite and tc.balance != "none" and (tc.bias_freeze_step < 0 or state["step"] < tc.bias_freeze_step):
        for l, moe in enumerate(layers):
            update_expert_bias(moe.expert_bias, counts_LE[l], state["momentum"][l], tc.balance, tc.smebu_lambda,
                               tc.smebu_beta, tc.smebu_kappa, tc.sign_gamma)
    return {"loss": losses[0].item() + losses[1].item() + losses[2].item(), "lm_loss": losses[0].item(),
            "aux_loss": losses[1].item(), "z_loss": losses[2].item(), "grad_norm": grad_norm.item(),
            "finite": finite, "counts_LE": counts_LE}


def balance_metrics(counts_LE: torch.Tensor, layers) -> dict:
    per_layer = [max_vio(c) for c in counts_LE]
    return {"max_vio": max(per_layer) if per_layer else 0.0,
            "max_vio_layers": [round(v, 4) for v in per_layer],
            "min_load_layers": counts_LE.min(-1).values.long().tolist(),
            "max_load_layers": counts_LE.max(-1).values.long().tolist(),
            "dead_experts_layers": (counts_LE == 0).sum(-1).tolist(),
            "bias_norm_layers": [round(m.expert_bias.norm().item(), 6) for m in layers]}


# --- fault tolerance: preemption signals and a hang watchdog

class Preemption:
    """SIGTERM / SIGUSR1 (Slurm, Kubernetes, spot reclaim) set a flag; the loop finishes the step in flight, every
    rank agrees (one all-reduce), writes a checkpoint and exits 0."""

    def __init__(self):
        self.requested = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def _handle(self, signum, frame):
        self.requested = True

    def close(self):
        """Give the signals back to their previous handlers (train.main may run inside another program)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def global_sums(device, *values: float) -> list[float]:
    """Each value summed over all ranks, in one all-reduce (float64: integers below 2**53 stay exact)."""
    return parallel.all_reduce_sum_(torch.tensor(values, dtype=torch.float64, device=device)).tolist()


class Watchdog:
    """If no step completes within `timeout_s`, dump every thread's stack to stderr and exit non-zero, so torchrun
    restarts the job from the newest checkpoint (the Trinity team alerted after 3 minutes without a step)."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.last_beat, self.step = timeout_s, time.time(), 0
        self.stopped = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, daemon=True).start()

    def beat(self, step: int):
        self.last_beat, self.step = time.time(), step

    def stop(self):
        """The run is over: a program that called train.main goes on without a timer that would kill it."""
        self.stopped.set()

    def _watch(self):
        while not self.stopped.wait(min(5.0, self.timeout_s / 4)):
            if time.time() - self.last_beat > self.timeout_s:
                print(f"watchdog: no step completed for {self.timeout_s:.0f}s after step {self.step}; "
                      f"stacks of every thread follow, then exit 3", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(3)


# --- the run

def autocast_for(tc: TrainConfig, device: torch.device):
    """(autocast context, compute dtype or None): bf16 on GPU, fp32 on CPU, unless --dtype says otherwise."""
    dtype = torch.bfloat16 if (tc.dtype == "bf16" or (tc.dtype == "auto" and device.type == "cuda")) else None
    return (torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()), dtype


def main(tc: TrainConfig, overrides: dict) -> dict:
    # --- setup: ranks, devices, precision, output directory
    rank, world, device = parallel.init_distributed(timeout_s=max(60, tc.step_timeout or 1800))
    master = rank == 0
    say = print if master else (lambda *a, **k: None)
    torch.manual_seed(tc.seed)
    autocast, dtype = autocast_for(tc, device)
    ckpt_root = os.path.join(tc.out_dir, "checkpoints")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    # --- data: the default corpus is prepared on first use (rank 0 writes, the others wait)
    if tc.data == data.DEFAULT_DATA_DIR and not os.path.exists(os.path.join(tc.data, "manifest.json")):
        if master:
            data.prepare(out_dir=tc.data)
        if dist.is_initialized():
            dist.barrier()
    manifest = data.load_manifest(tc.data)
    if tc.init_from_hf:
        cfg = dataclasses.replace(checkpoint.hf_config(tc.init_from_hf), **overrides)
    else:
        cfg = model_config(tc, overrides, manifest["vocab_size"])

    # --- layout: checked on every rank before any collective (parallel.py)
    layout = parallel.Layout(world, tc.dp_replicate, tc.ep)
    layout.check(cfg, tc.global_batch, tc.micro_batch)
    loader = data.DataLoader(tc.data, "train", tc.seq_len, tc.global_batch, rank, world, tc.seed,
                             vocab_size=cfg.vocab_size, tokenizer=tc.tokenizer)
    val_loader = data.DataLoader(tc.data, "val", tc.seq_len, tc.global_batch, rank, world, tc.seed,
                                 vocab_size=cfg.vocab_size, tokenizer=tc.tokenizer)
    resolved = {"train": dataclasses.asdict(tc), "model": dataclasses.asdict(cfg), "world_size": world}
    say(json.dumps(resolved, indent=1))
    say(layout.describe(cfg.n_experts))

    # --- model: built on meta, sharded, then initialised shard by shard
    mesh = parallel.build_mesh(layout, device.type)
    model = parallel.build_model(cfg, layout, mesh, device, ac=tc.ac, compile=tc.compile,
                                 param_dtype=torch.bfloat16 if dtype else None, seed=tc.seed,
                                 state_copies=state_copies(tc))
    if tc.init_from_hf:
        checkpoint.load_hf_into(model, tc.init_from_hf)  # each rank reads only the rows of its own shards
        say(f"initialised from {tc.init_from_hf}")
    twin = meta_model(cfg)  # counts come from an unsharded twin on the meta device
    n, flops_per_token = twin.num_params(), twin.flops_per_token(tc.seq_len)
    say(f"model: {n['total'] / 1e6:.1f}M parameters, {n['active'] / 1e6:.1f}M active, "
        f"{flops_per_token / 1e6:.1f} MFLOP/token")

    if tc.skew_router:
        for moe in moe_layers(model):
            moe.expert_bias[: 2 * cfg.top_k] += tc.skew_router

    # --- optimizer, balancing state, and resume from the newest complete checkpoint
    optimizer = build_optimizer(model, tc)
    layers = moe_layers(model)
    state = {"step": 0, "momentum": torch.zeros(len(layers), cfg.n_experts, device=device), "skipped": 0,
             "bad_steps": 0}
    resume_from = {"auto": checkpoint.latest(ckpt_root), "none": None}.get(tc.resume, tc.resume)
    if resume_from:
        saved = checkpoint.load(resume_from, {"model": model, "optim": optimizer}, config=resolved)
        state.update(step=saved["step"], skipped=saved["skipped"])
        state["momentum"].copy_(torch.as_tensor(saved["momentum"]))
        loader.load_state_dict(saved["data"])
        say(f"resumed from {resume_from} at step {state['step']}")
    if master:  # after the resume check, so a refused resume leaves the run's config.json alone
        os.makedirs(tc.out_dir, exist_ok=True)
        with open(os.path.join(tc.out_dir, "config.json"), "w") as f:
            json.dump(resolved, f, indent=1)

    def save(step: int, pending):
        if pending:
            pending()  # the previous asynchronous write must be complete before the next one starts
        train_state = {"step": step, "skipped": state["skipped"], "momentum": state["momentum"].cpu(),
                       "data": loader.state_dict()}
        return checkpoint.save(ckpt_root, step, {"model": model, "optim": optimizer, "train": train_state},
                               resolved, keep=tc.keep_ckpts, async_save=tc.async_ckpt)

    # --- loop
    peak = peak_tflops(device, tc.peak_tflops)
    tokens_per_step = tc.global_batch * tc.seq_len
    metrics_path = os.path.join(tc.out_dir, "metrics.jsonl")
    preemption, watchdog = Preemption(), Watchdog(tc.step_timeout)
    first_loss = val_loss = out = pending = None
    t_start = t_last = time.time()
    steps_since_log, start_step = 0, state["step"]
    for step in range(start_step, tc.steps):
        state["step"] = step
        lr = lr_at(step, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if step == tc.stall_at_step and restart == 0:  # drill: a hung step, for the watchdog
            time.sleep(10 * tc.step_timeout + 60)
        batch = loader.batch(step)
        out = train_step(model, optimizer, batch, tc, autocast, state, poison=step == tc.nan_at_step)
        # One all-reduce for the loop's decisions: a preemption signal on any rank, a checkpoint write still in flight
        # on any rank, and the global batch's token-id sum (a checksum of the data stream, for metrics.jsonl).
        preempted, writing, tokens_sum = global_sums(device, preemption.requested,
                                                     pending is not None and not pending.done(), batch[0].sum().item())
        if pending and not writing:  # every rank has written the last checkpoint: mark it complete now, not at the
            pending()                # next save, so a crash loses at most ckpt_every steps
            pending = None
        loader.step = step + 1
        watchdog.beat(step + 1)
        steps_since_log += 1
        first_loss = out["lm_loss"] if first_loss is None else first_loss
        last = step == tc.steps - 1
        record = {"step": step + 1, "loss": out["loss"], "lm_loss": out["lm_loss"], "aux_loss": out["aux_loss"],
                  "z_loss": out["z_loss"], "lr": lr, "grad_norm": out["grad_norm"], "tokens_sum": int(tokens_sum)}
        if not out["finite"]:
            say(f"step {step + 1}: non-finite loss or gradient norm; step skipped "
                f"({state['bad_steps']} in a row, {state['skipped']} in total)")
            if state["bad_steps"] >= tc.max_bad_steps:
                newest = checkpoint.latest(ckpt_root)
                watchdog.stop()
                preemption.close()
                raise RuntimeError(f"{state['bad_steps']} non-finite steps in a row, the last at step {step + 1}; "
                                   f"the last good checkpoint is {newest or 'none'}; lower --lr or inspect the data "
                                   f"of these steps, then resume")
        if (step + 1) % tc.log_every == 0 or last or step == start_step:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = (time.time() - t_last) / steps_since_log
            t_last, steps_since_log = time.time(), 0
            tok_s = tokens_per_step / dt
            mfu = tok_s * flops_per_token / (peak * 1e12 * world) if peak else None
            mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            bal = balance_metrics(out["counts_LE"], layers)
            eta = (time.time() - t_start) / (step + 1 - start_step) * (tc.steps - step - 1)
            record.update(tokens_per_s=tok_s, mfu=mfu, peak_mem_gib=mem, skipped_steps=state["skipped"], **bal)
            say(f"step {step + 1:5d}/{tc.steps} | loss {out['loss']:.4f} | lr {lr:.2e} | grad {out['grad_norm']:.3f}"
                f" | {tok_s:,.0f} tok/s | mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
                f" | mem {'n/a' if mem is None else f'{mem:.1f}GiB'} | maxvio {bal['max_vio']:.2f}"
                f" | eta {eta / 60:.1f}m")
        if (tc.eval_every and (step + 1) % tc.eval_every == 0) or last:
            val_loss = evaluate(model, val_loader, tc.eval_batches, tc.micro_batch, autocast)
            record["val_loss"] = val_loss
            say(f"step {step + 1:5d} | val loss {val_loss:.4f}")
        if master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if last or preempted or (tc.ckpt_every and (step + 1) % tc.ckpt_every == 0):
            pending = save(step + 1, pending)
        if preempted:
            say(f"preempted: checkpoint written at step {step + 1}; exiting")
            break
        if step + 1 == tc.crash_at_step and restart == 0 and rank == world - 1:  # drill: a rank dies
            print(f"crash drill: rank {rank} exits abruptly after step {step + 1}", file=sys.stderr, flush=True)
            os._exit(1)
    if pending:
        pending()

    # --- summary and a sample
    elapsed = time.time() - t_start
    if out is not None:
        say(f"done: {state['step'] + 1 - start_step} steps, "
            f"{(state['step'] + 1) * tokens_per_step:,} tokens seen in all, {elapsed:.0f}s; "
            f"loss {first_loss:.3f} -> {out['loss']:.3f}, "
            f"val loss {val_loss if val_loss is None else round(val_loss, 3)}; "
            f"outputs in {tc.out_dir}/")
    if tc.sample_tokens and out is not None and not preemption.requested:
        enc = data.get_encoding(manifest["tokenizer"])
        prompt = torch.tensor([enc.encode("def ")], device=device)
        torch.manual_seed(tc.seed)  # every rank samples the same tokens (FSDP/EP need every rank in the forward)
        model.eval()
        sample = model.generate(prompt, tc.sample_tokens, temperature=0.8, top_k=50)[0].tolist()
        say("sample:\n" + enc.decode([t for t in sample if t < enc.n_vocab]))
    watchdog.stop()
    preemption.close()
    return {"first_loss": first_loss, "loss": out and out["loss"], "val_loss": val_loss, "step": state["step"] + 1}


if __name__ == "__main__":
    try:
        main(*parse_args())
    except (data.DataError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    parallel.finish(0)  # after main returned: the model and optimizer are out of scope
