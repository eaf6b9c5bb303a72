"""
Pre-train an AfMoE model, from one CPU to thousands of GPUs: the same file runs alone or under torchrun.

    python train.py                                       # tiny model on the embedded corpus (CPU, minutes)
    python train.py --preset=tiny --steps=500 --lr=3e-3   # flags are TrainConfig fields; model fields too
    torchrun --nproc_per_node=8 train.py --dp_replicate=2 --ep=4 --global_batch=64
    python train.py --config=out/config.json --lr=1e-3    # a run's saved config (or TOML), flags over it
    python train.py --data=data/web:0.7,data/code:0.3     # a mixture of sources (phases: README, Data)
    python train.py --help

Each optimizer step: the rank's slice of the global batch in accumulated micro-batches, global gradient clipping, one
optimizer step, then one expert-bias update from the global batch's tokens-per-expert counts.
Logs go to the console, OUT_DIR/metrics.jsonl and, with --log_to=tensorboard,wandb, TensorBoard and W&B.
Under `torchrun --max-restarts=N` a job whose rank dies restarts and resumes from its newest complete checkpoint.
"""

import argparse
import contextlib
import dataclasses
import errno
import faulthandler
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import data
import parallel
from parallel import say
from model import (BALANCE_RULES, NON_NEGATIVE, POSITIVE, PRESETS, ModelConfig, Parser, Rule, above, at_least, check,
                   max_vio, meta_model, one_of, option, pad_vocab, refuse_unknown, suggest, update_expert_bias)


FRACTION = Rule(lambda v, _: 0 <= v < 1, "at least 0 and below 1")
OFF_OR_MORE = at_least(0, "0 (off) or more")
REPEATED_EPOCHS = 4  # more epochs of one source are warned about: past ~4, repeats help little (Muennighoff et al.)
CHANGEABLE = ("tokenizer", "data")  # what --allow_changed may name; the data order's seed, lengths and batch are fixed


def listed(text: str) -> list[str]:
    """The items of a comma-separated flag value, blanks dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


@dataclass
class TrainConfig:
    """Every field is a --flag=value option checked by its rule; parallel.Layout checks how sizes and batches meet."""
    # model and data
    preset: str = option("tiny", "model preset (ModelConfig fields are flags too: --n_layers=8)", one_of(*PRESETS))
    data: str = option(data.DEFAULT_DATA_DIR, "python data.py's output (the default corpus is prepared when absent) "
                                              "or a Megatron-LM dataset's path prefix; a mixture: PATH:WEIGHT,...; "
                                              "phases: MIXTURE;STEP=MIXTURE;... (each from STEP on)")
    tokenizer: str = option("cl100k_base", "the data's tokenizer (data.py --tokenizer): tiktoken name or Hugging Face "
                                           "folder; sizes the vocabulary")
    seq_len: int = option(128, "tokens per sequence", POSITIVE)
    doc_mask: bool = option(True, "intra-document attention masking (a token sees only its own document)")
    # batch and schedule
    steps: int = option(150, "optimizer steps", POSITIVE)
    global_batch: int = option(8, "sequences per optimizer step, whatever the number of ranks", POSITIVE)
    micro_batch: int = option(0, "sequences per rank per forward, accumulated (0: global_batch / world size: none)",
                              at_least(0, "0 (global_batch / world size) or more"))
    lr: float = option(5e-3, "peak learning rate", NON_NEGATIVE)
    min_lr_ratio: float = option(0.1, "final LR / peak LR", Rule(lambda v, _: 0 <= v <= 1, "between 0 and 1"))
    warmup_steps: int = option(20, "linear warmup steps", NON_NEGATIVE)
    decay: str = option("cosine", "LR decay after warmup (wsd: flat, then linear)", one_of("cosine", "linear", "wsd"))
    wsd_decay_frac: float = option(0.2, "fraction of steps, the last ones, spent decaying with --decay=wsd",
                                   Rule(lambda v, _: 0 < v <= 1, "above 0 and at most 1"))
    weight_decay: float = option(0.1, "AdamW weight decay on matrices (not norms or biases)", NON_NEGATIVE)
    beta1: float = option(0.9, "AdamW beta1", FRACTION)
    beta2: float = option(0.95, "AdamW beta2", FRACTION)
    optimizer: str = option("adamw", "muon: Muon for the hidden matrices (attention, dense FFN, experts), AdamW at "
                                     "--lr for the embedding, head, router and norms (as Trinity trained)",
                            one_of(*parallel.OPTIMIZERS))
    muon_lr: float = option(5e-2, "peak Muon LR on --lr's schedule, x sqrt(max(1, fan_out/fan_in))", NON_NEGATIVE)
    muon_momentum: float = option(0.95, "Muon momentum (Nesterov)", FRACTION)
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: off)", OFF_OR_MORE)
    seed: int = option(0, "seed for initialisation and data order")
    # expert load balancing (the bias rules are model.update_expert_bias's)
    balance: str = option("smebu", "expert-bias update once per step", one_of(*BALANCE_RULES))
    smebu_lambda: float = option(5e-4, "SMEBU step size λ", NON_NEGATIVE)
    smebu_beta: float = option(0.5, "SMEBU momentum β", FRACTION)
    smebu_kappa: float = option(2.0, "SMEBU tanh sharpness κ", above(0))
    sign_gamma: float = option(1e-3, "sign-rule step size γ", NON_NEGATIVE)
    bias_freeze_step: int = option(-1, "only steps 0 .. N-1 move the expert bias (-1: every step)",
                                   at_least(-1, "-1 (never) or a step number"))
    # parallelism and precision (parallel.py)
    dp_replicate: int = option(1, "HSDP replicas R: world = R x S, parameters sharded over S = world / R; auto (or 0): "
                                  "as many replicas of --dp_shard ranks as the launched world holds, the rest standing "
                                  "by (elastic jobs)", at_least(0, "auto (0) or at least 1"),
                               parse=lambda text: 0 if text == "auto" else int(text))
    dp_shard: int = option(0, "FSDP group size S (0: world / dp_replicate); with --dp_replicate=auto, fixed while the "
                              "world changes", NON_NEGATIVE)
    ep: int = option(1, "expert-parallel degree: divides S; routed experts split over ep consecutive ranks", POSITIVE)
    ac: str = option("none", "activation checkpointing", one_of(*parallel.AC_MODES))
    keep_gathered: bool = option(False, "FSDP keeps parameters gathered from the first forward to the last backward "
                                        "(one all-gather per step, not two per micro-batch; the whole model's memory)")
    compile: bool | None = option(None, "torch.compile each block (default: on with CUDA; off on CPU, slower there)")
    dtype: str = option("auto", "compute dtype (auto: bf16 on GPU, fp32 on CPU)", one_of("auto", "bf16", "fp32"))
    # logging and evaluation
    out_dir: str = option("out", "where metrics.jsonl, config.json and checkpoints go")
    log_every: int = option(10, "log every N steps", POSITIVE)
    log_to: str = option("none", "also log to tensorboard (OUT_DIR/tensorboard), wandb or both, comma-separated")
    wandb_project: str = option("nanotitan", "Weights & Biases project, with --log_to=wandb")
    wandb_mode: str = option("auto", "W&B mode (auto: WANDB_MODE, else online; offline: wandb sync uploads later)",
                             one_of("auto", "online", "offline", "disabled"))
    eval_every: int = option(50, "validate every N steps (and at the end; 0: only at the end)",
                             at_least(0, "0 (only at the end) or more"))
    eval_batches: int = option(4, "validation batches (of global_batch sequences) per evaluation", POSITIVE)
    peak_tflops: float = option(0.0, "device bf16 peak for MFU; 0: from the device table (unknown: n/a)",
                                at_least(0, "0 (from the device table) or more"))
    sample_tokens: int = option(48, "tokens sampled from a prompt at the end (0: none)", OFF_OR_MORE)
    # checkpoints and fault tolerance (checkpoint.py)
    ckpt_every: int = option(500, "checkpoint every N steps (0: only --ckpt_minutes, the end, preemption)", OFF_OR_MORE)
    ckpt_minutes: float = option(30.0, "also checkpoint this many minutes after the last one (0: off)", OFF_OR_MORE)
    keep_ckpts: int = option(3, "keep the newest K complete checkpoints of this run", POSITIVE)
    async_ckpt: bool = option(True, "write checkpoints in the background while training continues")
    resume: str = option("auto", "auto: the newest complete checkpoint in OUT_DIR/checkpoints that loads; none: "
                                 "start fresh; or a checkpoint directory")
    overwrite: bool = option(False, "replace OUT_DIR's other run (checkpoints, metrics, config) instead of refusing")
    resume_schedule: str = option("keep", "if --steps differs from the checkpoint's: keep its LR schedule, then its "
                                          "final LR, or stretch it over --steps", one_of("keep", "stretch"))
    init_from_hf: str = option("", "start from a Hugging Face afmoe folder (python checkpoint.py export ...)")
    allow_changed: str = option("", "on resume, accept another data set or tokenizer than the checkpoint's: data, "
                                    "tokenizer or both, comma-separated (a curriculum change, kept in config.json)",
                                Rule(lambda v, _: set(listed(v)) <= set(CHANGEABLE),
                                     "empty or some of tokenizer, data"))
    step_timeout: float = option(600.0, "seconds without a completed step before the watchdog dumps stacks and exits "
                                        "(0: off); also the collective timeout", OFF_OR_MORE)
    lease_wait: float = option(60.0, "seconds to wait for another live job to leave OUT_DIR before refusing (keep "
                                     "it below --step_timeout)", NON_NEGATIVE)
    max_bad_steps: int = option(5, "stop after this many non-finite (NaN/Inf) steps in a row", POSITIVE)
    # unattended runs: spikes, rollbacks, events
    spike_threshold: float = option(10.0, "skip with its batch a step whose loss or gradient norm is this many robust "
                                          "deviations (1.4826 x MAD) above the median of the last --spike_window steps;"
                                          " 10x that after a resume: a damaged checkpoint (0: both off)", OFF_OR_MORE)
    spike_window: int = option(50, "applied steps the spike statistics span (judged once it is full)", at_least(3))
    spike_rollback: int = option(3, "this many spikes within --spike_window steps roll back to the newest checkpoint "
                                    "before the first, skipping the first's to the last's batch (0: off)", OFF_OR_MORE)
    max_rollbacks: int = option(5, "rollbacks a run may make; the burst after the last stops it", OFF_OR_MORE)
    on_event: str = option("", "shell command run on each event worth a person's attention, with NANOTITAN_EVENT, "
                               "NANOTITAN_STEP, NANOTITAN_MESSAGE and NANOTITAN_OUT_DIR set (never saved)")
    straggler_threshold: float = option(0.2, "at each log, name the slowest rank if its time per step (data + "
                                             "compute) is this fraction above the others' median (0: off)", OFF_OR_MORE)
    crash_at_step: int = option(-1, "fault drill: the last rank dies after this step (first launch only)")
    stall_at_step: int = option(-1, "fault drill: the last rank hangs in this step, for the watchdog (first launch)")
    straggle_rank: int = option(-1, "straggler drill: this rank sleeps as long as its own work took, every step")
    nan_at_step: int = option(-1, "fault drill: this data step's batch makes the gradients NaN (non-finite guard)")
    spike_at_step: str = option("", "fault drill: these data steps' batches (comma-separated) scale the gradients "
                                    "100 times (spike guard)",
                                Rule(lambda v, _: not v or all(n.strip().isdigit() for n in v.split(",")),
                                     "empty or step numbers separated by commas"))
    skew_router: float = option(0.0, "collapse drill: a fresh run starts with this bias on the first 2*top_k experts")

    def __post_init__(self):
        check(self)
        log_sinks(self.log_to)  # a sink without its package is refused too, before any data or model is touched


# --- command line: every TrainConfig and ModelConfig field is a --flag=value option

MODEL_FIELDS = {f.name: f for f in fields(ModelConfig)}


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return text.lower() in ("1", "true", "yes", "on")
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


# Names other trainers (nanoGPT, torchtitan, Hugging Face) give to this file's flags, for "did you mean".
OTHER_NAMES = {other: ours for ours, others in {
    "lr": "learning_rate optimizer.lr", "steps": "max_iters max_steps lr_decay_iters training.steps num_train_steps",
    "global_batch": "batch_size global_batch_size training.global_batch_size",
    "micro_batch": "local_batch_size training.local_batch_size micro_batch_size per_device_train_batch_size "
                   "gradient_accumulation_steps",
    "seq_len": "block_size training.seq_len", "warmup_steps": "warmup_iters lr_scheduler.warmup_steps",
    "min_lr_ratio": "min_lr", "eval_every": "eval_interval", "eval_batches": "eval_iters",
    "log_every": "log_interval metrics.log_freq", "grad_clip": "grad_clip_norm max_norm training.max_norm",
    "ckpt_every": "checkpoint.interval save_steps", "keep_ckpts": "checkpoint.keep_latest_k", "resume": "init_from",
    "data": "dataset data_dir", "out_dir": "output_dir job.dump_folder", "n_layers": "n_layer", "n_heads": "n_head",
    "dim": "n_embd", "compile": "training.compile", "ep": "parallelism.expert_parallel_degree",
    "dp_replicate": "parallelism.data_parallel_replicate_degree", "ac": "activation_checkpoint.mode",
    "optimizer": "optimizer.name"}.items() for other in others.split()}


class _Parser(Parser):
    aliases = OTHER_NAMES  # another trainer's name for a flag names ours


def _kind(f) -> type:
    """The type of a flag's value: bool, int, float or str."""
    return bool if f.type in (bool, bool | None, "bool") else type(f.default)


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, dict]:
    """The TrainConfig and the model-field overrides (precedence: defaults < preset < --config file < command line;
    a --preset on the command line replaces the file's whole model table)."""
    parser = _Parser(description=__doc__.split("\n\n")[0].strip(), allow_abbrev=False)
    parser.add_argument("--config", default="", help="start from a config file, a run's OUT_DIR/config.json or TOML "
                                                      "with [train] and [model] tables; flags given here override it")
    model_group = parser.add_argument_group("model overrides (default: the preset's value)")
    settings = {f"train.{f.name}": f for f in fields(TrainConfig)} | {f"model.{n}": f for n, f in MODEL_FIELDS.items()}
    for key, f in settings.items():  # "train.lr": its field
        kind = _kind(f)
        train_flag = key.startswith("train.")
        shown = f" (default: {f.default})" if train_flag else ""  # a model field's default is the preset's
        (parser if train_flag else model_group).add_argument(
            f"--{f.name}", type=f.metadata.get("parse") or (_parse_bool if kind is bool else kind),
            default=argparse.SUPPRESS, help=f.metadata["help"].replace("%", "%%") + shown,  # argparse formats with %
            **({"nargs": "?", "const": True} if kind is bool else {}))
    given = vars(parser.parse_args(argv))  # only what the command line says (SUPPRESS: no defaults)
    config_path = given.pop("config")
    try:
        from_file = read_config(config_path, settings) if config_path else {}
        if "preset" in given:  # the command line's preset, not the file's model of another preset
            from_file = {k: v for k, v in from_file.items() if k not in MODEL_FIELDS}
        values = {**from_file, **given}
        tc = TrainConfig(**{f.name: values[f.name] for f in fields(TrainConfig) if f.name in values})
    except ValueError as e:  # a bad config file, a value its rule refuses, or --log_to
        parser.error(str(e))
    overrides = {k: values[k] for k in MODEL_FIELDS if k in values}
    if tc.compile is None:
        tc = dataclasses.replace(tc, compile=parallel.use_cuda())
    return tc, overrides


