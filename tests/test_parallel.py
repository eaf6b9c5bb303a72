"""parallel.py against a single-process run: 8 and 2 gloo processes on CPU train the same tiny model on the same global
batch under several layouts (HSDP, EP, context parallelism, activation checkpointing, compile, --keep_gathered) with
train.py's own train_step, and must match one process step for step.

    python -m pytest tests/test_parallel.py -q

The multi-rank runs are this file run under torchrun (`python -m torch.distributed.run --standalone
--nproc_per_node=8 tests/test_parallel.py eight OUT_DIR`); one launch loops over several layouts, because starting
8 torch processes on a 2-core machine costs more than the training. On a node with 8 GPUs, `--nccl` runs the same
layouts on NCCL, one GPU per rank, against one process on a GPU (a check of EP and HSDP before a long run):

    python -m pytest -q --nccl tests/test_parallel.py"""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import bench
import parallel
import train
from conftest import ranks_device, run_worker, torchrun
from model import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parent.parent
CFG = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_dense_layers=1, dense_hidden=128, n_heads=4, n_kv_heads=2,
                  head_dim=16, window=8, max_seq_len=32, n_experts=16, n_shared_experts=1, top_k=4,
                  expert_hidden=32, init_std=0.05, aux_loss_coef=1e-2, z_loss_coef=1e-3)
GLOBAL_BATCH, SEQ, STEPS, LR, MAX_NORM, BIAS_STEP = 16, 32, 3, 1e-2, 1.0, 1e-2
# AdamW divides each gradient element by its own RMS + eps. With the default eps=1e-8, an element whose gradient is
# ~1e-8 turns a rounding difference of ~1e-8 (ranks sum in another order) into an update difference of ~lr, which
# then grows step by step: two identical single-process runs on 2 threads end 4.5e-5 apart. eps=1e-3 (gradients
# here are ~1e-3) bounds that to lr * 1e-8 / eps = 1e-7 per step, so the parameters can be compared at fp32
# tolerance; the first step's gradients are compared directly as well.
ADAM_EPS = 1e-3

# Each run: world size, Layout kwargs, micro_batch (1 or 2 on 8 ranks: 2 or 1 accumulation steps), and optionally
# ac, compile (a torch.compile backend) and keep_gathered (train.py's --keep_gathered). train.py's step all-reduces
# across HSDP replicas on the last micro-batch only: the layouts with dp_replicate > 1 and 2 micro-batches check that.
RUNS = {
    "R1_S8_ep8": dict(world=8, layout=dict(dp_replicate=1, ep=8), micro_batch=1, keep_gathered=True),
    "R2_S4_ep4": dict(world=8, layout=dict(dp_replicate=2, ep=4), micro_batch=2),
    "R2_S4_ep2": dict(world=8, layout=dict(dp_replicate=2, ep=2), micro_batch=1),
    "R4_S2_ep1": dict(world=8, layout=dict(dp_replicate=4, ep=1), micro_batch=1, keep_gathered=True),
    "R1_S2_ep2_full_ac": dict(world=2, layout=dict(dp_replicate=1, ep=2), micro_batch=4, ac="full"),
    "R1_S2_ep2_selective_ac": dict(world=2, layout=dict(dp_replicate=1, ep=2), micro_batch=8, ac="selective"),
    # ep=1 on 2 ranks: the experts' FSDP all-gather runs inside the selectively checkpointed block
    "R1_S2_ep1_selective_ac": dict(world=2, layout=dict(dp_replicate=1, ep=1), micro_batch=4, ac="selective"),
    "R1_S2_ep2_compiled": dict(world=2, layout=dict(dp_replicate=1, ep=2), micro_batch=4, compile="aot_eager"),
    # Context parallelism, with document masks: each sequence's 32 tokens in 2 chunks of 16, its documents, the local
    # layers' window of 8 and the global layer crossing the boundary. With HSDP and EP (each EP group's two ranks hold
    # other rows), and alone with selective AC (its recompute reuses the all-to-alls and the balance loss's sum).
    "R2_S2_cp2_ep2": dict(world=8, layout=dict(dp_replicate=2, ep=2, cp=2), micro_batch=2, doc_mask=True),
    "R1_S1_cp2_selective_ac": dict(world=2, layout=dict(dp_replicate=1, cp=2), micro_batch=8, doc_mask=True,
                                   ac="selective"),
}
BAD_LAYOUT = (dict(dp_replicate=1, ep=2), 3)  # on 2 ranks: global batch 16 is not a multiple of 2 x 3
# torch.distributed.checkpoints saved by a layout after training (the values), loaded by another (the keys) before
DCP = {"R2_S4_ep2": "R1_S8_ep8", "R1_S1_cp2_selective_ac": "R2_S2_cp2_ep2"}


