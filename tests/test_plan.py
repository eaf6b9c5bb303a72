"""plan.py: the planner's memory, bytes and time against real models and hand-computed cases; its search; the run it
plans is the run train.py makes from the same flags and config file; the time failures cost.

    python -m pytest tests/test_plan.py -q

The multi-rank checks are this file run under torchrun (`python -m torch.distributed.run --standalone
--nproc_per_node=N tests/test_plan.py memory|traffic OUT_DIR`)."""

import argparse
import dataclasses
import json
import math
import re
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import bench
import checkpoint
import parallel
import plan
import train
from conftest import TINY_MODEL_FLAGS, run_worker, torchrun
from model import ModelConfig

CFG = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_dense_layers=1, dense_hidden=128, n_heads=4, n_kv_heads=2,
                  head_dim=16, window=8, max_seq_len=32, n_experts=16, n_shared_experts=1, top_k=4, expert_hidden=32)
SEQ = 32
GLOBAL_BATCH = 8
MICRO_BATCH = 4
SEED_LAYOUT = ["--preset=large", "--gpus=2048", "--dp_replicate=16", "--ep=8", "--seq_len=8192", "--global_batch=12288",
               "--micro_batch=1", "--tokens=17e12", "--gpu=b300", "--search=false", "--json"]
ROOT = Path(__file__).resolve().parent.parent


def run_json(capsys, argv) -> tuple[int, dict]:
    """plan.main's exit code and the JSON object on its last line."""
    code = plan.main(argv)
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def run_config(**fields) -> train.TrainConfig:
    """A run of CFG-sized batches in fp32, as the CPU runs these tests compare with train; `fields` change it."""
    return train.TrainConfig(**{"seq_len": SEQ, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH,
                                "dtype": "fp32", **fields})


# ------------------------------------------------------------------------------------------------------------------
# Memory

def test_plan_seed_layout(capsys):
    code, report = run_json(capsys, SEED_LAYOUT)
    assert report["flops_per_token"] == pytest.approx(99.2e9, rel=0.01)  # 6 x active weights + attention, at 8192
    # HSDP: each replica of 128 GPUs holds the whole model, so a GPU holds 1/128 of it (2 whole experts per layer),
    # not 1/2048: the 16 replicas hold copies.
    assert report["params_per_gpu"] == pytest.approx(398.6e9 / 128, rel=0.01)
    assert report["params_total"] == pytest.approx(398.6e9, rel=0.001)
    assert sum(report["memory_gib"].values()) == pytest.approx(report["memory_gib_per_gpu"])
    # 17T tokens: the steps of 12288 x 8192 tokens that reach them; communication makes the step longer than the
    # compute alone (17T x 99.2 GFLOP at 40% of 2048 x 2.25 PFLOP/s: 10.6 days).
    assert report["steps"] == math.ceil(17e12 / (12288 * 8192)) == 168_880
    assert report["days"] == pytest.approx(168_880 * report["step_seconds"] / 86400)
    assert report["days"] > 17e12 * 99.2e9 / (2048 * 2250e12 * 0.4) / 86400 and report["mfu"] < 0.4
    # Without activation checkpointing one 8192-token sequence per micro-batch fits a B300 in about 200 GiB, two do
    # not; with full AC the plan fits with room to spare.
    assert code == 0 and report["fits"] and report["memory_gib_per_gpu"] > 0.65 * 288
    code, two = run_json(capsys, SEED_LAYOUT + ["--micro_batch=2"])
    assert code == 1 and not two["fits"] and "try --ac=full" in two["reason"]
    code, report = run_json(capsys, SEED_LAYOUT + ["--ac=full"])
    assert code == 0 and report["fits"] and report["memory_gib_per_gpu"] < 0.9 * 288
    assert report["activations_gib_by_ac"]["full"] < report["activations_gib_by_ac"]["selective"] \
        < report["activations_gib_by_ac"]["none"]


@pytest.mark.parametrize("flags, code, reason", [
    (["--dp_replicate=3"], 2, "world size 2048 is not divisible by dp_replicate=3"),
    (["--ep=3"], 2, "ep=3 does not divide dp_shard=128"),
    (["--global_batch=1000"], 2, "global_batch=1000 sequences is not divisible by world 2048"),
    (["--cp=16"], 2, "cp=16 does not divide n_kv_heads=8"),
    (["--gpus=32", "--dp_replicate=1", "--global_batch=32"], 1, "GiB per GPU but a b300 offers"),
])
def test_plan_rejects_layouts_with_the_reason(capsys, flags, code, reason):
    got, report = run_json(capsys, SEED_LAYOUT + flags)
    assert got == code and report["fits"] is False and reason in report["reason"]


def test_ranks_standing_by_change_nothing_in_the_plan():
    """--dp_replicate=auto on 10 GPUs with --dp_shard=4 trains on 8 of them and 2 stand by: the plan of those 8."""
    tc = run_config(global_batch=16, micro_batch=1, dp_shard=4, ep=2)
    auto = plan.estimate(CFG, dataclasses.replace(tc, dp_replicate=0), 10)
    used = plan.estimate(CFG, dataclasses.replace(tc, dp_replicate=2), 8)
    for key in ("memory_bytes", "traffic_bytes_per_step", "network_bytes_per_step", "checkpoint", "optimizer"):
        assert auto[key] == used[key], key


