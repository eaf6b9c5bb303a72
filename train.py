"""
Pre-train an AfMoE model, from one CPU to thousands of GPUs: the same file runs alone or under torchrun.

    python train.py                                       # tiny model on the embedded corpus (CPU, minutes)
    python train.py --preset=tiny --steps=500 --lr=3e-3   # flags are TrainConfig fields; model fields too
    torchrun --nproc_per_node=8 train.py --dp_replicate=2 --ep=4 --global_batch=64
    python train.py --config=out/config.json --lr=1e-3    # a run's saved config (or TOML), flags over it
    python train.py --help

The loop is train(); what keeps an unattended run alive (lease, watchdog, events, bad steps, checkpoints) is watch.py.
"""

import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, fields
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C, even while torch loads: one line and exit code 130, not a traceback
    def _interrupted(kind, value, traceback):
        if not issubclass(kind, KeyboardInterrupt):
            return sys.__excepthook__(kind, value, traceback)
        if os.environ.get("RANK", "0") == "0":  # a second Ctrl-C in the loop says what it left
            print(value.args[0] if value.args else "interrupted: no checkpoint written; exiting", file=sys.stderr)
        sys.exit(130)
    sys.excepthook = _interrupted

import torch
import torch.distributed as dist

import checkpoint
import data
import parallel
import watch
from model import (
    BALANCE_RULES,
    NON_NEGATIVE,
    POSITIVE,
    PRESETS,
    ModelConfig,
    Parser,
    Rule,
    at_least,
    check,
    listed,
    meta_model,
    one_of,
    option,
    pad_vocab,
    read_settings,
    refuse_unknown,
    update_expert_bias,
)
from parallel import say

FRACTION = Rule(lambda v, _: 0 <= v < 1, "at least 0 and below 1")
OFF_OR_MORE = at_least(0, "0 (off) or more")
CHANGEABLE = ("tokenizer", "data", "seq_len")  # what --allow_changed may name


