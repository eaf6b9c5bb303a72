"""A training run's lifecycle: what a new, resumed, finished, interrupted or failing run does with OUT_DIR.

    python -m pytest tests/test_lifecycle.py -q

Each test runs train.py as a user would (in this process, or launched for signals and exit codes) on the tiny
corpus and checks what the user relies on: another run's files are never touched, a damaged newest checkpoint
falls back to the previous one, a full disk leaves no partial checkpoint, a run with nothing to do changes nothing,
and every refusal is one sentence.
"""

import errno
import json
import os
import re
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
import torch.distributed.checkpoint.filesystem as dcp_filesystem

import checkpoint
import data
import train
from conftest import TINY_MODEL_FLAGS
from test_resume import ENV, ROOT, rows, run_here, signal_mid_run

MODEL_FLAGS = [*TINY_MODEL_FLAGS, "--dim=32"]


def args(corpus_dir, out_dir, *extra):
    return [f"--data={corpus_dir}", f"--out_dir={out_dir}", "--seq_len=32", "--global_batch=4", "--micro_batch=2",
            "--log_every=1", "--eval_every=0", "--eval_batches=1", "--sample_tokens=0", "--warmup_steps=2",
            "--lr=1e-2", *MODEL_FLAGS, *extra]


def ckpts(out_dir) -> list[str]:
    root = Path(out_dir) / "checkpoints"
    return sorted(os.listdir(root)) if root.exists() else []


