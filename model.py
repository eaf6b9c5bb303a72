"""
The AfMoE transformer (Arcee's Trinity models): sigmoid top-k routing over many small experts plus a shared expert,
3:1 sliding-window / global attention. Knows nothing about ranks: parallel.py transforms the plain model in place.
Presets follow the Trinity technical report; transformers' `afmoe` is the reference forward pass.

    python model.py                # every preset's parameter and FLOP counts (no allocation)
    python model.py --preset tiny  # one forward pass of `tiny` on CPU

    model = Transformer(PRESETS["tiny"])
    logits_BTV = model(tokens_BT)
    loss, stats = model(tokens_BT, targets_BT=targets_BT, doc_ids_BT=doc_ids_BT, return_stats=True)
    tokens_BS = model.generate(prompt_BT, 64, temperature=0.8, top_k=50)  # KV-cached sampling

Shapes: B batch, T sequence, D width, H query heads, G key/value heads, Dh head dim, V vocab, E routed experts,
K experts per token, N tokens (B*T), I expert hidden width, L MoE layers.
"""

import argparse
import contextlib
import difflib
import json
import math
import warnings
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

# --- Configuration: settings are dataclass fields, each declared with its help and its rule (train.py's flags too)

@dataclass(frozen=True)
class Rule:
    """ok(value, settings), said in words that may name fields ("a multiple of n_kv_heads={n_kv_heads}")."""
    ok: Callable
    words: str
    choices: tuple = ()

    def parse(self, kind: type) -> Callable:
        """An argparse type for a flag outside a dataclass, refusing in the rule's words."""
        def parse(text: str):
            value = kind(text)
            if not self.ok(value, None):
                raise argparse.ArgumentTypeError(f"{text} must be {self.words}")
            return value
        parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
        return parse


def at_least(low: float, words: str = "") -> Rule:
    return Rule(lambda v, _: v >= low, words or f"at least {low:g}")


def above(low: float) -> Rule:
    return Rule(lambda v, _: v > low, f"above {low:g}")


def one_of(*choices) -> Rule:
    return Rule(lambda v, _: v in choices, "one of " + ", ".join(map(str, choices)), choices)


def option(default, help: str, rule: Rule | None = None, parse: Callable | None = None):
    """A settings field: default, help (plus one_of's choices), rule, and a parser if its type is not enough."""
    if rule is not None and rule.choices:
        help = f"{help}: {' | '.join(map(str, rule.choices))}"
    return field(default=default, metadata={"help": help, "rule": rule, "parse": parse})


def check(settings) -> None:
    """Raise ValueError, one sentence, naming every field of `settings` that breaks its rule."""
    values = {f.name: getattr(settings, f.name) for f in fields(settings)}
    rules = {f.name: f.metadata["rule"] for f in fields(settings) if f.metadata.get("rule")}
    problems = [f"--{name}={values[name]!s} must be {rule.words.format(**values)}" for name, rule in rules.items()
                if not rule.ok(values[name], settings)]
    if problems:
        raise ValueError("; ".join(problems) + ".")


# Names other trainers (nanoGPT, torchtitan, Hugging Face) give to our flags, for "did you mean".
OTHER_NAMES = {other: ours for ours, others in {
    "lr": "learning_rate optimizer.lr", "steps": "max_iters max_steps lr_decay_iters training.steps num_train_steps",
    "global_batch": "batch_size global_batch_size training.global_batch_size", "seq_len": "block_size training.seq_len",
    "micro_batch": "local_batch_size micro_batch_size per_device_train_batch_size gradient_accumulation_steps",
    "warmup_steps": "warmup_iters lr_scheduler.warmup_steps", "min_lr_ratio": "min_lr", "eval_every": "eval_interval",
    "eval_batches": "eval_iters", "log_every": "log_interval metrics.log_freq", "grad_clip": "grad_clip_norm max_norm",
    "ckpt_every": "checkpoint.interval save_steps", "resume": "init_from", "data": "dataset data_dir",
    "out_dir": "output_dir job.dump_folder", "n_layers": "n_layer", "n_heads": "n_head", "dim": "n_embd",
    "ep": "parallelism.expert_parallel_degree", "ac": "activation_checkpoint.mode"}.items() for other in others.split()}


def suggest(word: str, names) -> str | None:
    """The name in `names` a mistyped `word` likely means: ours for another trainer's, else the closest, or None."""
    bare = {name.lstrip("-"): name for name in names}
    key = word.lstrip("-").replace("-", "_")
    if OTHER_NAMES.get(key) in bare:
        return bare[OTHER_NAMES[key]]
    close = difflib.get_close_matches(key, list(bare), n=1, cutoff=0.6)
    return bare[close[0]] if close else None


def refuse_unknown(parser: argparse.ArgumentParser, words: list[str], known=None, also: list[str] = ()):
    """Exit as parser.error does if any of `words` is a flag neither `known` (default: parser) nor `also` has."""
    known = known or parser
    flags = [flag for action in known._actions for flag in action.option_strings] + list(also)
    unknown = [word.split("=")[0] for word in words if word.startswith("-") and word.split("=")[0] not in flags]
    if unknown:
        close = [flag for flag in (suggest(name, flags) for name in unknown) if flag]
        hint = f"did you mean {', '.join(close)}?" if close else f"{known.prog} --help lists the flags."
        parser.exit(2, f"{parser.prog}: error: unknown flag{'s' * (len(unknown) > 1)} {', '.join(unknown)}; {hint}\n")