# Every flag train.py takes, which bench.py and plan.py take too (after their own).
TRAIN_FLAGS = ["--config"] + [f"--{f.name}" for f in fields(TrainConfig)] + [f"--{name}" for name in MODEL_FIELDS]


def parse_tool_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """A tool's own flags (bench.py, plan.py), and the rest of argv, which must be train.py flags."""
    args, rest = parser.parse_known_args(argv)
    refuse_unknown(parser, rest, also=TRAIN_FLAGS, aliases=OTHER_NAMES)
    return args, rest


def with_batch_defaults(tc: TrainConfig, world: int) -> TrainConfig:
    """--micro_batch=0: each rank's whole share of the global batch in one forward (no accumulation)."""
    return dataclasses.replace(tc, micro_batch=max(1, tc.global_batch // world)) if tc.micro_batch == 0 else tc


# Keys of a run's config.json that are facts of the run that wrote it, not settings.
RUN_FACTS = ("world_size", "tokenizer", "data", "run_id", "from_step")
TYPE_NAMES = {bool: "bool (true or false)", int: "int", float: "number", str: "string"}


def config_file(path: str) -> dict:
    """What a config file holds: a run's config.json, or TOML (.toml). ValueError, one sentence, if it cannot be."""
    toml = path.lower().endswith(".toml")
    try:
        with open(path, "rb") as f:
            if toml:
                import tomllib  # Python 3.11's; imported here so that train.py itself runs on older ones
            raw = tomllib.load(f) if toml else json.load(f)
    except OSError as e:
        raise ValueError(f"--config={path} cannot be read ({e.strerror or e}).")
    except ValueError as e:  # the parsers' errors and a bad UTF-8 byte are all ValueErrors
        raise ValueError(f"--config={path} is not valid {'TOML' if toml else 'JSON'}: {e}.")
    if not isinstance(raw, dict):
        raise ValueError(f"--config={path} holds a {type(raw).__name__}; expected train and model tables.")
    return raw


def read_config(path: str, settings: dict) -> dict:
    """The flag values a config file sets, typed as the flags are (a config.json's model table rebuilds that model,
    vocab_size and max_seq_len too); ValueError, one sentence, for an unknown key or a wrongly typed value."""
    entries = {}  # "train.lr": 0.01, ...
    for key, value in config_file(path).items():
        if key in ("train", "model") and isinstance(value, dict):
            entries.update({f"{key}.{k}": v for k, v in value.items()})
        elif key not in RUN_FACTS:
            entries[key] = value
    by_name = {k.split(".")[1]: k for k in settings}
    values = {}
    for key, value in entries.items():
        if key not in settings:
            name = by_name.get(suggest(key if key in OTHER_NAMES else key.split(".")[-1], by_name, OTHER_NAMES))
            raise ValueError(f"--config={path} has an unknown key {key}; " + (f"did you mean {name}?" if name else
                             "keys are train.FLAG or model.FIELD, as python train.py --help lists them."))
        kind = _kind(settings[key])
        parse = settings[key].metadata.get("parse")
        if parse and isinstance(value, str):  # a word the flag takes too (dp_replicate = "auto")
            with contextlib.suppress(ValueError):
                value = parse(value)
        if key == "train.data" and isinstance(value, dict):
            value = data_spec(value, path)
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise ValueError(f"--config={path} sets {key} to {value!r}, which is not a valid {TYPE_NAMES[kind]}.")
        values[key.split(".")[1]] = kind(value)
    return values


def data_spec(table: dict, path: str) -> str:
    """--data's text for its TOML table: PATH = WEIGHT entries, or such tables by the step each phase starts at."""
    phases = table if all(isinstance(v, dict) for v in table.values()) else {"0": table}
    if not all(step.replace("_", "").isdigit() and all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                        for w in weights.values()) for step, weights in phases.items()):
        raise ValueError(f"--config={path} sets train.data to a table that is neither PATH = WEIGHT entries nor tables "
                         f"of them by the step each phase starts at ([train.data.0], [train.data.120000]).")
    return ";".join(f"{step}=" + ",".join(f"{source}:{weight}" for source, weight in phases[step].items())
                    for step in sorted(phases, key=int))


def model_config(tc: TrainConfig, overrides: dict, vocab_size: int) -> ModelConfig:
    """The preset, sized to the tokenizer's vocabulary (padded to a multiple of 128), then the user's overrides."""
    cfg = dataclasses.replace(PRESETS[tc.preset], **{"vocab_size": pad_vocab(vocab_size),
                                                     "max_seq_len": tc.seq_len, **overrides})
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
    else:
        progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.steps - 1 - tc.warmup_steps))
    if tc.decay == "cosine":
        return floor + (tc.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return tc.lr - (tc.lr - floor) * progress


# Dense bf16 peaks in TFLOP/s, for MFU (unknown devices report n/a). B300's gains are in FP4, not bf16.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "B300": 2250.0, "A100": 312.0}


def peak_tflops(device: torch.device, override: float = 0.0) -> float | None:
    if override or device.type != "cuda":
        return override or None
    return next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name(device)), None)


def state_copies(tc: TrainConfig) -> int:
    """fp32 copies of the weights training keeps: weights, gradients, moments (AdamW two; Muon one, nearly all)."""
    return 4 if tc.optimizer == "adamw" else 3


@torch.no_grad()
def evaluate(model, loader, n_batches: int, micro_batch: int, autocast, doc_mask: bool) -> float:
    """Mean LM loss over the first n validation batches (the same rows every time), averaged over ranks."""
    model.eval()
    total = torch.zeros((), device=next(model.parameters()).device)
    count = 0
    for batch in loader.val_batches(n_batches):
        for i in range(0, batch[0].shape[0], micro_batch):
            tokens_BT, targets_BT, doc_ids_BT = (t[i:i + micro_batch].to(total.device) for t in batch)
            with autocast:
                total += model(tokens_BT, targets_BT=targets_BT, doc_ids_BT=doc_ids_BT if doc_mask else None).float()
            count += 1
    model.train()
    return parallel.all_reduce_sum_(total / max(count, 1)).item() / parallel.rank_world()[1]