def document_ids(tokens_BT):
    """Documents ending at ids below 24 (about 1 token in 11), numbered within each row as data.py does."""
    ends_BT = (tokens_BT < 24).long()
    return ends_BT.cumsum(1) - ends_BT


def batches():
    return torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def config(run=None):
    """The TrainConfig of a run (one process: the whole global batch in one micro-batch): AdamW at a constant LR, the
    sign rule with a large step (so routing changes between steps), fp32 throughout."""
    run = run or dict(layout={}, micro_batch=GLOBAL_BATCH)
    return train.TrainConfig(global_batch=GLOBAL_BATCH, micro_batch=run["micro_batch"], seq_len=SEQ, lr=LR,
                             grad_clip=MAX_NORM, balance="sign", bias_step=BIAS_STEP,
                             doc_mask=run.get("doc_mask", False), dtype="fp32",
                             ac=run.get("ac", "none"), compile=run.get("compile", False),
                             keep_gathered=run.get("keep_gathered", False), **run["layout"])


def train_steps(run, model, tokens):
    """STEPS calls of bench.train_step (train.py's step) on this rank's slice of each global batch; returns the global
    losses, the gradient norms and the global tokens per expert, per step, and the first step's full gradients (on
    CPU) as the optimizer receives them: AdamW hides a wrongly scaled gradient, this does not."""
    optimizer = parallel.build_optimizer(model, run.tc)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    record = {"loss": [], "grad_norm": [], "counts": []}

    def keep_first_grads(optimizer, args, kwargs):
        if "grads" not in record:
            record["grads"] = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).cpu().clone()
                               for n, p in model.named_parameters()}
    optimizer.register_step_pre_hook(keep_first_grads)
    momentum_LE = torch.zeros(len(model.moe_layers()), CFG.n_experts, device=run.device)
    rows, chunk = run.layout.data_rank(run.rank)
    local_batch = GLOBAL_BATCH // run.layout.dp
    columns = slice(chunk * SEQ // run.layout.cp, (chunk + 1) * SEQ // run.layout.cp)  # as data.DataLoader cuts
    steps = [0]
    for step in range(STEPS):
        mine = tokens[step, rows * local_batch:(rows + 1) * local_batch]
        batch = (mine[:, :-1], mine[:, 1:], document_ids(mine[:, :-1]))
        out = bench.train_step(model, optimizer, tuple(t[:, columns] for t in batch), run.tc, run.autocast,
                               momentum_LE, steps)
        record["loss"].append(out["loss"])
        record["grad_norm"].append(out["grad_norm"])
        record["counts"].append(out["counts_LE"].cpu())
    return record


# ------------------------------------------------------------------------------------------------------------------
# The worker: this file under torchrun

def run_layout(name, init, tokens, rank, world, device):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0
    run = train.make_run(config(RUNS[name]), CFG, rank, world, device)  # checks the layout, as train.py does
    layout = run.layout
    mesh = parallel.build_mesh(layout, device.type)
    model = parallel.build_model(CFG, layout, mesh, device, ac=run.tc.ac, compile=run.tc.compile)
    # torch 2.13 cannot trace fp32 grouped_mm on CPU (its fake kernel wants bf16); CUDA's grouped GEMM runs in bf16,
    # where each rank's partial sums would round apart from one process's whole sums.
    if run.tc.compile or device.type == "cuda":
        for moe in model.moe_layers():
            moe.experts.impl = "loop"

    # Fresh init: every replica of a shard holds the same values (compared across dp_replicate in one gather).
    locals_ = [p.to_local().detach().flatten() for p in model.parameters()]
    flat = torch.cat(locals_)
    gathered = [torch.empty_like(flat) for _ in range(layout.dp_replicate)]
    dist.all_gather(gathered, flat, group=mesh.get_group("dp_replicate"))
    replicas_equal = all(torch.equal(g, flat) for g in gathered)
    param_bytes = {kind: sum(p.to_local().numel() * p.element_size() for n, p in model.named_parameters()
                             if ("experts." in n) == (kind == "experts")) for kind in ("dense", "experts")}

    gathered = {"fresh_init": {k: v.clone() for k, v in get_model_state_dict(model, options=full_options).items()}}
    if name in DCP:
        sharded = get_model_state_dict(model)
        dcp.load(sharded, checkpoint_id=OUT / f"dcp_{DCP[name]}")
        set_model_state_dict(model, sharded)
        gathered["dcp_loaded"] = get_model_state_dict(model, options=full_options)
    set_model_state_dict(model, dict(init), options=StateDictOptions(full_state_dict=True))  # it edits the dict
    record = train_steps(run, model, tokens)
    full = get_model_state_dict(model, options=full_options)
    if name in DCP.values():
        dcp.save(get_model_state_dict(model), checkpoint_id=OUT / f"dcp_{name}")
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"bias": [m.expert_bias.cpu().clone() for m in model.moe_layers()],
                                      "counts": record["counts"], "bytes": param_bytes,
                                      "replicas_equal": replicas_equal})
    if rank == 0:
        torch.save({**record, **gathered, "state_dict": full, "per_rank": per_rank}, OUT / f"{name}.pt")


