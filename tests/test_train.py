"""train.py: the command line, the schedule, short single-process runs (loss falls, NaN guard, resume), and what one
train_step promises (the z-loss in the gradient, a skipped step that changes nothing, the bias freeze step)."""

import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import bench
import data
import parallel
import train
import watch
from conftest import TINY_MODEL_FLAGS
from model import ModelConfig, Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_args(corpus_dir, out_dir, *extra):
    return [f"--data={corpus_dir}", f"--out_dir={out_dir}", "--seq_len=32", "--global_batch=4", "--micro_batch=2",
            "--log_every=1", "--eval_every=0", "--eval_batches=1", "--sample_tokens=0", "--warmup_steps=2",
            "--lr=1e-2", *TINY_MODEL_FLAGS, *extra]


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_mistyped_flag_names_the_closest_one():
    r = subprocess.run([sys.executable, "train.py", "--global_bach=8"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "did you mean --global_batch" in r.stderr
    r = subprocess.run([sys.executable, "train.py", "--balance=smbu"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "smebu" in r.stderr


def test_flags_cover_config_and_model_overrides():
    tc, overrides = train.parse_args(["--steps=7", "--doc_mask=false", "--n_layers=8", "--compile"])
    assert tc.steps == 7 and tc.doc_mask is False and tc.compile is True and overrides == {"n_layers": 8}
    cfg = train.model_config(tc, overrides, vocab_size=100277)
    assert cfg.vocab_size == 100352 and cfg.n_layers == 8 and cfg.n_experts == 256
    tc, overrides = train.parse_args(["--vocab_size=200192", "--max_seq_len=512"])  # the fields it also sets
    cfg = train.model_config(tc, overrides, vocab_size=100277)
    assert cfg.vocab_size == 200192 and cfg.max_seq_len == 512


def test_help_lists_every_flag_with_its_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert exit_.value.code == 0
    assert "--lr LR peak learning rate (default: 0.005)" in shown
    assert "layer i is global when (i+1) % global_every == 0" in shown  # a model field's help with a % in it


@pytest.mark.parametrize("flags, message", [
    (["--steps=0", "--beta1=1.5"], "error: --steps=0 must be at least 1; --beta1=1.5 must be at least 0 and below "
                                   "1."),
    (["--log_every=0"], "--log_every=0 must be at least 1."),
    (["--eval_batches=0"], "--eval_batches=0 must be at least 1."),
    (["--warmup_steps=-3"], "--warmup_steps=-3 must be 0 or more."),
    (["--keep_ckpts=0"], "--keep_ckpts=0 must be at least 1."),
    (["--decay=step", "--steps=0"], "--steps=0 must be at least 1; --decay=step must be one of cosine, linear, wsd."),
])
def test_out_of_range_flag_is_one_sentence_before_anything_runs(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--dim=0", "--window=0"], "--dim=0 must be at least 1; --window=0 must be at least 1."),
    (["--norm_eps=-1"], "norm_eps=-1.0 must be above 0"),
    (["--n_kv_heads=0"], "n_kv_heads=0 must be at least 1"),
    (["--max_seq_len=32", "--seq_len=64"], "--max_seq_len=32 is below --seq_len=64"),
])
def test_impossible_model_override_is_one_sentence(flags, message):
    tc, overrides = train.parse_args(flags)
    with pytest.raises(ValueError, match=re.escape(message)):
        train.model_config(tc, overrides, vocab_size=100277)


def test_missing_checkpoint_or_hf_folder_is_an_error_not_a_traceback(corpus_dir, tmp_path):
    for flag, message in (("--resume=/nonexistent", "error: checkpoint path /nonexistent does not exist; give a "),
                          ("--init_from_hf=/nonexistent", "error: /nonexistent has no config.json")):
        r = subprocess.run([sys.executable, "train.py", *run_args(corpus_dir, tmp_path, "--steps=1"), flag],
                           cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd"])
def test_lr_schedule_warms_up_then_decays_to_the_floor(decay):
    tc = train.TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1, decay=decay)
    lrs = [train.lr_at(s, tc) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b - 1e-12 for a, b in zip(lrs[9:], lrs[10:]))  # never increases after warmup
    assert lrs[-1] == pytest.approx(0.1, abs=0.02)
    if decay == "wsd":
        assert lrs[79] == pytest.approx(1.0)  # constant until the last 20%


def test_short_run_loss_falls_and_logs_everything(corpus_dir, tmp_path):
    tc, overrides = train.parse_args(run_args(corpus_dir, tmp_path, "--steps=30", "--eval_every=15"))
    result = train.main(tc, overrides)
    rows = metrics(tmp_path)
    assert len(rows) == 30 and result["val_loss"] is not None
    assert sum(r["loss"] for r in rows[-5:]) / 5 < rows[0]["loss"] - 2.0
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "max_vio", "max_vio_layers",
                "dead_experts_layers", "aux_loss", "z_loss"):
        assert key in rows[-1]
    assert "val_loss" in rows[14] and "val_loss" in rows[29]
    assert abs(rows[0]["lm_loss"] - math.log(100352)) < 0.5
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["model"]["dim"] == 64


def test_data_without_a_validation_set_trains_and_skips_validation(tmp_path, capsys):
    """Data prepared with --val_fraction=0 has no val split: train.py says so in one line and never evaluates."""
    stdlib = os.path.dirname(json.__file__)
    data.prepare([os.path.join(stdlib, "*.py")], str(tmp_path / "data"), val_fraction=0, workers=1, quiet=True)
    tc, overrides = train.parse_args(run_args(tmp_path / "data", tmp_path / "run", "--steps=2", "--eval_every=1"))
    result = train.main(tc, overrides)
    said = capsys.readouterr().out
    assert f"no validation set in {tmp_path / 'data'} (a Megatron-LM dataset, or prepared with --val_fraction=0" in said
    assert result["step"] == 2 and result["val_loss"] is None and "| val loss" not in said
    rows = metrics(tmp_path / "run")
    assert len(rows) == 2 and not any("val_loss" in row for row in rows)


def test_model_that_cannot_fit_in_memory_is_an_error(corpus_dir, tmp_path, monkeypatch):
    """train.main asks build_model to check room for the weights, gradients and both AdamW moments (4 copies): a
    machine with room for 3 refuses the run with the sentence train.py prints as its error."""
    tc, overrides = train.parse_args(run_args(corpus_dir, tmp_path, "--steps=1"))
    n_bytes = 4 * sum(p.numel() for p in train.meta_model(train.model_config(tc, overrides, 100352)).parameters())
    monkeypatch.setattr(train.parallel, "host_memory_available", lambda: 3 * n_bytes)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="the weights, gradients and optimizer state need"):
        train.main(tc, overrides)

def test_non_finite_step_is_skipped_with_its_batch(corpus_dir, tmp_path):
    """The NaN step's batch is skipped data: step 2 is taken again on the next batch, and four updates are made."""
    tc, overrides = train.parse_args(run_args(corpus_dir, tmp_path, "--steps=4", "--drill=nan@1"))
    train.main(tc, overrides)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["data_step"] for r in rows] == [0, 2, 3, 4]
    assert rows[-1]["skipped_steps"] == 1 and all(math.isfinite(r["loss"]) for r in rows)