# --- one optimizer step: the piece bench.py times as well

def phase(name: str):
    """A profiler range `train_step::name` around one phase of the step (bench.py reads them from its profile)."""
    return torch.profiler.record_function("train_step::" + name)


@dataclass
class TrainState:
    """What the loop carries from step to step besides model and optimizer."""
    step: int  # the next one
    momentum: torch.Tensor  # each MoE layer's balancing momentum [L, E]
    skipped: int = 0  # steps skipped, in all
    bad_steps: int = 0  # non-finite steps in a row
    resumed_world: int = 0  # the world size of the launch that wrote the checkpoint resumed (0: a fresh run)
    skipped_data: list = field(default_factory=list)  # [start, end) windows of loader steps, sorted and disjoint
    recent: list = field(default_factory=list)  # [loss, grad norm] of the last applied steps: the spike statistics
    spikes: list = field(default_factory=list)  # the recent spikes' [step, data step]
    rollbacks: int = 0
    KEPT = ("skipped", "skipped_data", "recent", "spikes", "rollbacks")  # in checkpoints, with step and momentum

    @classmethod
    def fresh(cls, model, device: torch.device) -> "TrainState":
        return cls(0, torch.zeros(len(model.moe_layers()), model.cfg.n_experts, device=device))

    def saved(self, step: int) -> dict:
        """The checkpoint's train-state values (the momentum tensor is kept beside the weights)."""
        return {"step": step, "momentum": self.momentum, **{name: getattr(self, name) for name in self.KEPT}}

    def targets(self, model, optimizer) -> dict:
        """Where a checkpoint loads, in place: the train state's tensors beside the weights."""
        return {"model": model, "optim": optimizer, "train": {"momentum": self.momentum}}

    def load(self, saved: dict):
        """The train state's values besides its tensors (checkpoint.load has loaded those in place)."""
        self.step = saved["step"]
        self.resumed_world = saved.get("world_size", 0)
        defaults = TrainState(0, self.momentum)  # for the keys checkpoints older than the spike guard lack
        for name in self.KEPT:
            setattr(self, name, saved.get(name, getattr(defaults, name)))

    def data_step(self) -> int:
        """The loader step this step reads: the (step + 1)-th outside the skipped windows."""
        data_step = self.step
        for start, end in self.skipped_data:
            if data_step >= start:
                data_step += end - start
        return data_step

    def skip_data(self, start: int, end: int):
        """Add the loader steps start .. end - 1 to the skipped windows."""
        merged = []
        for window in sorted(self.skipped_data + [[start, end]]):
            if merged and window[0] <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], window[1])
            else:
                merged.append(list(window))
        self.skipped_data = merged


SPREAD_FLOOR = 0.02  # a robust deviation is at least this fraction of the median: values that barely vary trip nothing
DAMAGE_FACTOR = 10  # right after a resume, a loss this many times further than a spike's limit: a damaged checkpoint


def spike_limits(recent: list, threshold: float) -> tuple[float, float]:
    """(loss, gradient norm) limits: the median of `recent` + `threshold` x 1.4826 x MAD (a normal distribution σ)."""
    limits = []
    for values in zip(*recent):
        median = statistics.median(values)
        deviation = 1.4826 * statistics.median(abs(v - median) for v in values)
        limits.append(median + threshold * max(deviation, SPREAD_FLOOR * abs(median)))
    return tuple(limits)


def train_step(model, optimizer, batch, tc: TrainConfig, autocast, state: TrainState, grad_scale: float = 1.0,
               limits: tuple[float, float] | None = None) -> dict:
    """Forward/backward over the rank's micro-batches, global gradient clipping, optimizer step, expert-bias update;
    a non-finite step or a spike (loss or gradient norm above `limits`) skips the last two. Returns the global batch's
    mean losses and counts_LE, the rank's per-sequence LM loss_B and why it was skipped (None, non-finite, spike)."""
    device = next(model.parameters()).device
    with phase("batch to device"):
        tokens_BT, targets_BT, doc_ids_BT = (t.to(device, non_blocking=True) for t in batch)
    n_micro = tokens_BT.shape[0] // tc.micro_batch
    layers = model.moe_layers()
    counts_LE = torch.zeros(len(layers), model.cfg.n_experts, device=device)
    losses = torch.zeros(3, device=device)  # lm, aux, z
    loss_B = []  # each of the rank's sequences' LM loss, for the loss by source
    if tc.keep_gathered and hasattr(model, "set_reshard_after_forward"):
        model.set_reshard_after_forward(False)  # the root too (FSDP2 keeps only the root's gathered by default)
    for i in range(n_micro):
        rows = slice(i * tc.micro_batch, (i + 1) * tc.micro_batch)
        if hasattr(model, "set_requires_all_reduce"):
            # FSDP reduce-scatters every micro-batch (unsharded gradients held across micro-batches would cost a
            # full model of fp32 gradients per GPU) and all-reduces across HSDP replicas on the last one only.
            model.set_requires_all_reduce(i == n_micro - 1)
            if tc.keep_gathered:  # the optimizer updates the shards: the last micro-batch frees the gathered copies
                model.set_reshard_after_backward(i == n_micro - 1)
        with autocast, phase("forward"):
            lm_loss, stats = model(tokens_BT[rows], targets_BT=targets_BT[rows],
                                   doc_ids_BT=doc_ids_BT[rows] if tc.doc_mask else None, return_stats=True)
        with phase("backward"):
            ((lm_loss + stats.balance_loss) / n_micro).backward()
        counts_LE += stats.counts_LE
        losses += torch.stack([lm_loss.detach().float(), stats.aux_loss.detach(), stats.z_loss.detach()]) / n_micro
        loss_B.append(stats.loss_B)
    with phase("all-reduce counts, losses"):  # the global batch: counts summed over ranks, losses averaged
        parallel.all_reduce_sum_(counts_LE)
        parallel.all_reduce_sum_(losses)
    losses /= parallel.rank_world()[1]
    if grad_scale != 1:  # a drill: NaN gradients or a spike
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(grad_scale)
    with phase("grad clip"):
        grad_norm = parallel.clip_grad_norm_(model, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
    lm, aux, z, norm = torch.cat([losses, grad_norm.reshape(1).to(losses)]).tolist()  # one host read
    skipped = None
    if not all(map(math.isfinite, (lm, aux, z, norm))):
        skipped = "non-finite"
    elif limits is not None and (lm + aux + z > limits[0] or norm > limits[1]):
        skipped = "spike"
    if skipped is None:
        with phase("optimizer"):
            optimizer.step()
        state.bad_steps = 0
        if tc.balance != "none" and (tc.bias_freeze_step < 0 or state.step < tc.bias_freeze_step):
            with phase("expert-bias update"):
                for l, moe in enumerate(layers):
                    update_expert_bias(moe.expert_bias, counts_LE[l], state.momentum[l], tc.balance, tc.smebu_lambda,
                                       tc.smebu_beta, tc.smebu_kappa, tc.sign_gamma)
    else:  # a skipped step changes nothing: no update, no bias move
        state.bad_steps += skipped == "non-finite"
        state.skipped += 1
    optimizer.zero_grad(set_to_none=True)
    return {"loss": lm + aux + z, "lm_loss": lm, "aux_loss": aux, "z_loss": z, "grad_norm": norm, "skipped": skipped,
            "counts_LE": counts_LE, "loss_B": torch.cat(loss_B)}


def balance_metrics(counts_LE: torch.Tensor, layers) -> dict:
    per_layer = [max_vio(c) for c in counts_LE]
    return {"max_vio": max(per_layer) if per_layer else 0.0,
            "max_vio_layers": [round(v, 4) for v in per_layer],
            "min_load_layers": counts_LE.min(-1).values.long().tolist(),
            "max_load_layers": counts_LE.max(-1).values.long().tolist(),
            "dead_experts_layers": (counts_LE == 0).sum(-1).tolist(),
            "bias_norm_layers": [round(m.expert_bias.norm().item(), 6) for m in layers]}


# --- metrics: OUT_DIR/metrics.jsonl, and TensorBoard or W&B with --log_to, written by rank 0

LOG_SINKS = ("tensorboard", "wandb")  # each the name of the package it needs


def log_sinks(log_to: str) -> list[str]:
    """The sinks --log_to names, refused in a sentence if unknown or not installed (--log is torchrun's --log-dir)."""
    names = [] if log_to == "none" else listed(log_to)
    for name in names:
        if name not in LOG_SINKS:
            close = suggest(name, LOG_SINKS)
            raise ValueError(f"--log_to={log_to}: {name} is not one of none, {', '.join(LOG_SINKS)}"
                             + (f"; did you mean {close}?" if close else "."))
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"--log_to={name} needs the {name} package, which is not installed here: "
                             f"pip install {name}")
    return names


def _logged_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a record cut short by a crash
        return math.inf


def write_config(out_dir: Path, resolved: dict, start_step: int):
    """OUT_DIR/config.json: the config and the step it applies from; a changed one moves the last to config_history."""
    path = out_dir / "config.json"
    if start_step and path.exists():
        before = json.loads(path.read_text())
        if {k: v for k, v in before.items() if k != "from_step"} == resolved:
            return  # the same settings: config.json holds them, from the step they first applied
        with open(out_dir / "config_history.jsonl", "a") as f:
            f.write(json.dumps(before) + "\n")
    data.write_durably(str(path), json.dumps({**resolved, "from_step": start_step}, indent=1))


def scalars_of(record: dict, prefix: str = "") -> dict:
    """A record's numbers by tag for the dashboards: lists as KEY/00, KEY/01, ..., dicts as KEY/NAME."""
    scalars = {}
    for key, value in record.items():
        if isinstance(value, list):
            value = {f"{i:02d}": v for i, v in enumerate(value)}
        if isinstance(value, dict):
            scalars.update(scalars_of(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):
            scalars[prefix + key] = value
    return scalars


class MetricsSinks:
    """Rank 0 writes OUT_DIR/config.json, then each record to metrics.jsonl and the --log_to sinks. A resumed run logs
    again the steps after its checkpoint: metrics.jsonl is cut, TensorBoard purges them, W&B goes on (wandb_run_id)."""

    def __init__(self, tc: TrainConfig, resolved: dict, start_step: int, master: bool):
        self.tensorboard = self.wandb = None
        self.path = Path(tc.out_dir, "metrics.jsonl") if master else None
        self.steps_lost = self.rewind(start_step)  # steps a dead launch logged past the checkpoint: trained again
        if not master:
            return
        write_config(Path(tc.out_dir), resolved, start_step)
        names = log_sinks(tc.log_to)
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(os.path.join(tc.out_dir, "tensorboard"), purge_step=start_step + 1)
        if "wandb" in names:
            import wandb
            id_file = Path(tc.out_dir, "wandb_run_id")
            run_id = id_file.read_text().strip() if id_file.exists() else None
            self.wandb = wandb.init(project=tc.wandb_project, id=run_id, resume="allow", dir=tc.out_dir,
                                    config=resolved, allow_val_change=True,  # a restart may extend --steps
                                    mode=None if tc.wandb_mode == "auto" else tc.wandb_mode)
            id_file.write_text(self.wandb.id)

    def rewind(self, step: int) -> int:
        """Forget the records after `step`, which a resumed or rolled back run logs again; returns how many."""
        forgotten = 0
        if self.path is not None and self.path.exists():
            cut = Path(f"{self.path}.tmp")
            with self.path.open() as old, cut.open("w") as new:  # streamed: a long run's file can be large
                for line in old:
                    if _logged_step(line) <= step:
                        new.write(line)
                    else:
                        forgotten += 1
            cut.replace(self.path)
        if self.tensorboard:  # a new writer hides the events past `step` (the constructor's purge_step)
            self.tensorboard.close()
            self.tensorboard = type(self.tensorboard)(self.tensorboard.log_dir, purge_step=step + 1)
        return forgotten

    def write(self, record: dict):
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = scalars_of({k: v for k, v in record.items() if k != "step"})
        if self.tensorboard:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, record["step"])
            self.tensorboard.flush()  # on disk at every record: a launch that dies keeps what it logged
        if self.wandb:
            self.wandb.log(scalars, step=record["step"])

    def close(self):
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            import wandb
            self.wandb.finish()
            wandb.teardown()  # waits for W&B's service to write the run out: a torchrun worker leaves by os._exit