def measured_bytes(model, optimizer, tc, batch) -> dict:
    """One bench.train_step (train.py's step); the bytes of this rank's parameter shards, of its gradients (read in
    the optimizer's pre-hook, where they all exist) and of its AdamW state after the step."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    nbytes = lambda tensors: sum(local(t).numel() * local(t).element_size() for t in tensors)  # noqa: E731
    seen = {}
    hook = optimizer.register_step_pre_hook(
        lambda opt, a, k: seen.update(grads=nbytes(p.grad for p in model.parameters() if p.grad is not None)))
    momentum_LE = torch.zeros(len(model.moe_layers()), model.cfg.n_experts)
    bench.train_step(model, optimizer, batch, tc, torch.autocast("cpu", enabled=False), momentum_LE, [0])
    hook.remove()
    return {"params": nbytes(model.parameters()), "grads": seen["grads"],
            "optimizer": nbytes(t for s in optimizer.state.values() for t in s.values() if t.numel() > 1)}


def predicted_bytes(layout) -> dict:
    tc = run_config(dp_replicate=layout.dp_replicate, ep=layout.ep)
    memory = plan.estimate(CFG, tc, layout.world)["memory_bytes"]
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
    optimizer = parallel.build_optimizer(model, tc, fused=False)
    measured = measured_bytes(model, optimizer, tc, bench.synthetic_batch(CFG.vocab_size, GLOBAL_BATCH, SEQ, 0, 1, 0))
    predicted = predicted_bytes(parallel.Layout(1))
    for kind in ("params", "grads", "optimizer"):
        assert predicted[kind] == pytest.approx(measured[kind], rel=0.05), kind
    # Activations (fp32 on CPU): the planner's per-token formula against what autograd actually saves, within 15%;
    # full AC keeps only each block's input plus the head's tensors.
    tokens_BT = torch.randint(0, CFG.vocab_size, (MICRO_BATCH, SEQ + 1))
    for ac in ("none", "full"):
        model = parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu"), ac=ac)
        want = plan.activation_bytes(CFG, SEQ, MICRO_BATCH, c=4)[ac]["saved"]
        assert want == pytest.approx(saved_activation_bytes(model, tokens_BT), rel=0.15), ac


def two_rank_worker(out: Path):
    """Under torchrun (run_worker tears the process group down): FSDP over 2 ranks with the experts split over
    ep=2; each rank's measured bytes."""
    rank, world, device = parallel.init_distributed(timeout_s=120)
    layout = parallel.Layout(world, dp_replicate=1, ep=2)
    tc = train.TrainConfig(global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, seq_len=SEQ)
    model = parallel.build_model(CFG, layout, parallel.build_mesh(layout, "cpu"), device)
    optimizer = parallel.build_optimizer(model, tc, fused=False)
    batch = bench.synthetic_batch(CFG.vocab_size, GLOBAL_BATCH, SEQ, rank, world, 0)
    (out / f"rank{rank}.json").write_text(json.dumps(measured_bytes(model, optimizer, tc, batch)))


def test_plan_memory_matches_two_fsdp_ranks(tmp_path):
    torchrun(2, __file__, "memory", str(tmp_path), timeout_s=240)
    predicted = predicted_bytes(parallel.Layout(2, 1, 2))
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for kind in ("params", "grads", "optimizer"):
            assert predicted[kind] == pytest.approx(measured[kind], rel=0.05), (rank, kind)


# ------------------------------------------------------------------------------------------------------------------
# Context parallelism

def test_cp_splits_each_row_s_activations_and_shards_parameters_over_its_ranks_too(capsys):
    """large at 256K tokens on 2,048 GPUs: with cp=4 a GPU holds a quarter of each row's tokens, and the FSDP group
    (dp_shard 32 x cp 4) is as large as cp=1's 128, so the weights cost the same."""
    long = SEED_LAYOUT[:4] + ["--seq_len=262144", "--global_batch=2048", "--micro_batch=1", "--ac=full", "--gpu=b300",
                              "--search=false", "--json"]
    _, one = run_json(capsys, long)
    code, four = run_json(capsys, long + ["--cp=4"])
    assert code == 0 and four["fits"] and four["cp"] == 4 and four["params_per_gpu"] == one["params_per_gpu"]
    assert four["memory_gib_per_gpu"] < one["memory_gib_per_gpu"] - 0.7 * one["activations_gib_by_ac"]["full"]
    assert four["activations_gib_by_ac"]["full"] == pytest.approx(one["activations_gib_by_ac"]["full"] / 4, rel=0.1)
    # The same FLOPs per token and tokens per GPU: a quarter of each of 4 rows, one after another, not one whole row.
    assert four["flops_per_token"] == one["flops_per_token"]
    assert (four["accumulation_steps"], one["accumulation_steps"]) == (4, 1)
    assert four["traffic_gb_per_step_per_gpu"][plan.CP_A2A] > 0
    assert plan.CP_A2A not in one["traffic_gb_per_step_per_gpu"]


@pytest.mark.parametrize("ac, passes", [("none", 2), ("selective", 2), ("full", 3)])
def test_cp_all_to_all_bytes_by_hand(ac, passes):
    """cp=2 on 4 ranks, bf16, 2 micro-batches of one 32-token row: per attention layer a rank sends half of q, k, v
    (16 tokens x (4 + 2 + 2) heads x 16 x 2 bytes) and of the output (4 heads), once forward and once backward, and
    forward again where full AC recomputes."""
    tc = run_config(dtype="bf16", micro_batch=1, global_batch=4, cp=2, ac=ac)
    per_layer = 16 * (4 + 2 + 2 + 4) * 16 * 2 / 2
    for per_node, network in ((8, 0.0), (1, 1.0)):  # the cp pair in one node, or across two
        links = plan.Links(per_node=per_node, intra=100e9, inter=10e9, latency=1e-6)
        p = plan.estimate(CFG, tc, 4, links)
        sent = p["traffic_bytes_per_step"][plan.CP_A2A]
        assert sent == 2 * CFG.n_layers * passes * per_layer
        assert p["network_bytes_per_step"][plan.CP_A2A] == network * sent
        # in line on the compute stream: each of the four buffers an all-to-all of its own
        buffers = [16 * h * 16 * 2 for h in (4, 2, 2, 4)]
        want = 2 * CFG.n_layers * passes * sum(links.seconds(plan.CP_A2A, b, p["groups"]["cp"]) for b in buffers)
        assert plan.project(p, 1e12, 100.0, steps=1)["seconds"][plan.CP_A2A] == pytest.approx(want)


