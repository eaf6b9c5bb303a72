"""A run that heals itself, on CPU over gloo: a launcher killed alone (its workers orphaned), one live job per
OUT_DIR, and a job that shrinks when a node dies and grows back when it returns.

    python -m pytest tests/test_elastic.py -q

Each test launches train.py under torchrun as a user would and checks what the user relies on: the relaunched or
resized job reads the same tokens and logs each step once; a second job never writes a directory a live job holds.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train
from test_resume import ENV, EXACT, ROOT, args, last_rows, rows, run, run_here, started, tensors

TWO_RANKS = ["--ep=2", "--micro_batch=1"]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a launcher's workers), read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited


def wait_for_step(out: Path, step: int, proc, timeout: float = 120):
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline and max(last_rows(out), default=0) < step:
        time.sleep(0.01)
    assert max(last_rows(out), default=0) >= step, f"step {step} was never logged"


@pytest.fixture(scope="module")
def uninterrupted(corpus_dir, tmp_path_factory):
    """12 steps on 2 ranks, checkpoints every 2."""
    out = tmp_path_factory.mktemp("uninterrupted")
    code, _, err = run(args(corpus_dir, out, "--steps=12", "--ckpt_every=2", *TWO_RANKS), out / "log", nproc=2)
    assert code == 0, err[-4000:]
    return out


def test_launcher_killed_alone_leaves_no_worker_and_the_relaunch_finishes_bitwise(uninterrupted, corpus_dir,
                                                                                 tmp_path):
    """kill -9 of torchrun only (as the OOM killer or a scheduler that signals the launcher does), at two moments,
    each followed at once by a relaunch: the orphaned workers stop within seconds, writing nothing more, and the last
    launch ends as the uninterrupted run did, each step logged once."""
    out = tmp_path / "run"
    argv = args(corpus_dir, out, "--steps=12", "--ckpt_every=2", *TWO_RANKS)
    for launch, kill_after in enumerate((3, 8)):
        with started(argv, tmp_path / f"log{launch}", nproc=2) as proc:
            wait_for_step(out, kill_after, proc)
            workers = children(proc.pid)
            assert len(workers) == 2
            os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: its workers are in sessions of their own
            deadline = time.time() + 10
            while any(map(alive, workers)) and time.time() < deadline:
                time.sleep(0.05)
            assert not any(map(alive, workers)), "a worker outlived its launcher"
    code, stdout, err = run(argv, tmp_path / "last", nproc=2)
    assert code == 0, err[-4000:]
    assert "taken over from host" in stdout  # the dead job's lease
    logged = rows(out)
    assert [r["step"] for r in logged] == list(range(1, 13))
    ref = last_rows(uninterrupted)
    for r in logged:
        assert {k: r[k] for k in EXACT} == {k: ref[r["step"]][k] for k in EXACT}, r["step"]
    want = tensors(str(uninterrupted / "checkpoints" / "step_00000012"))
    got = tensors(str(out / "checkpoints" / "step_00000012"))
    assert want.keys() == got.keys() and all((want[k] == got[k]).all() for k in want)
    assert not (out / "lease.json").exists()  # given back at the end


def test_a_second_job_waits_for_the_live_one_then_refuses_naming_it(corpus_dir, tmp_path, capsys):
    out = tmp_path / "run"
    with started(args(corpus_dir, out, "--steps=400", *TWO_RANKS), tmp_path / "log", nproc=2) as proc:
        wait_for_step(out, 1, proc)
        holder = json.loads((out / "lease.json").read_text())
        before = (out / "metrics.jsonl").stat().st_size
        t0 = time.time()
        with pytest.raises(ValueError, match=f"--out_dir={out} is in use by another job \\(host "
                                             f"{socket.gethostname()}, pid {holder['pid']}, last heartbeat at "):
            train.main(*train.parse_args(args(corpus_dir, out, "--steps=400", "--lease_wait=3")))
        assert 3 <= time.time() - t0 < 20
        assert proc.poll() is None and (out / "metrics.jsonl").stat().st_size > before  # the live job goes on


def test_the_lease_of_a_job_that_is_gone_is_taken_over(corpus_dir, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "lease.json").write_text(json.dumps({"owner": "x", "host": socket.gethostname(), "pid": dead.pid,
                                                     "beat": 7, "time": time.time()}))
    stdout = run_here(args(corpus_dir, tmp_path, "--steps=1"), capsys)
    assert f"lease of {tmp_path} taken over from host {socket.gethostname()} pid {dead.pid}, which is gone" in stdout
    assert [r["step"] for r in rows(tmp_path)] == [1]
