"""
Checkpoints: save and resume training on any number of ranks, and convert to and from Hugging Face's `afmoe`.

Each rank writes its shards of the tensors with torch.distributed.checkpoint (DCP), keyed by parameter name so any
layout reads them back; the rest is JSON. No RNG state is saved: training draws no random number after initialisation.

    ckpt_root/step_00000010/  .metadata, __0_0.distcp, ...  the tensors (DCP, one data file per rank)
                              config.json, state.json       training config; step, world size, "train", optimizer
                              checksums.json, COMPLETE       every other file's sha256; the marker, written last

    python checkpoint.py ls out/ckpt                         # step, complete or not, size of each checkpoint
    python checkpoint.py export out/ckpt out/hf              # newest complete one (or step_N) -> HF folder + tokenizer
    python checkpoint.py export out/ckpt out/hf --overwrite --dtype=float32  # replace it once complete; full precision
    python checkpoint.py sample out/ckpt --prompt="def " --max_new_tokens=64   # or a Hugging Face folder
    python checkpoint.py sample out/ckpt --threads=1         # on a busy CPU: many times faster

    pending = save("out/ckpt", step, {"model": model, "optim": optim, "train": train_state}, config, async_save=True)
    pending.wait()                                           # before the next save
    path, train_state = load_latest("out/ckpt", {"model": model, "optim": optim, "train": tensors})
    load_hf_into(model, "out/hf")                            # on every rank: each reads only its shards' rows
"""

import argparse
import errno
import fcntl
import hashlib
import itertools
import json
import math
import os
import pickle
import re
import shutil
import socket
import struct
import sys
import time
import warnings
from collections import namedtuple
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, fields, is_dataclass
from functools import cache

if __name__ == "__main__":  # Ctrl-C, even while torch loads (seconds): one line and exit code 130, not a traceback
    def _interrupted(kind, value, traceback):
        if not issubclass(kind, KeyboardInterrupt):
            return sys.__excepthook__(kind, value, traceback)
        print("interrupted: nothing is left half-written; run the command again", file=sys.stderr)
        sys.exit(130)
    sys.excepthook = _interrupted

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

import data
from model import POSITIVE, ModelConfig, Parser, Rule, above, at_least, check, meta_model, option, refuse_unknown
from parallel import gathered, local, rank_world

# Single-process DCP calls are deliberate here (world size 1, export); DCP warns about every one of them.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")

# --- Our state-dict names <-> transformers' AfmoeForCausalLM names

_PROJ = ("gate_proj", "up_proj", "down_proj")
_LAYER_KEYS = {  # ours -> transformers', inside layer i
    "attn_norm.weight": "input_layernorm.weight", "attn_post_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_mlp_layernorm.weight", "ffn_post_norm.weight": "post_mlp_layernorm.weight",
    **{f"attn.{p}.weight": f"self_attn.{p}.weight"
       for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "q_norm", "k_norm")},
    **{f"ffn.{p}.weight": f"mlp.{p}.weight" for p in _PROJ},
    **{f"ffn.shared.{p}.weight": f"mlp.shared_experts.{p}.weight" for p in _PROJ},
    "ffn.router.weight": "mlp.router.gate.weight", "ffn.expert_bias": "mlp.expert_bias",
    "ffn.experts.gate_up_proj": "mlp.experts.gate_up_proj", "ffn.experts.down_proj": "mlp.experts.down_proj"}
_TOP_KEYS = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}


def _hf_name(ours: str) -> str:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", ours)
    if m and m.group(2) in _LAYER_KEYS:
        return f"model.layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"
    if ours not in _TOP_KEYS:
        raise KeyError(f"state-dict key {ours!r} has no Hugging Face counterpart")
    return _TOP_KEYS[ours]


def to_hf_state_dict(sd: dict) -> dict:
    """Our state dict with transformers' AfmoeForCausalLM names (the same tensors)."""
    return {_hf_name(k): v for k, v in sd.items()}


def _hf_pieces(ours: str, shape: tuple, per_expert: bool) -> list[tuple[str, tuple]]:
    """[(Hugging Face name, its index in our tensor of `shape`: an int or a slice per dim)]. transformers stacks routed
    experts only in memory; on disk (`per_expert`) each has a gate_proj, up_proj and down_proj, gate then up for all."""
    whole = tuple(slice(0, n) for n in shape)
    name = _hf_name(ours)
    m = re.fullmatch(r"(.+\.experts)\.(gate_up_proj|down_proj)", name)
    if not per_expert or m is None:
        return [(name, whole)]
    if m.group(2) == "down_proj":
        return [(f"{m.group(1)}.{e}.down_proj.weight", (e, *whole[1:])) for e in range(shape[0])]
    half = shape[1] // 2  # transformers' gate_up_proj[e] is gate_proj over up_proj
    return [(f"{m.group(1)}.{e}.{proj}.weight", (e, rows, whole[2])) for proj, rows in
            (("gate_proj", slice(0, half)), ("up_proj", slice(half, shape[1]))) for e in range(shape[0])]


def _piece_shape(index: tuple) -> tuple:
    """The shape of the piece at `index` (an int drops its dim: one expert of the stack)."""
    return tuple(ix.stop - ix.start for ix in index if isinstance(ix, slice))