def test_search_tries_cp_on_long_rows_and_prints_a_runnable_command(capsys, monkeypatch):
    links = plan.Links(per_node=8)
    short = plan.search(CFG, run_config(global_batch=8, micro_batch=1), 8, "h100", links, 1e12)
    assert all(candidate.cp == 1 for candidate, _, _ in short[0])
    long_tc = run_config(seq_len=plan.CP_FROM, global_batch=8, micro_batch=1)
    best, tried, fit = plan.search(CFG, long_tc, 8, "h100", links, 1e12)
    assert tried > short[1]  # cp=2 layouts too (cp divides n_kv_heads=2)
    # 4 rows on 8 GPUs: only cp=2 gives each GPU a share, and the command says so
    given = ["--preset=tiny", *TINY_MODEL_FLAGS, f"--seq_len={plan.CP_FROM}", "--global_batch=4", "--cp=2",
             "--gpus=8", "--gpu=h100", "--json"]
    code, report = run_json(capsys, given)
    words = shlex.split(report["search"]["command"])
    assert code == 0 and all("--cp=2" in b["flags"] for b in report["search"]["best"]) and "--cp=2" in words
    monkeypatch.setenv("WORLD_SIZE", "8")
    tc, _ = train.parse_args(words[1:])
    assert tc.cp == 2 and parallel.Layout.for_world(8, tc.dp_replicate, tc.dp_shard, tc.ep, tc.cp).dp == 4


# ------------------------------------------------------------------------------------------------------------------
# Links and time

@pytest.mark.parametrize("world, replicas, ep, cp, per_node", [(64, 2, 4, 1, 8), (64, 4, 16, 1, 8), (16, 1, 2, 1, 4),
                                                              (64, 2, 8, 2, 8), (16, 1, 1, 2, 4)])
