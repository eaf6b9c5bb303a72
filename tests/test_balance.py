"""Expert load balancing: the bias update rules by hand, the auxiliary loss by brute force, MaxVio,
and a collapse drill where SMEBU and the sign rule must undo a router skewed toward a few experts."""

import json
import math
import os

import pytest
import torch

import train
from conftest import TINY_MODEL_FLAGS
from model import ModelConfig, Transformer, max_vio, update_expert_bias


def test_smebu_matches_a_hand_computed_step():
    counts = torch.tensor([10.0, 30.0, 20.0, 0.0])  # mean 15
    bias, momentum = torch.zeros(4), torch.tensor([1e-4, 0.0, 0.0, -1e-4])
    update_expert_bias(bias, counts, momentum, "smebu", lam=5e-4, beta=0.5, kappa=2.0)
    v = [(15 - 10) / 15, (15 - 30) / 15, (15 - 20) / 15, (15 - 0) / 15]
    delta = [5e-4 * math.tanh(2 * x) for x in v]
    delta = [d - sum(delta) / 4 for d in delta]  # re-centred
    expect_m = [0.5 * m + 0.5 * d for m, d in zip([1e-4, 0, 0, -1e-4], delta)]
    assert momentum.tolist() == pytest.approx(expect_m, abs=1e-9)
    assert bias.tolist() == pytest.approx(expect_m, abs=1e-9)
    # the tanh clamp: however overloaded, one step moves a bias by at most 2*lambda (clamp plus re-centring)
    momentum2, bias2 = torch.zeros(4), torch.zeros(4)
    update_expert_bias(bias2, torch.tensor([1e6, 0.0, 0.0, 0.0]), momentum2, "smebu", lam=5e-4, beta=0.0, kappa=2.0)
    assert bias2.abs().max() <= 2 * 5e-4 and abs(bias2.sum().item()) < 1e-9


def test_sign_rule_matches_a_hand_computed_step():
    bias = torch.tensor([0.1, 0.0, 0.0, 0.0])
    update_expert_bias(bias, torch.tensor([10.0, 30.0, 20.0, 0.0]), None, "sign", gamma=1e-3)
    # sign(15 - n) = [+1, -1, -1, +1], mean 0: no shift
    assert bias.tolist() == pytest.approx([0.101, -0.001, -0.001, 0.001])
    bias = torch.zeros(3)
    update_expert_bias(bias, torch.tensor([5.0, 5.0, 20.0]), None, "sign", gamma=1e-3)
    # sign(10 - n) = [+1, +1, -1] has mean 1/3: re-centred to [2/3, 2/3, -4/3] gamma
    assert bias.tolist() == pytest.approx([2e-3 / 3, 2e-3 / 3, -4e-3 / 3]) and abs(bias.sum()) < 1e-9


def test_max_vio():
    assert max_vio(torch.tensor([10, 30, 20, 0])) == pytest.approx((30 - 15) / 15)
    assert max_vio(torch.full((8,), 5)) == 0.0


