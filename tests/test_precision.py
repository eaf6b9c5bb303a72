"""--precision=fp8 and mxfp8 on CPU, where torchao emulates both: each converted matmul against high precision, a
short training run against the high-precision one, 2 ranks against one process, and the guardrail that returns a
run to bf16 after a rollback.

    python -m pytest tests/test_precision.py -q

The bounds are measured here (torch 2.13 CPU, torchao 0.18) with a margin; a new torchao that changes a recipe's
rounding moves them, and the numbers measured are in the README.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import bench
import checkpoint
import parallel
import train
from conftest import run_worker, torchrun
from model import GroupedExperts, ModelConfig, meta_model
from test_health import BURST, GUARD
from test_resume import EXACT, args, rows, run_here, tensors, train_state

pytest.importorskip("torchao")

# One MoE block (a dense block's FFN linears are converted alike), every converted width a multiple of MXFP8's 32.
CFG = ModelConfig(vocab_size=128, dim=64, n_layers=1, n_dense_layers=0, dense_hidden=128, n_heads=4, n_kv_heads=2,
                  head_dim=16, window=8, max_seq_len=32, n_experts=8, n_shared_experts=1, top_k=2,
                  expert_hidden=32, init_std=0.05)
CPU = torch.device("cpu")
LOW = ("fp8", "mxfp8")
STEPS, BATCH, SEQ = 20, 4, 32
# Measured: the 20 steps' largest |loss - high precision's| is 0.057 (fp8), 0.090 (mxfp8); the loss falls 4.93 -> 0.67.
LOSS_BOUND = 0.2
# Measured, the lowest SQNR of a converted matmul's output, input gradient and weight gradients: 28.1 dB for every
# linear in fp8 (rowwise) and mxfp8 alike (e4m3 values with power-of-two scales round each value's mantissa the same
# way), 23.4 dB for mxfp8's routed experts (their grouped GEMM's output is bf16 besides). Floors a little below.
SQNR_FLOOR_DB = {"linear": 27.0, "experts": 22.0}


def sqnr_db(want: torch.Tensor, got: torch.Tensor) -> float:
    """Signal to quantisation noise: 10·log10(|want|² / |want - got|²)."""
    return (10 * torch.log10(want.float().pow(2).sum() / (want.float() - got.float()).pow(2).sum())).item()


def tokens(steps: int, batch: int, seed: int = 1) -> torch.Tensor:
    """Rows counting up from a random start (modulo the vocabulary): a language a tiny model learns in 20 steps."""
    starts = torch.randint(0, CFG.vocab_size, (steps, batch, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(SEQ + 1)) % CFG.vocab_size


def config(precision: str, micro_batch: int = BATCH, **layout) -> train.TrainConfig:
    return train.TrainConfig(global_batch=BATCH, micro_batch=micro_batch, seq_len=SEQ, lr=1e-2, warmup_steps=2,
                             steps=STEPS, dtype="fp32", doc_mask=False, precision=precision, **layout)


def train_steps(run: train.Run, model, batches: torch.Tensor) -> dict:
    """train.py's step (bench.train_step) on this rank's rows of each global batch: the losses and gradient norms,
    and the first step's gradients (whole, on rank 0's CPU)."""
    optimizer = parallel.build_optimizer(model, run.tc)
    record = {"loss": [], "grad_norm": []}

    def keep_first_grads(optimizer, args, kwargs):
        if "grads" not in record:
            record["grads"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                               for n, p in model.named_parameters()}
    optimizer.register_step_pre_hook(keep_first_grads)
    momentum_LE = torch.zeros(len(model.moe_layers()), CFG.n_experts)
    rows_per_rank = BATCH // run.layout.world
    steps = [0]
    for b in batches:
        mine = b[run.rank * rows_per_rank:(run.rank + 1) * rows_per_rank]
        out = bench.train_step(model, optimizer, (mine[:, :-1], mine[:, 1:], torch.zeros_like(mine[:, 1:])), run.tc,
                               run.autocast, momentum_LE, steps)
        record["loss"].append(out["loss"])
        record["grad_norm"].append(out["grad_norm"])
    return record


def single_process(precision: str, batches: torch.Tensor, micro_batch: int = BATCH) -> dict:
    run = train.make_run(config(precision, micro_batch), CFG, 0, 1, CPU)
    model = parallel.build_model(CFG, run.layout, None, CPU, precision=precision)
    return train_steps(run, model, batches)


# --- what is converted, and how closely each converted matmul follows high precision

# The linears converted in a dense block and in a MoE block (the router is not among them)
DENSE = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.gate_proj", "attn.o_proj", "ffn.gate_proj", "ffn.up_proj",
         "ffn.down_proj")
MOE = DENSE[:5] + ("ffn.shared.gate_proj", "ffn.shared.up_proj", "ffn.shared.down_proj")


@pytest.mark.parametrize("precision", LOW)
def test_each_converted_matmul_agrees_with_high_precision(precision):
    """Every converted module's output, input gradient and weight gradient, on the same input and output gradient,
    against the same module in high precision (SQNR above the floor); bf16 again gives exactly the high-precision
    numbers; the router, head and embedding are never converted."""
    model = parallel.build_model(CFG, parallel.Layout(1), None, CPU, precision=precision)
    converted = dict(parallel.low_precision_modules(model, precision))
    assert "forward" not in model.layers["0"].ffn.router.__dict__ and "forward" not in model.head.__dict__
    assert "forward" not in model.embed.__dict__
    assert set(converted) == {f"layers.0.{name}" for name in MOE} | ({"layers.0.ffn.experts"} if precision == "mxfp8"
                                                                      else set())
    two_kinds = meta_model(ModelConfig(**{**CFG.__dict__, "n_layers": 2, "n_dense_layers": 1}))
    assert {name for name, _ in parallel.low_precision_modules(two_kinds, precision)} >= {
        f"layers.0.{name}" for name in DENSE}
    assert all("forward" in m.__dict__ for m in converted.values())
    generator = torch.Generator().manual_seed(0)
    for name, module in converted.items():
        if isinstance(module, GroupedExperts):
            counts_E = torch.tensor([40, 0, 24, 8, 56, 32, 0, 32])  # an empty expert and uneven groups
            x = torch.randn(int(counts_E.sum()), CFG.dim, generator=generator)
            inputs = (counts_E, torch.rand(len(x), generator=generator))
        else:
            x = torch.randn(3, 32, module.in_features, generator=generator)
            inputs = ()
        results = []
        for set_to in (precision, "bf16", precision):
            parallel.set_precision(model, set_to, CPU)
            module.zero_grad()
            x_in = x.clone().requires_grad_()
            y = module(x_in, *inputs)
            dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
            y.backward(dy)
            results.append([y.detach(), x_in.grad] + [p.grad.clone() for p in module.parameters()])
        low, high, again = results
        for a, b in zip(low, again):  # switched back, the same numbers
            assert torch.equal(a, b), name
        lowest = min(sqnr_db(h, lo) for h, lo in zip(high, low))
        assert lowest > SQNR_FLOOR_DB["experts" if isinstance(module, GroupedExperts) else "linear"], (name, lowest)
        plain = module.__class__.forward(module, x, *inputs)  # what the unconverted module computes
        parallel.set_precision(model, "bf16", CPU)
        assert torch.equal(module(x, *inputs), plain), name
        parallel.set_precision(model, precision, CPU)
    # Under bf16 autocast (--dtype=bf16) a converted linear gets the operands autocast would give F.linear.
    q_proj = converted["layers.0.attn.q_proj"]
    x = torch.randn(2, 32, CFG.dim, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = q_proj(x)
        parallel.set_precision(model, "bf16", CPU)
        high = q_proj(x)
    assert sqnr_db(high, low) > SQNR_FLOOR_DB["linear"], sqnr_db(high, low)


def test_widths_and_token_counts_off_the_scaling_block_are_refused_in_one_sentence(monkeypatch):
    odd = ModelConfig(**{**CFG.__dict__, "expert_hidden": 16})
    with pytest.raises(ValueError, match=r"--precision=mxfp8 scales blocks of 32 values, but expert_hidden x "
                                         r"n_shared_experts = 16, expert_hidden = 16 is not a multiple of 32"):
        parallel.check_precision("mxfp8", odd, CPU)
    parallel.check_precision("fp8", odd, CPU)  # fp8 leaves the experts alone, and 16 fits its scaled GEMMs
    # A weight gradient reduces over the tokens: a micro-batch of 14 is refused when training, not when sampling.
    model = parallel.build_model(CFG, parallel.Layout(1), None, CPU, precision="mxfp8")
    short = tokens(1, 1)[0, :, :15]
    with pytest.raises(ValueError, match=r"--precision=mxfp8 needs micro_batch x seq_len to be a multiple of 32, "
                                         r"not 14\."):
        model(short[:, :-1], targets_BT=short[:, 1:])
    with torch.no_grad():
        assert torch.isfinite(model(short[:, :-1], targets_BT=short[:, 1:]))
    monkeypatch.setattr(parallel.importlib.util, "find_spec", lambda name: None)  # torchao not installed
    with pytest.raises(ValueError, match=r"--precision=fp8 needs torchao: pip install torchao==0.18.0"):
        parallel.check_precision("fp8", CFG, CPU)


# --- 20 steps of training

@pytest.fixture(scope="module")
def high_precision():
    return single_process("bf16", tokens(STEPS, BATCH))


@pytest.mark.parametrize("precision", LOW)
def test_twenty_steps_in_low_precision_follow_high_precision(high_precision, precision):
    low = single_process(precision, tokens(STEPS, BATCH))
    deltas = [abs(a - b) for a, b in zip(low["loss"], high_precision["loss"])]
    assert max(deltas) < LOSS_BOUND, deltas
    assert low["loss"][-1] < 0.5 * low["loss"][0]  # it learns


# --- 2 ranks against one process: FSDP, and EP

# layout name -> (precision, TrainConfig layout). One process accumulates BATCH / 2 rows at a time, as each rank
# holds them: a quantisation scale over a tensor's rows (the weight gradients') then spans the same rows.
RANK_RUNS = {"fsdp_fp8": ("fp8", {}), "fsdp_mxfp8": ("mxfp8", {}), "ep_fp8": ("fp8", {"ep": 2}),
             "ep_mxfp8": ("mxfp8", {"ep": 2})}
RANK_STEPS = 3


def worker(out: str):
    rank, world, device = parallel.init_distributed(timeout_s=120)
    batches = tokens(RANK_STEPS, BATCH)
    results = {}
    for name, (precision, layout) in RANK_RUNS.items():
        run = train.make_run(config(precision, BATCH // world, **layout), CFG, rank, world, device)
        model = parallel.build_model(CFG, run.layout, parallel.build_mesh(run.layout, "cpu"), device,
                                     precision=precision)
        results[name] = train_steps(run, model, batches)
        dist.barrier()
    if rank == 0:
        torch.save(results, Path(out) / "ranks.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every RANK_RUNS layout, trained on 2 gloo ranks in one launch."""
    out = tmp_path_factory.mktemp("precision_ranks")
    torchrun(2, str(Path(__file__).resolve()), str(out))
    return torch.load(out / "ranks.pt")