def test_a_burst_of_non_finite_steps_with_no_rollback_left_stops_the_run(corpus_dir, tmp_path):
    tc, overrides = train.parse_args(run_args(corpus_dir, tmp_path, "--steps=4", "--drill=nan@1,2",
                                              "--max_rollbacks=0", "--spike_rollback=2"))
    with pytest.raises(watch.Stopped, match="^2 bad steps within 50 steps, the first at step 2, beyond --max_rollb"):
        train.main(tc, overrides)


def test_compile_defaults_on_with_cuda_only(monkeypatch):
    """Blocks compile by default where a GPU computes (there it is faster), not on the CPU; a flag or a config file
    decides otherwise."""
    assert train.parse_args([])[0].compile is False  # the tests choose the CPU (NANOTITAN_DEVICE=cpu)
    monkeypatch.setattr(train.parallel, "use_cuda", lambda: True)
    assert train.parse_args([])[0].compile is True
    assert train.parse_args(["--compile=false"])[0].compile is False


def test_closing_sample_is_shown_up_to_its_end_of_text(capsys):
    """train.py's closing sample draws all --sample_tokens tokens on every rank (a rank that stopped alone would leave
    the others waiting in the forward) and shows them up to the first end-of-text after the prompt."""
    enc = data.get_encoding("cl100k_base")
    prompt = enc.encode("def ")
    drawn = enc.encode(" f(x):") + [enc.eot_token] + enc.encode("import os")
    cfg = SimpleNamespace(vocab_size=100352)
    run = SimpleNamespace(device=torch.device("cpu"), tc=SimpleNamespace(seed=0, sample_tokens=len(drawn)), cfg=cfg)
    asked = {}

    def generate(tokens_BT, n, **kwargs):
        asked.update(kwargs, n=n)
        return torch.tensor([tokens_BT[0].tolist() + drawn])

    train.sample(run, SimpleNamespace(eval=lambda: None, generate=generate), "cl100k_base")
    assert asked["n"] == len(drawn) and "stop_id" not in asked
    assert capsys.readouterr().out == "sample:\n" + enc.decode(prompt + drawn[:drawn.index(enc.eot_token) + 1]) + "\n"


def test_validation_masks_documents_as_training_does():
    """evaluate gives the model the batch's document ids with --doc_mask (the default) and none without it, as
    forward_backward does, so that val_loss is measured under the attention the model trains with."""
    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, tokens_BT, targets_BT, doc_ids_BT):
            seen.append(doc_ids_BT)
            return self.w + 1.0

    batch = (torch.zeros(2, 4, dtype=torch.long),) * 2 + (torch.tensor([[0, 0, 1, 1]] * 2),)
    loader = SimpleNamespace(val_batches=lambda n: [batch] * n)
    for doc_mask in (True, False):
        assert train.evaluate(Model(), loader, 2, 1, torch.autocast("cpu", enabled=False), doc_mask) == 1.0
        assert all((ids is not None) == doc_mask for ids in seen) and len(seen) == 4
        seen.clear()


