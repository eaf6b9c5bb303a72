"""bench.py: the planner against real models (one process, and 2 gloo ranks with FSDP + EP), and each command's
output on tiny shapes. Speed goals live in bench.py's printed ratios, never in these tests.

    python -m pytest tests/test_bench.py -q

The 2-rank check is this file run under torchrun (`python -m torch.distributed.run --standalone --nproc_per_node=2
tests/test_bench.py OUT_DIR`)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import bench
import parallel
import train
from conftest import TINY_MODEL_FLAGS, run_worker
from model import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
CFG = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_dense_layers=1, dense_hidden=128, n_heads=4, n_kv_heads=2,
                  head_dim=16, window=8, max_seq_len=32, n_experts=16, n_shared_experts=1, top_k=4, expert_hidden=32)
SEQ, GLOBAL_BATCH, MICRO_BATCH = 32, 8, 4
SEED_LAYOUT = ["plan", "--preset=large", "--gpus=2048", "--dp_replicate=16", "--ep=8", "--seq=8192",
               "--global_batch=12288", "--micro_batch=1", "--gpu=b300", "--json"]


def run_json(capsys, argv) -> tuple[int, dict]:
    """bench.main's exit code and the JSON object on its last line. The timed commands run on one thread: two on a
    2-core machine that others are using can be 100x slower (bench.py's docstring)."""
    code = bench.main(argv)
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------------------------
# plan

def test_plan_seed_layout(capsys):
    code, plan = run_json(capsys, SEED_LAYOUT)
    assert plan["flops_per_token"] == pytest.approx(99.2e9, rel=0.01)  # SPEC §7
    # HSDP: each replica of 128 GPUs holds the whole model, so a GPU holds 1/128 of it (2 whole experts per layer,
    # SPEC §6), not 1/2048: the 16 replicas hold copies.
    assert plan["params_per_gpu"] == pytest.approx(398.6e9 / 128, rel=0.01)
    assert plan["params_total"] == pytest.approx(398.6e9, rel=0.001)
    assert sum(plan["memory_gib"].values()) == pytest.approx(plan["memory_gib_per_gpu"])
    # 17T tokens x 99.2 GFLOP at 40% of 2048 x 2.25 PFLOP/s
    assert plan["days"] == pytest.approx(17e12 * 99.2e9 / (2048 * 2250e12 * 0.4) / 86400, rel=0.01)
    # Without activation checkpointing one 8192-token sequence per micro-batch fits a B300 in about 200 GiB, two do
    # not; with full AC the plan fits with room to spare. Holding unsharded fp32 gradients between micro-batches
    # (--grad_sync=last) would not fit even then.
    assert code == 0 and plan["fits"] and plan["memory_gib_per_gpu"] > 0.65 * 288
    code, two = run_json(capsys, SEED_LAYOUT + ["--micro_batch=2"])
    assert code == 1 and not two["fits"] and "try --ac=full" in two["reason"]
    code, plan = run_json(capsys, SEED_LAYOUT + ["--ac=full"])
    assert code == 0 and plan["fits"] and plan["memory_gib_per_gpu"] < 0.9 * 288
    code, last = run_json(capsys, SEED_LAYOUT + ["--grad_sync=last", "--ac=full"])
    assert code == 1 and "unsharded fp32 gradients" in last["reason"]
    assert plan["activations_gib_by_ac"]["full"] < plan["activations_gib_by_ac"]["selective"] \
        < plan["activations_gib_by_ac"]["none"]


@pytest.mark.parametrize("flags, code, reason", [
    (["--dp_replicate=3"], 2, "world size 2048 is not divisible by dp_replicate=3"),
    (["--ep=3"], 2, "ep=3 does not divide dp_shard=128"),
    (["--global_batch=1000"], 2, "global_batch=1000 sequences is not divisible by world 2048"),
    (["--gpus=32", "--dp_replicate=1", "--global_batch=32", "--grad_sync=every"], 1, "GiB per GPU but a b300 offers"),
])
def test_plan_rejects_layouts_with_the_reason(capsys, flags, code, reason):
    got, plan = run_json(capsys, SEED_LAYOUT + flags)
    assert got == code and plan["fits"] is False and reason in plan["reason"]


def measured_bytes(model, optimizer, tc, batch) -> dict:
    """One train.train_step; the bytes of this rank's parameter shards, of its gradients (read in the optimizer's
    pre-hook, where they all exist) and of its AdamW state after the step."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    nbytes = lambda tensors: sum(local(t).numel() * local(t).element_size() for t in tensors)  # noqa: E731
    seen = {}
    hook = optimizer.register_step_pre_hook(
        lambda opt, a, k: seen.update(grads=nbytes(p.grad for p in model.parameters() if p.grad is not None)))
    state = {"step": 0, "momentum": torch.zeros(len(model.moe_layers()), CFG.n_experts), "skipped": 0,
             "bad_steps": 0}
    train.train_step(model, optimizer, batch, tc, torch.autocast("cpu", enabled=False), state)
    hook.remove()
    return {"params": nbytes(model.parameters()), "grads": seen["grads"],
            "optimizer": nbytes(t for s in optimizer.state.values() for t in s.values() if t.numel() > 1)}


def predicted_bytes(layout) -> dict:
    memory = bench.plan(CFG, layout, SEQ, MICRO_BATCH, GLOBAL_BATCH, compute_bytes=4)["memory_bytes"]
    return {"params": memory["parameters (fp32 master shards)"], "grads": memory["gradients (fp32 shards)"],
            "optimizer": memory["optimizer (AdamW m, v in fp32)"]}


def saved_activation_bytes(model, tokens_BT) -> int:
    """Bytes autograd keeps for backward over one forward (each storage once, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens_BT[:, :-1], targets_BT=tokens_BT[:, 1:])
    return sum(seen.values())


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_plan_memory_matches_a_real_model(one_thread):
    tc = train.TrainConfig(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, seq_len=SEQ)
    model = parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu"))
    optimizer = train.build_optimizer(model, tc, fused=False)
    measured = measured_bytes(model, optimizer, tc, bench.synthetic_batch(CFG.vocab_size, GLOBAL_BATCH, SEQ, 0, 1, 0))
    predicted = predicted_bytes(parallel.Layout(1))
    for kind in ("params", "grads", "optimizer"):
        assert predicted[kind] == pytest.approx(measured[kind], rel=0.05), kind
    # Activations (fp32 on CPU): the planner's per-token formula against what autograd actually saves, within 15%;
    # full AC keeps only each block's input plus the head's tensors.
    tokens_BT = torch.randint(0, CFG.vocab_size, (MICRO_BATCH, SEQ + 1))
    for ac in ("none", "full"):
        model = parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu"), ac=ac)
        want = bench.activation_bytes(CFG, SEQ, MICRO_BATCH, c=4)[ac]["saved"]
        assert want == pytest.approx(saved_activation_bytes(model, tokens_BT), rel=0.15), ac


def two_rank_worker(out: Path):
    """Under torchrun (run_worker tears the process group down): FSDP over 2 ranks with the experts split over
    ep=2; each rank's measured bytes."""
    rank, world, device = parallel.init_distributed(timeout_s=120)
    layout = parallel.Layout(world, dp_replicate=1, ep=2)
    tc = train.TrainConfig(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, seq_len=SEQ)
    model = parallel.build_model(CFG, layout, parallel.build_mesh(layout, "cpu"), device)
    optimizer = train.build_optimizer(model, tc, fused=False)
    batch = bench.synthetic_batch(CFG.vocab_size, GLOBAL_BATCH, SEQ, rank, world, 0)
    (out / f"rank{rank}.json").write_text(json.dumps(measured_bytes(model, optimizer, tc, batch)))


def test_plan_memory_matches_two_fsdp_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"2-rank run did not finish:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    predicted = predicted_bytes(parallel.Layout(2, 1, 2))
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for kind in ("params", "grads", "optimizer"):
            assert predicted[kind] == pytest.approx(measured[kind], rel=0.05), (rank, kind)


# ------------------------------------------------------------------------------------------------------------------
# moe, vs-hf, the training step

def test_moe_reports_the_three_paths_and_they_agree(capsys):
    code, out = run_json(capsys, ["moe", *TINY_MODEL_FLAGS, "--tokens=256", "--seq_len=64", "--iters=1",
                                  "--warmup=0", "--threads=1", "--json"])
    assert code == 0
    for key in ("grouped_ms", "loop_ms", "dense_ms", "moe_to_dense"):
        assert out[key] > 0, key
    # The dense comparator is a GEMM-friendly width (a multiple of 128) at least the MoE's active width; the ratio is
    # per FLOP: the dense time scaled to the MoE's active FLOPs.
    assert out["dense_hidden"] % 128 == 0 and 0 <= out["dense_hidden"] - out["active_hidden"] < 128
    dense_at_active = out["dense_ms"] * out["active_hidden"] / out["dense_hidden"]
    assert out["moe_to_dense"] == pytest.approx(out["grouped_ms"] / dense_at_active)
    assert out["grouped_vs_loop_max_diff"] < 1e-5
    assert {"router", "routed experts", "MoE permutation, combine, z-loss"} <= set(out["components_ms"])
    assert out["components_ms"]["routed experts"]["bwd"] > 0  # backward ops found their forward's component


def test_vs_hf_times_both_on_the_same_config(capsys):
    code, out = run_json(capsys, ["vs-hf", *TINY_MODEL_FLAGS, "--vocab_size=512", "--seq_len=32", "--iters=1",
                                  "--warmup=0", "--threads=1", "--json"])
    assert code == 0 and out["ours_ms"] > 0 and out["hf_ms"] > 0
    assert out["speedup"] == pytest.approx(out["hf_ms"] / out["ours_ms"])
    assert out["speedup_paired"] == pytest.approx(out["speedup"])  # one pair: its ratio is the ratio of medians
    assert out["first_loss_diff"] < 1e-4  # the same weights give the same LM loss: the same model was timed


def test_training_step_report(capsys):
    code, out = run_json(capsys, ["--preset=tiny", *TINY_MODEL_FLAGS, "--vocab_size=512", "--seq_len=32",
                                  "--global_batch=4", "--micro_batch=2", "--warmup=1", "--iters=2", "--threads=1",
                                  "--json"])
    assert code == 0
    for key in ("ms_median", "ms_min", "ms_max", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
                "peak_mem_gib", "flops_per_token"):
        assert out[key] > 0, key
    assert out["mfu"] is None  # CPU: no peak in the table
    assert out["tflops_per_device"] == pytest.approx(out["tokens_per_s"] * out["flops_per_token"] / 1e12)
    assert {"forward", "backward", "optimizer"} <= set(out["phases_ms"])
    components = out["components_ms"]
    assert {"attention", "router", "routed experts", "output head, cross-entropy", "optimizer"} <= set(components)
    assert components["attention"]["bwd"] > 0 and components["optimizer"]["total"] > 0
    assert components["output head, cross-entropy"]["bwd"] > 0  # the fused function's backward found its forward


# ------------------------------------------------------------------------------------------------------------------
# plot and the command line

def write_metrics(out_dir: Path):
    rows = [{"step": s, "loss": 5.0 - s / 10, "lm_loss": 5.0 - s / 10, "grad_norm": 1.0 / s,
             "max_vio_layers": [0.5 / s, 0.3 / s], "max_vio": 0.5 / s} for s in range(1, 11)]
    rows[-1]["val_loss"] = 4.2
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    write_metrics(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        bench.main(["plot", str(tmp_path)])


def test_plot_draws_the_metrics(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is optional (not in requirements.txt)")
    write_metrics(tmp_path)
    assert bench.main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "metrics.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["moe", "--tokns=5"], "did you mean --tokens"),
    (["--iter=3"], "did you mean --iters"),
    (["plan", "--gpu=b3000"], "invalid choice"),
    (["mo"], "did you mean moe"),
    (["--iters=0"], "argument --iters: 0 must be at least 1"),
    (["moe", "--tokens=-5"], "argument --tokens: -5 must be at least 1"),
    (["plan", "--mfu=0"], "argument --mfu: 0 must be above 0 and at most 1"),
    (["plan", "--gpus=abc"], "argument --gpus: invalid int value: 'abc'"),
    (["--lr=-1"], "--lr=-1.0 must be 0 or more."),
])
def test_mistyped_or_out_of_range_flags_and_commands_are_one_sentence(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert message in str(e.value) + capsys.readouterr().err


def test_moe_layer_too_big_for_memory_is_refused_before_allocation(capsys, monkeypatch):
    monkeypatch.setattr(parallel, "host_memory_available", lambda: 1 << 20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert bench.main(["moe", "--tokens=64", "--seq_len=64", "--iters=1"]) == 2
    assert "error: one MoE layer's weights and their gradients need" in capsys.readouterr().err


if __name__ == "__main__":
    run_worker(two_rank_worker, Path(sys.argv[1]))
