"""train.py on mixtures of sources in phases and on a Megatron-LM dataset: what a run logs by source, what a resume
reads, and what a resume with another mixture must be told.

    python -m pytest tests/test_mixture.py -q
"""

import json
import os
import re
import shutil

import pytest

import data
import train
import watch
from conftest import TINY_MODEL_FLAGS, torchrun

MEGATRON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron", "text_document")


def args(spec, out_dir, *extra):
    return [f"--data={spec}", f"--out_dir={out_dir}", "--seq_len=32", "--global_batch=8", "--micro_batch=4",
            "--log_every=1", "--eval_every=0", "--eval_batches=1", "--sample_tokens=0", "--warmup_steps=2",
            "--lr=1e-2", *TINY_MODEL_FLAGS, *extra]


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def csv_dir(tmp_path_factory):
    """A second prepared source with a val split: the standard library's csv and argparse modules."""
    out = str(tmp_path_factory.mktemp("csv"))
    stdlib = os.path.dirname(os.__file__)
    data.prepare([os.path.join(stdlib, "csv.py"), os.path.join(stdlib, "argparse.py")], out_dir=out,
                 val_fraction=0.5, workers=1, quiet=True)
    return out


def test_a_megatron_dataset_trains(tmp_path, capsys):
    """Megatron-LM's own writer made it (tests/megatron/make_fixture.py): the model learns from it, its documents
    masked as its index says, and the run says it has no validation set."""
    result = train.main(*train.parse_args(args(MEGATRON, tmp_path, "--steps=20")))
    rows = metrics(tmp_path)
    assert f"no validation set in {MEGATRON} (a Megatron-LM dataset, or prepared with --val_fraction=0): not " \
           f"validated" in capsys.readouterr().out
    assert result["step"] == 20 and result["val_loss"] is None
    assert sum(r["loss"] for r in rows[-5:]) / 5 < rows[0]["loss"] - 3.0
    assert rows[-1]["epochs_by_source"] == {MEGATRON: round(20 * 8 / 88, 4)}  # 2,818 tokens: 88 windows of 33
    config = json.load(open(tmp_path / "config.json"))
    assert config["tokenizer"]["name"] == "cl100k_base" and config["model"]["vocab_size"] == 100352
    assert config["data"]["sources"] == {MEGATRON: data.load_manifest(MEGATRON)["fingerprint"]}


def test_a_mixture_logs_its_tokens_loss_epochs_and_validation_by_source(corpus_dir, csv_dir, tmp_path, capsys,
                                                                        monkeypatch):
    """Every step records each source's tokens (its sequences that step), their mean loss, which weighs up to the
    step's loss, and its epochs so far; every evaluation, each source's own validation loss and their mean. A phase
    that leaves a source out gives it no tokens and no loss; a source read more often than REPEATED_EPOCHS (4, here a
    quarter, to see it in a few steps) is warned about once."""
    monkeypatch.setattr(watch, "REPEATED_EPOCHS", 0.25)
    spec = f"{corpus_dir}:1,{csv_dir}:1,{MEGATRON}:2;4={csv_dir}:1,{MEGATRON}:3"
    loader = data.DataLoader(spec, seq_len=32, global_batch=8)
    train.main(*train.parse_args(args(spec, tmp_path, "--steps=7", "--eval_every=3")))
    rows = metrics(tmp_path)
    sources = [corpus_dir, csv_dir, MEGATRON]
    for step, row in enumerate(rows):
        tokens = dict(zip(sources, 32 * loader.counts(step)))
        assert row["tokens_by_source"] == tokens and sum(tokens.values()) == 8 * 32
        assert set(row["loss_by_source"]) == {path for path, n in tokens.items() if n}
        weighted = sum(loss * tokens[path] for path, loss in row["loss_by_source"].items()) / (8 * 32)
        assert weighted == pytest.approx(row["lm_loss"], rel=1e-5)
        assert row["epochs_by_source"] == {path: round(e, 4) for path, e in zip(sources, loader.epochs(step))}
    assert rows[3]["tokens_by_source"][corpus_dir] > 0 and rows[4]["tokens_by_source"][corpus_dir] == 0  # 4 steps on
    for row in (rows[2], rows[5], rows[6]):
        by_source = row["val_loss_by_source"]
        assert set(by_source) == {corpus_dir, csv_dir}  # a Megatron-LM dataset has no val split
        assert row["val_loss"] == pytest.approx(sum(by_source.values()) / 2)
    said = capsys.readouterr().out
    assert f"no validation set in {MEGATRON} (a Megatron-LM dataset, or prepared with --val_fraction=0)" in said
    repeats = [line for line in said.splitlines() if "(epochs)" in line]
    first = next(row for row in rows if row["epochs_by_source"][MEGATRON] > 0.25)
    assert repeats == [f"warning: {MEGATRON} has been read {first['epochs_by_source'][MEGATRON]:.2f} times (epochs): "
                       f"add data or lower its weight"]


