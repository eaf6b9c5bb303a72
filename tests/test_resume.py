"""Fault tolerance end to end, on CPU in fp32 over gloo: train.py killed, crashed, preempted, stalled and resumed.

    python -m pytest tests/test_resume.py -q

Each test launches train.py as a user would (plain python, or torchrun with 4 ranks) on the tiny corpus and checks
what the user relies on: the losses of a resumed run are those of an uninterrupted one (bitwise on the same layout,
within fp32 rounding on another), the same tokens are read, a killed save never becomes the checkpoint to resume
from, and every failure ends the process with a clear exit code. One uninterrupted 4-rank run is the reference for
the crash and resharding tests. The NaN guard is tested in test_train.py.
"""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import checkpoint
import data
import train
import watch
from conftest import TINY_MODEL_FLAGS, craft_bytes_entry, crafted_metadata
from model import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parent.parent
# No TORCH_DISABLE_SHARE_RDZV_TCP_STORE: torchrun restarts must work as the README launches them.
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
FOUR_RANKS = ["--dp_replicate=2", "--ep=2", "--micro_batch=1"]  # world 4: HSDP 2 x 2 with the experts split over 2
# The 100k-token vocabulary makes the embedding and head most of the model: half the width halves the bytes every
# step gathers and every checkpoint writes.
MODEL_FLAGS = [*TINY_MODEL_FLAGS, "--dim=32"]
EXACT = ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "lr", "tokens_sum")  # per-step values, no timings


def args(corpus_dir, out_dir, *extra):
    return [f"--data={corpus_dir}", f"--out_dir={out_dir}", "--seq_len=32", "--global_batch=4", "--micro_batch=2",
            "--log_every=1", "--eval_every=0", "--eval_batches=1", "--sample_tokens=0", "--warmup_steps=2",
            "--lr=1e-2", *MODEL_FLAGS, *extra]