def _overlap(index: tuple, offsets, sizes) -> tuple[tuple, tuple] | None:
    """Where the piece at `index` meets our block at offsets/sizes: (index into the block, into the piece), or None."""
    into_block, into_piece = [], []
    for ix, o, s in zip(index, offsets, sizes):
        start, stop = (ix, ix + 1) if isinstance(ix, int) else (ix.start, ix.stop)
        lo, hi = max(start, o), min(stop, o + s)
        if lo >= hi:
            return None
        into_block.append(lo - o if isinstance(ix, int) else slice(lo - o, hi - o))
        if isinstance(ix, slice):
            into_piece.append(slice(lo - start, hi - start))
    return tuple(into_block), tuple(into_piece)


# --- Files

def _read_json(folder: str, name: str, expected: str = "a checkpoint written by this checkpoint.py") -> dict:
    if not os.path.isfile(os.path.join(folder, name)):
        raise FileNotFoundError(f"{folder} has no {name}; expected {expected}.")
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --- Finding and checking checkpoints

MARKER = "COMPLETE"
CHECKSUMS = "checksums.json"  # {file name: sha256} of every file the save wrote, written just before the marker
_STEP_RE = re.compile(r"step_(\d+)(\.tmp)?")
_Entry = namedtuple("_Entry", "step path complete tmp")  # tmp: a save in progress, or one that was killed


def _scan(ckpt_root: str) -> list[_Entry]:
    found = []
    for name in os.listdir(ckpt_root) if os.path.isdir(ckpt_root) else []:
        m = _STEP_RE.fullmatch(name)
        path = os.path.join(ckpt_root, name)
        if m and os.path.isdir(path):
            tmp = m.group(2) is not None
            found.append(_Entry(int(m.group(1)), path, not tmp and os.path.isfile(os.path.join(path, MARKER)), tmp))
    return sorted(found, key=lambda e: (e.step, e.tmp))


def latest(ckpt_root: str) -> str | None:
    """The newest complete checkpoint directory under ckpt_root, or None."""
    return next((e.path for e in reversed(_scan(ckpt_root)) if e.complete), None)


class CorruptCheckpoint(ValueError):
    """A complete checkpoint with a file missing, truncated, unreadable or changed (the message names it)."""


class SaveFailed(RuntimeError):
    """A save that could not be written; its partial files are removed."""


@contextmanager
def _together(errors: tuple = (OSError,)):
    """Every rank raises the first rank's `errors` from the block: none waits in a collective others skip."""
    failure = None
    try:
        yield
    except errors as e:
        failure = e
    failures = gathered(failure)
    if any(failures):
        raise next(f for f in failures if f)


# DCP pickles .metadata, and unpickling calls whatever a crafted file names: only the globals its metadata holds are
# allowed. Not BytesStorageMetadata: DCP reads a bytes entry with a full pickle, and save() writes none.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties", "StorageMeta",
                                              "ChunkStorageMetadata", "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"}, "torch.serialization": {"_get_layout"},
    "torch": {"Size"}, "pathlib": {"PosixPath", "WindowsPath"}}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not (dtype or name in _METADATA_GLOBALS.get(module, ())):
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata never holds")
        return super().find_class(module, name)


class _Reader(dcp.FileSystemReader):
    def read_metadata(self) -> Metadata:
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
        return metadata


def verify(path: str, contents: bool = True, named: bool = False):
    """Raise CorruptCheckpoint naming complete checkpoint `path`'s first bad file; each rank hashes every world-th
    (`contents`). `named`: the user named it, so files without a sha256 load unchecked, with a warning."""
    def bad(name: str, why: str):
        return CorruptCheckpoint(f"checkpoint {path} is damaged: {os.path.join(path, name)} {why}.")

    def read(name: str) -> dict:
        try:
            value = _read_json(path, name)
        except FileNotFoundError:
            raise bad(name, "is missing") from None
        except ValueError:
            raise bad(name, "is not valid JSON (truncated?)") from None
        if not isinstance(value, dict):
            raise bad(name, f"holds a JSON {type(value).__name__}, not an object")
        return value

    rank, world = rank_world()
    with _together((CorruptCheckpoint,)):
        read("config.json")
        state = read("state.json")
        if not (isinstance(state.get("step"), int) and isinstance(state.get("train"), dict)):
            raise bad("state.json", "lacks its integer step or its train state")
        try:
            storage = _Reader(path).read_metadata().storage_data
        except FileNotFoundError:
            raise bad(".metadata", "is missing") from None
        except Exception as e:  # truncated, or crafted: the allow-list refused it
            raise bad(".metadata", f"cannot be read ({e})") from None
        # Each file must reach the end of its last tensor: sorted by (file, end), the last end of each file stays.
        needed = dict(sorted((info.relative_path, info.offset + info.length) for info in storage.values()))
        for name, size in needed.items():
            if os.path.basename(name) != name:  # DCP would read a tensor from any file a crafted .metadata names
                raise bad(".metadata", f"names {name!r} as a data file, which is not a file of the checkpoint")
            file = os.path.join(path, name)
            have = os.path.getsize(file) if os.path.isfile(file) else None
            if have is None or have < size:
                raise bad(name, "is missing" if have is None else f"is truncated ({have} bytes of {size})")
        has_checksums = os.path.isfile(os.path.join(path, CHECKSUMS))
        checksums = read(CHECKSUMS) if has_checksums else {}
        unchecked = sorted({"config.json", "state.json", ".metadata", *needed} - checksums.keys())
        files = f"{', '.join(unchecked[:3])}{f' and {len(unchecked) - 3} more' if len(unchecked) > 3 else ''}"
        if unchecked and not named:
            why = f"lists no sha256 of {files}" if has_checksums else "is missing"
            raise bad(CHECKSUMS, f"{why}; to load it unchecked, name this checkpoint itself")
        if unchecked and rank == 0:
            warnings.warn(f"checkpoint {path} has no sha256 of {files}: it loads unchecked, as it was named",
                          stacklevel=2)
        for name in sorted(checksums)[rank::world] if contents else []:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise bad(name, "is missing")
            if _sha256(file) != checksums[name]:
                raise bad(name, "has changed since it was written (its sha256 differs)")


