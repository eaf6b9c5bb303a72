"""train.py's --log_to sinks (TensorBoard, Weights & Biases) and --config files.

    python -m pytest tests/test_logging_config.py -q

The sinks are read back from what they wrote (TensorBoard's event files, W&B's offline run files) and compared with
metrics.jsonl, across a restart that repeats steps. Config files: a run replayed from its config.json, TOML, the
precedence of flags over the file, bad keys, and the README's example configs.
"""

import dataclasses
import glob
import json
import os
import re
import shutil
import struct
import sys
import tomllib

import numpy as np
import pytest
import torch

import train
from conftest import torchrun
from model import PRESETS
from test_train import metrics, run_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_then_restart(corpus_dir, out_dir, *flags):
    """Four steps with checkpoints at 2 and 4; the one at 4 is deleted, as if the launch had died before writing
    it, and a second launch resumes from step 2 to step 6, repeating steps 3 and 4."""
    common = ["--ckpt_every=2", "--eval_every=2", *flags]
    train.main(*train.parse_args(run_args(corpus_dir, out_dir, "--steps=4", *common)))
    shutil.rmtree(os.path.join(out_dir, "checkpoints", "step_00000004"))
    train.main(*train.parse_args(run_args(corpus_dir, out_dir, "--steps=6", *common)))


def scalars(record: dict, prefix: str = "") -> dict:
    """A metrics.jsonl record as the sinks name its numbers: lists per MoE layer as KEY/00, KEY/01, ..., a dict's
    entries (a value per data source) as KEY/NAME; the events' words are the console's, not a dashboard's."""
    out = {}
    for key, value in record.items():
        if key == "events":
            continue
        if isinstance(value, list):
            out.update({f"{prefix}{key}/{l:02d}": v for l, v in enumerate(value)})
        elif isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif value is not None and key != "step":
            out[prefix + key] = value
    return out


def test_tensorboard_holds_metrics_jsonl_once_per_step_across_a_restart(corpus_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    launch_then_restart(corpus_dir, tmp_path, "--log_to=tensorboard")
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # the resumed launch dropped its replayed steps' lines
    latest = {r["step"]: scalars(r) for r in rows}  # steps 3 and 4 as the restarted launch logged them
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected_tags = set().union(*latest.values())
    assert {"loss", "lm_loss", "aux_loss", "z_loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "max_vio",
            "max_vio_layers/00", "max_vio_layers/02", f"loss_by_source/{corpus_dir}",
            f"val_loss_by_source/{corpus_dir}"} <= expected_tags and tags == expected_tags
    for tag in tags:
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        # TensorBoard stores float32: each value is the record's, rounded once.
        assert logged == [(step, float(np.float32(s[tag]))) for step, s in sorted(latest.items()) if tag in s], tag


def wandb_history(run_file: str) -> list[dict]:
    """The history rows of an offline W&B run file: LevelDB-style records in 32 KiB blocks after a 7-byte header,
    each record a 7-byte header (checksum, length, kind: 1 whole, 2 first, 3 middle, 4 last) and a protobuf."""
    from wandb.proto import wandb_internal_pb2

    with open(run_file, "rb") as f:
        raw = f.read()
    pos, part, rows = 7, b"", []
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        part, pos = part + raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_run_holds_metrics_jsonl_and_a_restart_continues_it(corpus_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional and not in requirements.txt")
    monkeypatch.setenv("WANDB_MODE", "offline")
    launch_then_restart(corpus_dir, tmp_path, "--log_to=wandb")
    run_id = (tmp_path / "wandb_run_id").read_text()
    run_files = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / f"run-{run_id}.wandb")))
    assert len(run_files) == 2  # both launches wrote to the run whose id the first one saved
    rows = metrics(tmp_path)
    for run_file, launch_rows in zip(run_files, (rows[:4], rows[4:])):
        logged = wandb_history(run_file)
        assert [r["_step"] for r in logged] == [r["step"] for r in launch_rows]
        for got, record in zip(logged, launch_rows):
            assert {k: got[k] for k in scalars(record)} == scalars(record)


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_missing_log_package_is_one_sentence_naming_what_to_install(package, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)  # import and find_spec now fail as if it were not installed
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--log_to=tensorboard,wandb"])
    assert exit_.value.code == 2
    assert (f"error: --log_to={package} needs the {package} package, which is not installed here: pip install {package}"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        train.parse_args(["--log_to=tensorbord"])
    assert "--log_to=tensorbord: tensorbord is not one of none, tensorboard, wandb; did you mean tensorboard?" in \
        capsys.readouterr().err


def test_run_from_its_config_json_is_the_same_run(corpus_dir, tmp_path):
    first, again = tmp_path / "first", tmp_path / "again"
    tc, overrides = train.parse_args(run_args(corpus_dir, first, "--steps=2", "--n_layers=2", "--optimizer=muon",
                                              "--seed=3"))
    train.main(tc, overrides)
    replay, replay_overrides = train.parse_args([f"--config={first / 'config.json'}", f"--out_dir={again}"])
    assert replay == dataclasses.replace(tc, out_dir=str(again))
    train.main(replay, replay_overrides)
    saved = [json.loads((d / "config.json").read_text()) for d in (first, again)]
    saved[1]["train"]["out_dir"] = saved[0]["train"]["out_dir"]
    assert saved[0].pop("run_id") != saved[1].pop("run_id")  # each run its own id
    assert saved[0] == saved[1] and saved[0]["model"]["n_layers"] == 2
    assert [r["loss"] for r in metrics(first)] == [r["loss"] for r in metrics(again)]


def test_toml_config_sits_between_the_preset_and_the_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\npreset = "nano"\nlr = 1e-3\nsteps = 7\ndoc_mask = false\n\n'
                    '[model]\nn_layers = 8\nn_experts = 64\n')
    tc, overrides = train.parse_args([f"--config={path}", "--lr=2e-3", "--n_experts=32"])
    assert (tc.preset, tc.lr, tc.steps, tc.doc_mask, tc.seq_len) == ("nano", 2e-3, 7, False, 128)
    cfg = train.model_config(tc, overrides, vocab_size=100277)
    nano = PRESETS["nano"]
    assert (cfg.n_layers, cfg.n_experts, cfg.dim, cfg.top_k) == (8, 32, nano.dim, nano.top_k)