@dataclass
class TrainConfig:
    """Every field is a --flag=value option checked by its rule; parallel.Layout checks how sizes and batches meet."""
    # model and data
    preset: str = option("tiny", "model preset (ModelConfig fields are flags too: --n_layers=8)", one_of(*PRESETS))
    data: str = option(data.DEFAULT_DATA_DIR, "data.py's output or a Megatron-LM path prefix; a mixture: PATH:WEIGHT,"
                                              "...; phases: MIXTURE;STEP=MIXTURE;... (each from STEP on)")
    tokenizer: str = option("cl100k_base", "the data's tokenizer: tiktoken name or Hugging Face folder")
    seq_len: int = option(128, "tokens per sequence", POSITIVE)
    doc_mask: bool = option(True, "a token attends only to its own document")
    # batch and schedule
    steps: int = option(150, "optimizer steps", POSITIVE)
    global_batch: int = option(8, "sequences per optimizer step, whatever the number of ranks", POSITIVE)
    micro_batch: int = option(0, "sequences per rank per forward (0: global_batch / world size)", NON_NEGATIVE)
    lr: float = option(5e-3, "peak learning rate", NON_NEGATIVE)
    min_lr_ratio: float = option(0.1, "final LR / peak LR", Rule(lambda v, _: 0 <= v <= 1, "between 0 and 1"))
    warmup_steps: int = option(20, "linear warmup steps", NON_NEGATIVE)
    decay: str = option("cosine", "LR decay after warmup (wsd: flat, then linear)", one_of("cosine", "linear", "wsd"))
    wsd_decay_frac: float = option(0.2, "with --decay=wsd, the fraction of steps spent decaying",
                                   Rule(lambda v, _: 0 < v <= 1, "above 0 and at most 1"))
    weight_decay: float = option(0.1, "AdamW weight decay on matrices", NON_NEGATIVE)
    beta1: float = option(0.9, "AdamW beta1", FRACTION)
    beta2: float = option(0.95, "AdamW beta2", FRACTION)
    optimizer: str = option("adamw", "muon: Muon for the blocks' matrices, AdamW at --lr for the rest (as Trinity)",
                            one_of(*parallel.OPTIMIZERS))
    muon_lr: float = option(5e-2, "peak Muon LR, x sqrt(max(1, fan_out/fan_in))", NON_NEGATIVE)
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: off)", OFF_OR_MORE)
    seed: int = option(0, "seed for initialisation and data order")
    # expert load balancing (model.update_expert_bias's rules)
    balance: str = option("smebu", "expert-bias update once per step", one_of(*BALANCE_RULES))
    bias_step: float = option(0.0, "its step size, SMEBU's λ or the sign rule's γ (0: the rule's own)", NON_NEGATIVE)
    bias_freeze_step: int = option(-1, "only steps 0 .. N-1 move the expert bias (-1: every step)",
                                   at_least(-1, "-1 (never) or a step number"))
    # parallelism and precision (parallel.py)
    dp_replicate: int = option(1, "HSDP replicas R (world = R x S x cp); auto (or 0): as many as the world holds, the "
                                  "rest standing by (elastic jobs)", at_least(0, "auto (0) or at least 1"),
                               parse=lambda text: 0 if text == "auto" else int(text))
    dp_shard: int = option(0, "FSDP group size S (0: world / dp_replicate / cp)", NON_NEGATIVE)
    ep: int = option(1, "expert-parallel degree (divides S)", POSITIVE)
    cp: int = option(1, "context parallelism: each sequence split over cp ranks",
                     Rule(lambda v, c: v >= 1 and c.seq_len % v == 0, "a divisor of seq_len={seq_len}"))
    ac: str = option("none", "activation checkpointing", one_of(*parallel.AC_MODES))
    keep_gathered: bool = option(False, "FSDP gathers once per step, not per micro-batch (holds the whole model)")
    compile: bool | None = option(None, "torch.compile each block (default: with CUDA)")
    dtype: str = option("auto", "compute dtype (auto: bf16 on GPU, fp32 on CPU)", one_of("auto", "bf16", "fp32"))
    threads: int = option(0, "CPU threads per process (0: one per core)", OFF_OR_MORE)
    precision: str = option("bf16", "fp8, mxfp8: block matmuls via torchao (README)", one_of(*parallel.PRECISIONS))
    keep_precision: bool = option(False, "keep --precision after a rollback (default: bf16 from then on)")
    # logging and evaluation
    out_dir: str = option("out", "where metrics, status.json, config.json and checkpoints go")
    log_every: int = option(10, "print a line every N steps (metrics.jsonl gets every step)", POSITIVE)
    log_to: str = option("none", "also log to tensorboard, wandb or both")
    eval_every: int = option(50, "validate every N steps and at the end (0: only at the end)", NON_NEGATIVE)
    eval_batches: int = option(4, "validation batches per evaluation", POSITIVE)
    sample_tokens: int = option(48, "tokens sampled from a prompt at the end (0: none)", OFF_OR_MORE)
    # checkpoints (checkpoint.py)
    ckpt_every: int = option(500, "checkpoint every N steps (0: only --ckpt_minutes, the end, preemption)", OFF_OR_MORE)
    ckpt_minutes: float = option(30.0, "also checkpoint this many minutes after the last one (0: off)", OFF_OR_MORE)
    keep_ckpts: int = option(3, "keep the newest K complete checkpoints of this run", POSITIVE)
    resume: str = option("auto", "auto: OUT_DIR's newest checkpoint that loads; none: start fresh; or a checkpoint")
    overwrite: bool = option(False, "replace OUT_DIR's other run instead of refusing")
    resume_schedule: str = option("keep", "if --steps differs from the checkpoint's: keep its LR schedule or stretch "
                                          "it over --steps", one_of("keep", "stretch"))
    init_from_hf: str = option("", "start from a Hugging Face afmoe folder")
    allow_changed: str = option("", "on resume, accept other data, tokenizer or seq_len (with global_batch)",
                                Rule(lambda v, _: set(listed(v)) <= set(CHANGEABLE), "empty, tokenizer, data, seq_len"))
    # an unattended run (watch.py)
    step_timeout: float = option(600.0, "seconds without a step before a hang report and exit (0: off); also the "
                                        "collective timeout", OFF_OR_MORE)
    spike_threshold: float = option(10.0, "skip a step whose loss or grad norm is this many robust deviations (log) "
                                          "above the window's median (0: only non-finite steps)", OFF_OR_MORE)
    spike_window: int = option(50, "applied steps the spike statistics span", at_least(3))
    spike_rollback: int = option(3, "bad steps within --spike_window that roll back to the checkpoint before", POSITIVE)
    max_rollbacks: int = option(5, "rollbacks a run may make before a burst stops it", NON_NEGATIVE)
    on_event: str = option("", "shell command run on each event, given NANOTITAN_* variables; never saved (README)")
    drill: str = option("", "faults to rehearse, KIND@N,...: spike@60,61 (losses x 100), nan@30, crash@30, stall@30 "
                            "(the last rank), straggle@1 (a rank), skew@0.1 (router bias)")

    def __post_init__(self):
        check(self)
        watch.log_sinks(self.log_to)  # a sink without its package is refused before any data is touched
        watch.parse_drills(self.drill)


# --- command line: every TrainConfig and ModelConfig field is a --flag=value option