def load_latest(ckpt_root: str, state: dict, say=print, up_to: int | None = None) -> tuple[str | None, dict | None]:
    """load() the newest complete checkpoint under ckpt_root (of step <= `up_to`) that loads, saying which it skipped:
    (None, None) when there is none, CorruptCheckpoint when none loads."""
    complete = [e.path for e in reversed(_scan(ckpt_root)) if e.complete and (up_to is None or e.step <= up_to)]
    for path in complete:
        try:
            return path, load(path, state, named=False)
        except CorruptCheckpoint as e:
            say(f"{e} Skipping it, trying the previous checkpoint.")
    if complete:
        raise CorruptCheckpoint(f"none of the {len(complete)} complete checkpoints under {ckpt_root} loads; restore "
                                f"their files or pass --resume=none --overwrite.")
    return None, None


def remove_after(ckpt_root: str, step: int):
    """Delete the checkpoints under ckpt_root after `step`: a rolled back run's, which a restart must not resume."""
    for e in _scan(ckpt_root):
        if e.step > step:
            shutil.rmtree(e.path, ignore_errors=True)


def _resolve(path: str) -> str:
    """A complete checkpoint directory: `path` itself, or the newest complete one when `path` is a root."""
    if os.path.isfile(os.path.join(path, MARKER)):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path {path} does not exist; give a step_N directory or the folder "
                                f"holding them.")
    if _STEP_RE.fullmatch(os.path.basename(os.path.normpath(path))) or os.path.exists(os.path.join(path, ".metadata")):
        newest = latest(os.path.dirname(os.path.normpath(path)))
        raise ValueError(f"checkpoint {path} is incomplete (its save was cut short); use {newest or 'a complete one'} "
                         f"instead.")
    found = latest(path)
    if found is None:
        raise FileNotFoundError(f"{path} holds no complete checkpoint (step_N with a {MARKER} file); train first.")
    return found


def saved_checkpoint(path: str) -> tuple[str, dict, ModelConfig]:
    """(the complete checkpoint _resolve finds, its config.json, its ModelConfig)."""
    path = _resolve(path)
    saved = _read_json(path, "config.json")
    if not isinstance(saved.get("model"), dict):
        raise ValueError(f"checkpoint {path} has no model config under 'model' in config.json.")
    known = {f.name for f in fields(ModelConfig)}
    return path, saved, ModelConfig(**{k: v for k, v in saved["model"].items() if k in known})


# --- Saving and loading training checkpoints

_OPTIONS = dsd.StateDictOptions(flatten_optimizer_state_dict=True)  # keys: "state.<param fqn>.exp_avg", ...


def _tensors_and_rest(values: dict) -> tuple[dict, dict]:
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in values.items() if k not in tensors}


def _state_dicts(state: dict) -> tuple[dict, dict, dict]:
    """`state` as ({"model", "optim", "train": tensors by name, for DCP}, the optimizer's rest, the train state's)."""
    model_sd, optim_sd = dsd.get_state_dict(state["model"], state.get("optim") or [], options=_OPTIONS)
    optim_tensors, optim_rest = _tensors_and_rest(optim_sd)
    train_tensors, train_rest = _tensors_and_rest(state.get("train") or {})
    return {"model": model_sd, "optim": optim_tensors, "train": train_tensors}, optim_rest, train_rest


@cache
def _gloo_group(world_group):
    """For async saves: DCP's background thread must not share the training loop's group, and needs a CPU backend."""
    return dist.new_group(backend="gloo")