def listed(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_bool(text: str) -> bool:
    """true/false, 1/0, yes/no or on/off: argparse's bool() takes any text as True."""
    if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes", "on")


def kind_of(f) -> type:
    """bool, int, float or str (an optional bool is a bool: --compile's default depends on the device)."""
    return bool if f.type in (bool, bool | None, "bool") else type(f.default)


class Parser(argparse.ArgumentParser):
    """argparse naming the closest flag to an unknown one; add_settings makes a dataclass's fields flags."""

    def error(self, message):
        if message.startswith("unrecognized arguments: "):
            refuse_unknown(self, message.removeprefix("unrecognized arguments: ").split())
        self.exit(2, f"{self.prog}: error: {message}\n")

    def add_settings(self, settings: type, title: str | None = None, show_defaults: bool = True):
        """A --field=value flag per field of `settings`, absent from the result unless given (bools: --flag alone)."""
        group = self.add_argument_group(title) if title else self
        for f in fields(settings):
            kind = kind_of(f)
            shown = f" (default: {f.default})" if show_defaults else ""
            group.add_argument(f"--{f.name}", type=f.metadata.get("parse") or (parse_bool if kind is bool else kind),
                               default=argparse.SUPPRESS, help=f.metadata["help"].replace("%", "%%") + shown,
                               **({"nargs": "?", "const": True} if kind is bool else {}))


def config_file(path: str) -> dict:
    toml = path.lower().endswith(".toml")
    try:
        with open(path, "rb") as f:
            if toml:
                import tomllib  # Python 3.11's
            raw = tomllib.load(f) if toml else json.load(f)
    except OSError as e:
        raise ValueError(f"--config={path} cannot be read ({e.strerror or e}).")
    except ValueError as e:  # the parsers' errors and a bad UTF-8 byte are all ValueErrors
        raise ValueError(f"--config={path} is not valid {'TOML' if toml else 'JSON'}: {e}.")
    if not isinstance(raw, dict):
        raise ValueError(f"--config={path} holds a {type(raw).__name__}; expected tables of settings.")
    return raw


TYPE_NAMES = {bool: "bool (true or false)", int: "int", float: "number", str: "string"}


def read_settings(path: str, tables: dict, facts: tuple = ()) -> dict:
    """{"table.field": value} of config file `path`, whose tables ([train], [model]) hold fields of `tables`'
    dataclasses, typed as their flags are; top-level `facts` are skipped."""
    raw = config_file(path)
    known = {f"{table}.{f.name}": f for table, cls in tables.items() for f in fields(cls)}
    entries = {f"{key}.{k}": v for key, table in raw.items() if key in tables and isinstance(table, dict)
               for k, v in table.items()}
    entries |= {key: v for key, v in raw.items() if key not in tables and key not in facts}
    values = {}
    for key, value in entries.items():
        if key not in known:  # named by its field alone: "learning_rate" and "train.n_layers" find their keys
            by_field = {k.split(".")[1]: k for k in known}
            close = by_field.get(suggest(key.split(".")[-1], by_field))
            hint = f"did you mean {close}?" if close else f"keys are {' or '.join(f'{t}.FIELD' for t in tables)}."
            raise ValueError(f"--config={path} has an unknown key {key}; {hint}")
        kind = kind_of(known[key])
        parse = known[key].metadata.get("parse")
        if parse and isinstance(value, str):  # a word the flag takes too (dp_replicate = "auto")
            with contextlib.suppress(ValueError):
                value = parse(value)
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise ValueError(f"--config={path} sets {key} to {value!r}, which is not a valid {TYPE_NAMES[kind]}.")
        values[key] = kind(value)
    return values


POSITIVE = at_least(1)
NON_NEGATIVE = at_least(0, "0 or more")


@dataclass
class ModelConfig:
    vocab_size: int = option(100352, "embedding/head rows: the tokenizer's ids padded to a multiple of 128", POSITIVE)
    dim: int = option(128, "model width D", POSITIVE)
    n_layers: int = option(4, "transformer blocks", POSITIVE)
    n_dense_layers: int = option(1, "leading blocks with a dense SwiGLU FFN, not MoE",
                                 Rule(lambda v, c: 0 <= v <= c.n_layers, "between 0 and n_layers={n_layers}"))
    dense_hidden: int = option(384, "the dense FFN's hidden width",
                               Rule(lambda v, c: v >= 1 or not c.n_dense_layers, "at least 1 with dense layers"))
    n_heads: int = option(4, "query heads H", Rule(lambda v, c: v >= 1 and (c.n_kv_heads < 1 or v % c.n_kv_heads == 0),
                                                    "at least 1 and a multiple of n_kv_heads={n_kv_heads}"))
    n_kv_heads: int = option(2, "key/value heads G (grouped-query attention)", POSITIVE)
    head_dim: int = option(32, "Dh, per head", Rule(lambda v, _: v >= 2 and v % 2 == 0, "even, for rotary embeddings"))
    window: int = option(64, "local layers' window: query t sees keys t-window+1 .. t", POSITIVE)
    global_every: int = option(4, "layer i is global when (i+1) % global_every == 0", POSITIVE)
    max_seq_len: int = option(256, "the longest sequence the model is trained for", POSITIVE)
    n_experts: int = option(256, "routed experts E", POSITIVE)
    n_shared_experts: int = option(1, "shared experts, which see every token", NON_NEGATIVE)
    top_k: int = option(4, "routed experts per token K", Rule(lambda v, c: 1 <= v <= c.n_experts,
                                                               "between 1 and n_experts={n_experts}"))
    route_scale: float = option(2.448, "scale of the gates (normalised over the chosen k)", above(0))
    expert_hidden: int = option(32, "I, each expert's FFN width (the shared expert's too)", POSITIVE)
    init_std: float = option(0.044, "σ of the truncated-normal init", above(0))
    norm_eps: float = option(1e-5, "RMSNorm epsilon", above(0))
    rope_theta: float = option(10000.0, "RoPE base", above(0))
    mup: bool = option(True, "embedding activations x sqrt(dim)")
    aux_loss_coef: float = option(1e-4, "sequence-wise balance loss α", NON_NEGATIVE)
    z_loss_coef: float = option(1e-6, "router z-loss (larger destabilised Trinity Large)", NON_NEGATIVE)

    def __post_init__(self):
        check(self)

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.global_every == 0

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_layers

    def to_hf(self) -> dict:
        """transformers' AfmoeConfig of this model (checkpoint.py converts the weights)."""
        return {"model_type": "afmoe", "architectures": ["AfmoeForCausalLM"],
                **{key: getattr(self, name) for name, key in HF_KEYS.items()},
                "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
                "layer_types": ["full_attention" if self.is_global(i) else "sliding_attention"
                                for i in range(self.n_layers)]}

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type={rope['rope_type']!r} is not supported; use the default RoPE.")
        heads = hf["num_attention_heads"]
        defaults = {**HF_DEFAULTS, "num_key_value_heads": heads, "head_dim": hf["hidden_size"] // heads}
        cfg = cls(**{name: defaults[key] if key in defaults and hf.get(key) is None else hf[key]
                     for name, key in HF_KEYS.items()}, rope_theta=rope.get("rope_theta", 10000.0))
        ours = cfg.to_hf()["layer_types"]
        if hf.get("layer_types") not in (None, ours):
            raise ValueError(f"layer_types {hf['layer_types']} are not every-{cfg.global_every}th-global: {ours}.")
        unsupported = {"attention_bias": "AfMoE has no biases", "tie_word_embeddings": "its embeddings are untied"}
        for key, why in unsupported.items():
            if hf.get(key):
                raise ValueError(f"{key}=True is not supported: {why}.")
        return cfg


# ModelConfig field -> transformers' AfmoeConfig key; the defaults fill keys an HF config leaves out or sets to None.
HF_KEYS = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
           "n_dense_layers": "num_dense_layers", "dense_hidden": "intermediate_size", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "window": "sliding_window",
           "global_every": "global_attn_every_n_layers", "max_seq_len": "max_position_embeddings",
           "n_experts": "num_experts", "n_shared_experts": "num_shared_experts", "top_k": "num_experts_per_tok",
           "route_scale": "route_scale", "expert_hidden": "moe_intermediate_size", "init_std": "initializer_range",
           "norm_eps": "rms_norm_eps", "mup": "mup_enabled"}
HF_DEFAULTS = {"num_dense_layers": 0, "sliding_window": 1024, "global_attn_every_n_layers": 4,
               "max_position_embeddings": 4096, "num_shared_experts": 0, "route_scale": 1.0,
               "initializer_range": 0.02, "rms_norm_eps": 1e-5, "mup_enabled": False}

# The Trinity report's Table 1 (tiny is ours: CPU-sized, same structure). train.py sizes vocab_size from its tokenizer.
PRESETS = {
    "tiny": ModelConfig(),
    "nano": ModelConfig(vocab_size=200192, dim=1024, n_layers=56, n_dense_layers=2, dense_hidden=3072, n_heads=8,
                        n_kv_heads=2, head_dim=128, window=2048, max_seq_len=4096, n_experts=128, top_k=8,
                        route_scale=2.826, expert_hidden=256, init_std=0.016),
    "mini": ModelConfig(vocab_size=200192, dim=2048, n_layers=32, n_dense_layers=2, dense_hidden=6144, n_heads=32,
                        n_kv_heads=4, head_dim=128, window=2048, max_seq_len=4096, n_experts=128, top_k=8,
                        route_scale=2.826, expert_hidden=1024, init_std=0.011),
    "large": ModelConfig(vocab_size=200192, dim=3072, n_layers=60, n_dense_layers=6, dense_hidden=12288, n_heads=48,
                         n_kv_heads=8, head_dim=128, window=4096, max_seq_len=8192, n_experts=256, top_k=4,
                         route_scale=2.448, expert_hidden=3072, init_std=0.009),
}


def pad_vocab(n_tokens: int) -> int:
    return -(-n_tokens // 128) * 128


# --- Building blocks

class _RMSNorm(torch.autograd.Function):
    """weight * x / rms(x), saving x and a scalar per row: about half the passes over x of autograd's backward."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x32 = x.float()
        rstd = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        y = x32 * rstd * weight
        # Not y.to(x.dtype) when that is y: torch 2.11's compiled autograd.Function then returns wrong grads.
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        x32 = x.float()
        w = weight.float()
        D = x.shape[-1]
        dy = dy.float()
        dy_x_ND = (dy * x32).reshape(-1, D)
        d_weight = rstd.reshape(1, -1) @ dy_x_ND  # sum over rows of dy * x_hat
        # dx = rstd * (w*dy - x_hat * mean(w*dy*x_hat)) = rstd * (w*dy - x * c), c = rstd^2 * mean(w*dy*x) per row
        c = (dy_x_ND @ w).view_as(rstd) * rstd.square() / D
        dx = torch.addcmul(dy * w, x32, c, value=-1).mul_(rstd)
        return dx.to(x.dtype), d_weight.view_as(weight).to(weight.dtype), None


class RMSNorm(nn.Module):
    """Computed in fp32 and cast back, as transformers' AfmoeRMSNorm does."""

    def __init__(self, dim: int, eps: float, init_gain: float = 1.0):
        super().__init__()
        self.eps = eps
        self.init_gain = init_gain
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        return _RMSNorm.apply(x, self.weight, self.eps)


def rope_cos_sin(T: int, head_dim: int, theta: float, device, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables of positions start .. start+T-1 (rotate-half layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs_TF = torch.outer(torch.arange(start, start + T, device=device, dtype=torch.float32), inv_freq)
    angles_TDh = torch.cat([freqs_TF, freqs_TF], dim=-1)
    return angles_TDh.cos(), angles_TDh.sin()


def apply_rope(x_BHTDh, cos_TDh, sin_TDh):
    x1, x2 = x_BHTDh.chunk(2, dim=-1)
    return (x_BHTDh * cos_TDh + torch.cat([-x2, x1], dim=-1) * sin_TDh).to(x_BHTDh.dtype)


@cache
def _warn_once(message: str):
    warnings.warn(message, stacklevel=3)


def make_mask(T: int, window: int | None, doc_ids_BT, device: torch.device, flex: bool | None = None):
    """Causal, within `window` and one document if given: a flex BlockMask when `flex` (default: on CUDA; it has no
    CPU backward), else a boolean [B or 1, 1, T, T] mask (True = attend), or None for plain causal."""
    def mask_mod(b, h, q, kv):
        keep = q >= kv
        if window is not None:
            keep = keep & (q - kv < window)
        if doc_ids_BT is not None:
            keep = keep & (doc_ids_BT[b, q] == doc_ids_BT[b, kv])
        return keep

    B = doc_ids_BT.shape[0] if doc_ids_BT is not None else None
    if device.type == "cuda" if flex is None else flex:
        from torch.nn.attention.flex_attention import create_block_mask
        return create_block_mask(mask_mod, B, None, T, T, device=device)
    if window is None and doc_ids_BT is None:
        return None
    q_11T1 = torch.arange(T, device=device).view(1, 1, T, 1)
    return mask_mod(torch.arange(B or 1, device=device).view(-1, 1, 1, 1), None, q_11T1, q_11T1.mT)


@cache
def compiled(function: Callable, **options) -> Callable:
    return torch.compile(function, **options)


def attend(q_BHTDh, k_BGTDh, v_BGTDh, mask):
    if mask is not None and not isinstance(mask, torch.Tensor):  # a flex BlockMask
        from torch.nn.attention.flex_attention import flex_attention
        return compiled(flex_attention, dynamic=False)(q_BHTDh, k_BGTDh, v_BGTDh, block_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q_BHTDh, k_BGTDh, v_BGTDh, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=True)


class Attention(nn.Module):
    """GQA, per-head q/k RMSNorm, RoPE on local layers only (global: NoPE): o = o_proj(attn * sigmoid(gate_proj(x)))."""
    seq_parallel = None  # parallel.ContextParallel: whole sequences inside attention

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.is_global = cfg.is_global(layer)
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.gate_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x_BTD, cos_TDh, sin_TDh, mask, cache: "KVCache | None" = None):
        B, T, _ = x_BTD.shape
        q_BHTDh = self.q_norm(self.q_proj(x_BTD).view(B, T, -1, self.head_dim)).transpose(1, 2)
        k_BGTDh = self.k_norm(self.k_proj(x_BTD).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v_BGTDh = self.v_proj(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2)
        if not self.is_global:
            q_BHTDh = apply_rope(q_BHTDh, cos_TDh, sin_TDh)
            k_BGTDh = apply_rope(k_BGTDh, cos_TDh, sin_TDh)
        kernel = cache.attend if cache is not None else self.seq_parallel.attend if self.seq_parallel else attend
        o_BHTDh = kernel(q_BHTDh, k_BGTDh, v_BGTDh, mask)
        o_BTHDh = o_BHTDh.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(o_BTHDh * torch.sigmoid(self.gate_proj(x_BTD)))


class KVCache:
    """One layer's keys and values while generating: the whole prompt first (with its mask), then one token a call,
    attending to every cached key. A local layer keeps its last `window` keys in a ring, position p in slot
    p % window (cached after RoPE; attention ignores their order)."""

    def __init__(self, length: int, window: int | None):
        self.size = length if window is None else min(window, length)
        self.pos = 0  # tokens written so far
        self.k_BGSDh = self.v_BGSDh = None  # allocated at the first call, in the keys' dtype and device

    def attend(self, q_BHTDh, k_BGTDh, v_BGTDh, mask):
        B, G, T, Dh = k_BGTDh.shape
        if T > 1 and self.pos:
            raise ValueError("a KVCache takes the whole prompt in its first call, then one token per call.")
        if self.k_BGSDh is None:
            self.k_BGSDh, self.v_BGSDh = (k_BGTDh.new_empty(B, G, self.size, Dh) for _ in range(2))
        keep = min(T, self.size)
        slots = torch.arange(self.pos + T - keep, self.pos + T, device=k_BGTDh.device) % self.size
        self.k_BGSDh.index_copy_(2, slots, k_BGTDh[:, :, T - keep:])
        self.v_BGSDh.index_copy_(2, slots, v_BGTDh[:, :, T - keep:])
        self.pos += T
        if T > 1:
            return attend(q_BHTDh, k_BGTDh, v_BGTDh, mask)
        n = min(self.pos, self.size)
        return F.scaled_dot_product_attention(q_BHTDh, self.k_BGSDh[:, :, :n], self.v_BGSDh[:, :, :n], enable_gqa=True)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). The dense-first layers and the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# --- Mixture of experts

# torch 2.11 may only have the private name. Its fake kernel takes only bf16 (the CPU one fp32 too): fp32 runs eager.
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_grouped_mm_eager = torch.compiler.disable(_grouped_mm) if _grouped_mm else None


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> str | None:
    """Why torch's grouped GEMM cannot run these operands, or None when it can."""
    if _grouped_mm is None:
        return f"torch {torch.__version__} has no grouped_mm"
    if x.device.type not in ("cpu", "cuda"):
        return f"grouped_mm is not available on {x.device.type}"
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 0):
        return "grouped_mm on CUDA needs compute capability >= 8.0"
    for w in weights:  # the kernels need 16-byte aligned strides
        if any((s * w.element_size()) % 16 for s in w.shape[1:]):
            return f"expert weight shape {tuple(w.shape)} is not 16-byte aligned for grouped_mm"


def expert_ffn(x_ND, counts_E, gate_up_EHD, down_EDI, impl: str, scale_N):
    """Each expert's SwiGLU on its rows of x (sorted by expert, counts_E each), scaled by scale_N before down_EDI
    [E, D, I]; gate_up_EHD [E, 2I, D], gate rows first. impl: "grouped" GEMM, "loop" (a matmul per expert: the
    reference) or "auto": grouped where torch can run it."""
    if impl == "auto":
        why_not = grouped_mm_supported(x_ND, gate_up_EHD, down_EDI)
        if why_not:
            _warn_once(f"MoE experts fall back to a slow per-expert loop: {why_not}.")
        impl = "loop" if why_not else "grouped"
    dtype = x_ND.dtype

    def swiglu(gate_up_NH):
        gate_NI, up_NI = gate_up_NH.chunk(2, dim=-1)
        act_NI = F.silu(gate_NI) * up_NI
        return (act_NI * scale_N.unsqueeze(-1)).to(act_NI.dtype)  # one rounding

    if impl == "loop":  # unbind, not gate_up_EHD[e]: each index's backward would write a whole [E, ...] gradient
        rows = counts_E.tolist()
        act_NI = swiglu(torch.cat([F.linear(x_nD, w_HD.to(dtype))
                                   for x_nD, w_HD in zip(x_ND.split(rows), gate_up_EHD.unbind(0))]))
        return torch.cat([F.linear(act_nI, w_DI.to(dtype))
                          for act_nI, w_DI in zip(act_NI.split(rows), down_EDI.unbind(0))])
    mm_dtype = torch.bfloat16 if x_ND.is_cuda else dtype  # CUDA's grouped GEMM wants bf16 (fp32 masters included)
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    mm = _grouped_mm if mm_dtype == torch.bfloat16 else _grouped_mm_eager
    act_NI = swiglu(mm(x_ND.to(mm_dtype), gate_up_EHD.to(mm_dtype).transpose(-2, -1), offs=offs_E))
    return mm(act_NI, down_EDI.to(mm_dtype).transpose(-2, -1), offs=offs_E).to(dtype)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stacked in HF's layout, on rows sorted by expert."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.impl = "auto"  # see expert_ffn
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x_ND, counts_E, scale_N):
        return expert_ffn(x_ND, counts_E, self.gate_up_proj, self.down_proj, self.impl, scale_N)


class _SortedRows(torch.autograd.Function):
    """x_ND -> x_MD, row m holding token order_M[m] // K. The backward sums each token's K row gradients in a fixed
    order, where index_select's own uses atomics on CUDA."""

    @staticmethod
    def forward(ctx, x_ND, order_M, inverse_M, K: int):
        ctx.save_for_backward(inverse_M)
        ctx.K = K
        return x_ND.index_select(0, order_M // K)

    @staticmethod
    def backward(ctx, dx_MD):
        (inverse_M,) = ctx.saved_tensors
        return dx_MD.index_select(0, inverse_M).view(-1, ctx.K, dx_MD.shape[-1]).sum(1), None, None, None


def count_ids(ids_M: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in ids_M. Not bincount: on CUDA it syncs to read the largest id."""
    return torch.zeros(n, dtype=torch.int64, device=ids_M.device).scatter_add_(0, ids_M, torch.ones_like(ids_M))


@dataclass
class ForwardStats:
    """Besides the loss: the MoE routers' counts and weighted losses, and each sequence's loss."""
    counts_LE: torch.Tensor  # tokens routed to each expert (on this rank, before any EP exchange)
    aux_loss: torch.Tensor   # sequence-wise balance loss, summed over layers (in the graph)
    z_loss: torch.Tensor     # router z-loss, summed over layers (in the graph)
    loss_B: torch.Tensor | None  # each sequence's mean cross-entropy (no graph); None without targets

    @property
    def balance_loss(self) -> torch.Tensor:
        return self.aux_loss + self.z_loss


class MoE(nn.Module):
    """Sigmoid token-choice routing over E experts plus a shared expert, no token dropping. forward returns (y_BTD,
    (counts_E, aux_loss, z_loss)) as plain tensors, which compiled, checkpointed and FSDP blocks pass through (AC's
    re-run returns the first forward's outputs: every token is counted once)."""
    seq_parallel = None  # parallel.ContextParallel: the balance loss's sequences span its ranks

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_hidden)
        self.shared = FeedForward(cfg.dim, cfg.expert_hidden * cfg.n_shared_experts) if cfg.n_shared_experts else None
        # Selection bias, updated by the balancing rule once per optimizer step, never by gradients.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))

    def route(self, x_ND):
        """(experts_NK, gates_NK, sigmoid scores_NE, logits_NE), fp32 even under autocast."""
        with torch.autocast(x_ND.device.type, enabled=False):
            logits_NE = F.linear(x_ND.float(), self.router.weight.float())
        scores_NE = torch.sigmoid(logits_NE)
        _, experts_NK = torch.topk(scores_NE + self.expert_bias, self.cfg.top_k, dim=-1)
        gates_NK = scores_NE.gather(-1, experts_NK)  # unbiased scores, normalised over the chosen k
        gates_NK = gates_NK / (gates_NK.sum(-1, keepdim=True) + 1e-20) * self.cfg.route_scale
        return experts_NK, gates_NK, scores_NE, logits_NE

    def forward(self, x_BTD):
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        experts_NK, gates_NK, scores_NE, logits_NE = self.route(x_ND)
        counts_E = count_ids(experts_NK.flatten(), self.cfg.n_experts)
        zero = torch.zeros((), device=x_ND.device)
        aux_loss = self.balance_loss(experts_NK, scores_NE, B, T) if self.cfg.aux_loss_coef else zero
        z_loss = self.cfg.z_loss_coef * torch.logsumexp(logits_NE, -1).pow(2).mean() if self.cfg.z_loss_coef else zero
        # The M = N*K (token, choice) rows sorted by expert; the gate scales each row inside the expert.
        order_M = torch.argsort(experts_NK.flatten(), stable=True)
        scale_M = gates_NK.flatten()[order_M]
        # Each token's K rows are gathered into [N, K, D] and summed in a fixed order, forward and backward: no
        # atomics, so bitwise reproducible on CUDA (and on CPU as fast as index_add).
        inverse_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(len(order_M), device=x_ND.device))
        y_MD = self.experts(_SortedRows.apply(x_ND, order_M, inverse_M, self.cfg.top_k), counts_E, scale_M)
        y_ND = y_MD.to(x_ND.dtype).index_select(0, inverse_M).view(B * T, self.cfg.top_k, D).sum(1)
        if self.shared is not None:
            y_ND = y_ND + self.shared(x_ND)
        return y_ND.view(B, T, D), (counts_E, aux_loss, z_loss)

    def balance_loss(self, experts_NK, scores_NE, B, T):
        """aux_loss_coef * mean over sequences of sum_i f_i * P_i, f_i = E/(K*T) * (its tokens with i in their top-k),
        P_i = mean over its tokens of s_i / sum_j s_j."""
        E = self.cfg.n_experts
        K = self.cfg.top_k
        sequence_NK = torch.arange(B, device=experts_NK.device).repeat_interleave(T).unsqueeze(1)
        counts_BE = count_ids((sequence_NK * E + experts_NK).flatten(), B * E).view(B, E)
        # With cp, this rank holds T of each sequence's n*T tokens: f from the whole sequences' counts, P this
        # rank's share; n times this loss, averaged over the n ranks, is the whole loss.
        n = self.seq_parallel.size if self.seq_parallel else 1
        if n > 1:
            counts_BE = self.seq_parallel.sum(counts_BE)
        f_BE = counts_BE * (E / (K * T * n))
        p_BE = (scores_NE / scores_NE.sum(-1, keepdim=True)).view(B, T, E).mean(1) / n
        return self.cfg.aux_loss_coef * n * (f_BE * p_BE).sum(-1).mean()


def max_vio(counts_E: torch.Tensor) -> float:
    """The report's balance metric: max_i (n_i - mean n) / mean n."""
    counts_E = counts_E.float()
    return ((counts_E.max() - counts_E.mean()) / counts_E.mean().clamp(min=1e-9)).item()


BALANCE_RULES = ("smebu", "sign", "none")


@torch.no_grad()
def update_expert_bias(bias_E, counts_E, momentum_E=None, rule: str = "smebu", lam: float = 5e-4,
                       beta: float = 0.5, kappa: float = 2.0, gamma: float = 1e-3):
    """Move the selection bias toward balance in place, once per optimizer step, on the global batch's counts.
    "smebu" (Trinity Large): v = (mean n - n)/mean n, d = lam * tanh(kappa * v) re-centred, m = beta*m + (1-beta)*d
    (momentum_E in place), b += m. "sign" (DeepSeek-V3): b += gamma * sign(mean n - n), re-centred."""
    counts_E = counts_E.float()
    mean = counts_E.mean().clamp(min=1e-9)
    if rule == "smebu":
        delta_E = lam * torch.tanh(kappa * (mean - counts_E) / mean)
        momentum_E.mul_(beta).add_((1 - beta) * (delta_E - delta_E.mean()))
        bias_E += momentum_E
    elif rule == "sign":
        delta_E = gamma * torch.sign(mean - counts_E)
        bias_E += delta_E - delta_E.mean()


# --- The output head fused with the loss

# Logits are made at most this many bytes of fp32 rows at a time: on CPU a chunk in cache beats all rows.
HEAD_CHUNK_BYTES = {"cpu": 64 << 20, "default": 1 << 30}
# Rounding matmuls keep this many chunks' logit gradients for one dh and one dW matmul: each dW matmul adds a [V, D]
# product into the fp32 dW, a pass over 10 bytes per weight (7 GB at V=200k, D=3072).
HEAD_GRAD_CHUNKS = 8

# Exact fp32: a row's exponentials need no shift by its max when their sum lies here (none overflows; those that
# underflow are below 1e-18 of it). A chunk with a row outside is redone shifted, and so are the chunks after it.
UNSHIFTED_SUM_RANGE = (1e-20, 1e30)


def head_chunks(tokens: int, vocab_size: int, device: torch.device) -> tuple[int, int]:
    """(rows per chunk, rows per gradient group): equal chunks of at most HEAD_CHUNK_BYTES of fp32 logits (no short
    last one reading all of W for a few rows), HEAD_GRAD_CHUNKS of them a group."""
    most = max(1, HEAD_CHUNK_BYTES.get(device.type, HEAD_CHUNK_BYTES["default"]) // (4 * vocab_size))
    rows = max(1, -(-tokens // max(1, -(-tokens // most))))
    return rows, min(tokens, rows * HEAD_GRAD_CHUNKS)


def fp32_matmul_is_exact(device: torch.device) -> bool:
    """Whether fp32 matmuls here run in full fp32, not TF32 or bf16 passes. The backend's own setting: the global
    getter raises once both the legacy and the per-backend APIs have been used."""
    backend = torch.backends.cuda.matmul if device.type == "cuda" else torch.backends.mkldnn.matmul
    return getattr(backend, "fp32_precision", "none") in ("none", "ieee")  # "none": not set, full fp32


def lse_and_grad(logits_CV, t_C1, g_CV=None):
    """Each row's log-sum-exp [C, 1] in fp32; with g_CV, softmax - onehot(t) written into it, rounded once from fp32
    (not a difference of two rounded numbers). Compiled on CUDA it reads the logits twice."""
    x_CV = logits_CV.float()
    max_C1 = x_CV.amax(-1, keepdim=True)
    sum_C1 = x_CV.sub_(max_C1).exp_().sum(-1, keepdim=True)
    if g_CV is not None:
        g_CV.copy_(x_CV.div_(sum_C1))
        g_CV.scatter_(1, t_C1, x_CV.gather(1, t_C1).sub_(1).to(g_CV.dtype))
    return sum_C1.log_().add_(max_C1)


def head_cross_entropy(h_ND, weight_VD, targets_N, grads: bool):
    """(each row's cross-entropy [N] of h @ weight.T against targets, 0 at target -100; the valid rows' count), a
    chunk of rows at a time: the [N, V] logits never exist whole. grads adds the summed loss's dh, dW. Exact fp32,
    from each chunk's exponentials E and row sums s: dh = E @ W / s - W[t], dW = E.T @ (h / s) - onehot.T @ h (no
    [rows, V] division). Rounding matmuls: lse_and_grad's gradient, HEAD_GRAD_CHUNKS chunks per matmul."""
    device = h_ND.device
    N, D = h_ND.shape
    V = weight_VD.shape[0]
    mm_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else h_ND.dtype
    fp32 = mm_dtype == torch.float32 and fp32_matmul_is_exact(device)
    valid_N1 = (targets_N != -100).unsqueeze(1)
    targets_N1 = targets_N.clamp(min=0).unsqueeze(1)
    rows, group = head_chunks(N, V, device)
    with torch.autocast(device.type, enabled=False):
        h_ND = h_ND.to(mm_dtype)
        weight_VD = weight_VD.to(mm_dtype)
        picked_N1, lse_N1 = (torch.empty(N, 1, dtype=torch.float32, device=device) for _ in range(2))
        if grads:
            dh_ND = torch.empty_like(h_ND)
            dweight_VD = torch.zeros(V, D, dtype=torch.float32, device=device)
            h_valid_ND = h_ND * valid_N1
        if fp32:
            exp_CV = torch.empty(min(rows, N), V, dtype=torch.float32, device=device)  # one buffer for every chunk
            shifted = False
        else:  # rounding matmuls
            fused = compiled(lse_and_grad) if device.type == "cuda" else lse_and_grad
            g_GV = torch.empty(min(group, N), V, dtype=mm_dtype, device=device) if grads else None
        for start in range(0, N, rows):
            end = min(start + rows, N)
            h = h_ND[start:end]
            t = targets_N1[start:end]
            if not fp32:
                logits_CV = h @ weight_VD.t()
                picked_N1[start:end] = logits_CV.gather(1, t)
                first = start - start % group
                lse_N1[start:end] = fused(logits_CV, t, g_GV[start - first:end - first] if grads else None)
                if grads and (end % group == 0 or end == N):
                    torch.mm(g_GV[:end - first], weight_VD, out=dh_ND[first:end])
                    dweight_VD += g_GV[:end - first].t() @ h_valid_ND[first:end]
                continue
            e = exp_CV[:end - start]
            torch.mm(h, weight_VD.t(), out=e)
            torch.gather(e, 1, t, out=picked_N1[start:end])
            shift = 0.0
            if not shifted:
                s = e.exp_().sum(-1, keepdim=True)
                shifted = not bool(((s >= UNSHIFTED_SUM_RANGE[0]) & (s <= UNSHIFTED_SUM_RANGE[1])).all())
                if shifted:
                    torch.mm(h, weight_VD.t(), out=e)
            if shifted:
                shift = e.amax(-1, keepdim=True)
                s = e.sub_(shift).exp_().sum(-1, keepdim=True)
            torch.add(s.log(), shift, out=lse_N1[start:end])
            if grads:  # the one-hot's share after the loop
                torch.mm(e, weight_VD, out=dh_ND[start:end]).div_(s)
                dweight_VD.addmm_(e.t(), h_valid_ND[start:end] / s)
        n_valid = valid_N1.sum()
        loss_N = torch.where(valid_N1, lse_N1 - picked_N1, 0.0).squeeze(1)
    if not grads:
        return loss_N, n_valid
    if fp32:
        dh_ND.sub_(weight_VD.index_select(0, targets_N1.squeeze(1)))
        dweight_VD.index_add_(0, targets_N1.squeeze(1), h_valid_ND, alpha=-1)
    return loss_N, n_valid, dh_ND.mul_(valid_N1), dweight_VD


class _HeadCrossEntropy(torch.autograd.Function):
    """(mean loss, each row's loss [N] without gradient); backward scales head_cross_entropy's dh, dW."""

    @staticmethod
    def forward(ctx, h_ND, weight_VD, targets_N):
        loss_N, n_valid, dh_ND, dweight_VD = head_cross_entropy(h_ND, weight_VD, targets_N, grads=True)
        ctx.save_for_backward(dh_ND, dweight_VD, n_valid)
        ctx.dtypes = h_ND.dtype, weight_VD.dtype
        ctx.mark_non_differentiable(loss_N)
        return loss_N.sum() / n_valid, loss_N

    @staticmethod
    def backward(ctx, dloss, _):
        dh_ND, dweight_VD, n_valid = ctx.saved_tensors
        scale = dloss / n_valid
        return dh_ND.mul_(scale).to(ctx.dtypes[0]), dweight_VD.mul_(scale).to(ctx.dtypes[1]), None


# --- The transformer

class Block(nn.Module):
    """Sandwich norms: x = x + post_norm(f(pre_norm(x))), post gains starting at 1/sqrt(L)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        post_gain = 1.0 / math.sqrt(cfg.n_layers)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.attn_post_norm = RMSNorm(cfg.dim, cfg.norm_eps, init_gain=post_gain)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MoE(cfg) if cfg.is_moe(layer) else FeedForward(cfg.dim, cfg.dense_hidden)
        self.ffn_post_norm = RMSNorm(cfg.dim, cfg.norm_eps, init_gain=post_gain)

    def forward(self, x_BTD, cos_TDh, sin_TDh, mask, cache: KVCache | None = None):
        x_BTD = x_BTD + self.attn_post_norm(self.attn(self.attn_norm(x_BTD), cos_TDh, sin_TDh, mask, cache))
        h_BTD = self.ffn_norm(x_BTD)
        y_BTD, router = self.ffn(h_BTD) if isinstance(self.ffn, MoE) else (self.ffn(h_BTD), None)
        return x_BTD + self.ffn_post_norm(y_BTD), router


class Transformer(nn.Module):
    seq_parallel = None  # parallel.ContextParallel: each sequence split over its ranks (S = size x T tokens)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0", "1", ... keeps state-dict names stable when parallel.py wraps blocks.
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if self.embed.weight.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, draw=None):
        """Truncated normal on [-3σ, 3σ] for weights, norm gains, zero expert bias, in a fixed order; on DTensors
        after `to_empty`, `draw(tensor, init)` applies each in place."""
        draw = draw or (lambda tensor, init: init(tensor))
        std = self.cfg.init_std
        normal = lambda t: nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std)  # noqa: E731
        for module in self.modules():
            if isinstance(module, RMSNorm):
                draw(module.weight, lambda t, gain=module.init_gain: t.fill_(gain))
            elif isinstance(module, (nn.Linear, nn.Embedding, GroupedExperts)):
                for w in module.parameters(recurse=False):
                    draw(w, normal)
            elif isinstance(module, MoE):
                draw(module.expert_bias, torch.Tensor.zero_)

    def moe_layers(self) -> list[MoE]:
        return [block.ffn for block in self.layers.values() if isinstance(block.ffn, MoE)]

    def forward(self, tokens_BT, targets_BT=None, doc_ids_BT=None, cache: list | None = None, return_stats=False):
        """Logits [B, T, V], or with targets the mean cross-entropy (head_loss). doc_ids_BT keeps attention within
        documents. return_stats adds ForwardStats. With a cache (new_cache) tokens_BT continue the cached ones, and
        only the last position's logits [B, 1, V] are made."""
        T = tokens_BT.shape[1]
        x_BTD = self.embed(tokens_BT)
        if self.cfg.mup:
            x_BTD = x_BTD * math.sqrt(self.cfg.dim)
        start, flex = (0, None) if cache is None else (cache[0].pos, False)
        # Context parallelism: tokens_BT is chunk `rank` of each sequence; attention sees whole sequences.
        sp = self.seq_parallel if cache is None else None
        S = T * sp.size if sp else T
        if sp:
            start = sp.rank * T
            doc_ids_BT = sp.gather(doc_ids_BT) if doc_ids_BT is not None else None
        cos_TDh, sin_TDh = rope_cos_sin(T, self.cfg.head_dim, self.cfg.rope_theta, tokens_BT.device, start)
        window = self.cfg.window if self.cfg.window < S else None
        masks = {is_global: make_mask(S, None if is_global else window, doc_ids_BT, tokens_BT.device, flex)
                 for is_global in (False, True)}
        routers = []
        for block, layer_cache in zip(self.layers.values(), cache or [None] * len(self.layers)):
            x_BTD, router = block(x_BTD, cos_TDh, sin_TDh, masks[block.attn.is_global], layer_cache)
            routers += [router] if router is not None else []
        h_BTD = self.norm(x_BTD if cache is None else x_BTD[:, -1:])
        loss_B = None
        if targets_BT is None or cache is not None:
            out = self.head(h_BTD)
        else:
            out, loss_B = self.head_loss(h_BTD, targets_BT)
        if not return_stats:
            return out
        zero = torch.zeros((), device=x_BTD.device)
        E = self.cfg.n_experts
        # Seeded with no counts and zero losses: a model without MoE layers reports [0, E] counts.
        counts, aux, z = zip((zero.new_zeros(0, E, dtype=torch.int64), zero, zero), *routers)
        return out, ForwardStats(torch.cat([counts_E.view(-1, E) for counts_E in counts]), sum(aux), sum(z), loss_B)

    def head_loss(self, h_BTD, targets_BT):
        """(mean cross-entropy of head(h), -100 ignored; each sequence's [B], no gradient), holding no logits."""
        h_ND = h_BTD.flatten(0, 1)
        targets_N = targets_BT.flatten()
        if torch.is_grad_enabled() and (h_ND.requires_grad or self.head.weight.requires_grad):
            loss, loss_N = _HeadCrossEntropy.apply(h_ND, self.head.weight, targets_N)
        else:
            loss_N, n_valid = head_cross_entropy(h_ND, self.head.weight, targets_N, grads=False)
            loss = loss_N.sum() / n_valid
        valid_B = (targets_BT != -100).sum(1).clamp(min=1)
        return loss, loss_N.view(targets_BT.shape).sum(1) / valid_B

    def num_params(self) -> dict:
        """Total and active (one token's share of the routed experts) counts; works on meta."""
        total = sum(p.numel() for p in self.parameters())
        routed = sum(p.numel() for m in self.moe_layers() for p in m.experts.parameters())
        return {"total": total, "active": total - routed + routed * self.cfg.top_k // self.cfg.n_experts}

    def flops_per_token(self, seq_len: int) -> float:
        """6 * (matmul weights one token touches, embedding table excluded) + 12 * sum_l H * Dh * ctx_l."""
        cfg = self.cfg
        norms = sum(m.weight.numel() for m in self.modules() if isinstance(m, RMSNorm))
        matmul = self.num_params()["active"] - self.embed.weight.numel() - norms
        ctx = sum(seq_len if cfg.is_global(i) else min(cfg.window, seq_len) for i in range(cfg.n_layers))
        return 6 * matmul + 12 * cfg.n_heads * cfg.head_dim * ctx

    def new_cache(self, length: int) -> list[KVCache]:
        return [KVCache(length, None if self.cfg.is_global(i) else self.cfg.window) for i in range(self.cfg.n_layers)]

    @torch.no_grad()
    def generate(self, tokens_BT, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, allowed_V: torch.Tensor | None = None, stop_id: int | None = None):
        """Sample max_new_tokens after each row of tokens_BT (sample_next's arguments): [B, T + new]. The prompt fills
        a KV cache once, then one token a step, eagerly (no recompiling per length). A row that samples stop_id repeats
        it; sampling ends once every row has. A sharded model's ranks must pass the same tokens and RNG state, and
        stop_id only where their draws cannot differ (a rank stopping alone leaves the others waiting)."""
        S = tokens_BT.shape[1] + max_new_tokens
        if S > self.cfg.max_seq_len:
            _warn_once(f"generating {S} tokens, past max_seq_len={self.cfg.max_seq_len}, the model's training length.")
        cache = self.new_cache(S)
        steps = [tokens_BT]  # the prompt, then a [B, 1] token per step
        done_B1 = torch.zeros(tokens_BT.shape[0], 1, dtype=torch.bool, device=tokens_BT.device)
        with torch.compiler.set_stance("force_eager"):
            for _ in range(max_new_tokens):
                next_B1 = sample_next(self(steps[-1], cache=cache)[:, -1], temperature, top_k, top_p, allowed_V)
                if stop_id is not None:
                    next_B1 = next_B1.masked_fill(done_B1, stop_id)
                    done_B1 |= next_B1 == stop_id
                steps.append(next_B1)
                if stop_id is not None and bool(done_B1.all()):
                    break
        return torch.cat(steps, dim=1).to(tokens_BT.dtype)


def top_p_filter(logits_BV, top_p: float | None):
    """-inf outside each row's nucleus: a token stays while those ranked above it hold less than top_p."""
    if top_p is None or top_p >= 1:
        return logits_BV
    sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
    probs_BV = torch.softmax(sorted_BV, -1)
    drop_BV = probs_BV.cumsum(-1) - probs_BV >= top_p
    return logits_BV.masked_fill(drop_BV.scatter(-1, order_BV, drop_BV), float("-inf"))


def sample_next(logits_BV, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                allowed_V: torch.Tensor | None = None):
    """One id per row [B, 1]: the argmax at temperature 0, else drawn from softmax(logits / temperature) over the
    top_k ids, then their top_p nucleus. allowed_V: True for ids that may come out (not padding)."""
    logits_BV = logits_BV.float()
    if allowed_V is not None:
        logits_BV = logits_BV.masked_fill(~allowed_V, float("-inf"))
    if temperature == 0:
        return logits_BV.argmax(-1, keepdim=True)
    ids_BV = None
    if top_k is not None and top_k < logits_BV.shape[-1]:  # draw among k candidates: cheaper than masking all V
        logits_BV, ids_BV = logits_BV.topk(top_k, dim=-1)
    next_B1 = torch.multinomial(torch.softmax(top_p_filter(logits_BV / temperature, top_p), -1), 1)
    return next_B1 if ids_BV is None else ids_BV.gather(-1, next_B1)


def meta_model(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


if __name__ == "__main__":
    parser = Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--preset", choices=PRESETS, help="run one forward pass of this preset on CPU")
    args = parser.parse_args()
    if args.preset:
        cfg = PRESETS[args.preset]
        tokens_BT = torch.randint(0, cfg.vocab_size, (2, min(cfg.max_seq_len, 128)))
        loss = Transformer(cfg)(tokens_BT[:, :-1], targets_BT=tokens_BT[:, 1:])
        print(f"{args.preset}: loss at init {loss.item():.3f} (ln V = {math.log(cfg.vocab_size):.3f})")
    for name, cfg in PRESETS.items():
        m = meta_model(cfg)
        n = m.num_params()
        print(f"{name:6s} total {n['total'] / 1e9:8.3f}B  active {n['active'] / 1e9:7.3f}B  "
              f"FLOPs/token at seq {cfg.max_seq_len}: {m.flops_per_token(cfg.max_seq_len) / 1e9:7.2f} G")