def test_groups_span_the_nodes_build_mesh_puts_them_on(world, replicas, ep, cp, per_node):
    """The planner's (ranks per node, nodes) of each group against rank 0's groups in parallel.build_mesh's own mesh
    (a fake process group of `world` ranks in this process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        layout = parallel.Layout(world, replicas, ep, cp)
        mesh = parallel.build_mesh(layout, "cpu")
        big = ModelConfig(**{**CFG.__dict__, "n_experts": 64})
        tc = run_config(micro_batch=1, global_batch=world, dp_replicate=replicas, ep=ep, cp=cp)
        groups = plan.estimate(big, tc, world, plan.Links(per_node=per_node))["groups"]
        assert "cp" in groups and "efsdp_cp" in groups
        for name, (k, m) in groups.items():
            ranks = parallel._submesh(mesh, name).mesh.flatten().tolist()
            nodes = {r // per_node for r in ranks}
            assert (k, m) == (len(ranks) // len(nodes), len(nodes)), name
    finally:
        dist.destroy_process_group()


def test_collective_costs_by_hand():
    links = plan.Links(per_node=8, intra=100.0, inter=10.0, latency=1.0)
    # One node: a ring of 8 sends 7/8 of 800 bytes at 100 B/s, in 7 steps.
    assert links.seconds(plan.AG, 800, (8, 1)) == pytest.approx(7 + 7)
    # Two nodes: then each GPU carries 1/8 of the buffer, half of it to the other node, at 10 B/s, in 1 step.
    assert links.seconds(plan.AG, 800, (8, 2)) == pytest.approx(14 + 800 / 8 / 2 / 10 + 1)
    assert links.seconds(plan.AR, 800, (8, 2)) == pytest.approx(2 * (14 + 800 / 8 / 2 / 10 + 1))  # RS, then AG
    # One GPU per node for 4 nodes: the whole ring on the network.
    assert links.seconds(plan.AG, 800, (1, 4)) == pytest.approx(800 * 3 / 4 / 10 + 3)
    # All-to-all over 16 ranks on 2 nodes: 7/16 over NVLink while 8/16 cross the network; 15 steps.
    assert links.seconds(plan.A2A, 800, (8, 2)) == pytest.approx(max(800 * 7 / 16 / 100, 800 * 8 / 16 / 10) + 15)
    assert plan.sent_bytes(800, (8, 2), plan.AR) == (2 * 800 * 15 / 16, 2 * 800 * 1 / 16)


def test_timeline_overlaps_communication_it_can_and_charges_the_waits():
    tl = plan.Timeline()
    first = tl.comm(plan.AG, 2.0, 0.0)                   # nothing to hide the first gather behind
    start = tl.compute(1.0, first)
    nxt = tl.comm(plan.AG, 0.5, start)                    # prefetched under the first block: hidden
    start = tl.compute(1.0, nxt)
    tl.comm(plan.RS, 3.0, tl.compute_end)                 # longer than what follows: 2 s exposed
    tl.compute(1.0)
    tl.compute(0.0, tl.link_end)
    assert tl.compute_end == pytest.approx(2 + 1 + 1 + 3)
    assert tl.seconds == pytest.approx({"compute": 3.0, f"exposed {plan.AG}": 2.0, f"exposed {plan.RS}": 2.0})
    assert tl.link_s == pytest.approx({plan.AG: 2.5, plan.RS: 3.0})


def test_one_gpu_steps_at_its_compute_rate():
    peak = 100.0
    rate = 40e12
    for ac, recompute in (("none", 0), ("selective", 0), ("full", 1)):
        p = plan.estimate(CFG, run_config(micro_batch=2, ac=ac), 1)
        assert p["head_flops_per_token"] == 6 * CFG.vocab_size * CFG.dim  # the head is the rest of the FLOPs
        blocks = sum(u["flops"] for u in p["units"])
        t = plan.project(p, rate, peak, steps=10)
        compute_s = 8 * SEQ * (p["flops_per_token"] + recompute * blocks / 3) / rate
        # then fused AdamW: 28 bytes per fp32 parameter at the HBM's speed
        assert t["step_s"] == pytest.approx(compute_s + 28 * p["params_per_gpu"] / plan.Links().hbm)
        assert t["days"] == pytest.approx(10 * t["step_s"] / 86400)
        if not recompute:
            assert t["mfu"] == pytest.approx(rate / (peak * 1e12) * compute_s / t["step_s"])
            assert set(t["seconds"]) == {"compute", plan.OPT_HBM}


@pytest.mark.parametrize("keep, optimizer", [(False, "adamw"), (True, "adamw"), (False, "muon")])
def test_middle_micro_batches_repeat_as_a_whole_timeline_runs_them(keep, optimizer):
    """project() times three micro-batches and repeats the middle one: the same step as all eight on one timeline,
    on links slow enough that communication spills from one micro-batch into the next."""
    links = plan.Links(per_node=8, intra=10e9, inter=1e7, latency=5e-6)
    tc = run_config(dtype="bf16", micro_batch=1, global_batch=16 * 8, dp_replicate=2, ep=2, keep_gathered=keep,
                    optimizer=optimizer)
    p = plan.estimate(CFG, tc, 16, links)
    tl = plan.Timeline()
    for i in range(8):
        plan.micro_batch_on(tl, p, 1e11, first=i == 0, last=i == 7)
    plan.optimizer_on(tl, p, 1e11)
    t = plan.project(p, 1e11, 100.0, steps=1)
    assert t["step_s"] == pytest.approx(tl.compute_end, rel=1e-9)
    assert t["seconds"] == pytest.approx(dict(tl.seconds), rel=1e-9)
    assert t["seconds"]["compute"] < t["step_s"] / 2  # communication-bound: the case where spilling matters


def test_a_layout_whose_fsdp_groups_cross_a_slow_network_ranks_below_one_that_keeps_them_in_a_node():
    """16 GPUs in two nodes of 8 whose network is 10^5 times slower than NVLink: FSDP over all 16 (R=1) gathers
    every block across it, twice per micro-batch; FSDP inside each node with the replicas across (R=2) crosses it
    once a step."""
    links = plan.Links(per_node=8, intra=100e9, inter=1e6, latency=5e-6)
    rate = 1e9
    peak = 100.0
    steps = {}
    tc = run_config(dtype="bf16", micro_batch=1, global_batch=64)
    for replicas in (1, 2):
        p = plan.estimate(CFG, dataclasses.replace(tc, dp_replicate=replicas), 16, links)
        steps[replicas] = plan.project(p, rate, peak, steps=1)
    cross = steps[1]
    inside = steps[2]
    assert cross["step_s"] > 2 * inside["step_s"] and cross["mfu"] < inside["mfu"] / 2
    assert cross["seconds"][f"exposed {plan.AG}"] > 10 * inside["seconds"].get(f"exposed {plan.AG}", 1e-9)
    best, tried, fit = plan.search(CFG, tc, 16, "h100", links, rate)
    assert tried == fit > 5 and len(best) == 5  # a toy model fits an H100 in every layout
    assert [r["step_s"] for _, _, r in best] == sorted(r["step_s"] for _, _, r in best)
    # The winners gather once a step (one micro-batch of 4, or parameters kept gathered), not 8 times as R=1 does.
    assert all(r["step_s"] < cross["step_s"] / 2 for _, _, r in best)
    assert all(p["accumulation_steps"] == 1 or p["keep_gathered"] for _, p, _ in best)
    assert best[0][2]["step_s"] <= inside["step_s"]
    assert "exposed FSDP all-gather" in plan.why_slower(cross, best[0][2])


def test_seed_search_recommends_layouts_train_py_runs(capsys):
    code, report = run_json(capsys, SEED_LAYOUT[:-2] + ["--ac=full", "--json"])
    out = report["search"]
    assert code == 0 and len(out["best"]) == 5 and out["fit"] < out["tried"]
    assert all(b["memory_gib_per_gpu"] <= 0.9 * 288 for b in out["best"])
    assert out["best"][0]["step_seconds"] <= report["step_seconds"]
    for b in out["best"]:
        tc, _ = train.parse_args(b["flags"].split() + ["--global_batch=12288", "--seq_len=8192"])  # no error
        assert tc.ep > 0 and tc.ac in ("none", "selective", "full")


def test_a_measured_compute_rate_replaces_the_mfu_guess(capsys):
    code, report = run_json(capsys, ["--preset=tiny", "--gpu=h200", "--tflops=450", "--search=false", "--json"])
    busy = report["seconds_per_step"]["compute"] / report["step_seconds"]  # the rest: AdamW at the H200's 4.8 TB/s
    assert code == 0 and report["gpus"] == 1 and report["compute_tflops"] == 450.0
    assert report["mfu"] == pytest.approx(450 / 989 * busy)
    assert report["step_seconds"] - report["seconds_per_step"]["compute"] == pytest.approx(
        28 * report["params_per_gpu"] / 4.8e12)


# ------------------------------------------------------------------------------------------------------------------
# The run train.py makes from the same flags and config file

def readme() -> str:
    return (ROOT / "README.md").read_text()


def large_toml(folder: Path) -> Path:
    """The README's large.toml, written to `folder`."""
    toml = next(block for block in re.findall(r"```toml\n(.*?)```", readme(), re.S) if "# large.toml" in block)
    (folder / "large.toml").write_text(toml)
    return folder / "large.toml"