def _first_failure(e: BaseException) -> tuple[int | None, str]:
    """(errno, one line) of an exception, or of the first rank's in DCP's CheckpointException."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return getattr(e, "errno", None), f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def _no_space(folder: str, code: int | None, needed: int) -> str | None:
    """'no space left on FOLDER (N MiB free)' if a write of `needed` bytes there failed for lack of room: the errno
    says so, or less is free (torch's zip writer and safetensors drop the errno); else None."""
    while not os.path.isdir(folder):  # a folder the failed write could not create: its disk is the parent's
        folder = os.path.dirname(folder) or "."
    free = shutil.disk_usage(folder).free
    if code == errno.ENOSPC or free < needed:
        return f"no space left on {folder} ({free / 2**20:.1f} MiB free)"
    return None


def abandon(ckpt_root: str, step: int) -> str:
    """Give up the save of `step` (a second Ctrl-C): rank 0 removes its partial folder, which it returns."""
    tmp = os.path.join(ckpt_root, f"step_{step:08d}.tmp")
    if rank_world()[0] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return tmp


@contextmanager
def _failing_cleanly(ckpt_root: str, step: int, needed: int):
    """A failed write of `needed` bytes (a full disk) becomes one SaveFailed sentence; its files are removed."""
    try:
        yield
    except (OSError, CheckpointException) as e:
        code, line = _first_failure(e)
        why = _no_space(ckpt_root, code, needed)  # before the partial files are freed
        tmp = abandon(ckpt_root, step)
        raise SaveFailed(f"{why or f'writing {tmp} failed ({line})'}: checkpoint step_{step:08d} not written (its "
                         f"partial files are removed); the newest checkpoint is still "
                         f"{latest(ckpt_root) or 'none'}.") from None


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, also taking each file's sha256 as soon as it is written (in the background if async)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.checksums = {}

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        for name in {result.storage_data.relative_path for result in written.wait()}:
            self.checksums[name] = _sha256(os.path.join(self.path, name))
        return written

    def finish(self, metadata, results):
        super().finish(metadata, results)
        self.checksums[".metadata"] = _sha256(os.path.join(self.path, ".metadata"))


def _commit(ckpt_root: str, step: int, keep: int, checksums: dict):
    """Rank 0, once every rank has written: write the checksums and the marker, rename step_N.tmp to step_N, and
    delete this run's (config "run_id") complete checkpoints beyond the newest `keep` and older killed saves."""
    def run_id(path: str):  # None for an unreadable config.json
        with suppress(OSError, ValueError):
            return _read_json(path, "config.json").get("run_id")

    final = os.path.join(ckpt_root, f"step_{step:08d}")
    data.write_durably(os.path.join(final + ".tmp", CHECKSUMS), json.dumps(checksums, indent=1, sort_keys=True))
    data.write_durably(os.path.join(final + ".tmp", MARKER), f"{step}\n")
    shutil.rmtree(final, ignore_errors=True)  # an earlier save of the same step, if any
    os.rename(final + ".tmp", final)
    fd = os.open(ckpt_root, os.O_RDONLY)  # make the rename itself durable
    os.fsync(fd)
    os.close(fd)
    entries = _scan(ckpt_root)
    run = run_id(final)
    complete = [e for e in entries if e.complete and e.step != step and run_id(e.path) == run]
    doomed = complete[:max(0, len(complete) - (keep - 1))] if keep > 0 else []
    for e in doomed + [e for e in entries if e.tmp and e.step < step]:  # never a newer save in progress
        shutil.rmtree(e.path, ignore_errors=True)


@dataclass
class PendingSave:
    """A save being written (in the background if async): wait() on every rank completes it or raises SaveFailed."""
    ckpt_root: str
    step: int
    keep: int
    future: Future
    writer: _Writer
    needed: int  # this rank's bytes: less than that free after a failed write is a full disk
    completed: bool = False

    def done(self) -> bool:
        """Whether this rank's files are written (wait() still completes the checkpoint)."""
        return self.future.done()

    def wait(self):
        if self.completed:
            return
        self.completed = True
        with _failing_cleanly(self.ckpt_root, self.step, self.needed):
            self.future.result()
            checksums = gathered(self.writer.checksums)  # also: every rank has written its files
            with _together():  # no rank moves on before the checkpoint is complete for all
                if rank_world()[0] == 0:
                    _commit(self.ckpt_root, self.step, self.keep, {k: v for c in checksums for k, v in c.items()})


def save(ckpt_root: str, step: int, state: dict, config: dict, keep: int = 3, async_save: bool = False) -> PendingSave:
    """Write `ckpt_root/step_{step:08d}` on every rank, keeping this run's newest `keep` (<= 0: all). state: "model",
    "optim" (or None), "train" (alike on all ranks; tensors to DCP, the rest to state.json). Returns once the tensors
    are staged on the CPU (async_save) or written."""
    rank, world = rank_world()
    tensors, optim_rest, train = _state_dicts(state)
    # Bad input fails here, on every rank, before any collective starts.
    if not isinstance(config.get("model"), (dict, ModelConfig, type(None))):
        raise TypeError(f"config['model'] must be a ModelConfig or its dict, not a {type(config['model']).__name__}.")
    texts = {"config.json": _json(config, "config"),
             "state.json": _json({"step": step, "world_size": world, "train": train, "optim": optim_rest}, "train")}
    needed = sum(local(t).nbytes for sd in tensors.values() for t in sd.values())
    tmp = abandon(ckpt_root, step)  # what a killed save of this step left
    writer = _Writer(tmp)
    with _failing_cleanly(ckpt_root, step, needed):
        with _together():
            if rank == 0:
                os.makedirs(tmp)
                for name, text in texts.items():
                    data.write_durably(os.path.join(tmp, name), text)
                    writer.checksums[name] = _sha256(os.path.join(tmp, name))
        if async_save:
            group = _gloo_group(dist.group.WORLD) if dist.is_initialized() else None
            future = dcp.async_save(tensors, storage_writer=writer, process_group=group, no_dist=group is None)
        else:
            future = Future()  # already done
            future.set_result(dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_initialized()))
    pending = PendingSave(ckpt_root, step, keep, future, writer, needed)
    if not async_save:
        pending.wait()
    return pending


def _json(obj, what: str) -> str:
    def refuse(value):
        if is_dataclass(value):  # a ModelConfig
            return asdict(value)
        raise TypeError(f"the checkpoint's {what} holds {value!r} of type {type(value).__name__}, which JSON cannot "
                        f"store; use numbers, strings, lists or dicts (or tensors, in train).")
    return json.dumps(obj, indent=1, default=refuse)


