"""Shared fixtures: a small prepared corpus and the flags of a model small enough for many short CPU runs."""

import glob
import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import sysconfig
import traceback
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

import data
import parallel

# The suite checks the CPU paths and runs the same on a GPU machine: this process and every worker it launches use
# the CPU (parallel.use_cuda). tests/test_cuda.py checks CUDA, and --nccl puts the multi-rank layouts on GPUs.
os.environ["NANOTITAN_DEVICE"] = "cpu"

# A structurally complete AfMoE (dense first layer, 3 local + 1 global, shared + routed experts) at toy width.
TINY_MODEL_FLAGS = ["--dim=64", "--n_heads=4", "--n_kv_heads=2", "--head_dim=16", "--dense_hidden=128",
                    "--n_experts=16", "--top_k=4", "--expert_hidden=16", "--window=16"]


# The suite runs on two workers (pytest -n 2 --dist loadfile), each file on one, so a file's module-scoped runs start
# once: the longest files start first, so that both workers finish at about the same time.
LONGEST_FIRST = ("test_resume", "test_elastic", "test_parallel", "test_data", "test_health", "test_muon")


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(Path(str(item.fspath)).stem, len(order)))  # stable: a file keeps its order


def ranks_device(config, nproc: int) -> torch.device:
    """Where a multi-rank test's ranks run: gloo on CPU, or with --nccl one GPU each (skipped without nproc GPUs)."""
    if not config.getoption("--nccl"):
        return torch.device("cpu")
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"--nccl needs {nproc} GPUs, one per rank; this machine has {torch.cuda.device_count()}")
    return torch.device("cuda")


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """About 100k cl100k tokens of standard-library source, prepared once per test session."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "json", "*.py")) + glob.glob(os.path.join(stdlib, "email", "*.py")))
    out = str(tmp_path_factory.mktemp("corpus"))
    data.prepare(files, out_dir=out, val_fraction=0.1, workers=1, quiet=True)
    return out


def crafted_metadata(creates: str) -> bytes:
    """A .metadata crafted to run code: pickle.load of it calls open(creates, "w"), so the file shows that it ran."""
    class CreatesAFile:
        def __reduce__(self):
            return open, (creates, "w")

    return pickle.dumps(CreatesAFile())


def rewrite_metadata(ckpt, change):
    """Rewrite checkpoint `ckpt`'s .metadata as change(metadata, its first .distcp file) leaves it, recomputing the
    checksums as a crafter would: only the loader's own checks of the metadata stand guard."""
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # a file this test suite wrote
    change(metadata, min(glob.glob(os.path.join(ckpt, "*.distcp"))))
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    checksums = Path(ckpt) / "checksums.json"
    checksums.write_text(json.dumps({name: hashlib.sha256((Path(ckpt) / name).read_bytes()).hexdigest()
                                     for name in json.loads(checksums.read_text())}))


def craft_bytes_entry(ckpt, key: str, creates: str):
    """Make tensor `key` of checkpoint `ckpt` a bytes entry, which DCP reads with a full pickle: crafted_metadata's
    pickle, appended to a .distcp file. Its metadata holds allowed classes only, and the entry the tensor's size and
    dtype, so a check of shapes alone lets it through."""
    def change(metadata, distcp):
        tensor = metadata.state_dict_metadata[key]
        entry = BytesStorageMetadata()
        entry.size, entry.properties = tensor.size, tensor.properties
        metadata.state_dict_metadata[key] = entry
        payload = crafted_metadata(creates)
        offset = os.path.getsize(distcp)
        with open(distcp, "ab") as f:
            f.write(payload)
        metadata.storage_data[MetadataIndex(key)] = _StorageInfo(os.path.basename(distcp), offset, len(payload))

    rewrite_metadata(ckpt, change)


def run_worker(fn, *args):
    """Entry point of a torchrun worker in a test file: fn(*args), then parallel.finish (no interpreter shutdown, see
    there). An exception still fails the rank, with its traceback."""
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
        parallel.finish(1)
    parallel.finish(0)


def torchrun(nproc: int, *args: str, timeout_s: int = 400, device: torch.device = torch.device("cpu")) -> str:
    """Run `python -m torch.distributed.run --nproc_per_node=nproc ARGS` from the repository root, on gloo ranks
    (NCCL ones on a cuda `device`), and return its output; kill the whole process group if it hangs, so nothing is
    left running, and fail with the end of its output."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "NANOTITAN_DEVICE": device.type}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{nproc}-rank run did not finish in {timeout_s}s:\n{output[-6000:]}")
    assert proc.returncode == 0, f"{nproc}-rank run failed:\n{output[-6000:]}"
    return output