def test_the_readme_large_toml_plans_to_the_figures_the_readme_states(capsys, tmp_path):
    """The README's large.toml, given as --config: its world size, batch, micro-batch, AC, layout and Muon are planned
    (not plan.py's own defaults), and the README's planning figures are what plan.py prints."""
    code, report = run_json(capsys, [f"--config={large_toml(tmp_path)}", "--json"])
    assert code == 0 and report["fits"]
    assert (report["gpus"], report["dp_replicate"], report["ep"], report["micro_batch"], report["global_batch"],
            report["seq"], report["ac"], report["optimizer"], report["steps"]) == (
        2048, 16, 8, 1, 12288, 8192, "full", "muon", 168_000)
    best = report["search"]["best"][0]
    failures = report["failures"]
    stated = [f"{report['memory_gib_per_gpu']:.1f} GiB per GPU", f"a {report['step_seconds']:.1f} s step",
              f"**{100 * report['mfu']:.1f}% MFU, {report['days']:.1f} days**", f"`{best['flags']}`",
              f"{best['memory_gib_per_gpu']:.0f} GiB per GPU",
              f"**{100 * best['mfu']:.1f}% MFU, {best['days']:.1f} days**",
              f"writes {failures['checkpoint_write_bytes'] / 2**30:.2f} GiB per GPU in "
              f"{failures['checkpoint_write_s']:.2f} s",
              f"every {failures['interval_steps']} steps ({failures['interval_s'] / 60:.1f} min)",
              f"goodput {100 * failures['goodput']['best']['by hand']:.1f}% restarted by hand, "
              f"{100 * failures['goodput']['best']['elastic']:.1f}% elastic",
              f"({100 * failures['goodput']['configured']['by hand']:.1f}% and "
              f"{100 * failures['goodput']['configured']['elastic']:.1f}% at the 30-minute default)"]
    section = " ".join(readme().split("### Planning a run")[1].split("\n## ")[0].split())  # lines joined
    assert [s for s in stated if s not in section] == []


def test_the_readme_long_context_figures_are_what_plan_py_prints(capsys, tmp_path, monkeypatch):
    """Each plan.py command of the README's long-context recipe, and the row of figures it states for it."""
    large_toml(tmp_path)
    monkeypatch.chdir(tmp_path)
    section = readme().split("## Long context")[1].split("\n## ")[0]
    commands = re.findall(r"python plan\.py (.*?)(?: +#.*)?\n", section)
    assert len(commands) == 3 and "--cp=4" in commands[2]
    for command in commands:
        code, r = run_json(capsys, shlex.split(command) + ["--search=false", "--json"])
        row = (f"| {r['gpus']:,} | {r['memory_gib_per_gpu']:.1f} GiB | {r['step_seconds']:.1f} s | "
               f"{100 * r['mfu']:.1f}% | {r['tokens_per_s_per_gpu']:,.0f} |")
        assert code == 0 and row in section, row


@pytest.mark.parametrize("with_file", [False, True])
def test_the_fastest_layout_s_command_trains_what_was_planned(capsys, tmp_path, monkeypatch, with_file):
    """plan.py's train.py command for the fastest layout, parsed as train.py parses it on as many ranks, is the run
    planned: the flags and config file plan.py was given (optimizer, model overrides, sequence, batch, the rest), with
    the fastest layout's flags in place of the given layout's."""
    given = ["--preset=tiny", *TINY_MODEL_FLAGS, "--optimizer=muon", "--muon_lr=0.01", "--seq_len=64",
             "--global_batch=64", "--keep_gathered=true", "--data=my data"]
    if with_file:
        (tmp_path / "run.toml").write_text('[train]\noptimizer = "muon"\nseq_len = 64\nglobal_batch = 64\n'
                                           'ac = "selective"\n[model]\nn_layers = 6\n')
        given = [f"--config={tmp_path / 'run.toml'}", *TINY_MODEL_FLAGS, "--muon_lr=0.01", "--steps=1000"]
    code, report = run_json(capsys, given + ["--gpus=16", "--gpu=h100", "--json"])
    words = shlex.split(report["search"]["command"])
    assert code == 0 and words[0] == "train.py"
    assert report["micro_batch"] == 64 // 16  # no --micro_batch: each rank's share, as under torchrun on 16 ranks
    monkeypatch.setenv("WORLD_SIZE", "16")  # as torchrun starts train.py on 16 ranks
    planned = train.parse_args(given + report["search"]["best"][0]["flags"].split())
    assert train.parse_args(words[1:]) == planned
    assert planned[0].optimizer == "muon" and planned[1]["dim"] == 64


