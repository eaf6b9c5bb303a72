"""parallel.Muon: the update of torch.optim.Muon and of an independent Newton-Schulz written here; on 8 gloo ranks
(HSDP + EP) the same parameters as one process, with no rank gathering more than its share of the matrices; a
checkpoint saved on one layout and resumed on two others; and Muon against AdamW on a short tiny-model run.

    python -m pytest tests/test_muon.py -q

The multi-rank runs are this file under torchrun (`python -m torch.distributed.run --standalone --nproc_per_node=8
tests/test_muon.py OUT_DIR`); one launch runs both layouts."""

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

import checkpoint
import parallel
import train
from conftest import TINY_MODEL_FLAGS, run_worker, torchrun
from model import ModelConfig, Transformer

# 12 experts: on R2_S4_ep2 each rank holds 3 whole experts, on R1_S8_ep2 the efsdp shards are 2, 2, 2 and 0 experts.
# dense_hidden 100: the dense FFN's rows split unevenly over 8 ranks (13 x 7 + 9).
CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_dense_layers=1, dense_hidden=100, n_heads=4, n_kv_heads=2,
                  head_dim=16, window=8, max_seq_len=16, n_experts=12, n_shared_experts=1, top_k=4,
                  expert_hidden=32, init_std=0.05, aux_loss_coef=1e-2, z_loss_coef=1e-3)
GLOBAL_BATCH, SEQ, STEPS, CKPT_STEP, LR, MUON_LR = 16, 16, 3, 2, 1e-2, 2e-2
ADAM_EPS = 1e-3  # as in test_parallel.py: bounds how much AdamW amplifies rounding differences between layouts
LAYOUTS = {"uninterrupted": dict(dp_replicate=2, ep=2), "resumed": dict(dp_replicate=1, ep=2)}


def make_optimizer(model) -> parallel.Muon:
    """train.py's optimizer, as --optimizer=muon builds it."""
    tc = train.TrainConfig(optimizer="muon", lr=LR, muon_lr=MUON_LR)
    optimizer = parallel.build_optimizer(model, tc, fused=False)
    for group in optimizer.param_groups:
        if not group["muon"]:
            group["eps"] = ADAM_EPS
    return optimizer


def train_step(model, optimizer, batch, rank, world):
    local = GLOBAL_BATCH // world
    mine = batch[rank * local:(rank + 1) * local]
    lm_loss, stats = model(mine[:, :-1], targets_BT=mine[:, 1:], return_stats=True)
    (lm_loss + stats.balance_loss).backward()
    optimizer.step()
    optimizer.zero_grad()


def dense_matrices() -> list[int]:
    """Elements of each row-sharded Muon matrix (the hidden 2-D weights; not the routed experts)."""
    model = Transformer(CFG)
    optimizer = make_optimizer(model)
    return [p.numel() for g in optimizer.param_groups if g["muon"] for p in g["params"] if p.dim() == 2]


# ------------------------------------------------------------------------------------------------------------------
# One process: the update itself