def worker(mode):
    """Every layout of this world size in turn (run_worker tears the process group down)."""
    rank, world, device = parallel.init_distributed(timeout_s=120)
    init = torch.load(OUT / "init.pt")
    if mode == "two":
        # A layout that cannot work raises the same sentence on every rank, before any collective.
        try:
            parallel.Layout(world, **BAD_LAYOUT[0]).check(CFG, GLOBAL_BATCH, BAD_LAYOUT[1])
            message = "no error"
        except ValueError as e:
            message = str(e)
        (OUT / f"bad_layout_rank{rank}.txt").write_text(message)
    for name, run in RUNS.items():
        if run["world"] == world:
            run_layout(name, init["state_dict"], init["tokens"], rank, world, device)


# ------------------------------------------------------------------------------------------------------------------
# The tests

@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """The single-process reference and every multi-rank run (with --nccl: on GPUs, the experts' fp32 loop)."""
    device = ranks_device(request.config, 8)
    out = tmp_path_factory.mktemp("parallel")
    torch.manual_seed(0)
    model = Transformer(CFG)
    tokens = batches()
    torch.save({"state_dict": model.state_dict(), "tokens": tokens}, out / "init.pt")
    for nproc, mode in ((8, "eight"), (2, "two")):
        torchrun(nproc, str(Path(__file__).resolve()), mode, str(out), device=device)
    model.to(device)
    if device.type == "cuda":  # as the ranks run them (run_layout)
        for moe in model.moe_layers():
            moe.experts.impl = "loop"
    references = {}
    # What parallel.build_model initialises in one process from the same (default) seed.
    fresh = parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu")).state_dict()
    for doc_mask in (False, True):  # one process, without and with document masks, from the same weights
        model.load_state_dict(torch.load(out / "init.pt")["state_dict"])
        one = dict(layout={}, micro_batch=GLOBAL_BATCH, doc_mask=doc_mask)
        reference = train_steps(train.make_run(config(one), CFG, 0, 1, device), model, tokens)
        reference["state_dict"] = {k: v.cpu().clone() for k, v in model.state_dict().items()}
        reference["bias"] = [m.expert_bias.cpu().clone() for m in model.moe_layers()]
        reference["device"] = device
        reference["fresh_init"] = fresh
        references[doc_mask] = reference
    results = {name: torch.load(out / f"{name}.pt", map_location="cpu") for name in RUNS}
    bad = [(out / f"bad_layout_rank{r}.txt").read_text() for r in range(2)]
    return references, results, bad