def _expect_tensors(path: str, entries: dict, wanted: dict):
    """Raise CorruptCheckpoint unless each of `wanted`'s tensors is, in .metadata `entries`, a tensor of its shape
    and dtype: DCP reads any other entry (bytes) with a full pickle, which runs the code it names."""
    for key, tensor in wanted.items():
        entry = entries[key]
        is_tensor = type(entry) is TensorStorageMetadata and isinstance(getattr(entry, "size", None), torch.Size)
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        if not (is_tensor and entry.size == tensor.shape and dtype == tensor.dtype):
            what = f"a {dtype} tensor of shape {tuple(entry.size)}" if is_tensor else f"a {type(entry).__name__}"
            raise CorruptCheckpoint(f"checkpoint {path} is damaged: its .metadata holds {key} as {what}, where a "
                                    f"{tensor.dtype} tensor of shape {tuple(tensor.shape)} is expected.")


def load(path: str, state: dict, named: bool = True) -> dict:
    """Load checkpoint `path` (or a root's newest), any layout, in place into state's "model", "optim" and "train"
    tensors on every rank; return the train state's other values. `named`: as verify's, unless `path` is a root."""
    given = path
    path = _resolve(path)
    verify(path, named=named and path == given)  # every file as it was written, or every rank raises CorruptCheckpoint
    saved_state = _read_json(path, "state.json")
    tensors, optim_rest, _ = _state_dicts(state)
    reader = _Reader(path)
    saved_meta = reader.read_metadata().state_dict_metadata
    wanted = {f"{group}.{k}": v for group, sd in tensors.items() for k, v in sd.items()}
    missing = [k for k in wanted if k not in saved_meta]
    if missing:
        groups = {k.split(".")[0] for k in missing}
        hint = ("it was saved without optimizer state; load no optimizer" if groups == {"optim"} else
                "its train state is older JSON; export it and start from that with --init_from_hf"
                if groups == {"train"} else "was it saved from another model?")
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors this run needs, e.g. "
                         f"{', '.join(missing[:3])}; {hint}.")
    _expect_tensors(path, saved_meta, wanted)
    try:
        dcp.load(tensors, storage_reader=reader, no_dist=not dist.is_initialized())
    except CheckpointException as e:  # files whole but unreadable; every rank raises it (DCP gathers failures)
        raise CorruptCheckpoint(f"checkpoint {path} is damaged: its tensors cannot be read "
                                f"({_first_failure(e)[1]}).") from None
    optim_sd = {**tensors["optim"], **{k: saved_state["optim"].get(k, v) for k, v in optim_rest.items()}}
    dsd.set_state_dict(state["model"], state.get("optim") or [], model_state_dict=tensors["model"],
                       optim_state_dict=optim_sd, options=_OPTIONS)
    for name, tensor in tensors["train"].items():  # DCP loaded into copies where the layout differs
        state["train"][name].copy_(tensor)
    return saved_state["train"]


# --- Hugging Face folders: export a checkpoint, import a model to start from

def _refuse_export_dir(out_dir: str, ckpt: str, overwrite: bool):
    out = os.path.realpath(out_dir)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{out_dir} is a file; give a folder to export to.")
    if os.path.commonpath([out, os.path.realpath(ckpt)]) == out:
        raise ValueError(f"{out_dir} holds the checkpoint {ckpt} being exported; export to another folder.")
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if held and not overwrite:
        what = "another model" if "config.json" in held else "other files"
        raise ValueError(f"{out_dir} already holds {what} ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}); "
                         f"pass --overwrite to replace it, or export to another folder.")


@contextmanager
def _export_lock(out_dir: str):
    """Refuses other exports into out_dir while held: a flock on a file beside it, freed however its process dies."""
    parent, base = os.path.split(os.path.abspath(out_dir))
    path = os.path.join(parent, f".{base}.lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace")
            os.close(fd)
            raise ValueError(f"another export into {out_dir} is running ({holder or 'starting'}); wait for it to "
                             f"finish, or export to another folder.") from None
        with suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)  # locked a file its holder removed as it finished: lock the one at `path` now
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        yield
    finally:
        os.unlink(path)
        os.close(fd)


DTYPES = {"bfloat16": "BF16", "float32": "F32"}  # exported dtypes: their safetensors names


def _write_safetensors(path: str, tensors: dict):
    """safetensors' save_file, durably, without first copying every tensor into bytes (a second copy in memory)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": DTYPES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-len(text) % 8)  # the tensors start 8-byte aligned
    data.write_durably(path, struct.pack("<Q", len(text)), text,
                       *(tensors[name].contiguous().view(torch.uint8).numpy() for name in sorted(tensors)))


def _save_pretrained_split(pieces: list, numel: dict, itemsize: int, max_bytes: int) -> list[list]:
    """`pieces` in files as save_pretrained splits them: a new file where the next unit would pass `max_bytes`; a
    unit over it alone, first. A unit is a tensor or one projection of a layer's experts (one storage in memory)."""
    shards, filling, size = [], [], 0
    for _, unit in itertools.groupby(pieces, key=lambda p: re.sub(r"\.experts\.\d+\.", ".experts.", p[0])):
        unit = list(unit)
        nbytes = sum(numel[piece[0]] for piece in unit) * itemsize
        if nbytes > max_bytes:
            shards.append(unit)
            continue
        if size + nbytes > max_bytes:
            shards.append(filling)
            filling, size = [], 0
        filling += unit
        size += nbytes
    return shards + ([filling] if filling else [])