def reference_newton_schulz(g, steps=5):
    """Keller Jordan's iteration in float64, one matrix at a time, written out."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason=f"torch {torch.__version__} has no torch.optim.Muon")
def test_matches_torch_muon():
    """Newton-Schulz in bf16 (as torch.optim.Muon always runs it): the same parameters, step for step."""
    torch.manual_seed(0)
    shapes = [(48, 24), (24, 48), (32, 32)]
    ours = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = parallel.Muon(ours, lr=2e-2, weight_decay=0.1, momentum=0.95)
    opt._dtype = lambda device: torch.bfloat16
    ref = torch.optim.Muon(theirs, lr=2e-2, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="original")
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q)


def test_fp32_stacks_and_adamw_match_references():
    """fp32 Newton-Schulz against the float64 one above, on a matrix and on a stack of expert matrices (each
    orthogonalised separately, with its own shape's LR factor); plain momentum form (buf = mu buf + g), lr_scale;
    the AdamW group against torch.optim.AdamW."""
    torch.manual_seed(0)
    lr, scale, wd, mu = 1e-3, 20.0, 0.1, 0.95
    matrix, stack, gain = torch.randn(40, 24) * 0.1, torch.randn(3, 24, 40) * 0.1, torch.randn(24)
    ours = [torch.nn.Parameter(t.clone()) for t in (matrix, stack, gain)]
    twin_gain = torch.nn.Parameter(gain.clone())
    opt = parallel.Muon([{"params": ours[:2], "lr_scale": scale, "weight_decay": wd},
                         {"params": [ours[2]], "muon": False, "weight_decay": 0.0}], lr=lr, momentum=mu)
    adamw = torch.optim.AdamW([twin_gain], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    want = [matrix.double(), stack.double()]
    bufs = [torch.zeros_like(w) for w in want]
    for _ in range(3):
        grads = [torch.randn(p.shape) for p in ours]
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        twin_gain.grad = grads[2].clone()
        opt.step()
        adamw.step()
        for i, w in enumerate(want):
            bufs[i] = mu * bufs[i] + grads[i].double()
            update = grads[i].double() + mu * bufs[i]  # Nesterov
            slices = [update] if update.dim() == 2 else list(update)
            o = torch.stack([reference_newton_schulz(s) for s in slices]).reshape(w.shape)
            rows, cols = w.shape[-2:]
            want[i] = w * (1 - lr * scale * wd) - lr * scale * math.sqrt(max(1, rows / cols)) * o
        for p, w in zip(ours[:2], want):
            torch.testing.assert_close(p.double(), w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours[2], twin_gain)
    # What the iteration is for: every singular value of the update lands near 1.
    sv = torch.linalg.svdvals(parallel.newton_schulz(torch.randn(1, 40, 24))[0])
    assert sv.min() > 0.6 and sv.max() < 1.3


def test_build_optimizer_groups():
    model = Transformer(CFG)
    adamw = parallel.build_optimizer(model, train.TrainConfig(), fused=False)
    assert isinstance(adamw, torch.optim.AdamW)
    optimizer = parallel.build_optimizer(model, train.TrainConfig(optimizer="muon", lr=2e-3, muon_lr=8e-3), fused=False)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    assert {n for n in muon if "layers.1." in n} == {
        f"layers.1.attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj")} | {
        f"layers.1.ffn.shared.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")} | {
        "layers.1.ffn.experts.gate_up_proj", "layers.1.ffn.experts.down_proj"}
    assert "layers.0.ffn.up_proj.weight" in muon  # the dense FFN
    assert not muon & {"embed.weight", "head.weight", "layers.1.ffn.router.weight", "norm.weight"}
    assert len(muon) + sum(len(g["params"]) for g in optimizer.param_groups if not g["muon"]) == len(names)
    assert [g["lr_scale"] for g in optimizer.param_groups] == [4.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------------------------------------
# 8 ranks: the worker (this file under torchrun)

def worker(out: Path):
    """Both layouts in turn (run_worker tears the process group down); each saves its final parameters and what
    Muon gathered per rank: the elements its exchanges brought it whole (the first of each round's two all-to-alls
    brings rows in, the second takes results back), how many matrices and the largest."""
    rank, world, device = parallel.init_distributed(timeout_s=120)
    init = torch.load(out / "init.pt")
    received = []  # elements each all-to-all of this step brought this rank
    all_to_all = dist.all_to_all_single

    def recorded(output, *args, **kwargs):
        received.append(output.numel())
        return all_to_all(output, *args, **kwargs)

    dist.all_to_all_single = recorded
    for name, layout_kwargs in LAYOUTS.items():
        layout = parallel.Layout(world, **layout_kwargs)
        layout.check(CFG, GLOBAL_BATCH, GLOBAL_BATCH // world)
        mesh = parallel.build_mesh(layout, device.type)
        model = parallel.build_model(CFG, layout, mesh, device)
        optimizer = make_optimizer(model)
        if name == "resumed":  # another layout: R1_S8 instead of R2_S4, 0-2 experts per rank instead of 3
            checkpoint.load(str(out / "ckpt"), {"model": model, "optim": optimizer})
        else:
            set_model_state_dict(model, dict(init["state_dict"]), options=StateDictOptions(full_state_dict=True))
        gathered = []
        for step in range(CKPT_STEP if name == "resumed" else 0, STEPS):
            received.clear()
            train_step(model, optimizer, init["tokens"][step], rank, world)
            whole = received[::2]
            gathered.append({"elements": sum(whole), "matrices": sum(n > 0 for n in whole),
                             "peak": max(whole, default=0)})
            if name == "uninterrupted" and step + 1 == CKPT_STEP:
                checkpoint.save(str(out / "ckpt"), CKPT_STEP, {"model": model, "optim": optimizer},
                                {"model": CFG})
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        per_rank = [None] * world
        dist.all_gather_object(per_rank, gathered)
        if rank == 0:
            torch.save({"state_dict": full, "gathered": per_rank}, out / f"{name}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process run, the 8-rank runs and a single process resumed from the 8-rank checkpoint."""
    out = tmp_path_factory.mktemp("muon")
    torch.manual_seed(0)
    model = Transformer(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(1))
    torch.save({"state_dict": model.state_dict(), "tokens": tokens}, out / "init.pt")
    torchrun(8, str(Path(__file__).resolve()), str(out))
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        train_step(model, optimizer, tokens[step], 0, 1)
    single = Transformer(CFG)
    single_opt = make_optimizer(single)
    with warnings.catch_warnings():  # "written by 8 ranks and this run has 1", and DCP's single-process notice
        warnings.simplefilter("ignore")
        checkpoint.load(str(out / "ckpt"), {"model": single, "optim": single_opt})
    for step in range(CKPT_STEP, STEPS):
        train_step(single, single_opt, tokens[step], 0, 1)
    results = {name: torch.load(out / f"{name}.pt") for name in LAYOUTS}
    return model.state_dict(), single.state_dict(), results


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eight_ranks_match_one_process(runs, name):
    """R2_S4_ep2 for three steps, and R1_S8_ep2 resumed from its step-2 checkpoint: the single-process parameters."""
    reference, _, results = runs
    state_dict = results[name]["state_dict"]
    assert state_dict.keys() == reference.keys()
    for key, want in reference.items():
        torch.testing.assert_close(state_dict[key], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_one_process_resumes_an_eight_rank_checkpoint(runs):
    reference, single, _ = runs
    for key, want in reference.items():
        torch.testing.assert_close(single[key], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_no_rank_gathers_more_than_its_share(runs, name):
    """Each rank assembles at most one whole matrix at a time and about 1/S of the dense matrices per step; the
    dense matrices are assembled once per replica, and the routed experts never."""
    _, _, results = runs
    R = LAYOUTS[name]["dp_replicate"]
    S = 8 // R
    sizes = dense_matrices()
    for step in range(len(results[name]["gathered"][0])):
        per_rank = [g[step] for g in results[name]["gathered"]]
        assert all(g["peak"] <= max(sizes) for g in per_rank)
        assert all(g["elements"] <= sum(sizes) / S + max(sizes) for g in per_rank)
        assert sum(g["elements"] for g in per_rank) == R * sum(sizes)
        assert sum(g["matrices"] for g in per_rank) == R * len(sizes)


# ------------------------------------------------------------------------------------------------------------------
# The tiny model: Muon against AdamW


def test_muon_beats_adamw_on_a_short_tiny_run(corpus_dir, tmp_path):
    """60 steps of the toy-width model, each optimizer at the best LRs of a sweep at exactly these settings (val loss:
    AdamW 7.45 / 7.32 / 7.34 at lr 2e-2 / 4e-2 / 8e-2; Muon 7.19 / 7.24 at muon_lr 5e-2 / 1e-1 with lr 4e-2)."""
    val = {}
    for name, flags in (("adamw", ["--optimizer=adamw", "--lr=4e-2"]),
                        ("muon", ["--optimizer=muon", "--lr=4e-2", "--muon_lr=5e-2"])):
        tc, overrides = train.parse_args([
            f"--data={corpus_dir}", f"--out_dir={tmp_path / name}", "--seq_len=32", "--global_batch=4",
            "--micro_batch=2", "--steps=60", "--warmup_steps=2", "--log_every=20", "--eval_every=0",
            "--eval_batches=4", "--sample_tokens=0", *TINY_MODEL_FLAGS, *flags])
        val[name] = train.main(tc, overrides)["val_loss"]
    print(f"val loss after 60 steps: {val}")
    assert val["muon"] < val["adamw"] - 0.05


if __name__ == "__main__":
    run_worker(worker, Path(sys.argv[1]))
