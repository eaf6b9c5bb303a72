"""An unattended run's health: spikes skipped, bursts rolled back, damaged checkpoints caught after a resume,
status.json and the --on_event command.

    python -m pytest tests/test_health.py -q

Each test runs train.py in this process on the tiny corpus with the drills a user rehearses with (--drill=spike@N,
nan@N) and checks what the user relies on. The reference for a skipped batch is a run whose loader itself
leaves that batch out: a skipped spike, or a rolled back burst, must end bitwise as that run does.
"""

import contextlib
import errno
import hashlib
import io
import itertools
import json
import os
import shlex
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

import data
import train
import watch
from conftest import torchrun
from test_resume import EXACT, args, rows, run_here, tensors, train_state

# Spikes judged from the 6th step on, against the last 5; far enough (10 robust deviations) that the tiny runs'
# ordinary steps never trip it, while the drill's 100-fold gradients always do.
GUARD = ["--spike_window=5", "--spike_threshold=10"]


def loader_without(monkeypatch, *skipped: int):
    """Make every training loader read the batches of the data steps not in `skipped`, in order: the run a skipped
    batch must match, made without train.py's own bookkeeping of skipped data."""
    batch = data.DataLoader.batch
    kept = [step for step in range(1000) if step not in skipped]

    def without(self, step):
        return batch(self, kept[step] if self.sources[0].split == "train" else step)

    monkeypatch.setattr(data.DataLoader, "batch", without)


def assert_same_run(out: Path, ref: Path, final: int):
    """Every logged step's losses, gradient norm, LR and tokens, and the final checkpoint's tensors, bit for bit."""
    got = rows(out)
    want = rows(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, final + 1))
    for r, w in zip(got, want):
        assert {k: r[k] for k in EXACT} == {k: w[k] for k in EXACT}, r["step"]
    got_tensors = tensors(str(out / "checkpoints" / f"step_{final:08d}"))
    want_tensors = tensors(str(ref / "checkpoints" / f"step_{final:08d}"))
    assert got_tensors.keys() == want_tensors.keys() and any(k.startswith("optim.") for k in got_tensors)
    for k in want_tensors:
        assert torch.equal(got_tensors[k], want_tensors[k]), k


# --- a single spike: skipped, with its batch