SETTINGS = {"train": TrainConfig, "model": ModelConfig}
RUN_FACTS = ("world_size", "tokenizer", "data", "run_id", "from_step")  # config.json keys that are not settings
TRAIN_FLAGS = ["--config"] + [f"--{f.name}" for cls in SETTINGS.values() for f in fields(cls)]  # bench.py, plan.py


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, dict]:
    """The TrainConfig and the model-field overrides: defaults < preset < --config file < command line."""
    parser = Parser(description=__doc__.split("\n\n")[0].strip(), allow_abbrev=False)
    parser.add_argument("--config", default="", help="a run's config.json or TOML with [train] and [model] tables")
    parser.add_settings(TrainConfig)
    parser.add_settings(ModelConfig, "model overrides (default: the preset's value)", show_defaults=False)
    given = vars(parser.parse_args(argv))  # only what the command line says
    config_path = given.pop("config")
    try:
        from_file = read_settings(config_path, SETTINGS, RUN_FACTS) if config_path else {}
        if "preset" in given:  # the command line's preset, not the file's model of another preset
            from_file = {k: v for k, v in from_file.items() if not k.startswith("model.")}
        values = {k.split(".")[1]: v for k, v in from_file.items()} | given
        tc = TrainConfig(**{f.name: values[f.name] for f in fields(TrainConfig) if f.name in values})
    except ValueError as e:  # a bad config file, a value its rule refuses, or --log_to
        parser.error(str(e))
    if tc.compile is None:
        tc = dataclasses.replace(tc, compile=parallel.use_cuda())
    return tc, {f.name: values[f.name] for f in fields(ModelConfig) if f.name in values}


def parse_tool_args(parser: Parser, argv: list[str]):
    """bench.py's or plan.py's own flags, and the rest of argv, which must be train.py flags."""
    args, rest = parser.parse_known_args(argv)
    refuse_unknown(parser, rest, also=TRAIN_FLAGS)
    return args, rest


def model_config(tc: TrainConfig, overrides: dict, vocab_size: int) -> ModelConfig:
    """The preset, sized to the tokenizer's vocabulary, then the user's overrides."""
    cfg = dataclasses.replace(PRESETS[tc.preset], **{"vocab_size": pad_vocab(vocab_size),
                                                     "max_seq_len": tc.seq_len, **overrides})
    if cfg.max_seq_len < tc.seq_len:
        raise ValueError(f"--max_seq_len={cfg.max_seq_len} is below --seq_len={tc.seq_len}; raise it or unset it.")
    return cfg


# --- schedule