# --- one step, as the loop makes it

# Two MoE layers after a dense one, 8 experts, a 128-token vocabulary: a step in milliseconds.
STEP_CFG = ModelConfig(vocab_size=128, dim=32, n_layers=3, n_dense_layers=1, dense_hidden=64, n_heads=2, n_kv_heads=1,
                       head_dim=16, window=8, max_seq_len=16, n_experts=8, top_k=2, expert_hidden=16)
NO_AUTOCAST = torch.autocast("cpu", enabled=False)


def step_setup(cfg: ModelConfig, **flags):
    """(model, train.py's optimizer for it, a TrainConfig of 4 sequences of 16 tokens in one micro-batch, a zero
    balancing momentum)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    tc = train.TrainConfig(global_batch=4, micro_batch=4, seq_len=16, **flags)
    return model, parallel.build_optimizer(model, tc), tc, torch.zeros(len(model.moe_layers()), cfg.n_experts)


def random_batch(step: int):
    """(tokens_BT, targets_BT, doc_ids_BT): 4 random sequences of 16 tokens, one document each, seeded by step."""
    rows_BT = torch.randint(0, STEP_CFG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(step))
    return rows_BT[:, :-1], rows_BT[:, 1:], torch.zeros(4, 16, dtype=torch.long)


def biases(model) -> torch.Tensor:
    return torch.stack([moe.expert_bias.clone() for moe in model.moe_layers()])


def test_router_z_loss_reaches_the_gradient_the_optimizer_applies():
    """With z_loss_coef > 0, each router's gradient that forward_backward hands the optimizer is that of lm loss + aux
    loss + z-loss, the z-loss computed here from each MoE layer's input: coef * mean over tokens of logsumexp(router
    logits)^2, summed over the MoE layers."""
    cfg = dataclasses.replace(STEP_CFG, z_loss_coef=1e-2)
    model, optimizer, tc, momentum_LE = step_setup(cfg, grad_clip=0.0)  # unclipped: the gradient as backward left it
    reference = copy.deepcopy(model)
    handed = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: handed.extend(moe.router.weight.grad.clone() for moe in model.moe_layers()))
    batch = random_batch(0)
    out = bench.train_step(model, optimizer, batch, tc, NO_AUTOCAST, momentum_LE, [0])

    inputs_BTD = []  # each MoE layer's input, in layer order
    for moe in reference.moe_layers():
        moe.register_forward_pre_hook(lambda module, args: inputs_BTD.append(args[0]))
    tokens_BT, targets_BT, doc_ids_BT = batch
    lm_loss, stats = reference(tokens_BT, targets_BT=targets_BT, doc_ids_BT=doc_ids_BT, return_stats=True)
    routers = [moe.router.weight for moe in reference.moe_layers()]
    z_loss = sum(cfg.z_loss_coef * torch.logsumexp(x_BTD.flatten(0, 1) @ w.T, -1).pow(2).mean()
                 for x_BTD, w in zip(inputs_BTD, routers))
    z_grads = torch.autograd.grad(z_loss, routers, retain_graph=True)
    (lm_loss + stats.aux_loss + z_loss).backward()
    assert out["z_loss"] == pytest.approx(z_loss.item(), rel=1e-5)
    assert len(handed) == len(routers) == 2
    for got, router, z_grad in zip(handed, routers, z_grads):
        assert z_grad.norm() > 0.1 * router.grad.norm()  # a share of the gradient that leaving it out would show
        torch.testing.assert_close(got, router.grad, rtol=1e-5, atol=1e-8)


def test_bias_freeze_step_stops_the_bias_updates_exactly_there():
    """--bias_freeze_step=N: steps 0 .. N-1 (the loop's state.step, counted from 0) move the expert bias; step N and
    the steps after it leave it where it is."""
    freeze = 2
    model, optimizer, tc, momentum_LE = step_setup(STEP_CFG, bias_freeze_step=freeze)
    seen = [biases(model)]
    for step in range(freeze + 2):
        bench.train_step(model, optimizer, random_batch(step), tc, NO_AUTOCAST, momentum_LE, [step])
        seen.append(biases(model))
    moved = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    assert moved == [True] * freeze + [False] * 2


def test_threads_sets_the_cpu_threads_of_the_run(corpus_dir, tmp_path):
    """--threads=1: one torch thread per process (on a busy CPU, threads waiting for a core stall each other)."""
    before = torch.get_num_threads()
    try:
        train.main(*train.parse_args(run_args(corpus_dir, tmp_path, "--steps=1", "--threads=1")))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