# --- for whoever watches an unattended run: OUT_DIR/status.json and --on_event

EVENT_TIMEOUT_S = 60  # an --on_event command still running after this long is killed


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def restarts() -> int:
    """How many times torchrun restarted this job (0: its first launch)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Alerts:
    """Rank 0's OUT_DIR/status.json, and --on_event's command run on each event: restart, resume, spike, rollback,
    damaged_checkpoint, checkpoint_failed, disk_nearly_full, stopped, finished, world_size_change, straggler, hang."""

    def __init__(self, run: "Run"):
        self.master = run.master
        self.command = run.tc.on_event
        self.out_dir = run.tc.out_dir
        self.restarts = restarts()
        self.status = None  # written once the loop begins: a launch with nothing to do writes nothing
        self.last_event = None
        self.waiting = []
        self.lock = threading.Lock()  # an event may come from another thread (a watchdog)
        if self.command:
            say(f"on each event: {self.command}")

    def event(self, name: str, step: int, message: str):
        """Say `message` (one line) and report it as event `name` at `step`; called alike on every rank."""
        say(message)
        if not self.master:
            return
        self.last_event = {"name": name, "step": step, "message": message, "time": now()}
        if self.status is not None:
            self.update()
        if not self.command:
            return
        env = {**os.environ, "NANOTITAN_EVENT": name, "NANOTITAN_STEP": str(step), "NANOTITAN_MESSAGE": message,
               "NANOTITAN_OUT_DIR": self.out_dir}
        try:  # in its own session: torchrun tearing the job down does not kill the alert that says why
            proc = subprocess.Popen(self.command, shell=True, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            say(f"--on_event for {name} could not start ({e.strerror}); training goes on")
            return
        waiter = threading.Thread(target=self._wait, args=(proc, name), daemon=True)
        waiter.start()
        self.waiting.append(waiter)

    def _wait(self, proc: subprocess.Popen, name: str):
        try:
            failed = proc.wait(timeout=EVENT_TIMEOUT_S) and f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            failed = f"killed after {EVENT_TIMEOUT_S}s"
        if failed:
            say(f"--on_event for {name} failed ({failed}); training goes on")

    def update(self, **numbers):
        """Rank 0: rewrite status.json with the loop's latest `numbers` and the last event."""
        with self.lock:
            self.status = {**(self.status or {}), **numbers, "restarts": self.restarts,
                           "last_event": self.last_event, "updated": now()}
            data.write_durably(os.path.join(self.out_dir, "status.json"), json.dumps(self.status, indent=1) + "\n")

    def close(self):
        """Wait for the commands still running (each ends within EVENT_TIMEOUT_S)."""
        for waiter in self.waiting:
            waiter.join()


# --- fault tolerance: preemption signals and a hang watchdog

class Guard:
    """SIGTERM, SIGUSR1 (Slurm, Kubernetes, spot reclaim) and SIGINT set `requested`: the loop checkpoints and exits 0
    (a second Ctrl-C stops at once). No step within `timeout_s`: the watchdog reports the hang and exits 3."""

    def __init__(self, timeout_s: float, hang_dir: str, alerts: Alerts):
        self.requested = self.interrupted = False
        self.alerts = alerts
        self.previous = {s: signal.signal(s, self._signal) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        self.timeout_s = timeout_s
        self.hang_dir = hang_dir
        self.last_beat = time.time()
        self.step = 0
        self.stopped = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, daemon=True).start()

    def _signal(self, signum, frame):
        if signum == signal.SIGINT and self.interrupted:
            raise KeyboardInterrupt
        self.requested = True
        self.interrupted = self.interrupted or signum == signal.SIGINT

    def beat(self, step: int):
        self.last_beat = time.time()
        self.step = step

    def _watch(self):
        while not self.stopped.wait(min(5.0, self.timeout_s / 4)):
            if time.time() - self.last_beat > self.timeout_s:
                stalled = f"watchdog: no step completed for {self.timeout_s:.0f}s after step {self.step}"
                print(f"{stalled}; stacks of every thread follow, then exit 3", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                verdict = None
                try:
                    verdict = report_hang(self.hang_dir, self.step, self.timeout_s)
                except Exception as e:  # an unwritable OUT_DIR must not keep the process from exiting
                    print(f"watchdog: no hang report ({e})", file=sys.stderr, flush=True)
                self.alerts.event("hang", self.step, verdict or stalled)
                if verdict:  # rank 0 of several ranks spoke: the others may exit
                    dist.distributed_c10d._get_default_store().set("hang/said", "1")
                sys.stdout.flush()
                os._exit(3)

    def close(self):
        """Stop the watchdog and give the signals back: train.main may run inside another program."""
        self.stopped.set()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# --- hang reports: what every rank was doing when no step completed (the watchdog writes them)

def collectives() -> dict:
    """This rank's process groups as torch's Flight Recorder saw them: {"groups": {name: {ranks, entered, completed}},
    "last": [...]}; entered > completed: it waits in collective `entered`; {} in one process; {"error": why}."""
    if not dist.is_initialized():
        return {}
    backend = dist.get_backend()
    # NCCL keeps its own recorder (CUDA builds); every other backend, gloo too, records into the generic one.
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace_json" if backend == "nccl" else "_dump_fr_trace_json",
                   None)
    if dump is None:
        return {"error": f"torch {torch.__version__} has no Flight Recorder for {backend}"}
    trace = json.loads(dump(True, False))
    status = trace.get("pg_status", {})
    groups = {}
    for group, name in dist.distributed_c10d._world.pg_names.items():
        seen = status.get(name, {})
        groups[name] = {"ranks": dist.get_process_group_ranks(group),
                        "entered": int(seen.get("last_enqueued_collective", -1)),
                        "completed": int(seen.get("last_completed_collective", -1))}
    last = [{"group": e["process_group"][0], "seq": e["collective_seq_id"], "op": e["profiling_name"],
             "sizes": e["input_sizes"]} for e in trace.get("entries", [])[-12:]]
    return {"groups": groups, "last": last}


def hang_verdict(records: dict[int, dict], world: int) -> str:
    """Rank 0's sentence on a hang from the ranks' records ({rank: collectives() and host}): in each process group
    where a rank waits, the ranks that never entered that collective; then the ranks that sent no record."""
    def named(ranks) -> str:
        return ", ".join(f"rank {r}" + (f" ({records[r]['host']})" if r in records else "") for r in ranks)

    groups = {}  # (name, ranks) -> {rank: its view of the group}
    for rank, record in records.items():
        for name, group in record.get("groups", {}).items():
            groups.setdefault((name, tuple(group["ranks"])), {})[rank] = group
    found = []
    for (name, ranks), views in sorted(groups.items()):
        waiting = {r: v["entered"] for r, v in views.items() if v["entered"] > v["completed"]}
        seq = max(waiting.values(), default=-1)
        behind = [r for r in ranks if r in views and views[r]["entered"] < seq]
        if not behind:
            continue
        op = next((e["op"] for r in waiting for e in records[r].get("last", [])
                   if e["group"] == name and e["seq"] == seq), "collective")
        waiters = [r for r in waiting if waiting[r] == seq]
        found.append(f"{named(behind)} never reached {op} #{seq} of process group {name} (ranks "
                     f"{', '.join(map(str, ranks))}), in which {named(waiters)} "
                     f"{'waits' if len(waiters) == 1 else 'wait'}")
    missing = [r for r in range(world) if r not in records]
    if missing:
        found.append(f"{named(missing)} sent no record (stuck holding the interpreter, or gone)")
    errors = {record["error"] for record in records.values() if "error" in record}
    return "hang: " + ("; ".join(found) or "no rank is behind another in a collective; read their stacks") + (
        f" ({'; '.join(errors)})" if errors else "")


