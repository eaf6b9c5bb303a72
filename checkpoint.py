"""
Checkpoints: save and resume training on any number of ranks, and convert to and from Hugging Face's `afmoe`.

A checkpoint is written with torch.distributed.checkpoint (DCP): every rank writes its own shards of the model and
optimizer, keyed by parameter name, and any other layout (another world size, FSDP or not) reads them back. Tensors
are the only thing DCP stores; everything else is JSON, so loading never unpickles code.

    ckpt_root/step_00000010/
        .metadata, __0_0.distcp, ...   model and optimizer tensors (DCP, one data file per rank)
        config.json                    the resolved training config, the model config under "model"
        state.json                     step, world size, the "train" dict, the optimizer's non-tensor settings
        rng_00000.json, ...            each rank's RNG states: torch CPU and CUDA, numpy, python
        COMPLETE                       written last, once every rank has finished writing

A save is written into step_00000010.tmp, and rank 0 renames it after the marker is in place, so a run killed
mid-save leaves the previous checkpoint as the newest complete one.

    python checkpoint.py ls out/ckpt                         # the checkpoints under a root: step, complete, size
    python checkpoint.py export out/ckpt out/hf              # the newest complete checkpoint -> Hugging Face folder,
                                                             # weights and the tokenizer its data was prepared with
    python checkpoint.py export out/ckpt/step_00000010 out/hf
    python checkpoint.py sample out/ckpt --prompt="def " --max_new_tokens=64   # or a Hugging Face folder

    from checkpoint import save, load, latest, load_latest, export_hf, load_hf, load_hf_into
    wait = save("out/ckpt", step, {"model": model, "optim": optim, "train": train_state}, config, async_save=True)
    wait()                                                   # on every rank, before the next save and at exit
    train_state = load(latest("out/ckpt"), {"model": model, "optim": optim}, config)
    path, train_state = load_latest("out/ckpt", {"model": model, "optim": optim}, config)  # skips damaged ones
    cfg, state_dict = load_hf("out/hf")                      # our ModelConfig and a state dict for Transformer(cfg)
    load_hf_into(model, "out/hf")                            # on every rank: each reads only its shards' rows
"""

import argparse
import base64
import errno
import json
import os
import random
import re
import shutil
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, is_dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

import data
from model import ModelConfig, config_fields

# Single-process DCP calls are deliberate here (world size 1, export); DCP warns about every one of them.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")

# ------------------------------------------------------------------------------------------------------------------
# Our state-dict names <-> transformers' AfmoeForCausalLM names