def reference_of(references: dict, name: str) -> dict:
    """The single-process run a layout is compared with: with document masks or without, as that layout trained."""
    return references[RUNS[name].get("doc_mask", False)]


@pytest.mark.parametrize("name", list(RUNS))
def test_training_matches_single_process(runs, name):
    references, results, _ = runs
    reference = reference_of(references, name)
    run = results[name]
    # Same routing decisions, hence the same global tokens-per-expert, every step.
    for ours, theirs in zip(run["counts"], reference["counts"]):
        assert torch.equal(ours, theirs)
    torch.testing.assert_close(run["loss"], reference["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(run["grad_norm"], reference["grad_norm"], rtol=1e-5, atol=1e-6)
    for key, want in reference["grads"].items():  # every gradient, experts and dense, is the global-batch mean
        torch.testing.assert_close(run["grads"][key], want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    assert run["state_dict"].keys() == reference["state_dict"].keys()  # no wrapper names in the state dict
    for key, want in reference["state_dict"].items():  # after 3 train steps, expert bias included
        torch.testing.assert_close(run["state_dict"][key], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name", list(RUNS))
def test_expert_bias_identical_on_every_rank(runs, name):
    references, results, _ = runs
    reference = reference_of(references, name)
    for rank_result in results[name]["per_rank"]:
        for ours, want in zip(rank_result["bias"], reference["bias"]):
            assert torch.equal(ours, want)
        for ours, want in zip(rank_result["counts"], reference["counts"]):
            assert torch.equal(ours, want)


@pytest.mark.parametrize("name", [n for n in RUNS if RUNS[n]["world"] == 8])
def test_each_rank_holds_its_share_of_the_parameters(runs, name):
    references, results, _ = runs
    reference = reference_of(references, name)
    # Dense parameters are sharded over dp_shard ranks, experts over efsdp x ep: the same number of ranks.
    shard = RUNS[name]["world"] // RUNS[name]["layout"]["dp_replicate"]
    total = {kind: sum(t.numel() * t.element_size() for n, t in reference["state_dict"].items()
                       if n.endswith("proj") or n.endswith("weight")
                       if ("experts." in n) == (kind == "experts")) for kind in ("dense", "experts")}
    for rank_result in results[name]["per_rank"]:
        for kind in ("dense", "experts"):
            assert rank_result["bytes"][kind] == pytest.approx(total[kind] / shard, rel=0.05), kind
        assert rank_result["replicas_equal"]


@pytest.mark.parametrize("name", list(RUNS))
def test_fresh_initialisation_matches_single_process(runs, name):
    """build_model gives every layout, from the same seed, the exact weights one process draws."""
    references, results, _ = runs
    reference = reference_of(references, name)
    if reference["device"].type == "cuda":
        pytest.skip("on CUDA, DTensor's RNG tracker draws shards from one global stream, not one process's draws")
    fresh, want = results[name]["fresh_init"], reference["fresh_init"]
    assert fresh.keys() == want.keys()
    for key in want:
        assert torch.equal(fresh[key], want[key]), key


@pytest.mark.parametrize("load, save", list(DCP.items()))
def test_checkpoint_saved_on_one_layout_loads_on_another(runs, load, save):
    """Trained on one layout (with context parallelism too), loaded on another: the same weights."""
    _, results, _ = runs
    saved, loaded = results[save]["state_dict"], results[load]["dcp_loaded"]
    assert saved.keys() == loaded.keys()
    for key, want in saved.items():
        assert torch.equal(loaded[key], want), key


def test_bad_layout_raises_on_every_rank(runs):
    _, _, bad = runs
    assert bad[0] == bad[1]
    assert "global_batch=16" in bad[0] and "micro_batch 3" in bad[0]


def test_describe_names_the_groups():
    text = parallel.Layout(8, dp_replicate=2, ep=2).describe(n_experts=16)
    assert "mesh [dp_replicate=2, efsdp=2, ep=2] over 8 ranks" in text
    assert "FSDP groups (dense params, dp_shard=4): [0-3] [4-7]" in text
    assert "replicas (dp_replicate=2, dense and experts): [0,4] [1,5] [2,6] ... (4 groups)" in text
    assert "EP groups (ep=2, consecutive ranks): [0-1] [2-3] [4-5] ... (4 groups)" in text
    assert "expert FSDP groups (efsdp=2): [0,2] [1,3] [4,6] ... (4 groups)" in text
    assert "routed experts: 16/2 = 8 per EP rank, 4 per GPU" in text
    assert "1 process" in parallel.Layout(1).describe()
    text = parallel.Layout(8, dp_replicate=1, ep=2, cp=2).describe(n_experts=16)
    assert "mesh [dp_replicate=1, efsdp=2, cp=2, ep=2] over 8 ranks" in text
    assert "FSDP groups (dense params, dp_shard=4 x cp=2): [0-7]" in text
    assert "CP groups (cp=2, the chunks of a row): [0,2] [1,3] [4,6] ... (4 groups)" in text
    assert "expert FSDP groups (efsdp=2 x cp=2): [0,2,4,6] [1,3,5,7]" in text
    assert "routed experts: 16/2 = 8 per EP rank, 2 per GPU" in text


def test_context_parallel_data_ranks_and_refusals():
    """The cp ranks of a group read the same rows, a chunk each, in build_mesh's order [dp_replicate, efsdp, cp, ep];
    a cp that does not divide the sequence is refused in one sentence, and so is one launched on too few ranks."""
    layout = parallel.Layout(8, dp_replicate=2, ep=2, cp=2)
    assert [layout.data_rank(r) for r in range(8)] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert (layout.dp, layout.dp_shard, layout.efsdp) == (4, 2, 1)
    with pytest.raises(ValueError, match=r"--cp=3 must be a divisor of seq_len=32"):
        config(dict(layout=dict(cp=3), micro_batch=1))
    with pytest.raises(ValueError, match=r"--dp_replicate=1 x --dp_shard=2 x --cp=2 is 4 ranks but 2 were launched"):
        parallel.Layout.for_world(2, 1, 2, 1, 2)


@pytest.mark.parametrize("layout, micro_batch, message", [
    (dict(world=8, dp_replicate=3), 1, "world size 8 is not divisible by dp_replicate=3"),
    (dict(world=8, dp_replicate=2, ep=8), 1, "ep=8 does not divide dp_shard=4"),
    (dict(world=8, ep=8), 1, None),  # fine
    (dict(world=6, ep=3), 1, "n_experts=16 is not divisible by ep=3"),
    (dict(world=8, dp_replicate=2, ep=2), 4, "global_batch=16 sequences is not divisible by world 8 x micro_batch 4"),
    # context parallelism: cp x the others must make the world; cp splits the kv heads; rows are world / cp
    (dict(world=8, cp=3), 1, r"world size 8 is not divisible by dp_replicate=1 x cp=3; choose cp from \[1, 2, 4, 8\]"),
    (dict(world=8, cp=4), 1, r"cp=4 does not divide n_kv_heads=2: choose cp from \[1, 2\]"),
    (dict(world=8, cp=2, ep=8), 1, r"ep=8 does not divide dp_shard=4 \(world 8 / dp_replicate 1 / cp 2\)"),
    (dict(world=8, cp=2), 8, "global_batch=16 sequences is not divisible by world 8 / cp 2 x micro_batch 8 = 32"),
    (dict(world=8, cp=2), 2, None),
])
def test_layout_check(layout, micro_batch, message):
    check = lambda: parallel.Layout(**layout).check(CFG, GLOBAL_BATCH, micro_batch)  # noqa: E731
    if message is None:
        check()
    else:
        with pytest.raises(ValueError, match=message):
            check()
    assert parallel.Layout(8, 2, 2).accumulation_steps(GLOBAL_BATCH, 1) == 2


def test_single_process_build_and_clip():
    """World 1: build_model gives a plain, initialised model; clip_grad_norm_ equals torch's on plain tensors."""
    device = torch.device("cpu")
    model = parallel.build_model(CFG, parallel.Layout(1), None, device, ac="full")
    assert model.state_dict().keys() == Transformer(CFG).state_dict().keys()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all((m.expert_bias == 0).all() for m in model.moe_layers())
    tokens = batches()[0, :2]
    loss = model(tokens[:, :-1], targets_BT=tokens[:, 1:])
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = parallel.clip_grad_norm_(model, 0.1)
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    torch.testing.assert_close(norm, want)
    assert norm > 0.1  # so the clipping itself was exercised
    clipped = [p.grad.clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    parallel.clip_grad_norm_(model, 0.1)
    for p, c in zip(model.parameters(), clipped):
        torch.testing.assert_close(p.grad, c)
    # Under the limit the gradients are left exactly as they are.
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    torch.testing.assert_close(parallel.clip_grad_norm_(model, 2 * float(want)), want)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)



def test_model_too_big_for_memory_is_refused_before_allocation(monkeypatch):
    """On CPU, build_model refuses a model whose shards times state_copies (weights, gradients, optimizer moments)
    cannot fit, with this machine's other ranks, in its available memory: one sentence, before anything is
    allocated (the OOM killer would end the run without a word). The same model alone on the machine is built."""
    n_bytes = 4 * sum(p.numel() for p in Transformer(CFG).parameters())
    monkeypatch.setattr(parallel, "host_memory_available", lambda: int(4 * n_bytes * 1.5))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu"), state_copies=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    def allocate(*args, **kwargs):
        raise AssertionError("memory was allocated before the check")

    monkeypatch.setattr(torch.nn.Module, "to_empty", allocate)
    with pytest.raises(ValueError, match=r"need 0\.\d GiB on each of this machine's 2 rank\(s\) but only .* GiB of "
                                         r"memory is available; choose a smaller model"):
        parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu"), state_copies=4)

def test_compiled_blocks_never_fall_back_to_eager():
    """Training and evaluation at two batch sizes compile more variants of Block.forward than dynamo's default limit
    of 8 (dense and MoE, local and global blocks, grad on and off, two shapes); apply_compile raises the limit, so
    none of them is left to run eagerly (dynamo is told to fail instead)."""
    # The limit counts dynamo's graphs, whatever the backend: "eager" spares the test AOT autograd's tracing.
    model = parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu"), compile="eager")
    for moe in model.moe_layers():  # torch 2.13 cannot trace fp32 grouped_mm on CPU (its fake kernel wants bf16)
        moe.experts.impl = "loop"
    tokens = batches()[0, :4]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        model(tokens[:, :-1], targets_BT=tokens[:, 1:]).backward()
        with torch.no_grad():
            for rows in (4, 1):
                model(tokens[:rows, :-1], targets_BT=tokens[:rows, 1:])


def test_fully_checkpointed_blocks_compile():
    """--ac=full with --compile: each compiled block recomputes its forward in backward, with the loss and gradients
    of the eager model that keeps its activations."""
    eager = parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu"))
    compiled = parallel.build_model(CFG, parallel.Layout(1), None, torch.device("cpu"), ac="full", compile="aot_eager")
    tokens = batches()[0, :2]
    for model in (eager, compiled):
        for moe in model.moe_layers():  # torch 2.13 cannot trace fp32 grouped_mm on CPU (its fake kernel wants bf16)
            moe.experts.impl = "loop"
        model(tokens[:, :-1], targets_BT=tokens[:, 1:]).backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


if __name__ == "__main__":
    OUT = Path(sys.argv[2])
    run_worker(worker, sys.argv[1])


def test_a_busy_cpu_is_named_with_the_thread_setting_that_helps(monkeypatch, capsys):
    """torch's thread per core on busy cores can be ~10x slower than one thread (README): said at start, on CPU."""
    threads = torch.get_num_threads()
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(parallel, "use_cuda", lambda: False)
    try:
        torch.set_num_threads(2)
        for load, said in ((9.0, True), (1.0, False)):
            monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
            assert parallel.init_distributed() == (0, 1, torch.device("cpu"))
            assert ("warning: the CPU is busy (load 9.0 on 2 threads), so one thread may run faster; "
                    "set OMP_NUM_THREADS=1\n" == capsys.readouterr().err) is said
    finally:
        torch.set_num_threads(threads)