def test_a_changed_mixture_on_resume_is_refused_unless_allowed_and_is_recorded(corpus_dir, csv_dir, tmp_path, capsys):
    """The data a checkpoint trained on is its sources' fingerprints and weights by phase: the same mixture written
    in another order, or from a copy, is the same; a new phase (here adding a source from the resume step on) is a
    curriculum change, refused unless --allow_changed=data, then recorded with the step it applies from."""
    first = f"{corpus_dir}:3,{csv_dir}:1"
    train.main(*train.parse_args(args(first, tmp_path, "--steps=2")))
    copy = shutil.copytree(corpus_dir, tmp_path / "copy")
    same = f"{csv_dir}:0.25,{copy}:0.75"
    train.main(*train.parse_args(args(same, tmp_path, "--steps=3")))
    newest = tmp_path / "checkpoints" / "step_00000003"
    changed = f"{same};3={csv_dir}:1,{MEGATRON}:1"
    with pytest.raises(ValueError, match=re.escape(f"--data={changed} is not the data checkpoint {newest} was trained "
                                                   f"on ({same}); resume with --data={same}, or pass "
                                                   f"--allow_changed=data to train on the new data from here on.")):
        train.main(*train.parse_args(args(changed, tmp_path, "--steps=4")))
    train.main(*train.parse_args(args(changed, tmp_path, "--steps=4", "--allow_changed=data")))
    said = capsys.readouterr().out
    assert "data: read as if the new --data had held from step 0; --data='OLD;STEP=NEW' keeps the steps before" in said
    logged = metrics(tmp_path)  # phase ";3=" shapes step 3 counted from 0: the 4th step, logged as step 4
    assert (logged[2]["step"], logged[2]["data_step"], set(logged[2]["tokens_by_source"])) == (3, 2, {str(copy),
                                                                                                      csv_dir})
    assert (logged[3]["step"], logged[3]["data_step"]) == (4, 3)
    assert logged[3]["tokens_by_source"] == {str(copy): 0, csv_dir: 128, MEGATRON: 128}
    config = json.load(open(tmp_path / "config.json"))
    assert config["from_step"] == 3 and config["data"]["phases"] == {"0": {csv_dir: 0.25, str(copy): 0.75},
                                                                      "3": {csv_dir: 0.5, MEGATRON: 0.5}}
    kept = [json.load(open(tmp_path / "checkpoints" / f"step_0000000{n}" / "config.json")) for n in (2, 3)]
    assert [c["train"]["data"] for c in kept] == [first, same]  # each checkpoint keeps the settings it was saved with
    assert kept[0]["data"]["fingerprint"] == kept[1]["data"]["fingerprint"] != config["data"]["fingerprint"]


def test_a_mixture_resumed_on_two_ranks_reads_and_logs_what_one_rank_did(corpus_dir, csv_dir, tmp_path):
    """A run stopped after 2 steps and resumed on 2 ranks across a phase boundary reads the tokens of an uninterrupted
    1-rank run, and its loss by source, summed over both ranks, is that run's (within float32 rounding)."""
    spec = f"{corpus_dir}:3,{csv_dir}:1;2={csv_dir}:1,{MEGATRON}:1"
    train.main(*train.parse_args(args(spec, tmp_path / "whole", "--steps=3")))
    train.main(*train.parse_args(args(spec, tmp_path / "split", "--steps=2")))
    torchrun(2, "train.py", *args(spec, tmp_path / "split", "--steps=3"))
    whole = metrics(tmp_path / "whole")
    split = metrics(tmp_path / "split")
    assert [r["tokens_sum"] for r in split] == [r["tokens_sum"] for r in whole]
    assert split[2]["tokens_by_source"] == whole[2]["tokens_by_source"] == {corpus_dir: 0, csv_dir: 128, MEGATRON: 128}
    assert split[2]["loss_by_source"] == pytest.approx(whole[2]["loss_by_source"], rel=1e-4)
    assert split[2]["val_loss_by_source"] == pytest.approx(whole[2]["val_loss_by_source"], rel=1e-4)


def test_a_toml_config_gives_a_mixture_as_the_flag_spells_it(corpus_dir, csv_dir, tmp_path, capsys):
    """data = "PATH:WEIGHT,...;STEP=..." in [train]: the mixture the flag gives; a table there is one sentence."""
    phased = tmp_path / "phased.toml"
    phased.write_text(f'[train]\ndata = "{corpus_dir}:0.75,{csv_dir}:0.25;120000={csv_dir}"\n')
    tc, _ = train.parse_args([f"--config={phased}"])
    assert data.Mixture(tc.data).identity() == data.Mixture(f"{corpus_dir}:3,{csv_dir}:1;120000={csv_dir}").identity()
    table = tmp_path / "table.toml"
    table.write_text(f'[train.data]\n"{corpus_dir}" = 3\n')
    with pytest.raises(SystemExit):
        train.parse_args([f"--config={table}"])
    assert f"--config={table} sets train.data to {{'{corpus_dir}': 3}}, which is not a valid string." in \
        capsys.readouterr().err
