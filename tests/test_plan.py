"""bench.py plan: the planner's memory, bytes and time against real models and hand-computed cases; its search.

    python -m pytest tests/test_plan.py -q

The multi-rank checks are this file run under torchrun (`python -m torch.distributed.run --standalone
--nproc_per_node=N tests/test_plan.py memory|traffic OUT_DIR`)."""

import json
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
import parallel
import train
from conftest import run_worker, torchrun
from model import ModelConfig

CFG = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_dense_layers=1, dense_hidden=128, n_heads=4, n_kv_heads=2,
                  head_dim=16, window=8, max_seq_len=32, n_experts=16, n_shared_experts=1, top_k=4, expert_hidden=32)
SEQ, GLOBAL_BATCH, MICRO_BATCH = 32, 8, 4
SEED_LAYOUT = ["plan", "--preset=large", "--gpus=2048", "--dp_replicate=16", "--ep=8", "--seq=8192",
               "--global_batch=12288", "--micro_batch=1", "--gpu=b300", "--search=false", "--json"]


def run_json(capsys, argv) -> tuple[int, dict]:
    """bench.main's exit code and the JSON object on its last line."""
    code = bench.main(argv)
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------------------------
# Memory

def test_plan_seed_layout(capsys):
    code, plan = run_json(capsys, SEED_LAYOUT)
    assert plan["flops_per_token"] == pytest.approx(99.2e9, rel=0.01)  # 6 x active weights + attention, at 8192
    # HSDP: each replica of 128 GPUs holds the whole model, so a GPU holds 1/128 of it (2 whole experts per layer),
    # not 1/2048: the 16 replicas hold copies.
    assert plan["params_per_gpu"] == pytest.approx(398.6e9 / 128, rel=0.01)
    assert plan["params_total"] == pytest.approx(398.6e9, rel=0.001)
    assert sum(plan["memory_gib"].values()) == pytest.approx(plan["memory_gib_per_gpu"])
    # 17T tokens in steps of 12288 x 8192 tokens; communication makes the step longer than the compute alone
    # (17T x 99.2 GFLOP at 40% of 2048 x 2.25 PFLOP/s: 10.6 days).
    assert plan["days"] == pytest.approx(17e12 / (12288 * 8192) * plan["step_seconds"] / 86400)
    assert plan["days"] > 17e12 * 99.2e9 / (2048 * 2250e12 * 0.4) / 86400 and plan["mfu"] < 0.4
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
    state = train.TrainState.fresh(model, torch.device("cpu"))
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
        want = bench.activation_bytes(CFG, SEQ, MICRO_BATCH, c=4)[ac]["saved"]
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
# Links and time