def _model_entries(path: str, cfg: ModelConfig) -> dict:
    """The .metadata entries of the model's tensors by name, each checked to be the tensor `cfg` makes."""
    meta = {n.removeprefix("model."): m for n, m in _Reader(path).read_metadata().state_dict_metadata.items()
            if n.startswith("model.")}
    expected = meta_model(cfg).state_dict()
    missing = [n for n in expected if n not in meta]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} model tensors its config needs, "
                         f"e.g. {', '.join(missing[:3])}.")
    _expect_tensors(path, meta, expected)
    return {n: meta[n] for n in expected}


def export_hf(ckpt_path: str, out_dir: str, max_shard_bytes: int = 5 * 2**30, tokenizer: str | None = None,
              overwrite: bool = False, dtype: str = "bfloat16") -> str:
    """Write what transformers' save_pretrained writes for checkpoint `ckpt_path`'s (or a root's newest) model in
    `dtype`, plus the tokenizer (by default the data's), beside out_dir, moved there once complete. Reads a file's
    tensors at a time, of any layout, cast as they are read; returns the checkpoint."""
    path, saved_config, cfg = saved_checkpoint(ckpt_path)
    out_dir = os.path.normpath(out_dir)
    parent, base = os.path.split(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    with _export_lock(out_dir):
        _refuse_export_dir(out_dir, path, overwrite)
        verify(path, named=path == ckpt_path)  # a damaged checkpoint is one sentence, before anything is written
        tokenizer = tokenizer or saved_config.get("tokenizer", {}).get("source")
        enc = None if tokenizer is None else data.get_encoding(tokenizer)
        if enc is None:
            warnings.warn(f"checkpoint {path} records no tokenizer, so {out_dir} gets none; pass --tokenizer",
                          stacklevel=2)
        elif enc.n_vocab > cfg.vocab_size:
            raise ValueError(f"tokenizer {tokenizer} has {enc.n_vocab} token ids but the model in {path} only "
                             f"{cfg.vocab_size}; pass its data's tokenizer with --tokenizer.")
        meta = _model_entries(path, cfg)
        torch_dtype = getattr(torch, dtype)
        # save_pretrained fills its files in name order, numbers numerically
        natural = sorted(meta, key=lambda n: [(0, int(w)) if w.isdigit() else (1, w) for w in _hf_name(n).split(".")])
        pieces = [(hf, ours, index) for ours in natural
                  for hf, index in _hf_pieces(ours, tuple(meta[ours].size), per_expert=True)]
        numel = {hf: math.prod(_piece_shape(index)) for hf, _, index in pieces}
        shards = _save_pretrained_split(pieces, numel, torch_dtype.itemsize, max_shard_bytes)
        files = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        eos = None if enc is None else enc.eot_token  # transformers' generate stops at this id
        source = {"checkpoint": os.path.abspath(path), "step": _read_json(path, "state.json")["step"],
                  "run_id": saved_config.get("run_id")}
        # transformers 5 reads "dtype"; earlier versions and the engines that use them, "torch_dtype"
        hf = {**cfg.to_hf(), "dtype": dtype, "torch_dtype": dtype, "eos_token_id": eos, "exported_from": source}
        total = sum(numel.values())
        # What killed exports into out_dir left (none is running: this one holds the lock)
        for name in os.listdir(parent):
            if re.fullmatch(rf"\.{re.escape(base)}\.export\.[^.]+\.tmp", name):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        tmp = os.path.join(parent, f".{base}.export.{os.getpid()}.tmp")
        old = os.path.join(parent, f".{base}.old")
        try:
            os.makedirs(tmp)
            for file, shard in zip(files, shards):
                sd = {f"model.{ours}": torch.empty(meta[ours].size, dtype=torch_dtype) for _, ours, _ in shard}
                dcp.load(sd, storage_reader=_Reader(path), no_dist=True)
                _write_safetensors(os.path.join(tmp, file),
                                   {hf_name: sd[f"model.{ours}"][index] for hf_name, ours, index in shard})
                del sd  # before the next file's tensors are allocated
            if len(files) > 1:
                index = {"metadata": {"total_parameters": total, "total_size": total * torch_dtype.itemsize},
                         "weight_map": {hf_name: file for file, shard in zip(files, shards) for hf_name, _, _ in shard}}
                data.write_durably(os.path.join(tmp, "model.safetensors.index.json"),
                                   json.dumps(index, indent=2, sort_keys=True) + "\n")
            data.write_durably(os.path.join(tmp, "config.json"), json.dumps(hf, indent=2))
            data.write_durably(os.path.join(tmp, "generation_config.json"), json.dumps({"eos_token_id": eos}))
            if enc is not None:
                data.save_hf_tokenizer(tokenizer, tmp)
            shutil.rmtree(old, ignore_errors=True)
            if os.path.isdir(out_dir):  # empty, or replaced with overwrite: kept until the new export is in place
                os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            full = _no_space(parent, _first_failure(e)[0], total * torch_dtype.itemsize)
            if full is None:
                raise
            raise SaveFailed(f"{full}: the export to {out_dir} was not written; {out_dir} is unchanged.") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _weight_files(hf_dir: str) -> dict[str, str]:
    if os.path.isfile(os.path.join(hf_dir, "model.safetensors.index.json")):
        weight_map = _read_json(hf_dir, "model.safetensors.index.json")["weight_map"]
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise FileNotFoundError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json.")
    absent = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(hf_dir, f))})
    if absent:
        raise FileNotFoundError(f"{hf_dir} lacks {len(absent)} weight file(s) its index names, "
                                f"e.g. {absent[0]}; copy the folder again.")
    return {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}