def report_hang(hang_dir: str, step: int, timeout_s: float) -> str | None:
    """Write HANG_DIR/rank_NNNNN.txt (last collectives, stacks); swap records through the job's store (it answers while
    collectives hang). Rank 0 returns hang_verdict's sentence; the others wait for hang/said lest their exit end it."""
    rank, world = parallel.rank_world()
    record = {"host": socket.gethostname(), **collectives()}
    os.makedirs(hang_dir, exist_ok=True)
    with open(os.path.join(hang_dir, f"rank_{rank:05d}.txt"), "w") as f:
        f.write(f"rank {rank} of {world} on {record['host']}, pid {os.getpid()}: no step completed for "
                f"{timeout_s:.0f}s after step {step}\n")
        for name, group in record.get("groups", {}).items():
            f.write(f"process group {name} (ranks {group['ranks']}): the last collective entered is "
                    f"#{group['entered']}, the last completed #{group['completed']} (-1: none)\n")
        f.write("last collectives (process group, sequence number, operation, input sizes):\n")
        f.writelines(f"  {e['group']} #{e['seq']} {e['op']} {e['sizes']}\n" for e in record.get("last", []))
        f.write(f"{record.get('error', '')}\nstacks:\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    if world == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    patience = timedelta(seconds=max(10.0, min(60.0, timeout_s)))  # the other ranks' watchdogs fire about together
    store.set(f"hang/{rank}", json.dumps(record))
    if rank != 0:
        with contextlib.suppress(Exception):  # rank 0 may be the one that cannot speak
            store.wait(["hang/said"], 2 * patience)
        return
    keys = [f"hang/{r}" for r in range(world)]
    with contextlib.suppress(Exception):  # past it, the missing ranks are named
        store.wait(keys, patience)
    records = {r: json.loads(store.get(key)) for r, key in enumerate(keys) if store.check([key])}
    return f"{hang_verdict(records, world)}; each rank's stack and last collectives are in {hang_dir}/"


# --- the run's output directory: one live job and one run per OUT_DIR, checked before anything heavy

LEASE_BEAT_S = 2.0  # how often the job holding OUT_DIR renews its lease
LEASE_STALE_S = 10.0  # a lease not renewed for this long, as another job sees it, belongs to a job that is gone


class Lease:
    """OUT_DIR/lease.json, held by one live job's rank 0 (README: one live job per OUT_DIR). A heartbeat is judged
    stopped by the watcher's own clock, no clocks compared; a holder whose lease is taken over stops."""

    def __init__(self, out_dir: str, wait_s: float):
        self.path = os.path.join(out_dir, "lease.json")
        self.mine = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "beat": 0}
        self.stopped = threading.Event()
        seen = None
        since = start = time.monotonic()
        while True:
            held = self.held()
            stale = held is not None and held == seen and time.monotonic() - since > LEASE_STALE_S
            if held is None or stale or self.gone(held):
                self.write()
                time.sleep(0.5)  # a job that wrote at the same moment: the last write wins, the other one waits
                if (self.held() or {}).get("owner") == self.mine["owner"]:
                    break
                continue
            if held != seen:  # the heartbeat moved: that job is alive
                seen = held
                since = time.monotonic()
            if time.monotonic() - start >= wait_s:
                raise ValueError(f"--out_dir={out_dir} is in use by another job (host {held['host']}, pid "
                                 f"{held['pid']}, last heartbeat at {time.ctime(held['time'])} by its clock); wait "
                                 f"for it to end or stop it, choose another --out_dir, or wait longer with "
                                 f"--lease_wait.")
            time.sleep(0.5)
        if held is not None:
            say(f"lease of {out_dir} taken over from host {held['host']} pid {held['pid']}, "
                f"{'which is gone' if self.gone(held) else 'whose heartbeat stopped'}")
        threading.Thread(target=self.renew, daemon=True).start()

    def held(self) -> dict | None:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(Path(self.path).read_text())

    @staticmethod
    def gone(held: dict) -> bool:
        """Whether the holder is a process of this host that no longer exists (a job that crashed here)."""
        if held.get("host") != socket.gethostname():
            return False
        try:
            os.kill(held["pid"], 0)
        except ProcessLookupError:
            return True
        except OSError:  # another user's process: alive
            pass
        return False

    def write(self):
        self.mine["beat"] += 1
        data.write_durably(self.path, json.dumps({**self.mine, "time": time.time()}))

    def renew(self):
        while not self.stopped.wait(LEASE_BEAT_S):
            held = self.held()
            if held is not None and held["owner"] != self.mine["owner"]:
                print(f"lease of {os.path.dirname(self.path)} taken over by host {held['host']} pid {held['pid']}: "
                      f"this job stops", file=sys.stderr, flush=True)
                os._exit(1)
            self.write()

    def release(self):
        self.stopped.set()
        if (self.held() or {}).get("owner") == self.mine["owner"]:
            os.remove(self.path)