def test_a_preset_on_the_command_line_replaces_the_files_model(corpus_dir, tmp_path):
    first = tmp_path / "first"
    train.main(*train.parse_args(run_args(corpus_dir, first, "--steps=1")))
    tc, overrides = train.parse_args([f"--config={first / 'config.json'}", "--preset=nano", "--n_layers=3"])
    cfg = train.model_config(tc, overrides, vocab_size=100277)
    assert tc.preset == "nano" and overrides == {"n_layers": 3}
    assert cfg == dataclasses.replace(PRESETS["nano"], vocab_size=100352, max_seq_len=tc.seq_len, n_layers=3)


def test_upper_case_toml_suffix_is_toml(tmp_path):
    path = tmp_path / "run.TOML"
    path.write_text("[train]\nsteps = 7\n")
    assert train.parse_args([f"--config={path}"])[0].steps == 7


@pytest.mark.parametrize("text, message", [
    ("[train]\nwarmup = 100\n", "has an unknown key train.warmup; did you mean train.warmup_steps?"),
    ("[train]\nlearning_rate = 1e-3\n", "has an unknown key train.learning_rate; did you mean train.lr?"),
    ("[train]\ndata = 5\n", "sets train.data to 5, which is not a valid string."),
    ("[train]\nlr = true\n", "sets train.lr to True, which is not a valid number."),
    ("[train]\nsteps = 1.5\n", "sets train.steps to 1.5, which is not a valid int."),
    ("[train]\ndoc_mask = 1\n", "sets train.doc_mask to 1, which is not a valid bool (true or false)."),
    ("[train]\nn_layers = 8\n", "has an unknown key train.n_layers; did you mean model.n_layers?"),
    ("lr = 0.1\n", "has an unknown key lr; did you mean train.lr?"),
    ("[train]\nsteps = 'many'\n", "sets train.steps to 'many', which is not a valid int."),
    ("[train\n", "is not valid TOML"),
])
def test_bad_config_file_is_one_sentence(text, message, tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        train.parse_args([f"--config={path}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_readme_toml_configs_are_valid_runs(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```toml\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        path = tmp_path / f"{i}.toml"
        path.write_text(block)
        tc, overrides = train.parse_args([f"--config={path}"])
        cfg = train.model_config(tc, overrides, vocab_size=PRESETS[tc.preset].vocab_size)
        world = tomllib.loads(block).get("world_size", 1)
        layout = train.make_run(tc, cfg, 0, world, torch.device("cpu")).layout  # checked as train.py checks it
    # The second is the Trinity Large seed run: 2,048 GPUs as 16 replicas of FSDP groups of 128, EP 8 in a node.
    assert (layout.world, layout.dp_replicate, layout.dp_shard, layout.ep) == (2048, 16, 128, 8)
    assert (tc.preset, tc.seq_len, tc.global_batch, tc.optimizer, tc.ac) == ("large", 8192, 12288, "muon", "full")


def test_only_rank_zero_writes_tensorboard(corpus_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torchrun(2, "train.py", *run_args(corpus_dir, tmp_path, "--steps=1", "--log_to=tensorboard"))
    assert len(os.listdir(tmp_path / "tensorboard")) == 1  # one event file: rank 1 wrote none
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, float(np.float32(metrics(tmp_path)[0]["loss"])))]