@pytest.mark.parametrize("world, replicas, ep, per_node", [(64, 2, 4, 8), (64, 4, 16, 8), (16, 1, 2, 4)])
def test_groups_span_the_nodes_build_mesh_puts_them_on(world, replicas, ep, per_node):
    """The planner's (ranks per node, nodes) of each group against rank 0's groups in parallel.build_mesh's own mesh
    (a fake process group of `world` ranks in this process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        layout = parallel.Layout(world, replicas, ep)
        mesh = parallel.build_mesh(layout, "cpu")
        big = ModelConfig(**{**CFG.__dict__, "n_experts": 64})
        groups = bench.plan(big, layout, SEQ, 1, world, links=bench.Links(per_node=per_node))["groups"]
        for name, (k, m) in groups.items():
            ranks = parallel._submesh(mesh, name).mesh.flatten().tolist()
            nodes = {r // per_node for r in ranks}
            assert (k, m) == (len(ranks) // len(nodes), len(nodes)), name
    finally:
        dist.destroy_process_group()


def test_collective_costs_by_hand():
    links = bench.Links(per_node=8, intra=100.0, inter=10.0, latency=1.0)
    # One node: a ring of 8 sends 7/8 of 800 bytes at 100 B/s, in 7 steps.
    assert links.ring_s(800, (8, 1)) == pytest.approx(7 + 7)
    # Two nodes: then each GPU carries 1/8 of the buffer, half of it to the other node, at 10 B/s, in 1 step.
    assert links.ring_s(800, (8, 2)) == pytest.approx(14 + 800 / 8 / 2 / 10 + 1)
    # One GPU per node for 4 nodes: the whole ring on the network.
    assert links.ring_s(800, (1, 4)) == pytest.approx(800 * 3 / 4 / 10 + 3)
    # All-to-all over 16 ranks on 2 nodes: 7/16 over NVLink while 8/16 cross the network; 15 steps.
    assert links.all_to_all_s(800, (8, 2)) == pytest.approx(max(800 * 7 / 16 / 100, 800 * 8 / 16 / 10) + 15)
    assert bench.sent_bytes(800, (8, 2), bench.AR) == (2 * 800 * 15 / 16, 2 * 800 * 1 / 16)


def test_timeline_overlaps_communication_it_can_and_charges_the_waits():
    tl = bench.Timeline()
    first = tl.comm(bench.AG, 2.0, 0.0)                   # nothing to hide the first gather behind
    start = tl.compute(1.0, first)
    nxt = tl.comm(bench.AG, 0.5, start)                    # prefetched under the first block: hidden
    start = tl.compute(1.0, nxt)
    tl.comm(bench.RS, 3.0, tl.compute_end)                 # longer than what follows: 2 s exposed
    tl.compute(1.0)
    tl.compute(0.0, tl.link_end)
    assert tl.compute_end == pytest.approx(2 + 1 + 1 + 3)
    assert tl.seconds == pytest.approx({"compute": 3.0, f"exposed {bench.AG}": 2.0, f"exposed {bench.RS}": 2.0})
    assert tl.link_s == pytest.approx({bench.AG: 2.5, bench.RS: 3.0})


def test_one_gpu_steps_at_its_compute_rate():
    peak, rate = 100.0, 40e12
    for ac, recompute in (("none", 0), ("selective", 0), ("full", 1)):
        p = bench.plan(CFG, parallel.Layout(1), SEQ, 2, 8, ac, compute_bytes=4)
        assert p["head_flops_per_token"] == 6 * CFG.vocab_size * CFG.dim  # the head is the rest of the FLOPs
        blocks = sum(u["flops"] for u in p["units"])
        t = bench.project(p, rate, peak, tokens_budget=8 * SEQ * 10)
        compute_s = 8 * SEQ * (p["flops_per_token"] + recompute * blocks / 3) / rate
        # then fused AdamW: 28 bytes per fp32 parameter at the HBM's speed
        assert t["step_s"] == pytest.approx(compute_s + 28 * p["params_per_gpu"] / bench.Links().hbm)
        assert t["days"] == pytest.approx(10 * t["step_s"] / 86400)
        if not recompute:
            assert t["mfu"] == pytest.approx(rate / (peak * 1e12) * compute_s / t["step_s"])
            assert set(t["seconds"]) == {"compute", bench.OPT_HBM}


@pytest.mark.parametrize("keep, optimizer", [(False, "adamw"), (True, "adamw"), (False, "muon")])
def test_middle_micro_batches_repeat_as_a_whole_timeline_runs_them(keep, optimizer):
    """project() times three micro-batches and repeats the middle one: the same step as all eight on one timeline,
    on links slow enough that communication spills from one micro-batch into the next."""
    links = bench.Links(per_node=8, intra=10e9, inter=1e7, latency=5e-6)
    p = bench.plan(CFG, parallel.Layout(16, 2, 2), SEQ, 1, 16 * 8, keep_gathered=keep, links=links,
                   optimizer=optimizer)
    tl = bench.Timeline()
    for i in range(8):
        bench.micro_batch_on(tl, p, 1e11, first=i == 0, last=i == 7)
    bench.optimizer_on(tl, p, 1e11)
    t = bench.project(p, 1e11, 100.0)
    assert t["step_s"] == pytest.approx(tl.compute_end, rel=1e-9)
    assert t["seconds"] == pytest.approx(dict(tl.seconds), rel=1e-9)
    assert t["seconds"]["compute"] < t["step_s"] / 2  # communication-bound: the case where spilling matters


def test_a_layout_whose_fsdp_groups_cross_a_slow_network_ranks_below_one_that_keeps_them_in_a_node():
    """16 GPUs in two nodes of 8 whose network is 10^5 times slower than NVLink: FSDP over all 16 (R=1) gathers
    every block across it, twice per micro-batch; FSDP inside each node with the replicas across (R=2) crosses it
    once a step."""
    links = bench.Links(per_node=8, intra=100e9, inter=1e6, latency=5e-6)
    rate, peak = 1e9, 100.0
    steps = {}
    for replicas in (1, 2):
        p = bench.plan(CFG, parallel.Layout(16, replicas, 1), SEQ, 1, 64, links=links)
        steps[replicas] = bench.project(p, rate, peak)
    cross, inside = steps[1], steps[2]
    assert cross["step_s"] > 2 * inside["step_s"] and cross["mfu"] < inside["mfu"] / 2
    assert cross["seconds"][f"exposed {bench.AG}"] > 10 * inside["seconds"].get(f"exposed {bench.AG}", 1e-9)
    best, tried, fit = bench.search(CFG, 16, SEQ, 64, "h100", links, rate)
    assert tried == fit > 5 and len(best) == 5  # a toy model fits an H100 in every layout
    assert [r["step_s"] for _, r in best] == sorted(r["step_s"] for _, r in best)
    # The winners gather once a step (one micro-batch of 4, or parameters kept gathered), not 8 times as R=1 does.
    assert all(r["step_s"] < cross["step_s"] / 2 for _, r in best)
    assert all(p["accumulation_steps"] == 1 or p["keep_gathered"] for p, _ in best)
    assert best[0][1]["step_s"] <= inside["step_s"]
    assert "exposed FSDP all-gather" in bench.why_slower(cross, best[0][1])


def test_seed_search_recommends_layouts_train_py_runs(capsys):
    code, plan = run_json(capsys, SEED_LAYOUT[:-2] + ["--ac=full", "--json"])
    out = plan["search"]
    assert code == 0 and len(out["best"]) == 5 and out["fit"] < out["tried"]
    assert all(b["memory_gib_per_gpu"] <= 0.9 * 288 for b in out["best"])
    assert out["best"][0]["step_seconds"] <= plan["step_seconds"]
    for b in out["best"]:
        tc, _ = train.parse_args(b["flags"].split() + ["--global_batch=12288", "--seq_len=8192"])  # no error
        assert tc.ep > 0 and tc.ac in ("none", "selective", "full")


def test_compute_rate_from_a_saved_bench_result(capsys, tmp_path):
    saved = tmp_path / "h200.json"
    saved.write_text("bench: ...\n" + json.dumps({"command": "step", "tflops_per_device": 450.0,
                                                  "device": "NVIDIA H200"}) + "\n")
    flags = ["plan", "--preset=tiny", "--gpus=1", "--dp_replicate=1", "--ep=1", "--gpu=h200", "--search=false",
             "--json"]
    code, plan = run_json(capsys, flags + [f"--tflops={saved}"])
    busy = plan["seconds_per_step"]["compute"] / plan["step_seconds"]  # the rest: AdamW at the H200's 4.8 TB/s
    assert code == 0 and plan["compute_tflops"] == 450.0 and plan["mfu"] == pytest.approx(450 / 989 * busy)
    assert plan["step_seconds"] - plan["seconds_per_step"]["compute"] == pytest.approx(
        28 * plan["params_per_gpu"] / 4.8e12)
    saved.write_text("not json\n")
    assert bench.main(flags + [f"--tflops={saved}"]) == 2
    assert "does not end with a bench.py --json result" in capsys.readouterr().err
    assert bench.main(flags + ["--tflops=nowhere.json"]) == 2
    assert "neither a number nor a file" in capsys.readouterr().err


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
        assert counter.get_total_flops() == bench.ns_flops(shape), shape
    model = parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu"))
    optimizer = parallel.build_optimizer(model, train.TrainConfig(optimizer="muon"), fused=False)
    work = bench.plan(CFG, parallel.Layout(1), SEQ, MICRO_BATCH, GLOBAL_BATCH, compute_bytes=4,
                      optimizer="muon")["optimizer"]
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
    p = bench.plan(CFG, parallel.Layout(1), SEQ, MICRO_BATCH, GLOBAL_BATCH, compute_bytes=4)
    # params_per_gpu: the count test_plan_memory_matches_* checks against real FSDP shards
    assert p["optimizer"]["hbm_bytes"] == counted.bytes == 28 * p["params_per_gpu"]
    assert p["optimizer"]["hbm_s"] == counted.bytes / bench.Links().hbm


def test_seed_layout_with_muon_reports_the_newton_schulz_flops_by_hand(capsys):
    """large at the seed layout: each GPU orthogonalises its 2 whole experts of each of the 54 MoE layers and 1/128 of
    the dense matrices (attention, dense FFN, shared expert), dealt over its FSDP group of 128."""
    def ns(O, F):  # 5 steps of X Xᵀ (2Q²W), b·A + c·A·A (2Q³), B·X (2Q²W)
        Q, W = min(O, F), max(O, F)
        return 5 * (4 * Q * Q * W + 2 * Q ** 3)
    D, Hd, Gd, I, Fd, E = 3072, 48 * 128, 8 * 128, 3072, 12288, 256
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
    assert opt["seconds"] == pytest.approx(parts[bench.NS] + parts[bench.MUON_A2A] + parts[bench.OPT_HBM])
    assert parts[bench.NS] == pytest.approx(opt["muon_flops_per_gpu"] / 900e12, rel=0.01)  # at 40% of 2250 TFLOP/s
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

KINDS = {"c10d._allgather_base_": bench.AG, "c10d._reduce_scatter_base_": bench.RS, "c10d.allreduce_": bench.AR,
         "_c10d_functional.all_to_all_single": bench.A2A, "c10d.alltoall_base_": bench.MUON_A2A}


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
        self.replicas, self.sent = replicas, defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = KINDS.get(str(func).rsplit(".", 1)[0])
        if kind is not None:
            n = len(group_ranks(args))
            if kind == bench.AG:
                self.sent[kind] += args[0].nbytes * (n - 1) / n
            elif kind == bench.RS:
                self.sent[kind] += args[1].nbytes * (n - 1) / n
            elif kind == bench.A2A:
                self.sent[kind] += args[0].nbytes * (n - 1) / n
            elif kind == bench.MUON_A2A:  # (output, input, group, output splits, input splits)
                own = args[4][group_ranks(args).index(dist.get_rank())]
                self.sent[kind] += (sum(args[4]) - own) * args[1].element_size()
            elif group_ranks(args) == self.replicas and n > 1:
                self.sent[kind] += 2 * sum(t.nbytes for t in args[0]) * (n - 1) / n
        return func(*args, **(kwargs or {}))


TRAFFIC_RUNS = [(1, False), (1, True), (2, False), (2, True)]  # (dp_replicate, --keep_gathered), all with ep=2
TRAFFIC_BATCH, TRAFFIC_MICRO = 16, 2  # two micro-batches per rank


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
        state = train.TrainState.fresh(model, torch.device("cpu"))
        S = layout.dp_shard
        counter = Collectives([rank % S + i * S for i in range(replicas)])
        losses = []
        for step in range(2):
            batch = bench.synthetic_batch(CFG.vocab_size, TRAFFIC_BATCH, SEQ, rank, world, step)
            with counter if step == 0 else torch.enable_grad():
                losses.append(train.train_step(model, optimizer, batch, tc, torch.autocast("cpu", enabled=False),
                                               state)["lm_loss"])
        weights = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]
        report[f"{replicas},{keep}"] = {"sent": dict(counter.sent), "losses": losses}
        if keep:
            default = report[f"{replicas},False"].pop("weights")
            report[f"{replicas},{keep}"]["weight_diff"] = max((a - b).abs().max().item()
                                                              for a, b in zip(weights, default))
        else:
            report[f"{replicas},{keep}"]["weights"] = weights
    report["muon"] = muon_step_counted(world, device)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def muon_step_counted(world: int, device) -> dict:
    """A train step with --optimizer=muon (FSDP over 4 ranks, ep=2): the Newton-Schulz FLOPs and the all-to-all bytes
    of this rank's optimizer step."""
    layout = parallel.Layout(world, 1, ep=2)
    tc = train.TrainConfig(global_batch=TRAFFIC_BATCH, micro_batch=TRAFFIC_MICRO, seq_len=SEQ, optimizer="muon")
    model = parallel.build_model(CFG, layout, parallel.build_mesh(layout, "cpu"), device)
    optimizer = parallel.build_optimizer(model, tc, fused=False)
    counter, flops, step = Collectives([]), FlopCounterMode(display=False), optimizer.step

    def counted_step():
        with flops, counter:
            step()
    optimizer.step = counted_step
    batch = bench.synthetic_batch(CFG.vocab_size, TRAFFIC_BATCH, SEQ, dist.get_rank(), world, 0)
    train.train_step(model, optimizer, batch, tc, torch.autocast("cpu", enabled=False), train.TrainState.fresh(
        model, torch.device("cpu")))
    return {"flops": flops.get_total_flops(), "sent": counter.sent[bench.MUON_A2A]}