def rank0s(value):
    """Rank 0's `value`, on every rank."""
    box = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def hold_out_dir(tc: TrainConfig, master: bool) -> Lease | None:
    """Make OUT_DIR and take its lease on rank 0; one sentence, on every rank, if it is unwritable or held."""
    try:
        os.makedirs(tc.out_dir, exist_ok=True)
        if not os.access(tc.out_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        raise ValueError(f"--out_dir={tc.out_dir} cannot be written to ({e.strerror}); choose a directory this "
                         f"user can create and write.") from None
    lease = refusal = None
    if master:
        try:
            lease = Lease(tc.out_dir, tc.lease_wait)
        except ValueError as e:
            refusal = str(e)
    refusal = rank0s(refusal)
    if refusal:
        raise ValueError(refusal)
    return lease


def prepare_out_dir(tc: TrainConfig, master: bool) -> tuple[TrainConfig, str | None]:
    """Refuse a run that would mix with or delete OUT_DIR's run (--resume=auto or one of its checkpoints continues it,
    --overwrite replaces it). Returns the config and what to resume from: a checkpoint, the root or None."""
    root = os.path.join(tc.out_dir, "checkpoints")
    restarted = restarts() > 0
    if restarted and checkpoint.latest(root):  # it continues from its own newest checkpoint
        return dataclasses.replace(tc, resume="auto"), root
    if tc.init_from_hf and tc.resume not in ("auto", "none"):
        raise ValueError(f"--init_from_hf={tc.init_from_hf} and --resume={tc.resume} both name the weights to start "
                         f"from; pass only one of them.")
    if tc.resume == "auto" and not tc.init_from_hf:
        return tc, root if checkpoint.latest(root) else None
    resume_from = None if tc.resume in ("auto", "none") else tc.resume
    # A checkpoint of this OUT_DIR's run goes on from there; a restarted job's files are its own first attempt's.
    if restarted or (resume_from and Path(os.path.abspath(resume_from)).is_relative_to(os.path.abspath(root))):
        return tc, resume_from
    # A run is its checkpoints and metrics; a config.json alone is what a launch that failed before its first step left.
    is_run = (os.path.isdir(root) and os.listdir(root)) or os.path.exists(os.path.join(tc.out_dir, "metrics.jsonl"))
    present = [name for name in ("checkpoints", "metrics.jsonl", "config.json", "config_history.jsonl")
               if os.path.exists(os.path.join(tc.out_dir, name))]
    if is_run and not tc.overwrite:
        if tc.init_from_hf:
            raise ValueError(f"--init_from_hf={tc.init_from_hf} starts from other weights, but --out_dir={tc.out_dir} "
                             f"holds a run ({', '.join(present)}) that this launch would mix with or delete; choose a "
                             f"new --out_dir, pass --overwrite to replace that run, or drop --init_from_hf to resume "
                             f"it.")
        raise ValueError(f"--out_dir={tc.out_dir} holds another run ({', '.join(present)}), which a new run would mix "
                         f"with or delete; continue it with --resume=auto, choose a new --out_dir, or pass --overwrite "
                         f"to replace it.")
    if is_run and master:
        shutil.rmtree(root, ignore_errors=True)
        for name in set(present) - {"checkpoints"}:
            os.remove(os.path.join(tc.out_dir, name))
    return tc, resume_from


def resume(resume_from: str | None, tc: TrainConfig, model, optimizer, state: TrainState, resolved: dict,
           alerts: Alerts) -> TrainConfig:
    """Load the checkpoint to continue from (auto: the newest that loads) into model, optimizer and `state`; set
    resolved["run_id"], its or a new one (a run prunes only its own checkpoints). Returns the LR schedule's config."""
    targets = state.targets(model, optimizer)
    if resume_from and tc.resume == "auto":
        resume_from, saved = checkpoint.load_latest(resume_from, targets, resolved, say)
    else:
        saved = checkpoint.load(resume_from, targets, config=resolved) if resume_from else None
    if saved is None:
        resolved["run_id"] = rank0s(uuid.uuid4().hex[:12])  # every rank names the run alike
        return tc
    state.load(saved)
    resolved["run_id"] = saved.get("run_id")
    alerts.event("restart" if alerts.restarts else "resume", state.step,
                 f"resumed from {resume_from} at step {state.step}")
    schedule_steps = saved.get("schedule_steps", tc.steps)
    if schedule_steps == tc.steps:
        return tc
    kept = dataclasses.replace(tc, steps=schedule_steps)  # keep: that schedule, then its final LR; stretch: a jump
    if tc.resume_schedule == "keep":
        say(f"LR schedule: the checkpoint's, laid over {schedule_steps} steps, then its final LR "
            f"{lr_at(schedule_steps - 1, kept):.2e} (--resume_schedule=keep; stretch lays it over --steps={tc.steps})")
        return kept
    say(f"LR schedule: laid again over --steps={tc.steps}, not the checkpoint's {schedule_steps} steps "
        f"(--resume_schedule=stretch; keep holds the checkpoint's)")
    return tc


# --- the run, stage by stage: setup, build, resume, the loop, finish

def autocast_for(tc: TrainConfig, device: torch.device):
    """(autocast context, compute dtype or None): bf16 on GPU, fp32 on CPU, unless --dtype says otherwise."""
    dtype = torch.bfloat16 if (tc.dtype == "bf16" or (tc.dtype == "auto" and device.type == "cuda")) else None
    return (torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()), dtype


@dataclass
class Run:
    """Where and how a run computes, settled on every rank (the layout checked) before any build or collective."""
    tc: TrainConfig
    cfg: ModelConfig
    layout: parallel.Layout
    rank: int
    device: torch.device
    autocast: contextlib.AbstractContextManager
    dtype: torch.dtype | None

    @classmethod
    def on(cls, tc: TrainConfig, cfg: ModelConfig, rank: int, world: int, device: torch.device) -> "Run":
        layout = parallel.Layout.following(world, tc.dp_replicate, tc.dp_shard, tc.ep)
        tc = with_batch_defaults(tc, layout.world)
        layout.check(cfg, tc.global_batch, tc.micro_batch)
        return cls(tc, cfg, layout, rank, device, *autocast_for(tc, device))

    @property
    def master(self) -> bool:
        return self.rank == 0


def prepare(tc: TrainConfig, overrides: dict, rank: int, world: int,
            device: torch.device) -> tuple[Run, dict, str | None]:
    """The run (OUT_DIR, data, model config, layout), its config.json (every checkpoint's too), what to resume from."""
    tc, resume_from = prepare_out_dir(tc, rank == 0)
    torch.manual_seed(tc.seed)
    if tc.data == data.DEFAULT_DATA_DIR and not os.path.exists(os.path.join(tc.data, "manifest.json")):
        if rank == 0:  # the default corpus is prepared on first use; the other ranks wait
            data.prepare(out_dir=tc.data)
        if dist.is_initialized():
            dist.barrier()
    mixture = data.Mixture(tc.data, tc.tokenizer)
    tokenizer = mixture.tokenizer  # its manifest fields: name, vocab_size, a Hugging Face folder's tokenizer_path
    if tc.init_from_hf:
        cfg = dataclasses.replace(checkpoint.hf_config(tc.init_from_hf), **overrides)
        data.check_vocabulary(tokenizer, tc.init_from_hf)  # the embedding rows must mean the data's tokens
    else:
        cfg = model_config(tc, overrides, tokenizer["vocab_size"])
    run = Run.on(tc, cfg, rank, world, device)  # --micro_batch=0 resolved
    train = {k: v for k, v in dataclasses.asdict(run.tc).items() if k != "on_event"}  # may hold a secret (a webhook)
    resolved = {"train": train, "model": dataclasses.asdict(cfg), "world_size": world,
                "tokenizer": {"name": tokenizer["tokenizer"],
                              "source": tokenizer.get("tokenizer_path", tokenizer["tokenizer"])},
                "data": mixture.identity()}
    if resume_from:
        compare_settings(resume_from, resolved)
    return run, resolved, resume_from


# Settings that change what a run trains, compared on resume with the checkpoint's (--steps has --resume_schedule).
SETTINGS = [f"train.{name}" for name in (
    "data", "seed", "seq_len", "global_batch", "doc_mask", "optimizer", "lr", "muon_lr", "weight_decay",
    "beta1", "beta2", "muon_momentum", "grad_clip", "warmup_steps", "decay", "wsd_decay_frac", "min_lr_ratio",
    "balance", "smebu_lambda", "smebu_beta", "smebu_kappa", "sign_gamma", "bias_freeze_step")] + [
    "model.aux_loss_coef", "model.z_loss_coef"]


def compare_settings(resume_from: str, resolved: dict):
    """Say how the training settings differ from the checkpoint's; other data or tokenizer needs --allow_changed."""
    path, saved, _ = checkpoint.saved_checkpoint(resume_from)
    changed = {}
    for key in SETTINGS:
        table, name = key.split(".")
        old = saved.get(table, {}).get(name)
        if old is not None and old != resolved[table][name]:
            changed[name] = (old, resolved[table][name])
    if "data" in saved:  # the same data prepared elsewhere is the same data: its path may move
        changed.pop("data", None)
        if saved["data"]["fingerprint"] != resolved["data"]["fingerprint"]:
            changed["data"] = (saved["train"]["data"], resolved["train"]["data"])
    if "tokenizer" in saved:
        old = saved["tokenizer"]
        try:
            same = data.same_tokenizer(old["source"], resolved["tokenizer"]["source"])
        except data.DataError:  # the checkpoint's tokenizer folder is gone: its recorded name alone
            same = old["name"] == resolved["tokenizer"]["name"]
        if not same:
            changed["tokenizer"] = (old["name"], resolved["tokenizer"]["name"])
    if not changed:
        return
    for name in ("seed", "seq_len", "global_batch"):
        if name in changed:
            raise ValueError(f"--{name}={changed[name][1]} differs from the {changed[name][0]} of checkpoint {path}, "
                             f"which fixes the data order; resume with --{name}={changed[name][0]}, or start a new "
                             f"run.")
    for name in CHANGEABLE:
        if name in changed and name not in listed(resolved["train"]["allow_changed"]):
            raise ValueError(f"--{name}={changed[name][1]} is not the {name} checkpoint {path} was trained on "
                             f"({changed[name][0]}); resume with --{name}={changed[name][0]}, or pass "
                             f"--allow_changed={name} to train on the new {name} from here on.")
    say(f"resuming {path} with settings that differ from its own:\n" +
        "\n".join(f"  {name}: {old!r} -> {new!r}" for name, (old, new) in changed.items()))
    if "data" in changed:  # the loader has no state: each source's place is a function of the mixture and the step
        say("  data: each source goes on from where the new --data puts it at this step, as if it had held from "
            "step 0; a change written as a new phase, --data='OLD;STEP=NEW', keeps the steps before STEP as they were")


def loaders(run: Run) -> tuple[data.DataLoader, dict[str, data.DataLoader]]:
    """This rank's train loader, and a validation loader by path for each source that has a val split."""
    tc = run.tc

    def loader(spec: str, split: str) -> data.DataLoader:
        return data.DataLoader(spec, split, tc.seq_len, tc.global_batch, run.rank, run.layout.world, tc.seed,
                               vocab_size=run.cfg.vocab_size, tokenizer=tc.tokenizer)

    train_loader = loader(tc.data, "train")
    mixture = train_loader.mixture
    val = {path: loader(path, "val") for path, manifest in zip(mixture.paths, mixture.manifests)
           if manifest["splits"]["val"]}
    for path, manifest in zip(mixture.paths, mixture.manifests):
        if path not in val:
            why = "a Megatron-LM dataset" if manifest.get("format") == "megatron" else "prepared with --val_fraction=0"
            say(f"no validation set in {path} ({why}): validation is skipped" + (" for it" if val else ""))
    return train_loader, val


def build(run: Run, copies: int | None = None):
    """(model, optimizer): built on meta, sharded, initialised; the memory check counts `copies` (or state_copies)."""
    mesh = parallel.build_mesh(run.layout, run.device.type)
    model = parallel.build_model(run.cfg, run.layout, mesh, run.device, ac=run.tc.ac, compile=run.tc.compile,
                                 param_dtype=torch.bfloat16 if run.dtype else None, seed=run.tc.seed,
                                 state_copies=copies or state_copies(run.tc))
    return model, parallel.build_optimizer(model, run.tc)


class Drills:
    """Faults injected on purpose ("drill" flags); only a first launch dies or hangs, so the restarted job finishes."""

    def __init__(self, run: Run):
        self.tc = run.tc
        self.rank = run.rank
        self.doomed = restarts() == 0 and run.rank == run.layout.world - 1  # the rank the crash and stall drills stop
        self.spike_at = {int(n) for n in listed(self.tc.spike_at_step)}

    def skew_router(self, model):
        """--skew_router, in every MoE layer (a resume loads the saved bias over it)."""
        for moe in model.moe_layers() if self.tc.skew_router else ():
            moe.expert_bias[: 2 * model.cfg.top_k] += self.tc.skew_router

    def before_step(self, step: int, data_step: int) -> float:
        """--stall_at_step hangs the last rank (the others wait in the step's first collective); the gradient factor."""
        if step == self.tc.stall_at_step and self.doomed:
            time.sleep(10 * self.tc.step_timeout + 60)
        if data_step == self.tc.nan_at_step:
            return math.nan
        return 100.0 if data_step in self.spike_at else 1.0  # --spike_at_step's factor

    def straggle(self, seconds: float):
        if self.rank == self.tc.straggle_rank:
            time.sleep(seconds)

    def after_step(self, step: int):
        if step + 1 == self.tc.crash_at_step and self.doomed:
            print(f"crash drill: rank {self.rank} exits abruptly after step {step + 1}", file=sys.stderr, flush=True)
            os._exit(1)


# --- stragglers: each rank's own time per step, gathered at every log

STEP_PARTS = ("data", "compute", "wait")


class StepTimes:
    """This rank's seconds per step in STEP_PARTS, summed between logs: data (reading its batch), compute (the rest of
    its own step, FSDP's gathers included) and wait (in the step's closing all-reduce, for the slowest rank)."""

    def __init__(self, run: Run):
        self.run = run
        self.sums_P = torch.zeros(len(STEP_PARTS), dtype=torch.float64)
        self.steps = 0
        self.hosts = [socket.gethostname()] * run.layout.world
        if run.layout.world > 1:  # once: each rank's host, to name a straggler where a person can find it
            dist.all_gather_object(self.hosts, socket.gethostname())

    def add(self, data_s: float, compute_s: float, wait_s: float):
        self.sums_P += torch.tensor([data_s, compute_s, wait_s], dtype=torch.float64)
        self.steps += 1

    def gather(self, threshold: float) -> tuple[dict, str | None]:
        """slowest() of every rank's mean seconds per step since the last call, gathered in one all-reduce."""
        times_RP = torch.zeros(self.run.layout.world, len(STEP_PARTS), dtype=torch.float64, device=self.run.device)
        times_RP[self.run.rank] = self.sums_P / self.steps
        parallel.all_reduce_sum_(times_RP)
        self.sums_P.zero_()
        self.steps = 0
        return slowest(times_RP.tolist(), self.hosts, threshold)


def slowest(times_RP: list[list[float]], hosts: list[str], threshold: float) -> tuple[dict, str | None]:
    """The record's per-rank seconds per step (data_s_ranks, ...), the slowest rank and how much longer its own time
    (data + compute) is than the other ranks' median; past `threshold`, also the sentence naming it and its host."""
    record = {f"{part}_s_ranks": [round(t[p], 4) for t in times_RP] for p, part in enumerate(STEP_PARTS)}
    if len(times_RP) < 2:
        return record, None
    own_R = [data + compute for data, compute, _ in times_RP]
    rank = max(range(len(own_R)), key=own_R.__getitem__)
    others = [t for r, t in enumerate(times_RP) if r != rank]
    median = statistics.median(data + compute for data, compute, _ in others)
    slower = own_R[rank] / median - 1 if median > 0 else 0.0
    record.update(slowest_rank=rank, slowest_vs_median=round(slower, 4))
    if not threshold or slower <= threshold:
        return record, None
    data, compute, _ = times_RP[rank]
    wait = statistics.median(t[2] for t in others)
    return record, (f"straggler: rank {rank} on {hosts[rank]} takes {own_R[rank]:.3f}s per step of its own (data "
                    f"{data:.3f}s, compute {compute:.3f}s), {100 * slower:.0f}% above the other ranks' median of "
                    f"{median:.3f}s; they wait {wait:.3f}s per step for it")


class Stopped(RuntimeError):
    """The run stopped itself (too many non-finite steps, too many rollbacks): one sentence, said as it stops."""


class Loop:
    """The optimizer steps of one launch, logged, evaluated and checkpointed when due; state.step counts updates."""

    def __init__(self, run: Run, model, optimizer, state: TrainState, loaders, schedule: TrainConfig, resolved: dict,
                 flops_per_token: float, drills: Drills, alerts: Alerts):
        tc = run.tc
        self.run = run
        self.model = model
        self.optimizer = optimizer
        self.state = state
        self.schedule = schedule
        self.loader, self.val_loaders = loaders
        self.resolved = resolved
        self.flops_per_token = flops_per_token
        self.sinks = MetricsSinks(tc, resolved, state.step, run.master)
        self.peak = peak_tflops(run.device, tc.peak_tflops)
        self.tokens_per_step = tc.global_batch * tc.seq_len
        self.guard = Guard(tc.step_timeout, os.path.join(tc.out_dir, "hang"), alerts)
        self.times = StepTimes(run)
        self.ckpt_root = os.path.join(tc.out_dir, "checkpoints")
        self.drills = drills
        self.repeated = set()  # the sources warned about being read more than REPEATED_EPOCHS times
        self.alerts = alerts
        self.first_loss = self.val_loss = self.out = self.pending = self.writing = self.lost = None
        self.t_start = self.t_last = self.ckpt_time = time.time()
        self.logged_step = self.start_step = state.step
        self.resumed = state.step > 0  # the first step checks the checkpoint against the losses it recorded
        if tc.allow_changed:  # those losses are of other data or another tokenizer: the spike statistics start again
            state.recent = []
        self.ckpt_step = 0
        self.final = self.disk_low = False
        old = state.resumed_world
        world = run.layout.world
        if old and old != world:
            alerts.event("world_size_change", state.step, f"world size changed: {old} -> {world} ranks "
                         f"({run.layout.describe().splitlines()[0]}), resumed at step {state.step}, "
                         f"{self.sinks.steps_lost} logged steps trained again")
        resumed = {"from_step": state.step, "world_size": [old, world], "steps_lost": self.sinks.steps_lost}
        self.restart_record = resumed if state.step else None  # what the launch's first record says it resumed as
        self.report()

    def train(self) -> dict:
        """The steps, then finish; however they end (a stop, bad data, a second Ctrl-C), guard and alerts close."""
        try:
            while self.state.step < self.run.tc.steps:
                if self.step():
                    break
            self.complete()
            return self.finish()
        except KeyboardInterrupt:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt(self.abandon()) from None
        finally:
            self.guard.close()
            self.alerts.close()

    def abandon(self) -> str:
        """Give up the checkpoint being written, if any, removing its partial files: what a second Ctrl-C says."""
        newest = checkpoint.latest(self.ckpt_root) or "none"
        if self.writing is None:
            what = f"stopped at once in step {self.state.step + 1}"
        else:
            partial = checkpoint.abandon(self.ckpt_root, self.writing)
            what = (f"checkpoint step_{self.writing:08d} abandoned before it was complete (its partial files "
                    f"{partial} removed)")
        return f"interrupted again: {what}; the newest checkpoint is {newest}"

    def step(self) -> bool:
        """One optimizer step (state.step) and the decisions after it; True when the run stops here (preempted)."""
        run = self.run
        tc = self.run.tc
        state = self.state
        step = state.step
        data_step = state.data_step()
        lr = lr_at(min(step, self.schedule.steps - 1), self.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_scale = self.drills.before_step(step, data_step)
        t_start = time.perf_counter()
        batch = self.loader.batch(data_step)
        t_data = time.perf_counter()
        limits, damaged_above = self.limits()
        out = train_step(self.model, self.optimizer, batch, tc, run.autocast, state, grad_scale, limits)
        self.drills.straggle(time.perf_counter() - t_data)
        if run.device.type == "cuda":
            torch.cuda.synchronize()  # the device's compute, not only the host's launches
        t_compute = time.perf_counter()
        # One all-reduce of the loop's decisions closes the step (each rank waits for the slowest): preemption or a
        # checkpoint write in flight on any rank, rank 0's checkpoint clock, the global batch's token-id sum (a data
        # checksum; float64 is exact below 2**53), each source's loss.
        writing = self.pending is not None and not self.pending.done()
        clock_due = run.master and bool(tc.ckpt_minutes) and time.time() - self.ckpt_time >= 60 * tc.ckpt_minutes
        source_B = torch.as_tensor(self.loader.sources_of(data_step), device=run.device)
        loss_S = torch.zeros(len(self.loader.sources), dtype=torch.float64, device=run.device)
        loss_S.index_add_(0, source_B, out["loss_B"].double())
        flags = torch.tensor([self.guard.requested, writing, clock_due, batch[0].sum().item()], dtype=torch.float64,
                             device=run.device)
        reduced = parallel.all_reduce_sum_(torch.cat([flags, loss_S])).tolist()
        preempted, writing, clock_due, tokens_sum = reduced[:4]
        self.times.add(t_data - t_start, t_compute - t_data, time.perf_counter() - t_compute)
        if not writing:  # every rank has written the last checkpoint: mark it complete now, not at the next save,
            self.complete()  # so a crash loses at most ckpt_every steps
        self.guard.beat(step + 1)
        self.resumed = False
        applied = out["skipped"] is None
        if applied:
            self.applied(step, data_step, lr, out, int(tokens_sum), reduced[4:])
        else:
            self.skip(step, data_step, out, limits, damaged_above)
        last = applied and state.step == tc.steps
        if last or preempted or clock_due or (applied and tc.ckpt_every and state.step % tc.ckpt_every == 0):
            self.save(state.step, final=last or preempted)
        if preempted:
            self.complete()  # said written only once it is complete
            if self.lost is None:
                say(f"{'interrupted' if self.guard.interrupted else 'preempted'}: checkpoint written at step "
                    f"{state.step}; exiting")
            return True
        if applied:
            self.drills.after_step(step)
        return False

    def limits(self) -> tuple[tuple[float, float] | None, float]:
        """(spike limits, once --spike_window steps are in; the loss past which the loaded checkpoint is damaged)."""
        tc = self.run.tc
        recent = self.state.recent
        if not tc.spike_threshold or not recent:
            return None, math.inf
        limits = spike_limits(recent, tc.spike_threshold) if len(recent) >= tc.spike_window else None
        if not self.resumed:
            return limits, math.inf
        damaged_above = spike_limits(recent, DAMAGE_FACTOR * tc.spike_threshold)[0]
        return limits or (damaged_above, math.inf), damaged_above

    def applied(self, step: int, data_step: int, lr: float, out: dict, tokens_sum: int, loss_S: list[float]):
        """An update made: the step counts, its values join the spike statistics; logged and evaluated when due."""
        run = self.run
        tc = run.tc
        state = self.state
        state.step = step + 1
        state.recent = (state.recent + [[out["loss"], out["grad_norm"]]])[-tc.spike_window:]
        self.out = out
        self.first_loss = out["lm_loss"] if self.first_loss is None else self.first_loss
        last = state.step == tc.steps
        record = {"step": step + 1, "loss": out["loss"], "lm_loss": out["lm_loss"], "aux_loss": out["aux_loss"],
                  "z_loss": out["z_loss"], "lr": lr, "grad_norm": out["grad_norm"], "tokens_sum": tokens_sum,
                  "data_step": data_step, **self.sources(data_step, loss_S)}
        if (step + 1) % tc.log_every == 0 or last or step == self.start_step:
            record.update(self.log(step, lr))
        if self.restart_record and step == self.restart_record["from_step"]:  # not again after a rollback
            record["resumed"] = self.restart_record
        if self.val_loaders and ((tc.eval_every and (step + 1) % tc.eval_every == 0) or last):
            losses = {path: evaluate(self.model, loader, tc.eval_batches, tc.micro_batch, run.autocast, tc.doc_mask)
                      for path, loader in self.val_loaders.items()}
            self.val_loss = record["val_loss"] = sum(losses.values()) / len(losses)
            record["val_loss_by_source"] = losses
            by_source = "" if len(losses) == 1 else " (" + ", ".join(f"{p} {v:.4f}" for p, v in losses.items()) + ")"
            say(f"step {step + 1:5d} | val loss {self.val_loss:.4f}{by_source}")
        self.sinks.write(record)

    def skip(self, step: int, data_step: int, out: dict, limits: tuple[float, float], damaged_above: float):
        """A damaged checkpoint falls back; else the batch is skipped data: non-finite steps stop, spikes roll back."""
        tc = self.run.tc
        state = self.state
        if out["loss"] > damaged_above:
            return self.fall_back(step, out, damaged_above)
        state.skip_data(data_step, data_step + 1)
        if out["skipped"] == "non-finite":
            say(f"step {step + 1}: non-finite loss or gradient norm; step skipped with its batch "
                f"({state.bad_steps} in a row, {state.skipped} skipped in total)")
            if state.bad_steps >= tc.max_bad_steps:
                self.stop(f"{state.bad_steps} non-finite steps in a row, the last at step {step + 1}; the last good "
                          f"checkpoint is {checkpoint.latest(self.ckpt_root) or 'none'}; lower --lr or inspect the "
                          f"data of these steps, then resume")
            return
        state.spikes = [s for s in state.spikes if s[0] > step - tc.spike_window] + [[step, data_step]]
        self.alerts.event("spike", step + 1,
                          f"step {step + 1}: spike (loss {out['loss']:.4g}, limit {limits[0]:.4g}; gradient norm "
                          f"{out['grad_norm']:.4g}, limit {limits[1]:.4g}: the last {len(state.recent)} steps' medians "
                          f"+ {tc.spike_threshold:g} robust deviations); skipped with its batch (data step "
                          f"{data_step}), {len(state.spikes)} within {tc.spike_window} steps")
        if tc.spike_rollback and len(state.spikes) >= tc.spike_rollback:
            self.rollback(step, data_step)

    def sources(self, step: int, loss_S: list[float]) -> dict:
        """The record's tokens, mean loss and epochs read by source; a source past REPEATED_EPOCHS is said once."""
        paths = self.loader.mixture.paths
        counts_S = self.loader.counts(step)
        epochs_S = self.loader.epochs(step)
        for path, epochs in zip(paths, epochs_S):
            if epochs > REPEATED_EPOCHS and path not in self.repeated:
                self.repeated.add(path)
                say(f"warning: by step {step + 1}, {path} has been read {epochs:.2f} times (epochs); data repeated "
                    f"more than {REPEATED_EPOCHS} times teaches little more: add data or lower its weight")
        return {"tokens_by_source": {path: int(n) * self.run.tc.seq_len for path, n in zip(paths, counts_S)},
                "loss_by_source": {path: loss / n for path, loss, n in zip(paths, loss_S, counts_S) if n},
                "epochs_by_source": {path: round(float(e), 4) for path, e in zip(paths, epochs_S)}}

    def rollback(self, step: int, data_step: int):
        """A burst of spikes (PaLM's recipe): back to the newest checkpoint before the first, skipping the data from
        its batch through the last's; later checkpoints are deleted, so that a restart never resumes them."""
        tc = self.run.tc
        state = self.state
        first_step, first_data = state.spikes[0]
        burst = f"{len(state.spikes)} spikes within {tc.spike_window} steps, the first at step {first_step + 1}"
        if state.rollbacks >= tc.max_rollbacks:
            self.stop(f"{burst}, call for rollback {state.rollbacks + 1}, beyond --max_rollbacks={tc.max_rollbacks}; "
                      f"lower --lr or inspect data steps {first_data} to {data_step}, then resume with a larger "
                      f"--max_rollbacks")
        state.skip_data(first_data, data_step + 1)
        history = {"skipped_data": state.skipped_data, "skipped": state.skipped, "rollbacks": state.rollbacks + 1,
                   "spikes": []}
        path = self.reload(first_step, f"{burst}, call for a rollback, but no checkpoint before step {first_step + 1} "
                                       f"is left; lower --ckpt_every or raise --keep_ckpts, then resume",
                           history=history)
        if self.run.master:
            checkpoint.remove_after(self.ckpt_root, state.step)
        self.alerts.event("rollback", state.step, f"{burst}: rolled back to {path} (rollback {state.rollbacks} of at "
                                                  f"most {tc.max_rollbacks}); data steps {first_data} to {data_step} "
                                                  f"are skipped")

    def fall_back(self, step: int, out: dict, damaged_above: float):
        """The checkpoint just loaded makes a loss far beyond those it recorded: damaged; the one before it loads."""
        damaged = (f"step {step + 1}, the first after loading the checkpoint of step {step}, has loss "
                   f"{out['loss']:.4g}, gradient norm {out['grad_norm']:.4g}, far beyond the loss {damaged_above:.4g} "
                   f"its recorded losses allow: that checkpoint looks damaged and is not trained on")
        path = self.reload(step - 1, f"{damaged}, and no earlier checkpoint is left; restore the checkpoints or start "
                                     f"again with --resume=none --overwrite", checkpoint.CorruptCheckpoint)
        self.alerts.event("damaged_checkpoint", step, f"{damaged}; fell back to {path}")

    def reload(self, up_to: int, none_left: str, error: type = Stopped, history: dict | None = None) -> str:
        """Load the newest loadable checkpoint up to step `up_to`, `history` over its train state; its path. None left:
        stop, saying `none_left`."""
        self.complete()
        path, saved = checkpoint.load_latest(self.ckpt_root, self.state.targets(self.model, self.optimizer),
                                             self.resolved, say, up_to=up_to)
        if saved is None:
            self.stop(none_left, error)
        self.state.load({**saved, **(history or {})})
        self.sinks.rewind(self.state.step)
        self.resumed = True
        self.logged_step = self.start_step = self.state.step
        self.t_start = self.t_last = time.time()
        return path

    def stop(self, message: str, error: type = Stopped):
        self.complete()  # the checkpoint in flight holds a state from before the trouble: keep it
        self.alerts.event("stopped", self.state.step, message)
        raise error(message)

    def save(self, step: int, final: bool):
        self.complete()  # the previous asynchronous write must be complete before the next one starts
        tc = self.run.tc
        self.ckpt_step = step
        self.final = final
        self.ckpt_time = time.time()
        self.writing = step  # until complete: what a second Ctrl-C abandons
        train = {**self.state.saved(step), "run_id": self.resolved["run_id"],
                 "schedule_steps": self.schedule.steps, "world_size": self.run.layout.world}
        try:
            self.pending = checkpoint.save(self.ckpt_root, step, {"model": self.model, "optim": self.optimizer,
                                           "train": train}, self.resolved, keep=tc.keep_ckpts, async_save=tc.async_ckpt)
        except checkpoint.SaveFailed as e:
            self.writing = None
            return self.failed(e)
        if not tc.async_ckpt:
            self.complete()

    def complete(self):
        """Wait for the checkpoint write in flight, if any, and mark its checkpoint complete."""
        if self.pending is None:
            return
        try:
            self.pending.wait()
        except checkpoint.SaveFailed as e:
            return self.failed(e)
        finally:
            self.pending = self.writing = None
        say(f"checkpoint step_{self.ckpt_step:08d} complete, {time.time() - self.ckpt_time:.1f}s after it began")
        if self.run.master:
            self.report()  # its newest checkpoint
            self.check_disk()

    def check_disk(self):
        """After each checkpoint, an event when OUT_DIR has room for fewer than two more (once, until it has again)."""
        size = sum(f.stat().st_size for f in Path(self.ckpt_root, f"step_{self.ckpt_step:08d}").iterdir())
        free = shutil.disk_usage(self.run.tc.out_dir).free
        low = free < 2 * size
        if low and not self.disk_low:
            self.alerts.event("disk_nearly_full", self.ckpt_step,
                              f"{self.run.tc.out_dir} has {free / 2**30:.2f} GiB free, room for fewer than two more "
                              f"checkpoints of {size / 2**30:.2f} GiB; free some space or lower --keep_ckpts")
        self.disk_low = low

    def failed(self, e: checkpoint.SaveFailed):
        if self.final:
            self.lost = e  # nothing follows to go on with: finish raises it once the run is wound up
        self.alerts.event("checkpoint_failed", self.ckpt_step, str(e) if self.final else f"{e} Training goes on.")

    def log(self, step: int, lr: float) -> dict:
        """The console line of this step, and the record's speed, memory and balance fields; status.json too."""
        tc = self.run.tc
        out = self.out
        dt = (time.time() - self.t_last) / (step + 1 - self.logged_step)  # the step synchronised the device
        self.t_last = time.time()
        self.logged_step = step + 1
        tok_s = self.tokens_per_step / dt
        mfu = tok_s * self.flops_per_token / (self.peak * 1e12 * self.run.layout.world) if self.peak else None
        mem = torch.cuda.max_memory_allocated(self.run.device) / 2**30 if self.run.device.type == "cuda" else None
        bal = balance_metrics(out["counts_LE"], self.model.moe_layers())
        # A launch's first step (compilation, cold caches) is recorded but not judged.
        times, straggler = self.times.gather(tc.straggler_threshold if step > self.start_step else 0.0)
        eta = (time.time() - self.t_start) / (step + 1 - self.start_step) * (tc.steps - step - 1)
        say(f"step {step + 1:5d}/{tc.steps} | loss {out['loss']:.4f} | lr {lr:.2e} | grad {out['grad_norm']:.3f} | "
            f"{tok_s:,.0f} tok/s | mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | mem "
            f"{'n/a' if mem is None else f'{mem:.1f}GiB'} | maxvio {bal['max_vio']:.2f} | eta {eta / 60:.1f}m")
        if straggler:
            self.alerts.event("straggler", step + 1, straggler)
        self.report(loss=out["loss"], tokens_per_s=tok_s, mfu=mfu, eta_s=eta)
        return dict(tokens_per_s=tok_s, mfu=mfu, peak_mem_gib=mem, skipped_steps=self.state.skipped, **bal, **times)

    def report(self, **numbers):
        """Rank 0's status.json: the step reached, the layout, the newest checkpoint and the latest step's `numbers`."""
        if not self.run.master:
            return
        layout = self.run.layout
        state = self.state
        self.alerts.update(step=state.step, steps=self.run.tc.steps, tokens=state.step * self.tokens_per_step,
                           **numbers, last_checkpoint=checkpoint.latest(self.ckpt_root), world_size=layout.world,
                           layout={"dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "ep": layout.ep},
                           skipped_steps=state.skipped, rollbacks=state.rollbacks)

    def finish(self) -> dict:
        """The summary and a sample, then the sinks are closed; returns the run's losses."""
        tc = self.run.tc
        out = self.out
        step = self.state.step
        if out is not None:
            summary = (f"done: {step - self.start_step} steps, {step * self.tokens_per_step:,} tokens seen in all, "
                       f"{time.time() - self.t_start:.0f}s; loss {self.first_loss:.3f} -> {out['loss']:.3f}, "
                       f"val loss {self.val_loss if self.val_loss is None else round(self.val_loss, 3)}; "
                       f"outputs in {tc.out_dir}/")
            if step == tc.steps:
                self.alerts.event("finished", step, summary)
            else:
                say(summary)
        if tc.sample_tokens and out is not None and not self.guard.requested:
            sample(self.run, self.model, self.resolved["tokenizer"]["source"])
        self.sinks.close()
        if self.lost:
            raise self.lost
        return {"first_loss": self.first_loss, "loss": out and out["loss"], "val_loss": self.val_loss, "step": step}


def sample(run: Run, model, tokenizer: str):
    """Says the --sample_tokens tokens the model writes after "def ", up to an end-of-text. Every rank draws all of
    them (no early stop), so that the ranks of a sharded model make the same forwards even if their draws differ."""
    enc = data.get_encoding(tokenizer)
    prompt = torch.tensor([enc.encode("def ")], device=run.device)
    torch.manual_seed(run.tc.seed)  # the same draws on every rank
    model.eval()
    allowed_V = checkpoint.decodable_ids(enc, run.cfg.vocab_size).to(run.device)
    tokens = model.generate(prompt, run.tc.sample_tokens, temperature=0.8, top_k=50, allowed_V=allowed_V)[0].tolist()
    say("sample:\n" + enc.decode(checkpoint.up_to_stop(tokens, prompt.shape[1], enc.eot_token)))


def main(tc: TrainConfig, overrides: dict) -> dict:
    """Set up, build, resume, train, finish (the lease given back however it ends): the losses and the step reached."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    used = parallel.Layout.following(launched, tc.dp_replicate, tc.dp_shard, tc.ep).world  # may stand some ranks by
    rank, world, device = parallel.init_distributed(timeout_s=max(60, tc.step_timeout or 1800), used=used)
    lease = hold_out_dir(tc, rank == 0)
    try:
        return train_run(*prepare(tc, overrides, rank, world, device))
    finally:
        if lease is not None:
            lease.release()


def train_run(run: Run, resolved: dict, resume_from: str | None) -> dict:
    tc = run.tc
    train_loader, val_loaders = loaders(run)
    say(json.dumps(resolved, indent=1))
    say(run.layout.describe(run.cfg.n_experts))
    if tc.dp_replicate == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torch 2.11-2.13: torchrun's agents share their rendezvous store with the workers (README, Elastic jobs)
        say("warning: a node that joins this elastic job later will wait forever; set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment on every node so that the job can grow "
            "(it shrinks either way)")

    model, optimizer = build(run)
    if tc.init_from_hf and resume_from is None:  # a restarted job resumes its own checkpoint instead
        checkpoint.load_hf_into(model, tc.init_from_hf)  # each rank reads only the rows of its own shards
        say(f"initialised from {tc.init_from_hf}")
    twin = meta_model(run.cfg)  # counted unsharded, on the meta device
    n = twin.num_params()
    flops = twin.flops_per_token(tc.seq_len)
    say(f"model: {n['total'] / 1e6:.1f}M parameters, {n['active'] / 1e6:.1f}M active, {flops / 1e6:.1f} MFLOP/token")
    drills = Drills(run)
    drills.skew_router(model)
    alerts = Alerts(run)

    state = TrainState.fresh(model, run.device)
    schedule = resume(resume_from, tc, model, optimizer, state, resolved, alerts)
    if state.step >= tc.steps:  # before any file is written: a run with nothing to do changes nothing
        say(f"already at step {state.step} of {tc.steps}; pass a larger --steps to train further")
        return {"first_loss": None, "loss": None, "val_loss": None, "step": state.step}
    return Loop(run, model, optimizer, state, (train_loader, val_loaders), schedule, resolved, flops, drills,
                alerts).train()


if __name__ == "__main__":
    try:
        main(*parse_args())
    except (data.DataError, ValueError, FileNotFoundError, checkpoint.SaveFailed, Stopped) as e:
        # A bad flag or layout fails alike on every rank (rank 0 says it); bad data can be one rank's own (it says it).
        if os.environ.get("RANK", "0") == "0" or isinstance(e, data.DataError):
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # torchrun stops the other ranks when one exits: give rank 0 time to say why first
            time.sleep(2)
        sys.exit(1 if isinstance(e, (checkpoint.SaveFailed, Stopped)) else 2)
    except KeyboardInterrupt as e:  # before the loop (nothing to save yet), or a second Ctrl-C (it says what it left)
        if os.environ.get("RANK", "0") == "0":
            print(e.args[0] if e.args else "interrupted: no checkpoint written; exiting", file=sys.stderr)
        sys.exit(130)
    parallel.finish(0)  # after main returned: the model and optimizer are out of scope