def test_aux_loss_matches_brute_force_and_reaches_the_router():
    cfg = ModelConfig(vocab_size=128, dim=32, n_layers=2, n_dense_layers=1, dense_hidden=64, n_heads=2,
                      n_kv_heads=1, head_dim=16, window=4, max_seq_len=16, n_experts=8, top_k=2, expert_hidden=16,
                      aux_loss_coef=0.5, z_loss_coef=0.0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    moe = model.moe_layers()[0]
    with torch.no_grad():
        moe.expert_bias.copy_(torch.randn(8) * 0.1)  # selection uses s + b; P uses s alone
    x = torch.randn(3, 10, 32)
    _, (_, aux_loss, _) = moe(x)
    B, T, E, K = 3, 10, 8, 2
    expected = 0.0
    for b in range(B):
        s = torch.sigmoid(x[b] @ moe.router.weight.T)
        chosen = torch.topk(s + moe.expert_bias, K, dim=-1).indices
        f = [E / (K * T) * sum(int(i in chosen[t].tolist()) for t in range(T)) for i in range(E)]
        p = [sum((s[t, i] / s[t].sum()).item() for t in range(T)) / T for i in range(E)]
        expected += sum(fi * pi for fi, pi in zip(f, p)) / B
    assert aux_loss.item() == pytest.approx(0.5 * expected, rel=1e-5)
    aux_loss.backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


def run_drill(corpus_dir, out_dir, rule, *flags):
    tc, overrides = train.parse_args([
        f"--data={corpus_dir}", f"--out_dir={out_dir}", "--seq_len=32", "--global_batch=8", "--micro_batch=8",
        "--steps=30", "--log_every=1", "--eval_every=0", "--eval_batches=1", "--sample_tokens=0", "--lr=1e-3",
        f"--balance={rule}", "--bias_step=1e-2", "--drill=skew@0.1",
        *TINY_MODEL_FLAGS, "--n_experts=64", *flags])
    train.main(tc, overrides)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return sum(r["max_vio"] for r in rows[-5:]) / 5, rows[-1]["loss"]


def test_collapse_drill_smebu_and_sign_undo_a_skewed_router(corpus_dir, tmp_path):
    """The first experts start with a large selection bias (a collapsed router). Without balancing the collapse
    stays; SMEBU must bring the worst layer's MaxVio below a third of it, and the sign rule must improve on it."""
    vio = {rule: run_drill(corpus_dir, tmp_path / rule, rule)[0] for rule in ("none", "smebu", "sign")}
    print("collapse drill, mean MaxVio of the last 5 steps:", vio)
    assert vio["smebu"] < vio["none"] / 3, vio
    assert vio["sign"] < vio["none"], vio


def test_global_counts_cover_every_micro_batch_and_rank(corpus_dir, tmp_path):
    """4 ranks (expert-parallel, 2 micro-batches each, activation checkpointing on) see the same tokens-per-expert
    counts, MaxVio and expert biases at every step as one process with the whole batch in one forward."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    from checkpoint import to_hf_state_dict
    # One initial model for both runs, from a Hugging Face folder: each of the 4 ranks reads only its shards.
    tc, overrides = train.parse_args(TINY_MODEL_FLAGS)
    cfg = train.model_config(tc, overrides, vocab_size=100277)
    torch.manual_seed(0)
    os.makedirs(tmp_path / "init")
    save_file(to_hf_state_dict(Transformer(cfg).state_dict()), str(tmp_path / "init" / "model.safetensors"))
    with open(tmp_path / "init" / "config.json", "w") as f:
        json.dump(cfg.to_hf(), f)
    common = [f"--data={corpus_dir}", "--seq_len=32", "--global_batch=8", "--steps=3", "--log_every=1",
              "--eval_every=0", "--eval_batches=1", "--sample_tokens=0", "--resume=none",
              f"--init_from_hf={tmp_path / 'init'}", *TINY_MODEL_FLAGS]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                    "train.py", *common, f"--out_dir={tmp_path / 'four'}", "--micro_batch=1", "--ep=2", "--ac=full"],
                   cwd=root, check=True, capture_output=True, timeout=600)
    tc, overrides = train.parse_args([*common, f"--out_dir={tmp_path / 'one'}", "--micro_batch=8"])
    train.main(tc, overrides)
    rows = {}
    for name in ("four", "one"):
        with open(tmp_path / name / "metrics.jsonl") as f:
            rows[name] = [json.loads(line) for line in f]
    for four, one in zip(rows["four"], rows["one"]):
        for key in ("min_load_layers", "max_load_layers", "dead_experts_layers", "max_vio_layers"):
            assert four[key] == one[key], key
        assert four["bias_norm_layers"] == pytest.approx(one["bias_norm_layers"], rel=1e-5)
        assert four["loss"] == pytest.approx(one["loss"], rel=1e-5)