@pytest.fixture(scope="module")
def finished(corpus_dir, tmp_path_factory):
    """A finished 4-step run (cosine schedule), checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("finished")
    train.main(*train.parse_args(args(corpus_dir, out, "--steps=4", "--ckpt_every=2")))
    assert ckpts(out) == ["step_00000002", "step_00000004"]
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


# --- another run's files are never deleted, mixed or overwritten

@pytest.mark.parametrize("resume", ["none", "other"])
def test_new_run_in_another_runs_out_dir_is_refused_then_overwrites_on_request(finished, corpus_dir, tmp_path,
                                                                               capsys, resume):
    out = copy_of(finished, tmp_path)
    resume_flag = f"--resume={finished / 'checkpoints' / 'step_00000002'}" if resume == "other" else "--resume=none"
    steps = 3 if resume == "other" else 1  # "other" continues another directory's step 2, "none" starts anew
    before = snapshot(out)
    with pytest.raises(ValueError, match=r"holds another run \(checkpoints, metrics.jsonl, config.json\); continue it "
                                         r"with --resume=auto, choose a new --out_dir, or pass --overwrite to replace "
                                         r"it\.$"):
        train.main(*train.parse_args(args(corpus_dir, out, f"--steps={steps}", resume_flag)))
    assert snapshot(out) == before  # nothing deleted, appended or rewritten

    run_here(args(corpus_dir, out, f"--steps={steps}", resume_flag, "--overwrite"), capsys)
    assert [r["step"] for r in rows(out)] == [steps]
    assert ckpts(out) == [f"step_{steps:08d}"]  # the old run's checkpoints are gone, not mixed in
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == steps


def test_torchrun_restart_continues_its_first_attempt(finished, corpus_dir, tmp_path, capsys, monkeypatch):
    """A restarted job launched with --resume=none --overwrite must not delete what its first attempt wrote."""
    out = copy_of(finished, tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    stdout = run_here(args(corpus_dir, out, "--steps=5", "--resume=none", "--overwrite"), capsys)
    assert f"resumed from {out / 'checkpoints' / 'step_00000004'} at step 4" in stdout
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5]


def test_init_from_hf_into_a_run_directory_is_refused(finished, corpus_dir, tmp_path, capsys):
    """Starting from other weights where a run lives would be overridden by --resume=auto: refused, as a new run is."""
    out = copy_of(finished, tmp_path)
    hf = tmp_path / "hf"
    checkpoint.export_hf(str(finished / "checkpoints"), str(hf))
    before = snapshot(out)
    with pytest.raises(ValueError, match=re.escape(f"--out_dir={out} holds another run (checkpoints, metrics.jsonl, "
                                                   f"config.json); drop --init_from_hf to resume it, choose a new "
                                                   f"--out_dir, or pass --overwrite to replace it.")):
        train.main(*train.parse_args(args(corpus_dir, out, "--steps=6", f"--init_from_hf={hf}")))
    assert snapshot(out) == before
    stdout = run_here(args(corpus_dir, out, "--steps=1", f"--init_from_hf={hf}", "--overwrite"), capsys)
    assert f"initialised from {hf}" in stdout and "resumed from" not in stdout
    assert [r["step"] for r in rows(out)] == [1] and ckpts(out) == ["step_00000001"]


def test_a_directory_with_only_a_config_is_not_a_run(corpus_dir, tmp_path, capsys):
    """A launch that failed before its first step leaves config.json alone: the next launch may use the folder."""
    (tmp_path / "config.json").write_text("{}")
    run_here(args(corpus_dir, tmp_path, "--steps=1", "--resume=none"), capsys)
    assert [r["step"] for r in rows(tmp_path)] == [1]


@pytest.fixture
def other_data(corpus_dir, tmp_path_factory):
    """A second corpus (the standard library's csv module), prepared like corpus_dir."""
    out = str(tmp_path_factory.mktemp("other_data"))
    data.prepare([os.path.join(os.path.dirname(os.__file__), "csv.py"), os.path.join(os.path.dirname(os.__file__),
                  "argparse.py")], out_dir=out, val_fraction=0.5, workers=1, quiet=True)
    return out


def test_resume_on_other_data_is_refused_unless_allowed_and_every_config_is_kept(finished, corpus_dir, other_data,
                                                                                 tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    newest = out / "checkpoints" / "step_00000004"
    with pytest.raises(ValueError, match=re.escape(f"--data={other_data} is not the data checkpoint {newest} was "
                                                   f"trained on ({corpus_dir}); resume with --data={corpus_dir}, or "
                                                   f"pass --allow_changed=data to train on the new data from here "
                                                   f"on.")):
        train.main(*train.parse_args(args(other_data, out, "--steps=5")))
    with pytest.raises(ValueError, match=re.escape(f"--seed=1 differs from checkpoint {newest}'s 0, which fixes the "
                                                   f"data order; resume with --seed=0")):
        train.main(*train.parse_args(args(corpus_dir, out, "--steps=5", "--seed=1")))
    moved = shutil.copytree(corpus_dir, tmp_path / "moved")  # the same data at another path is the same data
    stdout = run_here(args(str(moved), out, "--steps=5", "--lr=2e-2", "--micro_batch=1", "--spike_threshold=8"), capsys)
    assert (f"resuming {newest} with settings that differ from its own:\n  micro_batch: 2 -> 1\n  lr: 0.01 -> 0.02\n"
            f"  spike_threshold: 10.0 -> 8.0\n") in stdout
    shutil.rmtree(moved)
    shutil.copytree(other_data, moved)  # the same path, other contents
    with pytest.raises(ValueError, match=re.escape(f"--data={moved} is not the data checkpoint {out / 'checkpoints'}"
                                                   f"/step_00000005 was trained on (its contents changed since; "
                                                   f"restore them, or pass --allow_changed=data")):
        train.main(*train.parse_args(args(str(moved), out, "--steps=6")))
    stdout = run_here(args(other_data, out, "--steps=6", "--allow_changed=data"), capsys)
    assert f"  data: '{moved}' -> '{other_data}'" in stdout and "resumed from" in stdout
    # config.json holds the last launch's settings and the step they apply from; each checkpoint keeps its own.
    current = json.loads((out / "config.json").read_text())
    assert (current["from_step"], current["train"]["data"]) == (5, other_data)
    saved = json.loads((out / "checkpoints" / "step_00000005" / "config.json").read_text())
    assert (saved["train"]["data"], saved["train"]["lr"]) == (str(moved), 2e-2)


def snapshot(out: Path) -> dict:
    """Every file under out: its bytes and modification time."""
    return {str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}


def test_prune_deletes_only_the_runs_own_checkpoints(tmp_path):
    """Two runs (two run ids) saving into one root with keep=1: each prunes only its own older checkpoints."""
    model = torch.nn.Linear(4, 4)
    checkpoint.save(str(tmp_path), 1, {"model": model}, {"run_id": "a"}, keep=1)
    checkpoint.save(str(tmp_path), 2, {"model": model}, {"run_id": "b"}, keep=1)
    checkpoint.save(str(tmp_path), 3, {"model": model}, {"run_id": "b"}, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000003"]


def test_run_that_does_nothing_changes_nothing(finished, corpus_dir, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    before = snapshot(out)
    stdout = run_here(args(corpus_dir, out, "--steps=4"), capsys)  # --resume=auto at the run's last step
    assert "already at step 4 of 4; pass a larger --steps to train further" in stdout
    assert snapshot(out) == before


# --- checkpoints: by steps and by minutes, logged; Ctrl-C checkpoints; resumed metrics hold each step once

def test_default_checkpoints_bound_the_work_a_crash_loses(corpus_dir, tmp_path, capsys):
    defaults = train.TrainConfig()
    assert 0 < defaults.ckpt_every <= 1000 and 0 < defaults.ckpt_minutes <= 60
    # --ckpt_minutes: rank 0's clock makes every rank save; here every step is due.
    stdout = run_here(args(corpus_dir, tmp_path, "--steps=3", "--ckpt_every=0", "--ckpt_minutes=1e-9"), capsys)
    assert ckpts(tmp_path) == ["step_00000001", "step_00000002", "step_00000003"]
    for step in (1, 2, 3):
        assert f"checkpoint step_{step:08d} complete, " in stdout and "s after it began" in stdout


def test_ctrl_c_checkpoints_and_exits_zero_in_one_line(corpus_dir, tmp_path):
    out = tmp_path / "run"
    code, stdout, err, stopped = signal_mid_run(args(corpus_dir, out, "--steps=30"), out, tmp_path / "log",
                                                signal.SIGINT)
    assert code == 0, err[-4000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert f"interrupted: checkpoint written at step {stopped}; exiting" in stdout
    assert checkpoint.latest(str(out / "checkpoints")) == str(out / "checkpoints" / f"step_{stopped:08d}")


def test_ctrl_c_says_written_once_complete_and_a_second_one_abandons_the_save(corpus_dir, tmp_path, capsys,
                                                                             monkeypatch):
    """The checkpoint a Ctrl-C asks for is written in the background (slowed here): "written" is said only once it is
    complete; a second Ctrl-C while it is written abandons it, says so, and removes its partial files."""
    write_item = dcp_filesystem._write_item

    def slow(*args):  # a few seconds a checkpoint
        time.sleep(0.02)
        return write_item(*args)

    monkeypatch.setattr(dcp_filesystem, "_write_item", slow)
    for second in (False, True):
        out = tmp_path / f"second_{second}"

        def interrupt():
            while len(rows(out)) < 2:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)
            while second and not list((out / "checkpoints").glob("*.tmp")):
                time.sleep(0.01)
            if second:
                os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        if not second:
            stdout = run_here(args(corpus_dir, out, "--steps=30", "--ckpt_every=0"), capsys)
            stopped = rows(out)[-1]["step"]
            complete = stdout.index(f"checkpoint step_{stopped:08d} complete")
            assert stdout.index(f"interrupted: checkpoint written at step {stopped}; exiting") > complete
            continue
        with pytest.raises(KeyboardInterrupt) as e:
            run_here(args(corpus_dir, out, "--steps=30", "--ckpt_every=0"), capsys)
        stopped = rows(out)[-1]["step"]
        partial = out / "checkpoints" / f"step_{stopped:08d}.tmp"
        assert e.value.args[0] == (f"interrupted again: checkpoint step_{stopped:08d} abandoned before it was complete "
                                   f"(its partial files {partial} removed); the newest checkpoint is none")
        assert "checkpoint written" not in capsys.readouterr().out and ckpts(out) == []


def test_resumed_run_logs_each_step_once(finished, corpus_dir, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    stdout = run_here(args(corpus_dir, out, "--steps=4", f"--resume={out / 'checkpoints' / 'step_00000002'}"),
                      capsys)
    assert "at step 2" in stdout
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    original = rows(finished)
    assert [r["tokens_sum"] for r in logged] == [r["tokens_sum"] for r in original]  # the resumed rows replace them


# --- faults that fall back instead of crashing

def truncate_distcp(ckpt: Path):
    f = next(ckpt.glob("*.distcp"))
    f.write_bytes(f.read_bytes()[:100])
    return f.name, "is truncated (100 bytes of"


def truncate_state(ckpt: Path):
    (ckpt / "state.json").write_text((ckpt / "state.json").read_text()[:50])
    return "state.json", "is not valid JSON (truncated?)"


def remove_metadata(ckpt: Path):
    (ckpt / ".metadata").unlink()
    return ".metadata", "is missing"


@pytest.mark.parametrize("damage", [truncate_distcp, truncate_state, remove_metadata])
def test_damaged_newest_checkpoint_falls_back_or_names_the_file(finished, corpus_dir, tmp_path, capsys, damage):
    out = copy_of(finished, tmp_path)
    newest = out / "checkpoints" / "step_00000004"
    name, why = damage(newest)
    # An explicit path: one sentence naming the file.
    with pytest.raises(checkpoint.CorruptCheckpoint, match="^" + re.escape(f"checkpoint {newest} is damaged: "
                                                                           f"{newest / name} {why}")):
        train.main(*train.parse_args(args(corpus_dir, tmp_path / "other", "--steps=5", f"--resume={newest}")))
    # --resume=auto: the newest checkpoint that loads, saying which was skipped and why.
    stdout = run_here(args(corpus_dir, out, "--steps=5", "--ckpt_every=2"), capsys)
    assert f"checkpoint {newest} is damaged: {newest / name} {why}" in stdout
    assert "Skipping it, trying the previous checkpoint." in stdout
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'} at step 2" in stdout
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5]
    checkpoint.verify(str(newest))  # rewritten whole by the resumed run


def test_disk_full_during_a_save_is_one_line_and_the_run_goes_on(corpus_dir, tmp_path, capsys, monkeypatch):
    write_item = dcp_filesystem._write_item

    def disk_full_in_the_second_save(transforms, stream, *rest):  # the save of step 4 fills the disk part-way
        if os.path.basename(os.path.dirname(stream.name)) == "step_00000004.tmp":
            stream.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_item(transforms, stream, *rest)

    monkeypatch.setattr(dcp_filesystem, "_write_item", disk_full_in_the_second_save)
    root = tmp_path / "checkpoints"
    stdout = run_here(args(corpus_dir, tmp_path, "--steps=6", "--ckpt_every=2"), capsys)
    assert re.search(re.escape(f"no space left on {root} (") + r"\d+\.\d MiB free\): " +
                     re.escape(f"checkpoint step_00000004 not written (its partial files are removed); the newest "
                               f"checkpoint is still {root / 'step_00000002'}. Training goes on."), stdout)
    assert ckpts(tmp_path) == ["step_00000002", "step_00000006"]  # no step_00000004.tmp left behind
    assert [r["step"] for r in rows(tmp_path)] == list(range(1, 7))


def test_disk_full_at_the_final_save_fails_in_one_line(corpus_dir, tmp_path, monkeypatch):
    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp_filesystem, "_write_item", disk_full)
    with pytest.raises(checkpoint.SaveFailed, match=r"^no space left on .*checkpoints \(\d+\.\d MiB free\): "
                                                    r"checkpoint step_00000002 not "
                                                    r"written \(its partial files are removed\); the newest "
                                                    r"checkpoint is still none\.$"):
        train.main(*train.parse_args(args(corpus_dir, tmp_path, "--steps=2")))
    assert ckpts(tmp_path) == []


def test_token_id_beyond_the_vocabulary_names_the_shard_and_id(corpus_dir, tmp_path):
    bad = shutil.copytree(corpus_dir, tmp_path / "data")
    manifest = data.load_manifest(str(bad))
    shard = manifest["splits"]["train"][0]
    tokens = np.memmap(bad / shard["file"], np.dtype(manifest["dtype"]), "r+", offset=data.HEADER_BYTES)
    tokens[:] = 200_000  # the header and the manifest still say the ids are in range
    tokens.flush()
    loader = data.DataLoader(str(bad), "train", 32, 4, vocab_size=100352)
    with pytest.raises(data.DataError, match=f"train shard {bad / shard['file']} holds token id 200000 .*beyond "
                                             f"the model's vocab_size=100352"):
        loader.batch(0)


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_unwritable_out_dir_is_one_sentence_before_anything_heavy(tmp_path, where):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out" if where == "under_a_file" else Path("/proc/nanotitan_out")
    # --data names nothing: the out_dir check comes before the data (and the model)
    tc, overrides = train.parse_args(["--data=/nonexistent", f"--out_dir={out}"])
    with pytest.raises(ValueError, match=f"^--out_dir={out} cannot be written to \\(.*\\); choose a directory"):
        train.main(tc, overrides)


# --- silent surprises, said

@pytest.mark.parametrize("rule", ["keep", "stretch"])
def test_extending_a_run_says_which_lr_schedule_it_follows(finished, corpus_dir, tmp_path, capsys, rule):
    out = copy_of(finished, tmp_path)
    stdout = run_here(args(corpus_dir, out, "--steps=6", f"--resume_schedule={rule}"), capsys)
    tc4, tc6 = (train.parse_args(args(corpus_dir, out, f"--steps={n}"))[0] for n in (4, 6))
    lrs = [r["lr"] for r in rows(out)]
    assert lrs[:4] == [r["lr"] for r in rows(finished)]
    if rule == "keep":  # the finished 4-step schedule, then its final LR
        assert "LR schedule: the checkpoint's, over 4 steps, then its final LR" in stdout
        assert lrs[4:] == [train.lr_at(3, tc4)] * 2
    else:  # the schedule laid again over 6 steps: the LR jumps back up
        assert "LR schedule: laid again over --steps=6, not the checkpoint's 4 steps" in stdout
        assert lrs[4:] == [train.lr_at(4, tc6), train.lr_at(5, tc6)] and lrs[4] > lrs[3]


def test_readme_layouts_work_with_the_default_batch():
    for world, flags in ((2, ["--ep=2"]), (8, ["--dp_replicate=2", "--ep=4", "--global_batch=64"]), (1, [])):
        tc, overrides = train.parse_args(flags)
        run = train.make_run(tc, train.model_config(tc, overrides, 100277), 0, world, torch.device("cpu"))  # checks
        assert run.tc.micro_batch == tc.global_batch // world


def test_layout_error_is_one_line_from_one_rank(corpus_dir, tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", f"--data={corpus_dir}", f"--out_dir={tmp_path}", "--ep=3"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "ep" in errors[0], r.stderr[-3000:]
    assert 'train.py", line' not in r.stderr  # no worker traceback


@pytest.mark.parametrize("typed, meant", [("--learning_rate=3e-4", "--lr"), ("--max_iters=100", "--steps"),
                                          ("--batch_size=16", "--global_batch"), ("--n_layer=8", "--n_layers"),
                                          ("--training.steps=10", "--steps"), ("--global_bach=8", "--global_batch")])
def test_other_trainers_flag_names_are_suggested(typed, meant, capsys):
    with pytest.raises(SystemExit):
        train.parse_args([typed])
    assert f"did you mean {meant}?" in capsys.readouterr().err


def test_nothing_close_is_suggested_for_a_flag_unlike_any(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--bogus=1"])
    err = capsys.readouterr().err
    assert "unknown flag --bogus; " in err and "--help lists the flags." in err and "did you mean" not in err