def command(argv, nproc=1, restarts=0):
    if nproc == 1:
        return [sys.executable, "train.py", *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={restarts}", "train.py", *argv]


@contextlib.contextmanager
def started(argv, log: Path, nproc=1, restarts=0):
    """train.py running in its own process group, its stdout and stderr in log.out / log.err; whatever is left of
    the group (a torchrun worker, a hung rank) is killed on the way out."""
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        proc = subprocess.Popen(command(argv, nproc, restarts), cwd=ROOT, env=ENV, stdout=out, stderr=err,
                                start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run(argv, log: Path, nproc=1, restarts=0, timeout=240) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a train.py run that must end within timeout seconds."""
    with started(argv, log, nproc, restarts) as proc:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(argv)} did not finish in {timeout}s:\n{Path(f'{log}.err').read_text()[-4000:]}")
    return proc.returncode, Path(f"{log}.out").read_text(), Path(f"{log}.err").read_text()


def run_here(argv, capsys) -> str:
    """train.main in this process (no interpreter to start), on one thread like the launched runs (another thread
    count sums in another order): its stdout."""
    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.main(*train.parse_args(argv))
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


def rows(out_dir) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def last_rows(out_dir) -> dict[int, dict]:
    """The row logged for each step."""
    return {r["step"]: r for r in rows(out_dir)}


def tensors(ckpt: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer), read into plain tensors by one process."""
    meta = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
          if isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
    return sd


def train_state(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "state.json")) as f:
        return json.load(f)["train"]


@pytest.fixture(scope="module")
def reference(corpus_dir, tmp_path_factory):
    """20 uninterrupted steps on 4 ranks; checkpoints at steps 10 and 20."""
    out = tmp_path_factory.mktemp("reference")
    code, _, err = run(args(corpus_dir, out, "--steps=20", "--ckpt_every=10", *FOUR_RANKS), out / "log", nproc=4)
    assert code == 0, err[-4000:]
    assert sorted(last_rows(out)) == list(range(1, 21))
    return out


# --- a rank dies: torchrun restarts the job, which resumes by itself and ends as if nothing had happened

def test_crash_restart_resumes_bitwise(reference, corpus_dir, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = run(args(corpus_dir, out, "--steps=20", "--ckpt_every=5", "--drill=crash@12",
                                 *FOUR_RANKS), tmp_path / "log", nproc=4, restarts=1)
    assert code == 0, err[-4000:]
    assert "crash drill: rank 3 exits abruptly after step 12" in err
    # Step 10's checkpoint is written in the background and marked complete as soon as every rank has written it
    # (here during step 11), not at the next save: the crash after step 12 loses 2 steps, not 7.
    assert f"resumed from {out}/checkpoints/step_00000010 at step 10" in stdout
    ref = last_rows(reference)
    logged = rows(out)
    assert [r["step"] for r in logged] == list(range(1, 21))  # steps 11 and 12 of before the crash were dropped
    for r in logged:
        assert {k: r[k] for k in EXACT} == {k: ref[r["step"]][k] for k in EXACT}, r["step"]
    # The final model, optimizer moments, expert biases and balancing momentum are bit for bit the reference's.
    final_ref, final = reference / "checkpoints" / "step_00000020", out / "checkpoints" / "step_00000020"
    want, got = tensors(str(final_ref)), tensors(str(final))
    assert want.keys() == got.keys() and any(k.startswith("optim.") for k in got)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert ({k: v for k, v in train_state(str(final)).items() if k != "run_id"} ==  # each launch is its own run
            {k: v for k, v in train_state(str(final_ref)).items() if k != "run_id"})


# --- resharding: a 4-rank checkpoint resumed on 2 ranks and on 1 process

# Another layout sums the same numbers in another order (gradients over 2 ranks or 1 process and their
# micro-batches, not 4 ranks), so the losses may differ by fp32 rounding, which AdamW can amplify in elements with
# tiny gradients (see test_parallel.py). Measured over the 10 resumed steps: at most 1 ulp of the loss (9.5e-7 at
# ~9); the bound allows 100 ulps.
LOSS_TOL = 1e-4


@pytest.mark.parametrize("nproc,layout", [(2, ["--ep=2", "--micro_batch=1"]), (1, ["--micro_batch=2"])],
                         ids=["2ranks", "1process"])
def test_resume_on_another_world_size(reference, corpus_dir, tmp_path, capsys, nproc, layout):
    out = tmp_path / "run"
    ckpt = reference / "checkpoints" / "step_00000010"
    argv = args(corpus_dir, out, "--steps=20", f"--resume={ckpt}", *layout)
    if nproc == 1:
        stdout = run_here(argv, capsys)
    else:
        code, stdout, err = run(argv, tmp_path / "log", nproc=nproc)
        assert code == 0, err[-4000:]
    assert f"resumed from {ckpt} at step 10" in stdout
    ref, got = last_rows(reference), last_rows(out)
    assert sorted(got) == list(range(11, 21))
    for step, r in got.items():
        assert r["tokens_sum"] == ref[step]["tokens_sum"], step  # the same global batches
        assert r["lr"] == ref[step]["lr"], step
        assert abs(r["lm_loss"] - ref[step]["lm_loss"]) <= LOSS_TOL, (step, r["lm_loss"], ref[step]["lm_loss"])


# --- a context-extension phase: the run goes on with 4x longer sequences, split over 2 context-parallel ranks

def test_context_extension_resumes_with_longer_sequences_on_cp_ranks(reference, corpus_dir, tmp_path, capsys):
    """The reference's first 10 steps (4 x 32 tokens, 4 ranks), then steps 11-20 at --seq_len=128 on 2 ranks with
    --cp=2 and --global_batch=1 (the same 128 tokens a step): refused unless --allow_changed=seq_len; then the LR
    schedule goes on as planned, each step is logged once, and every step reads 128 tokens in one sequence."""
    out = tmp_path / "run"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("lease.json", "step_00000020", "log.*"))
    longer = args(corpus_dir, out, "--steps=20", "--seq_len=128", "--global_batch=1", "--micro_batch=1")
    with pytest.raises(ValueError, match=r"--seq_len=128 differs from checkpoint .*step_00000010's 32, which fixes "
                                         r"the data order; resume with --seq_len=32 or pass --allow_changed=seq_len"):
        train.main(*train.parse_args(longer))
    code, stdout, err = run([*longer, "--cp=2", "--allow_changed=seq_len"], tmp_path / "log", nproc=2)
    assert code == 0, err[-4000:]
    assert f"resumed from {out}/checkpoints/step_00000010 at step 10" in stdout
    assert "seq_len: 32 -> 128" in stdout and "global_batch: 4 -> 1" in stdout
    assert "CP groups (cp=2, the chunks of a row): [0-1]" in stdout
    ref = last_rows(reference)
    logged = rows(out)
    assert [r["step"] for r in logged] == list(range(1, 21))  # the first phase's steps 11-20 were dropped
    for r in logged:
        assert r["lr"] == ref[r["step"]]["lr"], r["step"]  # the cosine schedule over 20 steps, uninterrupted
        assert sum(r["tokens_by_source"].values()) == 128
        assert r["loss"] == ref[r["step"]]["loss"] if r["step"] <= 10 else math.isfinite(r["loss"])
    assert json.loads((out / "config.json").read_text())["train"]["seq_len"] == 128


# --- kill -9 in the middle of a checkpoint write

def test_kill_during_checkpoint_write_resumes_from_the_previous(corpus_dir, tmp_path, capsys):
    def mid_write(tmp: Path) -> bool:  # data files being written, the metadata (written last) not yet there
        with contextlib.suppress(FileNotFoundError):
            names = os.listdir(tmp)
            return any(n.endswith(".distcp") for n in names) and ".metadata" not in names
        return False

    for attempt in range(3):  # the kill may land just after the write; then try again
        out = tmp_path / f"run{attempt}"
        second = out / "checkpoints" / "step_00000004.tmp"
        with started(args(corpus_dir, out, "--steps=6", "--ckpt_every=2"), tmp_path / f"log{attempt}") as proc:
            deadline = time.time() + 120
            while proc.poll() is None and time.time() < deadline and not mid_write(second):
                time.sleep(0.002)
            caught = mid_write(second)
            os.killpg(proc.pid, signal.SIGKILL)
        if caught and not (out / "checkpoints" / "step_00000004").exists():
            break
    else:
        pytest.fail("the second checkpoint write was never caught mid-way")
    assert checkpoint.latest(str(out / "checkpoints")) == str(out / "checkpoints" / "step_00000002")
    before = last_rows(out)

    stdout = run_here(args(corpus_dir, out, "--steps=6", "--ckpt_every=2"), capsys)  # --resume=auto
    assert f"resumed from {out}/checkpoints/step_00000002 at step 2" in stdout
    assert checkpoint.latest(str(out / "checkpoints")) == str(out / "checkpoints" / "step_00000006")
    assert not any(name.endswith(".tmp") for name in os.listdir(out / "checkpoints"))  # the leftovers are gone
    after = last_rows(out)
    assert sorted(after) == list(range(1, 7))
    for step in before.keys() & {3, 4}:  # logged before the kill and again after the resume: the same numbers
        assert {k: after[step][k] for k in EXACT} == {k: before[step][k] for k in EXACT}, step


# --- SIGTERM: finish the step, checkpoint it, exit 0; the next launch continues from there

def signal_mid_run(run_args: list[str], out: Path, log: Path, sig: int) -> tuple[int, str, str, int]:
    """Start train.py, send `sig` once two steps are logged; (exit code, stdout, stderr, last logged step)."""
    with started(run_args, log) as proc:
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline and len(rows(out)) < 2:
            time.sleep(0.01)
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
    return code, Path(f"{log}.out").read_text(), Path(f"{log}.err").read_text(), rows(out)[-1]["step"]


def test_sigterm_checkpoints_and_exits_zero_then_resumes(corpus_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, err, stopped = signal_mid_run(args(corpus_dir, out, "--steps=12"), out, tmp_path / "log",
                                                signal.SIGTERM)
    assert code == 0, err[-4000:]
    assert 2 <= stopped < 12
    assert f"preempted: checkpoint written at step {stopped}; exiting" in stdout
    assert checkpoint.latest(str(out / "checkpoints")) == str(out / "checkpoints" / f"step_{stopped:08d}")

    stdout = run_here(args(corpus_dir, out, "--steps=12"), capsys)
    assert f"resumed from {out}/checkpoints/step_{stopped:08d} at step {stopped}" in stdout
    assert [r["step"] for r in rows(out)] == list(range(1, 13))  # each step logged once: none lost, none repeated


# --- the watchdog: a hung step ends the process with its stacks

def test_watchdog_dumps_stacks_and_exits_3(corpus_dir, tmp_path):
    t0 = time.time()
    code, _, err = run(args(corpus_dir, tmp_path, "--steps=5", "--drill=stall@2", "--step_timeout=3"),
                       tmp_path / "log", timeout=90)
    assert code == 3, err[-4000:]
    assert time.time() - t0 < 60  # the stall itself would last 90 s
    assert "watchdog: no step completed for 3s after step 2" in err
    assert "Thread 0x" in err and 'File "' in err and "train.py" in err  # faulthandler's stacks, the hung frame


@pytest.mark.parametrize("failure", ["stopped", "bad data"])
def test_main_inside_a_program_leaves_no_watchdog_or_signal_handlers(corpus_dir, tmp_path, failure):
    """train.main called from another program (a test, a notebook) gives the signals back and stops its watchdog,
    which would otherwise end that program with exit code 3 once step_timeout passes; also when the run fails: it
    stops itself, or a step reads a token id beyond the vocabulary."""
    signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    before = [signal.getsignal(s) for s in signals]
    threads = set(threading.enumerate())
    flags = ["--drill=nan@0", "--spike_rollback=1", "--max_rollbacks=0"]
    error = "1 bad steps within 50 steps"
    if failure == "bad data":
        corpus_dir = shutil.copytree(corpus_dir, tmp_path / "data")
        manifest = data.load_manifest(str(corpus_dir))
        shard = corpus_dir / manifest["splits"]["train"][0]["file"]
        np.memmap(shard, np.dtype(manifest["dtype"]), "r+", offset=data.HEADER_BYTES)[:] = 200_000
        flags = []
        error = "holds token id 200000"
    with pytest.raises((watch.Stopped, data.DataError), match=error):
        train.main(*train.parse_args(args(corpus_dir, tmp_path / "out", "--steps=2", *flags)))
    assert [signal.getsignal(s) for s in signals] == before
    watchdogs = [t for t in threading.enumerate() if t not in threads and t.name.endswith("(watch)")]
    for t in watchdogs:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in watchdogs)


# --- export to Hugging Face and start a run from the export

@pytest.fixture(scope="module")
def short_run(corpus_dir, tmp_path_factory):
    """3 steps in this process; the final checkpoint is step 3."""
    out = tmp_path_factory.mktemp("short")
    train.main(*train.parse_args(args(corpus_dir, out, "--steps=3")))
    return out


def test_export_loads_in_transformers_and_starts_a_run(short_run, corpus_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_dir = tmp_path / "hf"
    result = subprocess.run([sys.executable, "checkpoint.py", "export", str(short_run / "checkpoints"), str(hf_dir),
                             "--dtype=float32"],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "step_00000003" in result.stdout

    ckpt = str(short_run / "checkpoints" / "step_00000003")
    with open(os.path.join(ckpt, "config.json")) as f:
        ours = Transformer(ModelConfig(**json.load(f)["model"]))
    checkpoint.load(ckpt, {"model": ours})  # straight from the training checkpoint, not through the export
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager")
    tokens_BT, targets_BT, _ = data.DataLoader(corpus_dir, "train", 32, 4, seed=0).batch(0)  # the first batch
    with torch.no_grad():
        logits_BTV = ours.eval()(tokens_BT)
        hf_logits_BTV = hf.eval()(tokens_BT).logits.float()
    assert (logits_BTV - hf_logits_BTV).abs().max().item() <= 1e-4
    hf_loss = torch.nn.functional.cross_entropy(hf_logits_BTV.flatten(0, 1), targets_BT.flatten()).item()

    # A run from the export: no model flags (the architecture comes from the folder), one micro-batch and no
    # document mask, so its first loss is exactly the loss computed above.
    tc, overrides = train.parse_args([f"--data={corpus_dir}", f"--out_dir={tmp_path / 'run'}", "--seq_len=32",
                                      "--global_batch=4", "--micro_batch=4", "--doc_mask=false", "--steps=1",
                                      "--eval_every=0", "--eval_batches=1", "--sample_tokens=0",
                                      f"--init_from_hf={hf_dir}"])
    first_loss = train.main(tc, overrides)["first_loss"]
    assert abs(first_loss - hf_loss) <= 1e-4, (first_loss, hf_loss)
    assert abs(first_loss - math.log(ours.cfg.vocab_size)) > 0.1  # trained weights, not a fresh initialisation


# --- a checkpoint of another architecture is refused with the differing fields

def test_resume_with_another_architecture_fails_in_one_line(short_run, corpus_dir, tmp_path):
    code, _, err = run(args(corpus_dir, tmp_path, "--steps=3", f"--resume={short_run / 'checkpoints'}",
                            "--n_layers=2", "--expert_hidden=8"), tmp_path / "log")
    assert code == 2
    assert err.splitlines() == [
        f"error: checkpoint {short_run}/checkpoints/step_00000003 has another model architecture (n_layers: 4 in the "
        f"checkpoint vs 2 now; expert_hidden: 16 in the checkpoint vs 8 now); resume with its model config or start a "
        f"new run."]


def test_resume_from_a_crafted_checkpoint_runs_no_code(short_run, corpus_dir, tmp_path):
    ckpt = shutil.copytree(short_run / "checkpoints" / "step_00000003", tmp_path / "step_00000003")
    created = tmp_path / "created_by_the_pickle"
    (ckpt / ".metadata").write_bytes(crafted_metadata(str(created)))
    (ckpt / "checksums.json").unlink(missing_ok=True)  # only the unpickler stands guard
    with pytest.raises(checkpoint.CorruptCheckpoint) as damaged:
        train.main(*train.parse_args(args(corpus_dir, tmp_path / "run", "--steps=4", f"--resume={ckpt}")))
    assert not created.exists()
    assert str(damaged.value) == (f"checkpoint {ckpt} is damaged: {ckpt / '.metadata'} cannot be read (it names "
                                  f"io.open, which DCP's metadata never holds).")


def test_a_bytes_entry_runs_no_code_on_resume_and_auto_falls_back(short_run, corpus_dir, tmp_path):
    """A checkpoint whose .metadata (allowed classes only, checksums recomputed) makes a tensor a bytes entry, which DCP
    would read with a full pickle: --resume=PATH says it is damaged, --resume=auto resumes the previous one."""
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(short_run / "checkpoints" / "step_00000003", root / "step_00000003")
    crafted = shutil.copytree(root / "step_00000003", root / "step_00000004")
    created = tmp_path / "created_by_the_pickle"
    craft_bytes_entry(crafted, "model.embed.weight", str(created))
    damaged = (f"checkpoint {crafted} is damaged: {crafted / '.metadata'} cannot be read (it names torch.distributed."
               f"checkpoint.metadata.BytesStorageMetadata, which DCP's metadata never holds).")
    code, _, err = run(args(corpus_dir, tmp_path / "other", "--steps=5", f"--resume={crafted}"), tmp_path / "named")
    assert code == 2 and err.splitlines()[-1] == f"error: {damaged}", err[-4000:]
    code, out, err = run(args(corpus_dir, tmp_path / "run", "--steps=4", "--resume=auto"), tmp_path / "auto")
    assert code == 0, err[-4000:]
    assert f"{damaged} Skipping it, trying the previous checkpoint." in out
    assert sorted(last_rows(tmp_path / "run")) == [4]  # from step 3 on
    assert not created.exists()


def test_a_checkpoint_without_checksums_resumes_only_when_named(short_run, corpus_dir, tmp_path):
    """Without its checksums.json a checkpoint is damaged to --resume=auto, but --resume=PATH of it loads, warning."""
    root = tmp_path / "run" / "checkpoints"
    unchecked = shutil.copytree(short_run / "checkpoints" / "step_00000003", root / "step_00000003")
    (unchecked / "checksums.json").unlink()
    code, _, err = run(args(corpus_dir, tmp_path / "run", "--steps=4", "--resume=auto"), tmp_path / "auto")
    assert code == 2 and err.splitlines()[-1].startswith(f"error: none of the 1 complete checkpoints under {root} "
                                                         f"loads"), err[-4000:]
    code, _, err = run(args(corpus_dir, tmp_path / "named", "--steps=4", f"--resume={unchecked}"), tmp_path / "named")
    assert code == 0, err[-4000:]
    assert f"checkpoint {unchecked} has no sha256 of .metadata, __0_0.distcp, config.json and 1 more: it loads " \
           f"unchecked" in err
    assert sorted(last_rows(tmp_path / "named")) == [4]