def hf_config(hf_dir: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face `afmoe` folder whose config.json and weight files are there."""
    hf = _read_json(hf_dir, "config.json", "a Hugging Face model folder")
    if hf.get("model_type") != "afmoe":
        raise ValueError(f"{hf_dir} holds a model_type={hf.get('model_type')!r} model; only 'afmoe' (Trinity) "
                         f"models can be loaded.")
    _weight_files(hf_dir)
    return ModelConfig.from_hf(hf)


def load_hf_into(model, hf_dir: str) -> int:
    """Fill `model` (plain or sharded, any dtype) from a Hugging Face `afmoe` folder, its routed experts one tensor
    each or stacked. Each rank reads only its own shards' rows; returns the bytes of tensor data it read."""
    hf_config(hf_dir)  # config.json and the weight files the index names are there
    files = _weight_files(hf_dir)
    tensors = dsd.get_model_state_dict(model, options=_OPTIONS)
    with ExitStack() as stack:  # safe_open reads a file's header; get_slice then reads only the bytes asked for
        opened = {path: stack.enter_context(safe_open(path, "pt")) for path in sorted(set(files.values()))}
        on_disk = {name: opened[path].get_slice(name) for name, path in files.items()}
        pieces = {k: _hf_pieces(k, tuple(v.shape), per_expert=_hf_name(k) not in on_disk) for k, v in tensors.items()}
        missing = [name for p in pieces.values() for name, _ in p if name not in on_disk]
        if missing:
            raise ValueError(f"{hf_dir} lacks {len(missing)} tensors this config needs, e.g. {missing[:3]}; is it an "
                             f"afmoe model with the same number of layers and experts?")
        wrong = [f"{name} {tuple(on_disk[name].get_shape())} in the folder vs {_piece_shape(index)} here"
                 for p in pieces.values() for name, index in p
                 if tuple(on_disk[name].get_shape()) != _piece_shape(index)]
        if wrong:
            raise ValueError(f"{hf_dir} holds tensors of other shapes ({'; '.join(wrong[:3])}); drop the flags that "
                             f"change this model's config.")
        read = 0
        for k, v in tensors.items():
            chunk = v.__create_chunk_list__()[0] if isinstance(v, DTensor) else None  # this rank's block of v
            offsets, sizes = (chunk.offsets, chunk.sizes) if chunk else ((0,) * v.dim(), tuple(v.shape))
            block = torch.empty(sizes, dtype=v.dtype)
            for name, index in pieces[k]:
                where = _overlap(index, offsets, sizes)
                if where is not None:
                    part = on_disk[name][where[1]]
                    read += part.nbytes
                    block[where[0]] = part
            block = block.to(local(v).device)
            tensors[k] = (DTensor.from_local(block, v.device_mesh, v.placements, shape=v.shape, stride=v.stride())
                          if chunk else block)
    dsd.set_model_state_dict(model, tensors, options=_OPTIONS)
    return read


# --- Command line

def _ls(ckpt_root: str):
    if not os.path.isdir(ckpt_root):
        raise FileNotFoundError(f"checkpoint root {ckpt_root} does not exist.")
    entries = _scan(ckpt_root)
    print(f"{'step':>10}  {'status':<10}  {'size':>10}  path" if entries else f"no checkpoints under {ckpt_root}")
    for e in entries:
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(e.path) for f in fs)
        status = "complete" if e.complete else "partial" if e.tmp else "incomplete"
        if e.complete:
            try:
                verify(e.path, contents=False)  # quick: the files' bytes are checked when one is loaded
            except CorruptCheckpoint:
                status = "damaged"
        print(f"{e.step:>10}  {status:<10}  {size / 2**20:>7.1f} MB  {e.path}")
    if entries:
        print("partial: a save running or killed; incomplete: no COMPLETE marker; damaged: a file bad or missing")


def sampling_model(path: str, device: torch.device):
    """(model in eval mode, tokenizer or None, why none) of a Hugging Face `afmoe` folder or a checkpoint or root."""
    if os.path.isfile(os.path.join(path, "config.json")) and "model_type" in _read_json(path, "config.json"):
        model = meta_model(hf_config(path)).to_empty(device=device)
        load_hf_into(model, path)
        tokenizer = path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    else:
        given = path  # a checkpoint the user names may lack checksums; a root's newest may not
        path, saved, cfg = saved_checkpoint(path)
        model = meta_model(cfg).to_empty(device=device)
        load(given, {"model": model})
        tokenizer = saved.get("tokenizer", {}).get("source")  # the data's, as export_hf reads it
    if not tokenizer:
        return model.eval(), None, f"{path} names no tokenizer"
    try:
        return model.eval(), data.get_encoding(tokenizer), None
    except data.DataError as e:  # the prompt can still be token ids
        return model.eval(), None, str(e)


def up_to_stop(row: list[int], start: int, stop_id: int | None) -> list[int]:
    """row through the first stop_id at or after `start` (a sample through its end-of-text), else all."""
    return row[:row.index(stop_id, start) + 1] if stop_id in row[start:] else row