def test_planned_bytes_are_the_bytes_the_collectives_move_and_keep_gathered_trains_alike(tmp_path):
    torchrun(4, __file__, "traffic", str(tmp_path), timeout_s=400)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    for replicas, keep in TRAFFIC_RUNS:
        runs = [report[f"{replicas},{keep}"] for report in reports]
        predicted = bench.plan(CFG, parallel.Layout(4, replicas, 2), SEQ, TRAFFIC_MICRO, TRAFFIC_BATCH,
                               compute_bytes=4, keep_gathered=keep)["traffic_bytes_per_step"]
        assert {k for k, v in predicted.items() if v} == set(runs[0]["sent"])
        for rank, run in enumerate(runs):
            for kind in (bench.AG, bench.RS, bench.AR):
                assert run["sent"].get(kind, 0.0) == pytest.approx(predicted[kind], rel=1e-12), (rank, kind)
            # A rank sends back the results of the tokens it received, which routing makes uneven; the planner
            # assumes balance, which holds on average: an EP group receives what it sends.
            assert run["sent"][bench.A2A] == pytest.approx(predicted[bench.A2A], rel=0.1), rank
        mean = sum(run["sent"][bench.A2A] for run in runs) / 4
        assert mean == pytest.approx(predicted[bench.A2A], rel=1e-12)
        if keep:  # fewer all-gathers, the same training
            default = [report[f"{replicas},False"] for report in reports]
            for run, base in zip(runs, default):
                assert run["sent"][bench.AG] < base["sent"][bench.AG] / 2
                assert run["losses"] == base["losses"] and run["weight_diff"] == 0.0
    # Muon: each rank's Newton-Schulz FLOPs exactly (the planner deals the dense matrices as parallel.Muon does).
    muon = bench.plan(CFG, parallel.Layout(4, 1, 2), SEQ, TRAFFIC_MICRO, TRAFFIC_BATCH, compute_bytes=4,
                      optimizer="muon")["optimizer"]
    assert [report["muon"]["flops"] for report in reports] == muon["flops_by_rank"]
    # A rank sends its rows of the matrices others own, then the whole of its own but its rows: uneven with what it
    # owns; the planner's bytes are the mean.
    assert sum(report["muon"]["sent"] for report in reports) / 4 == pytest.approx(muon["a2a_bytes"][0], rel=1e-12)


if __name__ == "__main__":
    worker = {"memory": two_rank_worker, "traffic": traffic_worker}[sys.argv[1]]
    run_worker(worker, Path(sys.argv[2]))