def test_a_single_spike_is_skipped_as_if_its_batch_were_not_in_the_data(corpus_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "spiked"
    stdout = run_here(args(corpus_dir, out, "--steps=9", "--ckpt_every=0", "--drill=spike@6", *GUARD), capsys)
    spikes = [line for line in stdout.splitlines() if ": spike (" in line]
    assert len(spikes) == 1 and spikes[0].startswith("step 7: spike (loss ")
    assert "skipped with its batch (data step 6), 1 within 5 steps" in spikes[0]
    assert [r["data_step"] for r in rows(out)] == [0, 1, 2, 3, 4, 5, 7, 8, 9]  # step 7 redone on the next batch
    assert train_state(str(out / "checkpoints" / "step_00000009"))["skipped_data"] == [[6, 7]]

    ref = tmp_path / "reference"
    loader_without(monkeypatch, 6)
    run_here(args(corpus_dir, ref, "--steps=9", "--ckpt_every=0", *GUARD), capsys)
    assert_same_run(out, ref, 9)


# --- a burst: rolled back to the checkpoint before it, its data skipped; a restart keeps the skip

BURST = ["--steps=12", "--ckpt_every=2", "--drill=spike@7,9,10", "--spike_rollback=3", *GUARD]


@pytest.fixture(scope="module")
def burst(corpus_dir, tmp_path_factory):
    """A run whose data steps 7, 9 and 10 spike: step 8 skips data step 7 and trains on 8, step 9 skips 9 and 10,
    the third spike in 5 steps; (OUT_DIR, its stdout)."""
    out = tmp_path_factory.mktemp("burst")
    stdout = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_here runs
    try:
        with contextlib.redirect_stdout(stdout):
            train.main(*train.parse_args(args(corpus_dir, out, *BURST)))
    finally:
        torch.set_num_threads(threads)
    return out, stdout.getvalue()


def test_a_burst_of_spikes_rolls_back_once_and_skips_its_window(burst, corpus_dir, tmp_path, capsys, monkeypatch):
    out, stdout = burst
    events = [line.split(":")[0] for line in stdout.splitlines() if ": spike (" in line or "rolled back" in line]
    assert events == ["step 8", "step 9", "step 9", "3 bad steps within 5 steps, the first at step 8"]
    assert (f"3 bad steps within 5 steps, the first at step 8: rolled back to {out / 'checkpoints' / 'step_00000006'} "
            f"(rollback 1 of at most 5); data steps 7 to 10 are skipped") in stdout
    # Step 8 trained on data step 8 before the rollback; after it, data steps 7 to 10 are never read again.
    assert [r["data_step"] for r in rows(out)] == [0, 1, 2, 3, 4, 5, 6, 11, 12, 13, 14, 15]
    final = train_state(str(out / "checkpoints" / "step_00000012"))
    assert (final["skipped_data"], final["rollbacks"]) == ([[7, 11]], 1)

    ref = tmp_path / "reference"
    loader_without(monkeypatch, 7, 8, 9, 10)
    run_here(args(corpus_dir, ref, "--steps=12", "--ckpt_every=2", *GUARD), capsys)
    assert_same_run(out, ref, 12)


def test_a_rollback_survives_a_restart(burst, corpus_dir, tmp_path, capsys):
    """A new launch resuming from a checkpoint written after the rollback reads the data the run read."""
    run, _ = burst
    out = shutil.copytree(run, tmp_path / "run")
    ckpt = out / "checkpoints" / "step_00000008"  # the rolled back run's: the abandoned step 8 was deleted
    assert train_state(str(ckpt))["skipped_data"] == [[7, 11]]
    stdout = run_here(args(corpus_dir, out, *BURST, f"--resume={ckpt}"), capsys)
    assert f"resumed from {ckpt} at step 8" in stdout and ": spike (" not in stdout
    again = rows(out)
    before = rows(run)
    assert [r["step"] for r in again] == list(range(1, 13))
    for r, w in zip(again[8:], before[8:]):
        assert {k: r[k] for k in (*EXACT, "data_step")} == {k: w[k] for k in (*EXACT, "data_step")}, r["step"]


def test_a_run_stopped_right_after_a_rollback_never_resumes_the_abandoned_checkpoints(burst, corpus_dir, tmp_path,
                                                                                    capsys):
    """The run stops (a burst of NaN steps, no rollback left) soon after the rollback, before any checkpoint records
    it: the next launch resumes step 6, not the abandoned step 8, meets the burst again, and ends as the run that never
    stopped."""
    out = tmp_path / "run"
    with pytest.raises(watch.Stopped, match="^3 bad steps within 5 steps, the first at step 8, beyond --max_rollbac"):
        run_here(args(corpus_dir, out, *BURST, "--drill=spike@7,9,10,nan@11,12,13", "--max_rollbacks=1"), capsys)
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000004", "step_00000006"]
    run_here(args(corpus_dir, out, *BURST), capsys)
    assert_same_run(out, burst[0], 12)


def test_a_launch_that_resumed_and_then_rolled_back_says_once_what_it_resumed_as(corpus_dir, tmp_path, capsys):
    """The first launch stops on a non-finite step 3 while step 2's checkpoint is being written: the stop completes
    it. The second launch resumes there, meets the burst and rolls back to step 6: metrics.jsonl says the launch
    resumed at step 2 in one record, not again after the rollback."""
    out = tmp_path / "run"
    with pytest.raises(watch.Stopped, match="^1 bad steps within 5 steps, the first at step 3, beyond --max_rollbacks"):
        run_here(args(corpus_dir, out, *BURST, "--drill=nan@2", "--spike_rollback=1", "--max_rollbacks=0"), capsys)
    assert os.listdir(out / "checkpoints") == ["step_00000002"]
    run_here(args(corpus_dir, out, *BURST), capsys)
    resumed = [(r["step"], e["message"]) for r in rows(out) for e in r.get("events", []) if e["name"] == "resume"]
    assert len(resumed) == 1 and resumed[0][0] == 3 and " at step 2, " in resumed[0][1]


def test_every_rank_makes_the_same_decisions(burst, corpus_dir, tmp_path):
    """On 2 ranks (the experts split over both) the burst is skipped and rolled back as in one process: the spike
    statistics are of the global batch's all-reduced loss and gradient norm, so every rank decides alike."""
    out = tmp_path / "run"
    torchrun(2, "train.py", *args(corpus_dir, out, *BURST, "--ep=2", "--micro_batch=1"))
    single = rows(burst[0])
    got = rows(out)
    assert [r["data_step"] for r in got] == [r["data_step"] for r in single]
    assert [r["tokens_sum"] for r in got] == [r["tokens_sum"] for r in single]
    final = train_state(str(out / "checkpoints" / "step_00000012"))
    assert (final["skipped_data"], final["rollbacks"], final["skipped"]) == ([[7, 11]], 1, 3)


def test_a_burst_beyond_max_rollbacks_stops_the_run_in_one_sentence(corpus_dir, tmp_path):
    with pytest.raises(watch.Stopped, match="^3 bad steps within 5 steps, the first at step 8, beyond --max_rollbacks"
                                            "=0; lower --lr or inspect data steps 7 to 10, then resume$"):
        train.main(*train.parse_args(args(corpus_dir, tmp_path, *BURST, "--max_rollbacks=0")))


# --- right after a resume: a loss far beyond the checkpoint's is a damaged checkpoint

def test_a_checkpoint_whose_first_loss_jumps_is_not_trained_on(corpus_dir, tmp_path, capsys):
    out = tmp_path / "run"
    run_here(args(corpus_dir, out, "--steps=4", "--ckpt_every=2"), capsys)
    original = rows(out)
    damaged = out / "checkpoints" / "step_00000004"
    whole = tensors(str(damaged))
    tampered = {**whole, "model.head.weight": whole["model.head.weight"] * 1000}  # loads; the loss leaps
    dcp.save(tampered, checkpoint_id=str(damaged), no_dist=True)
    checksums = json.loads((damaged / "checksums.json").read_text())  # as if saved so: the files are as written
    (damaged / "checksums.json").write_text(json.dumps({name: hashlib.sha256((damaged / name).read_bytes()).hexdigest()
                                                        for name in checksums}))

    stdout = run_here(args(corpus_dir, out, "--steps=6", "--ckpt_every=2"), capsys)
    assert f"resumed from {damaged} at step 4" in stdout
    line = next(line for line in stdout.splitlines() if "looks damaged" in line)
    assert line.startswith("step 5, the first after loading the checkpoint of step 4, has loss ")
    assert line.endswith(f"that checkpoint looks damaged; fell back to {out / 'checkpoints' / 'step_00000002'}")
    again = rows(out)
    assert [r["step"] for r in again] == list(range(1, 7))
    for r, w in zip(again[:4], original):  # steps 3 and 4 trained again from step 2, as they were first
        assert {k: r[k] for k in EXACT} == {k: w[k] for k in EXACT}, r["step"]
    rewritten = tensors(str(damaged))  # step 4 written again, whole
    assert all(torch.equal(rewritten[k], whole[k]) for k in whole)


# --- status.json and --on_event

def test_on_event_sees_each_drilled_event_once_and_status_json_says_where_the_run_is(corpus_dir, tmp_path, capsys,
                                                                                     monkeypatch):
    """One launch rehearses a nearly full disk, a burst of spikes and its rollback and a failed checkpoint, and
    finishes; a restarted launch with another command (the first is not saved with the run) stops on NaN steps."""
    out = tmp_path / "run"
    heard = tmp_path / "heard"
    command = f'echo "$NANOTITAN_EVENT $NANOTITAN_STEP $NANOTITAN_MESSAGE" >> {shlex.quote(str(heard))}'
    free = shutil.disk_usage(tmp_path).free
    frees = itertools.chain([free, free, 0, 0], itertools.repeat(free))  # nearly full at checkpoints 6 and 8
    monkeypatch.setattr(watch.shutil, "disk_usage", lambda path: SimpleNamespace(free=next(frees)))
    save = watch.checkpoint.save

    def failing_at_10(root, step, *rest, **kwargs):
        if step == 10:
            raise watch.checkpoint.SaveFailed("writing step_00000010 failed (drill).")
        return save(root, step, *rest, **kwargs)

    monkeypatch.setattr(watch.checkpoint, "save", failing_at_10)
    stdout = run_here(args(corpus_dir, out, *BURST, "--steps=14", f"--on_event={command}"), capsys)
    assert f"on each event: {command}" in stdout
    first = heard.read_text().splitlines()
    said = [" ".join(line.split()[:2]) for line in first]
    said.remove("disk_nearly_full 6")  # said once checkpoint 6 is complete, in the background: before or after step 8
    assert said == ["spike 8", "spike 9", "spike 9", "rollback 6", "checkpoint_failed 10", "finished 14"]
    for line in first:  # the message, whole, as the console said it
        assert line.split(" ", 2)[2] in stdout
    status = json.loads((out / "status.json").read_text())
    assert {k: status[k] for k in ("step", "steps", "tokens", "world_size", "layout", "restarts", "skipped_steps",
                                   "rollbacks")} == {
        "step": 14, "steps": 14, "tokens": 14 * 4 * 32, "world_size": 1, "restarts": 0, "skipped_steps": 3,
        "rollbacks": 1, "layout": {"dp_replicate": 1, "dp_shard": 1, "ep": 1}}
    assert status["loss"] == rows(out)[-1]["loss"] and status["tokens_per_s"] > 0 and status["mfu"] is None
    assert status["last_checkpoint"] == str(out / "checkpoints" / "step_00000014")
    assert status["last_event"]["name"] == "finished" and status["last_event"]["step"] == 14
    saved = json.loads((out / "config.json").read_text())["train"]
    assert "on_event" not in saved and "on_event" not in json.loads((out / "checkpoints" / "step_00000014" /
                                                                      "config.json").read_text())["train"]

    heard_again = tmp_path / "heard_again"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(watch.Stopped, match="^1 bad steps within 50 steps, the first at step 15, beyond"):
        run_here(args(corpus_dir, out, "--steps=16", "--drill=nan@18", "--spike_rollback=1", "--max_rollbacks=0",
                      f"--on_event=echo $NANOTITAN_EVENT >> {shlex.quote(str(heard_again))}"), capsys)
    assert heard.read_text().splitlines() == first  # the first launch's command is not the restarted launch's
    assert heard_again.read_text().splitlines() == ["restart", "spike", "stopped"]
    status = json.loads((out / "status.json").read_text())
    assert (status["restarts"], status["step"], status["last_event"]["name"]) == (1, 14, "stopped")


def test_a_failing_or_hanging_command_is_said_and_never_stops_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(watch, "EVENT_TIMEOUT_S", 1)
    out = tmp_path / "run"
    out.mkdir()
    for command, said in (("exit 3", "--on_event for spike failed (exit code 3); training goes on"),
                          ("sleep 30", "--on_event for spike failed (killed after 1s); training goes on")):
        events = watch.Events(str(out), True, [], command, {})
        started = time.time()
        events.event("spike", 3, "step 3: spike")
        assert time.time() - started < 1  # the command runs in the background
        events.close()
        assert said in capsys.readouterr().out


def test_a_full_disk_at_a_log_step_is_said_once_and_the_run_goes_on(corpus_dir, tmp_path, capsys, monkeypatch):
    """status.json cannot be written (ENOSPC) at any step: one line says so, the run finishes and metrics.jsonl,
    appended to another file, holds every step."""
    write = watch.data.write_durably

    def full_for_status(path, text):
        if path.endswith("status.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(path, text)
    monkeypatch.setattr(watch.data, "write_durably", full_for_status)
    stdout = run_here(args(corpus_dir, tmp_path, "--steps=4", "--log_every=1"), capsys)
    said = [line for line in stdout.splitlines() if "status.json not written" in line]
    assert said == [f"{tmp_path / 'status.json'} not written ({os.strerror(errno.ENOSPC)}); training goes on"]
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4] and not (tmp_path / "status.json").exists()


def test_healthy_runs_raise_no_spike_while_the_drills_do():
    """The loss and gradient norm of every step of the README's default CPU run (python train.py) and of one at 10x
    its LR (--lr=5e-2), recorded with the guard off (--spike_threshold=0; torch 2.13 CPU): judged with the default
    spike settings, no step is bad; the spike drill's x100 loss and gradients at a judged step are caught there and
    nowhere else. (These two recordings also stay within 7.1 robust deviations on the linear scale; the log scale
    is for the heavier tails other machines' runs show: there a limit is a factor of the typical value.)"""
    runs = json.loads((Path(__file__).parent / "healthy_runs.json").read_text())
    tc = train.TrainConfig()
    quiet = SimpleNamespace(event=lambda *args: None)
    for name, steps in runs.items():
        bad = watch.BadSteps(tc, quiet)
        assert [step for step, (loss, grad) in enumerate(steps) if not bad.judge(step, step, loss, grad)] == [], name
        assert bad.recent and len(steps) == 150
        for drilled in (tc.spike_window, 100, 149):
            bad = watch.BadSteps(tc, quiet)
            judged = [bad.judge(step, step, *((100 * loss, 100 * grad) if step == drilled else (loss, grad)))
                      for step, (loss, grad) in enumerate(steps)]
            assert [step for step, applied in enumerate(judged) if not applied] == [drilled], (name, drilled)