# Our name -> transformers' name, per layer ("{}" is the layer index). Everything else is one-to-one below.
_LAYER_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_post_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_mlp_layernorm.weight",
    "ffn_post_norm.weight": "post_mlp_layernorm.weight",
    **{f"attn.{p}.weight": f"self_attn.{p}.weight"
       for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "q_norm", "k_norm")},
    **{f"ffn.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
    **{f"ffn.shared.{p}.weight": f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
    "ffn.router.weight": "mlp.router.gate.weight",
    "ffn.expert_bias": "mlp.expert_bias",
    "ffn.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "ffn.experts.down_proj": "mlp.experts.down_proj",
}
_TOP_KEYS = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")


def _hf_name(ours: str) -> str:
    if ours in _TOP_KEYS:
        return _TOP_KEYS[ours]
    m = _LAYER_RE.fullmatch(ours)
    if m is None or m.group(2) not in _LAYER_KEYS:
        raise KeyError(f"state-dict key {ours!r} has no Hugging Face counterpart")
    return f"model.layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"


def _our_names(cfg: ModelConfig) -> list[str]:
    from model import meta_model
    return list(meta_model(cfg).state_dict().keys())


def to_hf_state_dict(sd: dict, cfg: ModelConfig) -> dict:
    """Our state dict -> transformers' AfmoeForCausalLM state dict (same tensors, renamed)."""
    return {_hf_name(k): v for k, v in sd.items()}


def _check_hf_names(present: set, wanted: dict):
    missing = sorted(set(wanted) - present)
    if missing:
        raise KeyError(f"the Hugging Face state dict lacks {len(missing)} tensors this config needs, "
                       f"e.g. {missing[:3]}; is it an afmoe model with the same number of layers and experts?")


def from_hf_state_dict(hf_sd: dict, cfg: ModelConfig) -> dict:
    """transformers' AfmoeForCausalLM state dict -> one that Transformer(cfg).load_state_dict(strict=True) takes."""
    wanted = {_hf_name(k): k for k in _our_names(cfg)}
    _check_hf_names(set(hf_sd), wanted)
    out = {}
    for hf_key, ours in wanted.items():
        t = hf_sd[hf_key]
        out[ours] = t.float() if ours.endswith("expert_bias") else t
    return out


# ------------------------------------------------------------------------------------------------------------------
# JSON for the small non-DCP data: exact tensors (raw bytes, base64), tuples and non-string dict keys survive

_TAGS = ("__tensor__", "__tuple__", "__items__")


def _encode(obj, where: str):
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"__tensor__": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "data": base64.b64encode(raw).decode("ascii")}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: _encode(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {"__items__": [[_encode(k, where), _encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    if type(obj).__module__ == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:
        return obj.item()  # a numpy scalar comes back as the python number
    raise TypeError(f"{where} is of type {type(obj).__name__}, which a checkpoint cannot store; "
                    f"use numbers, strings, lists, tuples, dicts or tensors.")


def _decode(obj):
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        dtype = getattr(torch, obj["__tensor__"])
        raw = base64.b64decode(obj["data"])
        if not raw:
            return torch.empty(obj["shape"], dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(obj["shape"])
    if "__tuple__" in obj:
        return tuple(_decode(v) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k): _decode(v) for k, v in obj["__items__"]}
    return {k: _decode(v) for k, v in obj.items()}


def _config_json(obj):
    if is_dataclass(obj):
        return asdict(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    raise TypeError(f"config value {obj!r} of type {type(obj).__name__} is not JSON; "
                    f"use numbers, strings, lists or dicts in the training config.")


def _write(path: str, text: str):
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _read_json(ckpt: str, name: str) -> dict:
    path = os.path.join(ckpt, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {ckpt} has no {name}; it was not written by this checkpoint.py.")
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------------------------
# RNG states (saved per rank: each rank draws its own streams)

def rng_state() -> dict:
    """This process's RNG states: torch CPU, the current CUDA device (if CUDA is in use), numpy, python."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, keys.tolist(), pos, has_gauss, cached)
    except ImportError:
        pass
    return state


def set_rng_state(state: dict):
    """Restore what rng_state() returned."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ------------------------------------------------------------------------------------------------------------------
# Saving, finding and loading training checkpoints

MARKER = "COMPLETE"
_STEP_RE = re.compile(r"step_(\d+)(\.tmp)?")
# Fields that do not change the weights' shapes or the function they compute: a run may change them on resume.
_NOT_ARCHITECTURE = ("max_seq_len", "init_std", "aux_loss_coef", "z_loss_coef")


@dataclass
class _Entry:
    step: int
    path: str
    complete: bool
    tmp: bool  # a save in progress, or one that was killed


def _scan(ckpt_root: str) -> list[_Entry]:
    """Every step directory under ckpt_root, by step."""
    if not os.path.isdir(ckpt_root):
        return []
    found = []
    for name in os.listdir(ckpt_root):
        m = _STEP_RE.fullmatch(name)
        path = os.path.join(ckpt_root, name)
        if m and os.path.isdir(path):
            tmp = m.group(2) is not None
            found.append(_Entry(int(m.group(1)), path, not tmp and os.path.isfile(os.path.join(path, MARKER)), tmp))
    return sorted(found, key=lambda e: (e.step, e.tmp))


def latest(ckpt_root: str) -> str | None:
    """The newest complete checkpoint directory under ckpt_root, or None."""
    complete = [e for e in _scan(ckpt_root) if e.complete]
    return complete[-1].path if complete else None


class CorruptCheckpoint(ValueError):
    """A checkpoint marked complete whose files are missing, truncated or unreadable; the message names the file."""


class SaveFailed(RuntimeError):
    """A save that could not be written (the message says why); its partial files are removed, the previous
    checkpoint stays the newest complete one."""


def verify(path: str):
    """Check that the files of complete checkpoint `path` are all there and whole: .metadata, every .distcp file as
    long as the tensors it holds, config.json, state.json and each rank's rng file parse. Raises CorruptCheckpoint
    naming the first bad file; reads no tensor data."""
    def bad(name: str, why: str):
        return CorruptCheckpoint(f"checkpoint {path} is damaged: {os.path.join(path, name)} {why}.")

    def read(name: str) -> dict:
        try:
            return _read_json(path, name)
        except FileNotFoundError:
            raise bad(name, "is missing") from None
        except ValueError:
            raise bad(name, "is not valid JSON (truncated?)") from None

    read("config.json")
    for r in range(read("state.json").get("world_size", 1)):
        read(f"rng_{r:05d}.json")
    try:
        storage = dcp.FileSystemReader(path).read_metadata().storage_data
    except FileNotFoundError:
        raise bad(".metadata", "is missing") from None
    except Exception:
        raise bad(".metadata", "cannot be read (truncated?)") from None
    needed = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        have = os.path.getsize(os.path.join(path, name)) if os.path.isfile(os.path.join(path, name)) else None
        if have is None or have < size:
            raise bad(name, "is missing" if have is None else f"is truncated ({have} bytes of {size})")


def load_latest(ckpt_root: str, state: dict, config=None, say=print) -> tuple[str | None, dict | None]:
    """load() the newest complete checkpoint under ckpt_root that loads, newest first: a damaged one is skipped with
    a line saying which and why. (None, None) when there is none; raises CorruptCheckpoint when none loads."""
    complete = [e.path for e in reversed(_scan(ckpt_root)) if e.complete]
    for path in complete:
        try:
            return path, load(path, state, config)
        except CorruptCheckpoint as e:
            say(f"{e} Skipping it, trying the previous checkpoint.")
    if complete:
        raise CorruptCheckpoint(f"none of the {len(complete)} complete checkpoints under {ckpt_root} loads (see "
                                f"above); start again with --resume=none --overwrite, or restore the files.")
    return None, None


def _resolve(path: str) -> str:
    """A complete checkpoint directory: `path` itself, or the newest complete one when `path` is a root."""
    if os.path.isfile(os.path.join(path, MARKER)):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path {path} does not exist.")
    if _STEP_RE.fullmatch(os.path.basename(os.path.normpath(path))) or os.path.exists(os.path.join(path, ".metadata")):
        newest = latest(os.path.dirname(os.path.normpath(path)))
        raise ValueError(f"checkpoint {path} is incomplete (no {MARKER} marker: its save was interrupted); "
                         f"use {newest or 'an earlier, complete checkpoint'} instead.")
    found = latest(path)
    if found is None:
        raise FileNotFoundError(f"{path} holds no complete checkpoint (a step_NNNNNNNN directory with a {MARKER} "
                                f"file); train with checkpointing on first.")
    return found


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _model_config(model) -> ModelConfig | None:
    for m in (model, getattr(model, "_orig_mod", None)):  # torch.compile wraps the module
        if isinstance(getattr(m, "cfg", None), ModelConfig):
            return m.cfg
    return None


def _resolved_config(config, model) -> dict:
    out = asdict(config) if is_dataclass(config) else dict(config or {})
    m = out.get("model")
    if isinstance(m, ModelConfig):
        out["model"] = asdict(m)
    elif m is None and _model_config(model) is not None:
        out["model"] = asdict(_model_config(model))
    elif m is not None and not isinstance(m, dict):
        raise TypeError(f"config['model'] must be the ModelConfig (or its dict), not a {type(m).__name__}.")
    return out


@contextmanager
def _step_hooks_silenced(optim):
    """get/set_state_dict take a zero-lr optimizer step to create missing state; step hooks (the expert-bias
    update) must not fire on it."""
    saved = optim._optimizer_step_pre_hooks.copy(), optim._optimizer_step_post_hooks.copy()
    optim._optimizer_step_pre_hooks.clear()
    optim._optimizer_step_post_hooks.clear()
    try:
        yield
    finally:
        optim._optimizer_step_pre_hooks.update(saved[0])
        optim._optimizer_step_post_hooks.update(saved[1])


_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # keys: "state.<param fqn>.exp_avg", ...


def _state_dicts(model, optim) -> tuple[dict, dict]:
    """({"model": tensors, "optim": tensors} for DCP, the optimizer's non-tensor values), keyed by parameter name
    whatever the wrapping (FSDP2, torch.compile, activation checkpointing)."""
    if optim is None:
        return {"model": get_model_state_dict(model, options=_OPTIONS)}, {}
    with _step_hooks_silenced(optim):
        model_sd, optim_sd = get_state_dict(model, optim, options=_OPTIONS)
    tensors = {k: v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
    return {"model": model_sd, "optim": tensors}, {k: v for k, v in optim_sd.items() if k not in tensors}


_async_group_of: list = [None, None]  # (default group, its gloo group for async saves)


def _async_group():
    """A gloo group for async saves: DCP runs its collectives from a background thread, which must not share a
    group with the training loop's collectives, and needs a CPU backend even when training uses NCCL."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _async_group_of[0] is not dist.group.WORLD:
        _async_group_of[:] = [dist.group.WORLD, dist.new_group(backend="gloo")]
    return _async_group_of[1]


_pending: list[Callable[[], None]] = []


def save(ckpt_root: str, step: int, state: dict, config: dict, keep: int = 3,
         async_save: bool = False) -> Callable[[], None]:
    """Write checkpoint `ckpt_root/step_{step:08d}`; every rank calls it.

    state: "model" (nn.Module, plain or FSDP2/DTensor), "optim" (optimizer or None), "train" (dict of plain values
    and tensors, identical on all ranks), "rng" (optional, this rank's rng_state(); taken now when absent).
    config: the training config (dict or dataclass); config["model"] is the ModelConfig, taken from the model when
    absent. Keeps the newest `keep` complete checkpoints (keep <= 0 keeps all).
    async_save: return as soon as the tensors are copied to CPU and write them in the background.
    Returns a callable that waits for the write and marks the checkpoint complete; every rank must call it before
    the next save and before exiting (a synchronous save is complete already and the callable does nothing). Its
    .done() says whether this rank's write has finished, so a loop can mark the checkpoint complete as soon as every
    rank's has, without waiting. A write that fails (a full disk) raises SaveFailed, here or from the callable,
    after removing its partial files; the previous checkpoint stays the newest. Pruning spares other runs'
    checkpoints: those whose config "run_id" differs from this one's."""
    while _pending:  # a forgotten wait() of the previous async save
        _pending[0]()
    rank, world = _rank_world()
    model, optim = state["model"], state.get("optim")
    # Bad input fails here, on every rank, before any collective starts (so no rank waits on one that failed).
    config_text = json.dumps(_resolved_config(config, model), indent=2, default=_config_json)
    rng_text = json.dumps(_encode(state.get("rng") or rng_state(), "state['rng']"))
    tensors, optim_rest = _state_dicts(model, optim)
    state_text = json.dumps({"step": step, "world_size": world, "train": _encode(state.get("train") or {}, "train"),
                             "optim": _encode(optim_rest, "optimizer state")}, indent=1)

    final = os.path.join(ckpt_root, f"step_{step:08d}")
    tmp = final + ".tmp"

    @contextmanager
    def failing_cleanly():
        """A write that fails (a full disk) becomes one SaveFailed sentence; its partial files are removed."""
        try:
            yield
        except (OSError, CheckpointException) as e:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = latest(ckpt_root)
            why = (f"no space left on {ckpt_root}" if _errno(e) == errno.ENOSPC
                   else f"writing {tmp} failed ({_first_failure(e)})")
            raise SaveFailed(f"{why}: checkpoint step_{step:08d} not written (its partial files are removed); the "
                             f"newest checkpoint is still {previous or 'none'}.") from None

    with failing_cleanly():
        failure = None
        try:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # left by a save of this step that was killed
                os.makedirs(tmp)
        except OSError as e:
            failure = e
        _barrier()
        try:
            _write(os.path.join(tmp, f"rng_{rank:05d}.json"), rng_text)
            if rank == 0:
                _write(os.path.join(tmp, "config.json"), config_text)
                _write(os.path.join(tmp, "state.json"), state_text)
        except OSError as e:
            failure = failure or e
        _raise_any(failure, world)  # before DCP's collectives

    def commit():
        _barrier()  # every rank has written all of its files
        failure = None
        if rank == 0:
            try:
                _write(os.path.join(tmp, MARKER), f"{step}\n")
                if os.path.isdir(final):  # an earlier save of the same step
                    shutil.rmtree(final)
                os.rename(tmp, final)
                fd = os.open(ckpt_root, os.O_RDONLY)  # make the rename itself durable
                os.fsync(fd)
                os.close(fd)
                _prune(ckpt_root, keep, step)
            except OSError as e:
                failure = e
        _raise_any(failure, world)  # no rank moves on before the checkpoint is complete for all

    if not async_save:
        with failing_cleanly():
            dcp.save(tensors, checkpoint_id=tmp, no_dist=world == 1 and not dist.is_initialized())
            commit()
        return _complete
    group = _async_group()
    with failing_cleanly():
        future = dcp.async_save(tensors, checkpoint_id=tmp, process_group=group, no_dist=group is None)

    def wait():
        if wait in _pending:
            _pending.remove(wait)
            with failing_cleanly():
                future.result()
                commit()

    wait.done = future.done
    _pending.append(wait)
    return wait


def _raise_any(failure: OSError | None, world: int):
    """Every rank raises the first rank's failure, if any rank had one: all of them give up together, and none is
    left waiting in a collective the others skipped. A barrier otherwise."""
    failures = [failure] * world
    if world > 1:
        dist.all_gather_object(failures, failure)
    failed = next((f for f in failures if f is not None), None)
    if failed is not None:
        raise failed


def _errno(e: BaseException) -> int | None:
    """The errno of an OSError, also when DCP wrapped it (a CheckpointException holds each rank's exception)."""
    if isinstance(e, CheckpointException):
        return next((_errno(exc) for exc, _ in e.failures.values() if _errno(exc) is not None), None)
    return getattr(e, "errno", None)


def _first_failure(e: BaseException) -> str:
    """One line for an exception, DCP's per-rank CheckpointException included (its str is every rank's traceback)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def _complete():
    """What a synchronous save returns: its checkpoint is complete already."""


_complete.done = lambda: True


def _run_id(path: str):
    try:
        return _read_json(path, "config.json").get("run_id")
    except (OSError, ValueError):
        return None


def _prune(ckpt_root: str, keep: int, step: int):
    """Delete complete checkpoints of the same run (the same config "run_id" as the one just written) beyond the
    newest `keep`, and the leftovers of killed saves older than `step`; never the checkpoint just written, never a
    newer save in progress, never another run's checkpoint."""
    entries = _scan(ckpt_root)
    run = _run_id(os.path.join(ckpt_root, f"step_{step:08d}"))
    complete = [e for e in entries if e.complete and e.step != step and _run_id(e.path) == run]
    doomed = complete[:max(0, len(complete) - (keep - 1))] if keep > 0 else []
    doomed += [e for e in entries if e.tmp and e.step < step]
    for e in doomed:
        shutil.rmtree(e.path, ignore_errors=True)


def _architecture_diff(saved: dict, current: dict) -> list[str]:
    names = [n for n in dict.fromkeys([*config_fields(), *saved]) if n not in _NOT_ARCHITECTURE]
    return [f"{n}: {saved.get(n, 'absent')!r} in the checkpoint vs {current.get(n, 'absent')!r} now"
            for n in names if saved.get(n) != current.get(n)]


def load(path: str, state: dict, config: dict | ModelConfig | None = None) -> dict:
    """Load checkpoint `path` (or the newest complete one under a root) into state["model"] and state["optim"] in
    place, whatever their current layout; restore this rank's RNG states; return the saved "train" dict (tensors
    on CPU). Every rank calls it.

    config: when given (the training config dict with "model", or a ModelConfig), a checkpoint saved with another
    model architecture is refused with the list of differing fields.
    RNG: rank r restores the states rank r % saved_world_size saved, so the same world size resumes every stream
    exactly and a single process resumes rank 0's."""
    path = _resolve(path)
    verify(path)
    rank, world = _rank_world()
    saved_config = _read_json(path, "config.json")
    saved_state = _read_json(path, "state.json")
    model, optim = state["model"], state.get("optim")
    if config is not None:
        current = asdict(config) if isinstance(config, ModelConfig) else _resolved_config(config, model).get("model")
        if current is not None and isinstance(saved_config.get("model"), dict):
            diff = _architecture_diff(saved_config["model"], current)
            if diff:
                raise ValueError(f"checkpoint {path} was saved with a different model architecture "
                                 f"({'; '.join(diff)}); resume with the checkpoint's model config or start a new run.")
        ours, theirs = (c.get("tokenizer", {}).get("name") for c in (_resolved_config(config, model), saved_config))
        if None not in (ours, theirs) and ours != theirs:
            raise ValueError(f"checkpoint {path} was trained on {theirs} tokens but this run's data holds {ours} "
                             f"tokens; resume on data prepared with {theirs}, or start a new run.")

    tensors, optim_rest = _state_dicts(model, optim)
    saved_meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    wanted = {f"{group}.{k}": v for group, sd in tensors.items() for k, v in sd.items()}
    missing = [k for k in wanted if k not in saved_meta]
    if missing:
        hint = ("it was saved without optimizer state; pass no optimizer or start a new one"
                if all(k.startswith("optim.") for k in missing) else "was it saved from another model?")
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors this run needs, e.g. "
                         f"{', '.join(missing[:3])}; {hint}.")
    wrong = [f"{k} {tuple(saved_meta[k].size)} in the checkpoint vs {tuple(v.shape)} now"
             for k, v in wanted.items() if tuple(saved_meta[k].size) != tuple(v.shape)]
    if wrong:
        raise ValueError(f"checkpoint {path} holds tensors of other shapes ({'; '.join(wrong[:3])}); "
                         f"resume with the checkpoint's model config.")

    try:
        dcp.load(tensors, checkpoint_id=path, no_dist=world == 1 and not dist.is_initialized())
    except CheckpointException as e:  # files whole but unreadable; every rank raises it (DCP gathers failures)
        raise CorruptCheckpoint(f"checkpoint {path} is damaged: its tensors cannot be read "
                                f"({_first_failure(e)}).") from None
    if optim is None:
        set_model_state_dict(model, tensors["model"], options=_OPTIONS)
    else:
        saved_rest = _decode(saved_state["optim"])
        optim_sd = {**tensors["optim"], **{k: saved_rest.get(k, v) for k, v in optim_rest.items()}}
        with _step_hooks_silenced(optim):
            set_state_dict(model, optim, model_state_dict=tensors["model"], optim_state_dict=optim_sd,
                           options=_OPTIONS)

    saved_world = saved_state["world_size"]
    if saved_world != world and rank == 0:
        warnings.warn(f"checkpoint {path} was written by {saved_world} ranks and this run has {world}: "
                      f"rank r resumes the RNG streams of saved rank r % {saved_world}.", stacklevel=2)
    with open(os.path.join(path, f"rng_{rank % saved_world:05d}.json")) as f:
        set_rng_state(_decode(json.load(f)))
    return _decode(saved_state["train"])


# ------------------------------------------------------------------------------------------------------------------
# Hugging Face folders: export a checkpoint, import a model to start from

def export_hf(ckpt_path: str, out_dir: str, max_shard_bytes: int = 5 * 2**30, tokenizer: str | None = None) -> str:
    """Write a transformers `afmoe` folder (config.json, model.safetensors or numbered shards plus
    model.safetensors.index.json, tokenizer.json and tokenizer_config.json) from checkpoint `ckpt_path` (or the
    newest complete one under a root), in one process whatever world size wrote it. Holds one output shard in memory
    at a time. The tokenizer is the one the training data was prepared with, unless `tokenizer` (a tiktoken name or
    a Hugging Face tokenizer folder) is given. Returns the checkpoint used."""
    from safetensors.torch import save_file

    path = _resolve(ckpt_path)
    saved_config = _read_json(path, "config.json")
    saved = saved_config.get("model")
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint {path} has no model config under 'model' in config.json, so it cannot be "
                         f"exported.")
    cfg = ModelConfig(**{k: v for k, v in saved.items() if k in config_fields()})
    tokenizer = tokenizer or saved_config.get("tokenizer", {}).get("source")
    if tokenizer is None:
        warnings.warn(f"checkpoint {path} records no tokenizer, so {out_dir} gets none; pass the one its data was "
                      f"prepared with (--tokenizer)", stacklevel=2)
    elif (n_vocab := data.get_encoding(tokenizer).n_vocab) > cfg.vocab_size:
        raise ValueError(f"tokenizer {tokenizer} has {n_vocab} token ids but the model in {path} only "
                         f"{cfg.vocab_size}; pass the tokenizer its data was prepared with (--tokenizer)")
    saved_meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    names = _our_names(cfg)
    missing = [n for n in names if f"model.{n}" not in saved_meta]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} model tensors its config needs, "
                         f"e.g. {', '.join(missing[:3])}.")

    shards, size = [[]], 0
    for n in names:
        meta = saved_meta[f"model.{n}"]
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):  # an earlier export's weights would be mixed in by from_pretrained
        if name.startswith("model") and ".safetensors" in name:
            os.remove(os.path.join(out_dir, name))
    weight_map, total = {}, 0
    for file, shard in zip(files, shards):
        sd = {f"model.{n}": torch.empty(saved_meta[f"model.{n}"].size, dtype=saved_meta[f"model.{n}"].properties.dtype)
              for n in shard}
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        hf_sd = to_hf_state_dict({n: sd[f"model.{n}"] for n in shard}, cfg)
        save_file(hf_sd, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(hf_sd, file))
        total += sum(t.numel() * t.element_size() for t in hf_sd.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write(os.path.join(out_dir, "model.safetensors.index.json"), json.dumps(index, indent=2))
    dtype = saved_meta["model.embed.weight"].properties.dtype
    hf_config = {**cfg.to_hf(), "dtype": str(dtype).removeprefix("torch.")}
    _write(os.path.join(out_dir, "config.json"), json.dumps(hf_config, indent=2))
    if tokenizer is not None:
        data.save_hf_tokenizer(tokenizer, out_dir)
    return path


def _hf_folder(hf_dir: str) -> tuple[dict, list[str]]:
    """The config.json and the weight files of a Hugging Face `afmoe` folder."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{hf_dir} has no config.json; expected a Hugging Face model folder.")
    with open(config_path) as f:
        hf = json.load(f)
    if hf.get("model_type") != "afmoe":
        raise ValueError(f"{hf_dir} holds a model_type={hf.get('model_type')!r} model; only 'afmoe' (Trinity) "
                         f"models can be loaded.")
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json.")
    absent = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
    if absent:
        raise FileNotFoundError(f"{hf_dir} lacks {len(absent)} weight file(s) its index names, "
                                f"e.g. {absent[0]}; copy the folder again.")
    return hf, [os.path.join(hf_dir, f) for f in files]


def hf_config(hf_dir: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face `afmoe` folder."""
    return ModelConfig.from_hf(_hf_folder(hf_dir)[0])


def load_hf(hf_dir: str) -> tuple[ModelConfig, dict]:
    """Read a Hugging Face `afmoe` folder whole: our ModelConfig and a state dict for
    Transformer(cfg).load_state_dict. (To fill a sharded model, load_hf_into reads only each rank's slices.)"""
    from safetensors.torch import load_file

    hf, files = _hf_folder(hf_dir)
    hf_sd = {}
    for file in files:
        hf_sd.update(load_file(file))
    cfg = ModelConfig.from_hf(hf)
    return cfg, from_hf_state_dict(hf_sd, cfg)


def load_hf_into(model, hf_dir: str):
    """Fill `model`, plain or sharded by parallel.py, from a Hugging Face `afmoe` folder, in place. Every rank
    calls it and reads from the safetensors files only the rows of the shards it holds (torch.distributed.checkpoint
    with its Hugging Face reader), so no rank ever holds the whole model. Weights stored in another dtype (a bf16
    export) are converted to the model's."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    _hf_folder(hf_dir)  # config.json and the weight files the index names are there
    reader = HuggingFaceStorageReader(hf_dir)
    shapes = {k: tuple(meta.size) for k, meta in reader.read_metadata().state_dict_metadata.items()}
    tensors = get_model_state_dict(model, options=_OPTIONS)
    wanted = {_hf_name(k): v for k, v in tensors.items()}
    _check_hf_names(set(shapes), wanted)
    wrong = [f"{k} {shapes[k]} in the folder vs {tuple(v.shape)} here" for k, v in wanted.items()
             if shapes[k] != tuple(v.shape)]
    if wrong:
        raise ValueError(f"{hf_dir} holds tensors of other shapes ({'; '.join(wrong[:3])}); start from a folder "
                         f"of this model's config, or drop the flags that change it.")
    _, world = _rank_world()
    dcp.load(wanted, storage_reader=reader, no_dist=world == 1 and not dist.is_initialized())
    set_model_state_dict(model, {k: wanted[_hf_name(k)] for k in tensors}, options=_OPTIONS)


# ------------------------------------------------------------------------------------------------------------------
# Command line

def _ls(ckpt_root: str):
    if not os.path.isdir(ckpt_root):
        raise FileNotFoundError(f"checkpoint root {ckpt_root} does not exist.")
    entries = _scan(ckpt_root)
    if not entries:
        print(f"no checkpoints under {ckpt_root}")
        return
    print(f"{'step':>10}  {'status':<10}  {'size':>10}  path")
    for e in entries:
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(e.path) for f in fs)
        status = "complete" if e.complete else "partial" if e.tmp else "incomplete"
        print(f"{e.step:>10}  {status:<10}  {size / 2**20:>7.1f} MB  {e.path}")
    print("partial: a save in progress or killed; incomplete: no COMPLETE marker. Only complete ones are loaded.")


def sampling_model(path: str, device: torch.device):
    """(model in eval mode, tokenizer or None, why there is none) from a Hugging Face `afmoe` folder, a checkpoint
    directory or a checkpoint root. The tokenizer has encode, decode and n_vocab: a folder's tokenizer.json through
    transformers' AutoTokenizer, a checkpoint's tiktoken encoding (its train.tokenizer)."""
    import data
    from model import Transformer

    hf_dir = os.path.isfile(os.path.join(path, "config.json")) and "model_type" in _read_json(path, "config.json")
    if hf_dir:
        cfg = hf_config(path)
    else:
        path = _resolve(path)
        saved = _read_json(path, "config.json")
        if not isinstance(saved.get("model"), dict):
            raise ValueError(f"checkpoint {path} has no model config under 'model' in config.json.")
        cfg = ModelConfig(**{k: v for k, v in saved["model"].items() if k in config_fields()})
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    if hf_dir:
        load_hf_into(model, path)
    else:
        with warnings.catch_warnings():  # the world size that wrote it does not matter for sampling
            warnings.simplefilter("ignore")
            load(path, {"model": model})
    model.eval()

    tokenizer, why_none = None, f"{path} names no tokenizer"
    if hf_dir and any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        try:
            from transformers import AutoTokenizer
            hf_tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # a missing package or an unreadable file: the prompt can still be token ids
            why_none = f"the tokenizer in {path} could not be loaded ({type(e).__name__}: {e})"
        else:
            tokenizer = argparse.Namespace(encode=hf_tok.encode, decode=hf_tok.decode, n_vocab=len(hf_tok))
    elif not hf_dir and saved.get("train", {}).get("tokenizer"):
        try:
            tokenizer = data.get_encoding(saved["train"]["tokenizer"])
        except data.DataError as e:
            why_none = str(e)
    return model, tokenizer, why_none


def decodable_ids(tokenizer, vocab_size: int) -> torch.Tensor:
    """[vocab_size] bools, True for the ids `tokenizer` can decode: the embedding is padded past its n_vocab, and
    tiktoken's cl100k_base leaves some ids below n_vocab unassigned (100256 and 100261-100275)."""
    ok = [i < tokenizer.n_vocab for i in range(vocab_size)]
    if hasattr(tokenizer, "decode_single_token_bytes"):  # tiktoken
        for i in range(min(tokenizer.n_vocab, vocab_size)):
            try:
                tokenizer.decode_single_token_bytes(i)
            except KeyError:
                ok[i] = False
    return torch.tensor(ok)


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of token ids such as 1,2,3") from None


def _sample(args):
    checks = [("temperature", args.temperature >= 0, "0 (greedy) or more"),
              ("top_k", args.top_k >= 0, "0 (off) or more"),
              ("top_p", 0 < args.top_p <= 1, "above 0 and at most 1 (1: off)"),
              ("max_new_tokens", args.max_new_tokens >= 1, "at least 1"),
              ("num_samples", args.num_samples >= 1, "at least 1")]
    problems = [f"--{name}={getattr(args, name)} must be {rule}" for name, ok, rule in checks if not ok]
    if problems:
        raise ValueError("; ".join(problems) + ".")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda but this machine has no CUDA device; use --device=cpu.")
    device = torch.device(args.device)
    model, tokenizer, why_none = sampling_model(args.ckpt, device)
    for p in model.parameters():  # the expert bias (a buffer) stays fp32: it decides the routing
        p.data = p.data.to(getattr(torch, args.dtype))
    if args.prompt_ids is not None:
        ids = args.prompt_ids
    elif tokenizer is None:
        raise ValueError(f"{why_none}, so --prompt cannot be encoded; give the prompt as token ids with "
                         f"--prompt_ids=1,2,3.")
    else:
        ids = tokenizer.encode(args.prompt)
    V = model.cfg.vocab_size
    if not ids or not all(0 <= t < V for t in ids):
        raise ValueError(f"the prompt must be 1 or more token ids in [0, {V}), not {ids}; give --prompt or "
                         f"--prompt_ids.")
    torch.manual_seed(args.seed)
    prompt_BT = torch.tensor([ids] * args.num_samples, device=device)
    allowed_V = None if tokenizer is None else decodable_ids(tokenizer, V).to(device)
    t0 = time.time()
    rows = model.generate(prompt_BT, args.max_new_tokens, args.temperature, args.top_k or None, args.top_p,
                          allowed_V).tolist()  # on the host: the time includes the device's work
    seconds = time.time() - t0
    for i, row in enumerate(rows):
        print(f"--- sample {i + 1}/{args.num_samples}")
        print(row if tokenizer is None else tokenizer.decode(row), flush=True)
    print(f"{args.num_samples} x {args.max_new_tokens} tokens in {seconds:.2f}s "
          f"({args.num_samples * args.max_new_tokens / seconds:.1f} tokens/s on {device.type})", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="checkpoint.py", description=__doc__.split("\n\n")[0].strip(),
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{ls,export,sample}")
    p = sub.add_parser("ls", help="list the checkpoints under CKPT_ROOT: step, complete or not, size")
    p.add_argument("ckpt_root", metavar="CKPT_ROOT")
    p = sub.add_parser("export", help="write a Hugging Face afmoe folder from a checkpoint")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a checkpoint directory, or a root (its newest complete one)")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--max_shard_gb", type=float, default=5.0, help="largest safetensors file (default 5 GiB)")
    p.add_argument("--tokenizer", default=None, help="tiktoken name or Hugging Face tokenizer folder to write "
                   "(default: the one the training data was prepared with)")
    p = sub.add_parser("sample", help="generate text from a checkpoint or a Hugging Face afmoe folder")
    p.add_argument("ckpt", metavar="CKPT", help="a checkpoint directory, a root (its newest complete one) or a "
                                               "Hugging Face afmoe folder")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--prompt_ids", type=_token_ids, help="the prompt as token ids (1,2,3), for a model without "
                                                         "a tokenizer; overrides --prompt")
    p.add_argument("--max_new_tokens", type=int, default=64, help="tokens generated after the prompt")
    p.add_argument("--num_samples", type=int, default=1, help="continuations of the prompt, generated as one batch")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy")
    p.add_argument("--top_k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top_p", type=float, default=1.0, help="sample among the most likely tokens whose "
                                                            "probability reaches p (1: all)")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same samples")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights' dtype (default: bfloat16 on cuda, float32 on cpu)")
    args = parser.parse_args(argv)
    if args.command == "sample" and args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    try:
        if args.command == "ls":
            _ls(args.ckpt_root)
        elif args.command == "sample":
            _sample(args)
        else:
            used = export_hf(args.ckpt_dir, args.out_dir, int(args.max_shard_gb * 2**30), args.tokenizer)
            print(f"exported {used} to {args.out_dir}")
    except (OSError, ValueError, KeyError) as e:
        print(f"checkpoint.py: error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