@pytest.mark.parametrize("precision", LOW)
def test_two_ranks_match_one_process_in_low_precision(two_ranks, precision):
    """FSDP on 2 ranks, and EP where the experts stay in high precision (fp8), equal one process at the fp32 layouts'
    tolerances (tests/test_parallel.py). With MXFP8 experts under EP, an expert's token group holds both ranks' rows,
    and the weight gradient's blocks of 32 tokens span them as one process's never do: the same losses to 0.5%
    (measured 0.15%) and first gradients at least as close as a converted matmul to high precision."""
    one = single_process(precision, tokens(RANK_STEPS, BATCH), micro_batch=BATCH // 2)
    for name in (f"fsdp_{precision}", f"ep_{precision}"):
        got = two_ranks[name]
        if name == "ep_mxfp8":
            torch.testing.assert_close(got["loss"], one["loss"], rtol=5e-3, atol=0)
            assert all(sqnr_db(want, got["grads"][key]) > SQNR_FLOOR_DB["experts"] for key, want in
                       one["grads"].items() if want.abs().sum() > 0), name
            continue
        torch.testing.assert_close(got["loss"], one["loss"], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(got["grad_norm"], one["grad_norm"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
        for key, want in one["grads"].items():
            torch.testing.assert_close(got["grads"][key], want, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{name} {key}: {m}")


# --- the guardrail: a burst in low precision rolls back and goes on in bf16, across resumes

def test_a_burst_in_fp8_goes_on_in_bf16_and_a_resume_stays_there(corpus_dir, tmp_path, capsys):
    out = tmp_path / "fp8"
    stdout = run_here(args(corpus_dir, out, *BURST, "--precision=fp8"), capsys)
    said = [line for line in stdout.splitlines() if "the run goes back in bf16" in line]
    assert said == ["3 bad steps within 5 steps, the first at step 8 in --precision=fp8: the run goes back in bf16 and "
                    "stays there (--keep_precision keeps fp8)"]
    events = [e for r in rows(out) for e in r.get("events", []) if e["name"] == "precision"]
    assert len(events) == 1 and events[0]["message"] == said[0]
    assert train_state(str(out / "checkpoints" / "step_00000012"))["bf16_since"] == 7

    # Resumed with the same flags, it trains in bf16: the steps of a launch that asks for bf16, bit for bit.
    more = ["--steps=13", f"--resume={out / 'checkpoints' / 'step_00000012'}"]
    stays = run_here(args(corpus_dir, tmp_path / "again", *BURST, "--precision=fp8", *more), capsys)
    assert "training in bf16, not --precision=fp8: a burst of bad steps from step 8 left it" in stays
    run_here(args(corpus_dir, tmp_path / "bf16", *BURST, "--precision=bf16", *more), capsys)
    kept = run_here(args(corpus_dir, tmp_path / "kept", *BURST, "--precision=fp8", "--keep_precision", *more), capsys)
    assert "training in bf16" not in kept
    again, bf16, fp8 = ([{k: r[k] for k in EXACT} for r in rows(tmp_path / name)] for name in ("again", "bf16", "kept"))
    assert again == bf16 and len(again) == 1
    assert fp8 != bf16  # --keep_precision trains in fp8 again


def test_resume_across_a_precision_change_lists_it_and_exports_the_master_weights(corpus_dir, tmp_path, capsys):
    out = tmp_path / "run"
    run_here(args(corpus_dir, out, "--steps=2", "--ckpt_every=2", "--expert_hidden=32", *GUARD), capsys)
    stdout = run_here(args(corpus_dir, out, "--steps=3", "--expert_hidden=32", "--precision=mxfp8", *GUARD), capsys)
    assert "precision: 'bf16' -> 'mxfp8'" in stdout
    assert [r["step"] for r in rows(out)] == [1, 2, 3]
    assert json.loads((out / "config.json").read_text())["train"]["precision"] == "mxfp8"
    # Its checkpoint holds the fp32 master weights under their own names: the export is a bf16 run's.
    ckpt = out / "checkpoints" / "step_00000003"
    checkpoint.export_hf(str(ckpt), str(tmp_path / "hf"), dtype="float32")
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert exported["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float32
    assert torch.equal(exported["model.layers.1.self_attn.q_proj.weight"],
                       tensors(str(ckpt))["model.layers.1.attn.q_proj.weight"])


if __name__ == "__main__":
    run_worker(worker, sys.argv[1])