@pytest.mark.parametrize("argv, message", [
    (["--gpu=b3000"], "invalid choice"),
    (["--mfu=0"], "argument --mfu: 0 must be above 0 and at most 1"),
    (["--gpus=abc"], "argument --gpus: invalid int value: 'abc'"),
    (["--tflops=h200.json"], "argument --tflops: invalid float value: 'h200.json'"),
    (["--mtbf_hour=3"], "unknown flag --mtbf_hour; did you mean --mtbf_hours?"),
    (["--learning_rate=1"], "unknown flag --learning_rate; did you mean --lr?"),
    (["--grad_sync=last"], "unknown flag --grad_sync"),
    (["--lr=-1"], "--lr=-1.0 must be 0 or more."),
    (["--seq_len=8192", "--cp=3"], "--cp=3 must be a divisor of seq_len=8192."),
    (["--gpus=8", "--dp_replicate=2", "--dp_shard=3"],
     "--dp_replicate=2 x --dp_shard=3 is 6 ranks but 8 were launched"),
])
def test_mistyped_or_out_of_range_flags_are_one_sentence(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        plan.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------------
# Failures

def test_failure_costs_by_hand():
    p = {"world": 2048, "checkpoint": {"write_bytes": 1e9, "read_bytes": 20e9}}
    args = argparse.Namespace(mtbf_hours=8192, storage_gbs=2.0, repair_minutes=30, restart_minutes=5)
    tc = train.TrainConfig(step_timeout=600, ckpt_every=500, ckpt_minutes=30)
    f = plan.failure_costs(p, tc, 24.0, args)
    # One failure every 8192 / 2048 = 4 h = 14,400 s. A checkpoint writes 1 GB at 2 GB/s, 0.5 s; Young's interval is
    # sqrt(2 x 0.5 s x 14,400 s) = 120 s, 5 steps of 24 s.
    assert f["mtbf_hours_job"] == 4 and f["checkpoint_write_s"] == 0.5 and f["checkpoint_read_s"] == 10
    assert f["interval_s"] == pytest.approx(120) and f["interval_steps"] == 5
    # Down per failure: by hand, 30 min to repair, a 5 min restart and the 10 s read; elastic, the 600 s collective
    # timeout, then two restarts of 310 s (without the node, and again when it returns).
    assert f["downtime_s"] == {"by hand": 2110, "elastic": 1220}
    # Lost: 0.5 s each 120 s, and per failure (one each 14,400 s) half an interval of work and the downtime.
    assert f["goodput"]["best"] == pytest.approx({"by hand": 1 - 0.5 / 120 - (60 + 2110) / 14400,
                                                  "elastic": 1 - 0.5 / 120 - (60 + 1220) / 14400})
    # train.py's flags checkpoint every 500 steps (12,000 s) or 30 min, whichever comes first.
    assert f["configured_interval_s"] == 1800
    assert f["goodput"]["configured"] == pytest.approx({"by hand": 1 - 0.5 / 1800 - (900 + 2110) / 14400,
                                                        "elastic": 1 - 0.5 / 1800 - (900 + 1220) / 14400})
    # Young's interval is the one that loses least.
    lost = [plan.lost_fraction(120 * x, 0.5, 0, 14400) for x in (0.8, 1, 1.25)]
    assert lost[1] < lost[0] and lost[1] < lost[2]


def test_seed_layout_failures_come_from_its_checkpoint_bytes(capsys):
    """The seed layout checkpoints its fp32 shards and Muon's and AdamW's state: each GPU writes its 1/16 share of
    its FSDP group's (the replicas take turns) and reads its whole shard on a restart."""
    code, report = run_json(capsys, SEED_LAYOUT + ["--ac=full", "--optimizer=muon", "--storage_gbs=1"])
    state = (report["memory_gib"]["parameters (fp32 master shards)"]
             + report["memory_gib"]["optimizer (Muon momentum, AdamW m, v; fp32)"]) * 2**30
    f = report["failures"]
    assert code == 0 and f["checkpoint_write_bytes"] == pytest.approx(state / 16)
    assert f["checkpoint_write_s"] == pytest.approx(state / 16 / 1e9)
    assert f["checkpoint_read_s"] == pytest.approx(state / 1e9) and f["mtbf_hours_job"] == 4
    assert f["timeout_s"] == 600  # train.py's default --step_timeout
    assert f["interval_steps"] == round(math.sqrt(2 * state / 16 / 1e9 * 4 * 3600) / report["step_seconds"])
    assert 0 < f["goodput"]["best"]["by hand"] < f["goodput"]["best"]["elastic"] < 1


# ------------------------------------------------------------------------------------------------------------------
# The optimizer step

def muon_step_flops(model, optimizer) -> int:
    """The matmul FLOPs torch counts in one step of `optimizer` on random gradients."""
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with FlopCounterMode(display=False) as counter:
        optimizer.step()
    return counter.get_total_flops()


def test_muon_flops_are_the_newton_schulz_matmuls_a_real_step_runs(one_thread):
    for shape in ((3, 24, 40), (3, 40, 24), (1, 16, 16)):  # wide, tall (turned wide), square
        with FlopCounterMode(display=False) as counter:
            parallel.newton_schulz(torch.randn(shape))
        assert counter.get_total_flops() == plan.ns_flops(shape), shape
    model = parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu"))
    optimizer = parallel.build_optimizer(model, train.TrainConfig(optimizer="muon"), fused=False)
    work = plan.estimate(CFG, run_config(optimizer="muon"), 1)["optimizer"]
    assert work["flops"] == work["critical_flops"] == muon_step_flops(model, optimizer) > 0


class FusedAdamWBytes(TorchDispatchMode):
    """HBM bytes of torch's fused AdamW kernel: it reads params, grads, m, v and writes params, m, v back."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._fused_adamw_.default:
            self.bytes += sum(t.nbytes for i in (0, 1, 2, 3, 0, 2, 3) for t in args[i])
        return func(*args, **(kwargs or {}))


def test_adamw_moves_28_bytes_per_fp32_parameter_of_the_shard(one_thread):
    model = parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu"))
    optimizer = parallel.build_optimizer(model, train.TrainConfig(), fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with FusedAdamWBytes() as counted:
        optimizer.step()
    p = plan.estimate(CFG, run_config(), 1)
    # params_per_gpu: the count test_plan_memory_matches_* checks against real FSDP shards
    assert p["optimizer"]["hbm_bytes"] == counted.bytes == 28 * p["params_per_gpu"]
    assert p["optimizer"]["hbm_s"] == counted.bytes / plan.Links().hbm


def test_seed_layout_with_muon_reports_the_newton_schulz_flops_by_hand(capsys):
    """large at the seed layout: each GPU orthogonalises its 2 whole experts of each of the 54 MoE layers and 1/128 of
    the dense matrices (attention, dense FFN, shared expert), dealt over its FSDP group of 128."""
    def ns(O, F):  # 5 steps of X Xᵀ (2Q²W), b·A + c·A·A (2Q³), B·X (2Q²W)
        Q = min(O, F)
        W = max(O, F)
        return 5 * (4 * Q * Q * W + 2 * Q ** 3)
    D = 3072            # dim
    Hd = 48 * 128       # query heads x head_dim
    Gd = 8 * 128        # key-value heads x head_dim
    I = 3072            # expert hidden
    Fd = 12288          # dense FFN hidden
    E = 256             # routed experts
    attention = ns(Hd, D) * 2 + ns(Gd, D) * 2 + ns(D, Hd)               # q, gate; k, v; o
    dense = 60 * attention + 6 * (2 * ns(Fd, D) + ns(D, Fd)) + 54 * (2 * ns(I, D) + ns(D, I))
    experts = 54 * E // 128 * (ns(2 * I, D) + ns(D, I))                 # gate_up [2I, D], down [D, I]
    mean = experts + dense / 128
    assert mean == pytest.approx(254.1e12, rel=1e-3)
    code, adamw = run_json(capsys, SEED_LAYOUT + ["--ac=full"])
    code, muon = run_json(capsys, SEED_LAYOUT + ["--ac=full", "--optimizer=muon"])
    opt = muon["optimizer_step"]
    assert code == 0 and opt["muon_flops_mean"] == pytest.approx(mean, rel=1e-12)
    # Dealt by size, not FLOPs: the busiest rank does at most one more matrix (a dense FFN's) than the mean.
    assert mean <= opt["muon_flops_per_gpu"] <= mean + ns(Fd, D)
    parts = muon["seconds_per_step"]
    assert opt["seconds"] == pytest.approx(parts[plan.NS] + parts[plan.MUON_A2A] + parts[plan.OPT_HBM])
    assert parts[plan.NS] == pytest.approx(opt["muon_flops_per_gpu"] / 900e12, rel=0.01)  # at 40% of 2250 TFLOP/s
    # AdamW streams 28 bytes per fp32 parameter of the GPU's shard at 8 TB/s; the step and the run grow by it.
    assert adamw["optimizer_step"]["hbm_bytes_per_gpu"] == 28 * adamw["params_per_gpu"]
    assert adamw["optimizer_step"]["seconds"] == pytest.approx(28 * adamw["params_per_gpu"] / 8e12)
    code, slower = run_json(capsys, SEED_LAYOUT + ["--ac=full", "--hbm_gbs=4000"])
    assert slower["hbm_gb_s"] == 4000 and slower["optimizer_step"]["seconds"] == pytest.approx(
        2 * adamw["optimizer_step"]["seconds"])
    assert muon["step_seconds"] - adamw["step_seconds"] == pytest.approx(opt["seconds"] - adamw["optimizer_step"][
        "seconds"], rel=1e-6)
    assert muon["days"] > adamw["days"] and muon["mfu"] < adamw["mfu"]


# ------------------------------------------------------------------------------------------------------------------
# Bytes on the wire: the planner's against the collectives of real train steps (4 gloo ranks)

KINDS = {"c10d._allgather_base_": plan.AG, "c10d._reduce_scatter_base_": plan.RS, "c10d.allreduce_": plan.AR,
         "_c10d_functional.all_to_all_single": plan.A2A, "c10d.alltoall_base_": plan.MUON_A2A}


def group_ranks(args) -> list[int]:
    for a in args:
        if isinstance(a, str):  # functional collectives name their group
            return dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(a))
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.get_process_group_ranks(dist.ProcessGroup.unbox(a))
            except RuntimeError:  # another kind of object (a ReduceOp)
                continue
    raise AssertionError("a collective without a process group")


class Collectives(TorchDispatchMode):
    """The bytes this rank sends in every collective issued under it (backward included), by the standard ring
    accounting on the buffers the collective really got: (n-1)/n of an all-gather's output, of a reduce-scatter's
    and an all-to-all's input, twice that of an all-reduce's; Muon's all-to-alls, all but the rank's own split.
    All-reduces count only over `replicas` (HSDP); train_step's own sums of losses and expert counts run over every
    rank."""

    def __init__(self, replicas: list[int]):
        super().__init__()
        self.replicas = replicas
        self.sent = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = KINDS.get(str(func).rsplit(".", 1)[0])
        if kind is not None:
            n = len(group_ranks(args))
            if kind == plan.AG:
                self.sent[kind] += args[0].nbytes * (n - 1) / n
            elif kind == plan.RS:
                self.sent[kind] += args[1].nbytes * (n - 1) / n
            elif kind == plan.A2A:
                self.sent[kind] += args[0].nbytes * (n - 1) / n
            elif kind == plan.MUON_A2A:  # (output, input, group, output splits, input splits)
                own = args[4][group_ranks(args).index(dist.get_rank())]
                self.sent[kind] += (sum(args[4]) - own) * args[1].element_size()
            elif group_ranks(args) == self.replicas and n > 1:
                self.sent[kind] += 2 * sum(t.nbytes for t in args[0]) * (n - 1) / n
        return func(*args, **(kwargs or {}))


TRAFFIC_RUNS = [(1, False), (1, True), (2, False), (2, True)]  # (dp_replicate, --keep_gathered), all with ep=2
TRAFFIC_BATCH = 16
TRAFFIC_MICRO = 2  # two micro-batches per rank


def traffic_worker(out: Path):
    """Under torchrun, 4 ranks: two train steps per layout with and without --keep_gathered, the bytes of the first
    counted at the collectives; losses and final weights."""
    rank, world, device = parallel.init_distributed(timeout_s=120)
    report = {}
    for replicas, keep in TRAFFIC_RUNS:
        layout = parallel.Layout(world, replicas, ep=2)
        tc = train.TrainConfig(global_batch=TRAFFIC_BATCH, micro_batch=TRAFFIC_MICRO, seq_len=SEQ, keep_gathered=keep)
        model = parallel.build_model(CFG, layout, parallel.build_mesh(layout, "cpu"), device)
        optimizer = parallel.build_optimizer(model, tc, fused=False)
        momentum_LE, steps = torch.zeros(len(model.moe_layers()), CFG.n_experts), [0]
        S = layout.dp_shard
        counter = Collectives([rank % S + i * S for i in range(replicas)])
        losses = []
        for step in range(2):
            batch = bench.synthetic_batch(CFG.vocab_size, TRAFFIC_BATCH, SEQ, rank, world, step)
            with counter if step == 0 else torch.enable_grad():
                losses.append(bench.train_step(model, optimizer, batch, tc, torch.autocast("cpu", enabled=False),
                                               momentum_LE, steps)["lm_loss"])
        weights = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]
        report[f"{replicas},{keep}"] = {"sent": dict(counter.sent), "losses": losses}
        if keep:
            default = report[f"{replicas},False"].pop("weights")
            report[f"{replicas},{keep}"]["weight_diff"] = max((a - b).abs().max().item()
                                                              for a, b in zip(weights, default))
        else:
            report[f"{replicas},{keep}"]["weights"] = weights
            checkpoint.save(str(out / f"ckpt{replicas}"), 1, {"model": model, "optim": optimizer}, {})
    report["muon"] = muon_step_counted(world, device)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def muon_step_counted(world: int, device) -> dict:
    """A train step with --optimizer=muon (FSDP over 4 ranks, ep=2): the Newton-Schulz FLOPs and the all-to-all bytes
    of this rank's optimizer step."""
    layout = parallel.Layout(world, 1, ep=2)
    tc = train.TrainConfig(global_batch=TRAFFIC_BATCH, micro_batch=TRAFFIC_MICRO, seq_len=SEQ, optimizer="muon")
    model = parallel.build_model(CFG, layout, parallel.build_mesh(layout, "cpu"), device)
    optimizer = parallel.build_optimizer(model, tc, fused=False)
    counter = Collectives([])
    flops = FlopCounterMode(display=False)
    step = optimizer.step

    def counted_step():
        with flops, counter:
            step()
    optimizer.step = counted_step
    batch = bench.synthetic_batch(CFG.vocab_size, TRAFFIC_BATCH, SEQ, dist.get_rank(), world, 0)
    bench.train_step(model, optimizer, batch, tc, torch.autocast("cpu", enabled=False),
                     torch.zeros(len(model.moe_layers()), CFG.n_experts), [0])
    return {"flops": flops.get_total_flops(), "sent": counter.sent[plan.MUON_A2A]}


def tensor_bytes_by_file(path: Path) -> dict:
    """{file: tensor bytes it holds} of a DCP checkpoint, read from its metadata (the file format's own bytes aside)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    metadata = FileSystemReader(str(path)).read_metadata()
    held = defaultdict(int)
    for index, where in metadata.storage_data.items():
        tensor = metadata.state_dict_metadata[index.fqn]
        if isinstance(tensor, TensorStorageMetadata):
            chunk = next(c for c in tensor.chunks if c.offsets == index.offset)
            held[where.relative_path] += math.prod(chunk.sizes) * tensor.properties.dtype.itemsize
    return dict(held)


def test_planned_bytes_are_the_bytes_the_collectives_move_and_keep_gathered_trains_alike(tmp_path):
    torchrun(4, __file__, "traffic", str(tmp_path), timeout_s=400)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    for replicas, keep in TRAFFIC_RUNS:
        runs = [report[f"{replicas},{keep}"] for report in reports]
        tc = run_config(global_batch=TRAFFIC_BATCH, micro_batch=TRAFFIC_MICRO, dp_replicate=replicas, ep=2,
                        keep_gathered=keep)
        predicted = plan.estimate(CFG, tc, 4)["traffic_bytes_per_step"]
        assert {k for k, v in predicted.items() if v} == set(runs[0]["sent"])
        for rank, run in enumerate(runs):
            for kind in (plan.AG, plan.RS, plan.AR):
                assert run["sent"].get(kind, 0.0) == pytest.approx(predicted[kind], rel=1e-12), (rank, kind)
            # A rank sends back the results of the tokens it received, which routing makes uneven; the planner
            # assumes balance, which holds on average: an EP group receives what it sends.
            assert run["sent"][plan.A2A] == pytest.approx(predicted[plan.A2A], rel=0.1), rank
        mean = sum(run["sent"][plan.A2A] for run in runs) / 4
        assert mean == pytest.approx(predicted[plan.A2A], rel=1e-12)
        if not keep:  # a checkpoint: each rank writes its shards' share, the replicas taking turns
            planned = plan.estimate(CFG, tc, 4)["checkpoint"]
            held = tensor_bytes_by_file(tmp_path / f"ckpt{replicas}" / "step_00000001")
            assert held == pytest.approx({f"__{r}_0.distcp": planned["write_bytes"] for r in range(4)}, rel=1e-3)
            # A restart reads a replica's shards back whole: the checkpoint over its dp_shard ranks.
            assert sum(held.values()) / (4 // replicas) == pytest.approx(planned["read_bytes"], rel=1e-3)
        if keep:  # fewer all-gathers, the same training
            default = [report[f"{replicas},False"] for report in reports]
            for run, base in zip(runs, default):
                assert run["sent"][plan.AG] < base["sent"][plan.AG] / 2
                assert run["losses"] == base["losses"] and run["weight_diff"] == 0.0
    # Muon: each rank's Newton-Schulz FLOPs exactly (the planner deals the dense matrices as parallel.Muon does).
    tc = run_config(global_batch=TRAFFIC_BATCH, micro_batch=TRAFFIC_MICRO, ep=2, optimizer="muon")
    muon = plan.estimate(CFG, tc, 4)["optimizer"]
    assert [report["muon"]["flops"] for report in reports] == muon["flops_by_rank"]
    # A rank sends its rows of the matrices others own, then the whole of its own but its rows: uneven with what it
    # owns; the planner's bytes are the mean.
    assert sum(report["muon"]["sent"] for report in reports) / 4 == pytest.approx(muon["a2a_bytes"][0], rel=1e-12)


if __name__ == "__main__":
    worker = {"memory": two_rank_worker, "traffic": traffic_worker}[sys.argv[1]]
    run_worker(worker, Path(sys.argv[2]))