def decodable_ids(tokenizer, vocab_size: int) -> torch.Tensor:
    """[vocab_size] bools: the ids `tokenizer` assigns (not padding, nor gaps: cl100k_base's 100256, 100261-100275)."""
    allowed_V = torch.zeros(vocab_size, dtype=torch.bool)
    allowed_V[[i for i in data.vocabulary(tokenizer).values() if i < vocab_size]] = True
    return allowed_V


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of token ids such as 1,2,3") from None


@dataclass
class Sampling:
    """The sample command's flags."""
    prompt: str = option("", "text to continue")
    prompt_ids: list | None = option(None, "the prompt as token ids (1,2,3) in place of --prompt (no tokenizer)",
                                     parse=_token_ids)
    temperature: float = option(0.8, "softmax temperature; 0 is greedy", at_least(0, "0 (greedy) or more"))
    top_k: int = option(50, "sample among the k most likely tokens (0: all)", at_least(0, "0 (off) or more"))
    top_p: float = option(1.0, "sample among the most likely tokens whose probability reaches p (1: all)",
                          Rule(lambda v, _: 0 < v <= 1, "above 0 and at most 1 (1: off)"))
    max_new_tokens: int = option(64, "tokens generated after the prompt", POSITIVE)
    num_samples: int = option(1, "continuations of the prompt, generated as one batch", POSITIVE)
    seed: int = option(0, "the same seed gives the same samples")
    threads: int = option(0, "CPU threads (0: one per core); on a busy machine 1 can be many times faster",
                          at_least(0, "0 (torch's default) or more"))


def _sample(args):
    opt = Sampling(**{f.name: getattr(args, f.name) for f in fields(Sampling) if f.name in args})
    check(opt)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda but this machine has no CUDA device; use --device=cpu.")
    device = torch.device(args.device)
    if opt.threads:
        torch.set_num_threads(opt.threads)
    model, tokenizer, why_none = sampling_model(args.ckpt, device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    for p in model.parameters():  # the expert bias (a buffer) stays fp32: it decides the routing
        p.data = p.data.to(dtype)
    if opt.prompt_ids is None and tokenizer is None:
        raise ValueError(f"{why_none}, so --prompt cannot be encoded; give token ids with --prompt_ids=1,2,3.")
    # "<|endoftext|>" in a prompt is that token, the boundary before a new document, as in the training data
    ids = tokenizer.encode(opt.prompt, allowed_special="all") if opt.prompt_ids is None else opt.prompt_ids
    V = model.cfg.vocab_size
    if not ids or not all(0 <= t < V for t in ids):
        raise ValueError(f"the prompt must be 1 or more token ids in [0, {V}), not {ids}; give --prompt or "
                         f"--prompt_ids.")
    torch.manual_seed(opt.seed)
    allowed_V = None if tokenizer is None else decodable_ids(tokenizer, V).to(device)
    stop_id = getattr(tokenizer, "eot_token", None)  # a row ends at its tokenizer's end-of-text, shown
    t0 = time.time()
    rows = model.generate(torch.tensor([ids] * opt.num_samples, device=device), opt.max_new_tokens,
                          opt.temperature, opt.top_k or None, opt.top_p, allowed_V, stop_id).tolist()  # waits
    seconds = time.time() - t0
    steps = len(rows[0]) - len(ids)
    for i, row in enumerate(rows):
        row = up_to_stop(row, len(ids), stop_id)
        print(f"--- sample {i + 1}/{opt.num_samples}")
        print(row if tokenizer is None else tokenizer.decode(row), flush=True)
    on = f"{device.type}, {torch.get_num_threads()} threads" if device.type == "cpu" else device.type
    print(f"{opt.num_samples} x {steps} tokens in {seconds:.2f}s ({opt.num_samples * steps / seconds:.1f} tokens/s "
          f"on {on}){'; every sample reached end-of-text' if steps < opt.max_new_tokens else ''}", file=sys.stderr)


def main(argv=None) -> int:
    parser = Parser(prog="checkpoint.py", description=__doc__.split("\n\n")[0].strip(), allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{ls,export,sample}")
    sub.add_parser("ls", help="list the checkpoints under CKPT_ROOT: step, complete or not, size").add_argument(
        "ckpt_root", metavar="CKPT_ROOT")
    p = sub.add_parser("export", help="write a Hugging Face afmoe folder from a checkpoint")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a checkpoint directory, or a root (its newest complete one)")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--max_shard_gb", type=above(0).parse(float), default=5.0, help="largest file (default 5 GiB)")
    p.add_argument("--tokenizer", help="tiktoken name or Hugging Face tokenizer folder (default: the data's)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR's files once the new export is complete")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="default: bfloat16, as published")
    p = sub.add_parser("sample", help="generate text from a checkpoint or a Hugging Face afmoe folder")
    p.add_argument("ckpt", metavar="CKPT", help="a checkpoint directory, a root or a Hugging Face afmoe folder")
    p.add_settings(Sampling)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, else float32")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # a flag: named as the subcommand's closest; an extra argument: refused as argparse would
        refuse_unknown(parser, unknown, sub.choices[args.command])
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command == "ls":
            _ls(args.ckpt_root)
        elif args.command == "sample":
            _sample(args)
        else:
            used = export_hf(args.ckpt_dir, args.out_dir, int(args.max_shard_gb * 2**30), args.tokenizer,
                             args.overwrite, args.dtype)
            print(f"exported {used} to {args.out_dir}")
    except (OSError, ValueError, KeyError, SaveFailed) as e:
        print(f"checkpoint.py: error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