def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine, linear or warmup-stable-decay to lr x min_lr_ratio at the last step."""
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


# --- one optimizer step's pieces, which bench.py times as well

def phase(name: str):
    """A profiler range around one phase of the step, which bench.py reads."""
    return torch.profiler.record_function("train_step::" + name)


def forward_backward(model, batch, tc: TrainConfig, autocast, source_B=None, n_sources: int = 1) -> dict:
    """Forward and backward over the rank's rows in micro-batches, then the global batch's numbers (one all-reduce)
    and the gradients clipped to their global norm, read in one host sync. tokens_sum is a checksum of the token ids,
    exact in float64 below 2**53."""
    device = next(model.parameters()).device
    with phase("batch to device"):
        tokens_BT, targets_BT, doc_ids_BT = (t.to(device, non_blocking=True) for t in batch)
    n_micro = tokens_BT.shape[0] // tc.micro_batch
    counts_LE = torch.zeros(len(model.moe_layers()), model.cfg.n_experts, device=device)
    losses = torch.zeros(3, device=device)  # lm, aux, z
    loss_B = []
    if tc.keep_gathered and hasattr(model, "set_reshard_after_forward"):
        model.set_reshard_after_forward(False)  # the root too (FSDP2 keeps only the root's gathered by default)
    for i in range(n_micro):
        rows = slice(i * tc.micro_batch, (i + 1) * tc.micro_batch)
        if hasattr(model, "set_requires_all_reduce"):
            # FSDP reduce-scatters every micro-batch (unsharded gradients held across micro-batches would cost a full
            # model of fp32 gradients per GPU) and all-reduces across HSDP replicas on the last one only.
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
    source_B = torch.zeros(len(tokens_BT), dtype=torch.long) if source_B is None else torch.as_tensor(source_B)
    loss_S = torch.zeros(n_sources, dtype=torch.float64, device=device).index_add_(  # cp ranks: a chunk's mean each
        0, source_B.to(device), torch.cat(loss_B).double() / tc.cp)
    world = parallel.rank_world()[1]
    with phase("all-reduce counts, losses"):  # sums over the global batch; each rank's mean loss / world
        numbers = torch.cat([losses.double() / world, loss_S, tokens_BT.sum().double().view(1),
                             counts_LE.flatten().double()])
        parallel.all_reduce_sum_(numbers)
    with phase("grad clip"):
        grad_norm = parallel.clip_grad_norm_(model, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
    host = torch.cat([numbers[:4 + n_sources], grad_norm.reshape(1).to(numbers)]).tolist()  # one host read
    lm, aux, z = host[:3]
    return {"loss": lm + aux + z, "lm_loss": lm, "aux_loss": aux, "z_loss": z, "grad_norm": host[-1],
            "loss_by_source": host[3:3 + n_sources], "tokens_sum": int(host[3 + n_sources]),
            "counts_LE": numbers[4 + n_sources:].view_as(counts_LE).float()}


def update_biases(model, counts_LE: torch.Tensor, momentum_LE: torch.Tensor, tc: TrainConfig, step: int):
    """Move each MoE layer's routing bias toward balance from the global batch's counts."""
    if tc.balance != "none" and (tc.bias_freeze_step < 0 or step < tc.bias_freeze_step):
        with phase("expert-bias update"):
            step_size = {"lam": tc.bias_step, "gamma": tc.bias_step} if tc.bias_step else {}
            for moe, counts_E, momentum_E in zip(model.moe_layers(), counts_LE, momentum_LE):
                update_expert_bias(moe.expert_bias, counts_E, momentum_E, tc.balance, **step_size)


@torch.no_grad()
def evaluate(model, loader, n_batches: int, micro_batch: int, autocast, doc_mask: bool) -> float:
    """Mean LM loss over the first n validation batches (the same rows every time), over all ranks."""
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


# --- setup: where the run computes, its OUT_DIR, data, model and what it resumes

@dataclass
class Run:
    """Where and how this launch computes, settled on every rank before any collective."""
    tc: TrainConfig
    cfg: ModelConfig
    layout: parallel.Layout
    rank: int
    device: torch.device
    autocast: contextlib.AbstractContextManager
    dtype: torch.dtype | None  # under autocast; None: fp32
    master: bool = False


def make_run(tc: TrainConfig, cfg: ModelConfig, rank: int, world: int, device: torch.device) -> Run:
    """The Run of this rank: the layout checked against the model and batch, bf16 autocast on a GPU by default."""
    layout = parallel.Layout.for_world(world, tc.dp_replicate, tc.dp_shard, tc.ep, tc.cp)
    tc = with_micro_batch(tc, layout.dp)
    layout.check(cfg, tc.global_batch, tc.micro_batch)
    bf16 = tc.dtype == "bf16" or (tc.dtype == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    return Run(tc, cfg, layout, rank, device, autocast, torch.bfloat16 if bf16 else None, rank == 0)


def with_micro_batch(tc: TrainConfig, rows: int) -> TrainConfig:
    """--micro_batch=0 resolved: a rank's whole share of the global batch over `rows` ranks."""
    return dataclasses.replace(tc, micro_batch=max(1, tc.global_batch // rows)) if tc.micro_batch == 0 else tc


def claim_out_dir(tc: TrainConfig, master: bool) -> watch.Lease | None:
    """OUT_DIR made and its lease taken on rank 0, or one sentence on every rank."""
    try:
        os.makedirs(tc.out_dir, exist_ok=True)
        if not os.access(tc.out_dir, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise ValueError(f"--out_dir={tc.out_dir} cannot be written to ({e.strerror}); choose a directory you can "
                         f"write.") from None
    lease, refusal = None, None
    if master:
        try:
            lease = watch.Lease(tc.out_dir)
        except ValueError as e:
            refusal = str(e)
    refusal = parallel.gathered(refusal)[0]
    if refusal:
        raise ValueError(refusal)
    return lease


def resume_source(tc: TrainConfig, master: bool) -> str | None:
    """What to resume (a checkpoint, the checkpoints folder or None); another run in OUT_DIR is replaced or refused."""
    root = os.path.join(tc.out_dir, "checkpoints")
    if tc.init_from_hf and tc.resume not in ("auto", "none"):
        raise ValueError(f"--init_from_hf and --resume={tc.resume} both name the weights to start from; pass one.")
    if watch.restarts() and checkpoint.latest(root):  # torchrun restarted the job: its own newest checkpoint
        return root
    if tc.resume == "auto" and not tc.init_from_hf:
        return root if checkpoint.latest(root) else None
    resume_from = None if tc.resume in ("auto", "none") else tc.resume
    # A restarted job's files are its first attempt's; a checkpoint of this OUT_DIR's run continues it.
    if watch.restarts() or (resume_from and Path(os.path.abspath(resume_from)).is_relative_to(os.path.abspath(root))):
        return resume_from
    # A config.json alone is what a launch that failed before its first step left.
    present = [name for name in ("checkpoints", "metrics.jsonl", "config.json") if Path(tc.out_dir, name).exists()]
    if os.path.exists(os.path.join(tc.out_dir, "metrics.jsonl")) or (os.path.isdir(root) and os.listdir(root)):
        if not tc.overwrite:
            how = "drop --init_from_hf to resume it" if tc.init_from_hf else "continue it with --resume=auto"
            raise ValueError(f"--out_dir={tc.out_dir} holds another run ({', '.join(present)}); {how}, choose a new "
                             f"--out_dir, or pass --overwrite to replace it.")
        if master:
            shutil.rmtree(root, ignore_errors=True)
            for name in set(present) - {"checkpoints"}:
                os.remove(os.path.join(tc.out_dir, name))
    return resume_from


def prepare(tc: TrainConfig, overrides: dict, rank: int, world: int, device: torch.device) -> tuple[Run, dict]:
    """The Run and its resolved config, which config.json and checkpoints keep."""
    torch.manual_seed(tc.seed)
    if tc.data == data.DEFAULT_DATA_DIR and not os.path.exists(os.path.join(tc.data, "manifest.json")):
        if rank == 0:  # the default corpus is prepared on first use; the other ranks wait
            data.prepare(out_dir=tc.data)
        if dist.is_initialized():
            dist.barrier()
    mixture = data.Mixture(tc.data, tc.tokenizer)
    tokenizer = mixture.tokenizer  # name, vocab_size and a Hugging Face folder's tokenizer_path
    if tc.init_from_hf:
        cfg = dataclasses.replace(checkpoint.hf_config(tc.init_from_hf), **overrides)
        data.check_vocabulary(tokenizer, tc.init_from_hf)  # the embedding rows must mean the data's tokens
    else:
        cfg = model_config(tc, overrides, tokenizer["vocab_size"])
    run = make_run(tc, cfg, rank, world, device)
    resolved = {"train": {k: v for k, v in dataclasses.asdict(run.tc).items() if k != "on_event"},  # may hold a secret
                "model": dataclasses.asdict(cfg), "world_size": world, "data": mixture.identity(),
                "tokenizer": {"name": tokenizer["tokenizer"],
                              "source": tokenizer.get("tokenizer_path", tokenizer["tokenizer"])}}
    return run, resolved


# Settings that change what a run trains, compared on resume with the checkpoint's; the data order's are fixed.
COMPARED = ["data", "seed", "seq_len", "global_batch", "micro_batch", "doc_mask", "dtype", "optimizer", "lr", "muon_lr",
            "weight_decay", "beta1", "beta2", "grad_clip", "warmup_steps", "decay", "wsd_decay_frac", "min_lr_ratio",
            "balance", "bias_step", "bias_freeze_step", "spike_threshold", "spike_window", "spike_rollback",
            "max_rollbacks", "precision", "keep_precision"]
FIXED = ("seed", "seq_len", "global_batch")
FREE_MODEL_FIELDS = ("max_seq_len", "init_std", "aux_loss_coef", "z_loss_coef")  # neither shapes nor the function


def compare_settings(resume_from: str, resolved: dict):
    """The one compatibility check of a resume: another architecture, seed, length or batch is refused, and other data
    or tokenizer unless --allow_changed; other changes are listed."""
    path, saved, _ = checkpoint.saved_checkpoint(resume_from)
    model = {name: (saved["model"].get(name), value) for name, value in resolved["model"].items()
             if saved["model"].get(name) != value}
    shape = [f"{name}: {old!r} in the checkpoint vs {new!r} now" for name, (old, new) in model.items()
             if name not in FREE_MODEL_FIELDS]
    if shape:
        raise ValueError(f"checkpoint {path} has another model architecture ({'; '.join(shape)}); resume with its "
                         f"model config or start a new run.")
    changed = {f"model.{name}": olds for name, olds in model.items()}
    changed |= {name: (saved["train"].get(name), resolved["train"][name]) for name in COMPARED
                if saved["train"].get(name, resolved["train"][name]) != resolved["train"][name]}
    changed.pop("data", None)  # the same data prepared elsewhere is the same data: its path may move
    if saved["data"]["fingerprint"] != resolved["data"]["fingerprint"]:
        changed["data"] = (saved["train"]["data"], resolved["train"]["data"])
    try:
        same = data.same_tokenizer(saved["tokenizer"]["source"], resolved["tokenizer"]["source"])
    except data.DataError:  # the checkpoint's tokenizer folder is gone: its recorded name alone
        same = saved["tokenizer"]["name"] == resolved["tokenizer"]["name"]
    if not same:
        changed["tokenizer"] = (saved["tokenizer"]["name"], resolved["tokenizer"]["name"])
    allowed = set(listed(resolved["train"]["allow_changed"]))
    for name in [n for n in FIXED if n in changed and not ("seq_len" in allowed and n in ("seq_len", "global_batch"))]:
        how = "" if name == "seed" else " or pass --allow_changed=seq_len (a context extension)"
        raise ValueError(f"--{name}={changed[name][1]} differs from checkpoint {path}'s {changed[name][0]}, which "
                         f"fixes the data order; resume with --{name}={changed[name][0]}{how}, or start anew.")
    for name in [n for n in CHANGEABLE if n in changed and n not in allowed]:
        old, new = changed[name]
        how = "its contents changed since; restore them" if old == new else f"{old}); resume with --{name}={old}"
        raise ValueError(f"--{name}={new} is not the {name} checkpoint {path} was trained on ({how}, or pass "
                         f"--allow_changed={name} to train on the new {name} from here on.")
    if changed:
        say(f"resuming {path} with settings that differ from its own:\n" +
            "\n".join(f"  {name}: {old!r} -> {new!r}" for name, (old, new) in changed.items()))
    # The loader has no state: each source's place is a function of the mixture, the sequence length and the step.
    if "seq_len" in changed:
        say("  seq_len: each source is read in the new length from where it would be at this step (some tokens again)")
    if "data" in changed:
        say("  data: read as if the new --data had held from step 0; --data='OLD;STEP=NEW' keeps the steps before STEP")


def loaders(run: Run) -> tuple[data.DataLoader, dict[str, data.DataLoader]]:
    """This rank's train loader, and a validation loader by path for each source with a val split."""
    tc = run.tc
    rows, chunk = run.layout.data_rank(run.rank)  # the cp ranks of a group read the same rows, a chunk each

    def loader(spec: str, split: str) -> data.DataLoader:
        return data.DataLoader(spec, split, tc.seq_len, tc.global_batch, rows, run.layout.dp, tc.seed,
                               vocab_size=run.cfg.vocab_size, tokenizer=tc.tokenizer, cp=(chunk, run.layout.cp))

    train_loader = loader(tc.data, "train")
    mixture = train_loader.mixture
    val = {path: loader(path, "val") for path, manifest in zip(mixture.paths, mixture.manifests)
           if manifest["splits"]["val"]}
    for path in set(mixture.paths) - set(val):
        say(f"no validation set in {path} (a Megatron-LM dataset, or prepared with --val_fraction=0): not validated")
    return train_loader, val


# fp32 copies of the weights by optimizer: weights, gradients, moments (AdamW two; Muon one, nearly all)
STATE_COPIES = {"adamw": 4, "muon": 3}


def build(run: Run, copies: int | None = None):
    """(model, optimizer): built on meta, sharded, initialised; the memory check counts `copies` fp32 copies."""
    mesh = parallel.build_mesh(run.layout, run.device.type)
    model = parallel.build_model(run.cfg, run.layout, mesh, run.device, ac=run.tc.ac, compile=run.tc.compile,
                                 param_dtype=run.dtype, seed=run.tc.seed, precision=run.tc.precision,
                                 state_copies=copies or STATE_COPIES[run.tc.optimizer])
    return model, parallel.build_optimizer(model, run.tc)


@dataclass
class TrainState:
    """What the loop carries from step to step besides model and optimizer; checkpoints keep it with BadSteps'."""
    step: int  # the next optimizer step
    momentum: torch.Tensor  # each MoE layer's SMEBU momentum [L, E], saved beside the weights
    schedule: TrainConfig  # whose steps lay out the LR schedule (--resume_schedule)
    run_id: str = ""  # a run prunes only its own checkpoints

    def saved(self, bad_steps: watch.BadSteps, world: int) -> dict:
        return {"step": self.step, "momentum": self.momentum, "run_id": self.run_id, "world_size": world,
                "schedule_steps": self.schedule.steps, **bad_steps.state_dict()}


def restore(source: str, run: Run, model, optimizer, state: TrainState, bad_steps: watch.BadSteps,
            up_to: int | None = None) -> dict | None:
    """The one load path, for resume, rollback and fall-back: checkpoint `source` or the checkpoints folder's newest
    that loads (of a step at most up_to); the saved train state, or None."""
    targets = {"model": model, "optim": optimizer, "train": {"momentum": state.momentum}}
    if source == os.path.join(run.tc.out_dir, "checkpoints"):  # a damaged checkpoint: the one before it
        source, saved = checkpoint.load_latest(source, targets, say=say, up_to=up_to)
    else:  # named by the user (a folder of checkpoints: its newest)
        source = checkpoint.saved_checkpoint(source)[0]
        saved = checkpoint.load(source, targets)
    if saved is None:
        return None
    state.step = saved["step"]
    state.run_id = saved["run_id"]
    bad_steps.load_state_dict(saved, fresh_statistics=bool(run.tc.allow_changed))
    parallel.set_precision(model, bad_steps.precision(), run.device)  # bf16 once a burst left low precision
    return {**saved, "path": source}


def lr_schedule(tc: TrainConfig, saved_steps: int) -> TrainConfig:
    """The config whose steps lay out the LR schedule when --steps differs from the checkpoint's."""
    if saved_steps == tc.steps:
        return tc
    if tc.resume_schedule == "stretch":
        say(f"LR schedule: laid again over --steps={tc.steps}, not the checkpoint's {saved_steps} steps")
        return tc
    kept = dataclasses.replace(tc, steps=saved_steps)
    say(f"LR schedule: the checkpoint's, over {saved_steps} steps, then its final LR {lr_at(saved_steps - 1, kept):.2e}"
        f" (--resume_schedule=stretch lays it over --steps={tc.steps})")
    return kept


# --- the loop

def train(run: Run, model, optimizer, state: TrainState, resolved: dict, alive: "Alive") -> dict:
    """The optimizer steps of this launch: batch, forward and backward, accept or skip, optimizer step, bias update;
    then log, evaluate and checkpoint when due."""
    tc = run.tc
    loader, val_loaders = loaders(run)
    meter = watch.Meter(run, state.step)
    while state.step < tc.steps:
        # --- a single training step
        step = state.step
        data_step = alive.bad_steps.data_step(step)  # batches of skipped steps are never read again
        lr = lr_at(min(step, state.schedule.steps - 1), state.schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        alive.drills.before_step(step, data_step, model, tc.step_timeout)
        t_start = time.perf_counter()
        batch = loader.batch(data_step)
        t_data = time.perf_counter()
        out = forward_backward(model, batch, tc, run.autocast, loader.sources_of(data_step), len(loader.sources))
        applied = alive.bad_steps.judge(step, data_step, out["loss"], out["grad_norm"])  # a spike or NaN: skipped
        if applied:
            with phase("optimizer"):
                optimizer.step()
            update_biases(model, out["counts_LE"], state.momentum, tc, step)
            state.step += 1
        optimizer.zero_grad(set_to_none=True)
        alive.drills.straggle(time.perf_counter() - t_data)
        if run.device.type == "cuda":
            torch.cuda.synchronize()  # the device's compute, not only the host's launches
        t_compute = time.perf_counter()
        # --- checkpoint decisions, agreed by all ranks: the step's closing collective
        save, written, preempted = alive.checkpoints.due(state.step, applied, alive.watchdog.requested)
        meter.add(t_data - t_start, t_compute - t_data, time.perf_counter() - t_compute)
        alive.watchdog.beat(step + 1)
        if written:  # every rank has written the last checkpoint: it is complete now, not at the next save
            alive.checkpoints.wait()
        if alive.bad_steps.back_to is not None:  # a burst, or a damaged checkpoint: load an earlier one
            go_back(run, model, optimizer, state, alive)
            meter = watch.Meter(run, state.step)
            continue
        # --- log, evaluate, save
        if applied:
            record = {"step": step + 1, "lr": lr, "data_step": data_step,
                      **{k: out[k] for k in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "tokens_sum")},
                      **meter.by_source(loader, data_step, out["loss_by_source"])}
            if (step + 1) % tc.log_every == 0 or state.step == tc.steps or step == meter.start_step:
                record |= meter.log(step, lr, out, model, alive)
            if val_loaders and ((tc.eval_every and (step + 1) % tc.eval_every == 0) or state.step == tc.steps):
                record |= validate(model, val_loaders, run, step)
            alive.events.record(record, step=state.step, tokens=state.step * meter.tokens_per_step, loss=out["loss"],
                                skipped_steps=alive.bad_steps.skipped, rollbacks=alive.bad_steps.rollbacks)
            meter.last = {**out, **record}
        if save:
            alive.checkpoints.save(state.step, {"model": model, "optim": optimizer, "train": state.saved(
                alive.bad_steps, run.layout.world)}, resolved, final=preempted or state.step == tc.steps)
        if preempted:  # on any rank (or Ctrl-C): this step's checkpoint, complete, then exit 0
            alive.checkpoints.wait()
            if alive.checkpoints.lost is None:
                say(f"{'interrupted' if alive.watchdog.interrupted else 'preempted'}: checkpoint written at step "
                    f"{state.step}; exiting")
            break
    alive.checkpoints.wait()
    return meter.summary(state, alive)


def go_back(run: Run, model, optimizer, state: TrainState, alive: "Alive"):
    """Load the newest checkpoint at or before BadSteps.back_to; later ones are deleted: no restart may resume them."""
    alive.checkpoints.wait()  # the checkpoint in flight is complete before any is loaded or deleted
    kept = alive.bad_steps.state_dict()
    root = alive.checkpoints.root
    saved = restore(root, run, model, optimizer, state, alive.bad_steps, up_to=alive.bad_steps.back_to[0])
    if saved is None:
        raise (checkpoint.CorruptCheckpoint if alive.bad_steps.back_to[2] == "damaged_checkpoint" else watch.Stopped)(
            f"{alive.bad_steps.back_to[1]}, and no earlier checkpoint is left; lower --ckpt_every or raise "
            f"--keep_ckpts, or restore the checkpoints")
    if run.master:
        checkpoint.remove_after(root, state.step)
    alive.events.rewind(state.step)
    alive.bad_steps.rolled_back(state.step, kept, saved["path"])


def validate(model, val_loaders: dict, run: Run, step: int) -> dict:
    tc = run.tc
    losses = {path: evaluate(model, loader, tc.eval_batches, tc.micro_batch, run.autocast, tc.doc_mask)
              for path, loader in val_loaders.items()}
    val_loss = sum(losses.values()) / len(losses)
    by_source = "" if len(losses) == 1 else " (" + ", ".join(f"{p} {v:.4f}" for p, v in losses.items()) + ")"
    say(f"step {step + 1:5d} | val loss {val_loss:.4f}{by_source}")
    return {"val_loss": val_loss, "val_loss_by_source": losses}


@dataclass
class Alive:
    """The watch.py objects the loop calls at its marked points."""
    events: watch.Events
    bad_steps: watch.BadSteps
    checkpoints: watch.Checkpoints
    watchdog: watch.Watchdog
    drills: watch.Drills


def sample(run: Run, model, tokenizer: str):
    """Say what the model writes after "def ". Every rank draws all --sample_tokens (no early stop): the ranks of a
    sharded model must make the same forwards even if their draws differ."""
    enc = data.get_encoding(tokenizer)
    prompt = torch.tensor([enc.encode("def ")], device=run.device)
    torch.manual_seed(run.tc.seed)  # the same draws on every rank
    model.eval()
    allowed_V = checkpoint.decodable_ids(enc, run.cfg.vocab_size).to(run.device)
    tokens = model.generate(prompt, run.tc.sample_tokens, temperature=0.8, top_k=50, allowed_V=allowed_V)[0].tolist()
    say("sample:\n" + enc.decode(checkpoint.up_to_stop(tokens, prompt.shape[1], enc.eot_token)))


def main(tc: TrainConfig, overrides: dict) -> dict:
    """Set up, build, resume, train; the lease is given back however it ends. Returns the losses and step."""
    torch.set_num_threads(tc.threads or torch.get_num_threads())  # on a busy CPU, waiting threads stall each other
    launched = int(os.environ.get("WORLD_SIZE", "1"))  # the ranks past the layout's world stand by
    used = parallel.Layout.for_world(launched, tc.dp_replicate, tc.dp_shard, tc.ep, tc.cp).world
    rank, world, device = parallel.init_distributed(timeout_s=max(60, tc.step_timeout or 1800), used=used)
    lease = claim_out_dir(tc, rank == 0)
    try:
        resume_from = resume_source(tc, rank == 0)
        run, resolved = prepare(tc, overrides, rank, world, device)
        if resume_from:
            compare_settings(resume_from, resolved)
        return setup_and_train(run, resolved, resume_from)
    finally:
        if lease is not None:
            lease.release()


def setup_and_train(run: Run, resolved: dict, resume_from: str | None) -> dict:
    tc = run.tc
    say(json.dumps(resolved, indent=1))
    say(run.layout.describe(run.cfg.n_experts))
    if tc.dp_replicate == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torch 2.11-2.13: torchrun's agents share their rendezvous store with the workers (README, Elastic jobs)
        say("warning: a node joining later would wait forever; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every "
            "node's torchrun environment")
    model, optimizer = build(run)
    if tc.init_from_hf and resume_from is None:
        checkpoint.load_hf_into(model, tc.init_from_hf)  # each rank reads only the rows of its own shards
        say(f"initialised from {tc.init_from_hf}")
    n = meta_model(run.cfg).num_params()
    say(f"model: {n['total'] / 1e6:.1f}M parameters, {n['active'] / 1e6:.1f}M active")
    drills = watch.Drills(tc.drill, run.rank, run.layout.world, model)
    state = TrainState(0, torch.zeros(len(model.moe_layers()), run.cfg.n_experts, device=run.device), tc)
    events = watch.Events(tc.out_dir, run.master, watch.log_sinks(tc.log_to), tc.on_event, resolved)
    bad_steps = watch.BadSteps(tc, events)
    saved = restore(resume_from, run, model, optimizer, state, bad_steps) if resume_from else None
    if saved is None:
        state.run_id = parallel.gathered(uuid.uuid4().hex[:12])[0]  # every rank names the run alike
    else:
        state.schedule = lr_schedule(tc, saved["schedule_steps"])
    if state.step >= tc.steps:  # before any file is written: nothing to do changes nothing
        say(f"already at step {state.step} of {tc.steps}; pass a larger --steps to train further")
        return {"first_loss": None, "loss": None, "val_loss": None, "step": state.step}
    if run.master:
        data.write_durably(os.path.join(tc.out_dir, "config.json"), json.dumps(resolved | {
            "run_id": state.run_id, "from_step": state.step}, indent=1))
    steps_lost = events.rewind(state.step)  # steps a dead launch logged past the checkpoint: trained again
    if saved is not None:
        world = f"world size {saved['world_size']} -> {run.layout.world} ranks, " if saved["world_size"] != \
            run.layout.world else ""
        events.event("restart" if watch.restarts() else "resume", state.step, f"resumed from {saved['path']} at step "
                     f"{state.step}, {world}{steps_lost} logged steps trained again")
    alive = Alive(events, bad_steps, watch.Checkpoints(tc, events, run.master, run.device),
                  watch.Watchdog(tc.step_timeout, os.path.join(tc.out_dir, "hang"), events), drills)
    events.update(steps=tc.steps, step=state.step, world_size=run.layout.world, layout={
        "dp_replicate": run.layout.dp_replicate, "dp_shard": run.layout.dp_shard, "ep": run.layout.ep})
    try:
        result = train(run, model, optimizer, state, resolved, alive)
        if tc.sample_tokens and not alive.watchdog.requested:
            sample(run, model, resolved["tokenizer"]["source"])
        return result
    except watch.Stopped as e:
        alive.checkpoints.wait()  # the checkpoint in flight holds a state from before the trouble: keep it
        events.event("stopped", state.step, str(e))
        raise
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once
        raise KeyboardInterrupt(alive.checkpoints.abandon()) from None
    finally:
        alive.watchdog.close()
        events.close()


if __name__ == "__main__":
    try:
        main(*parse_args())
    except (data.DataError, ValueError, FileNotFoundError, checkpoint.SaveFailed, watch.Stopped) as e:
        # A bad flag fails alike on every rank (rank 0 says it); bad data can be one rank's own.
        if os.environ.get("RANK", "0") == "0" or isinstance(e, data.DataError):
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # torchrun stops the other ranks when one exits: give rank 0 time to say why first
            time.sleep(2)
        sys.exit(1 if isinstance(e, (checkpoint.SaveFailed, watch.Stopped)) else 2)
    parallel.finish(0)  # after main returned: the model and optimizer are out of scope
