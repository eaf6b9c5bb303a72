"""checkpoint.py: exact resume, crash safety, pruning, async saves, resharding from 2 FSDP ranks to 1 process,
and Hugging Face export checked against transformers' afmoe.

    python -m pytest tests/test_checkpoint.py -q

This file is also the worker the multi-process tests launch:
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/test_checkpoint.py fsdp OUT_DIR
    python tests/test_checkpoint.py save-loop CKPT_ROOT    # saves forever; the kill test SIGKILLs it mid-save
"""

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import checkpoint
from checkpoint import export_hf, hf_config, latest, load, load_hf_into, save, to_hf_state_dict
from conftest import craft_bytes_entry, crafted_metadata, rewrite_metadata, run_worker
from model import ModelConfig, Transformer

# DCP warns on every single-process call; checkpoint.py silences it, pytest's per-test filters bring it back.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_cfg(**kw):
    base = dict(vocab_size=256, dim=64, n_layers=4, n_dense_layers=1, dense_hidden=96, n_heads=4, n_kv_heads=2,
                head_dim=16, window=8, max_seq_len=64, n_experts=16, n_shared_experts=1, top_k=4,
                route_scale=2.448, expert_hidden=32, init_std=0.05)
    base.update(kw)
    return ModelConfig(**base)


def randomise_(model, seed, scale=0.1):
    """Random values for every parameter and buffer, so no tensor is trivially equal to its init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            t.copy_(torch.randn(t.shape, generator=g) * scale + (1.0 if "norm" in name else 0.0))


def train_steps(model, optim, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=g)
        loss = model(tokens, targets_BT=tokens)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def make(cfg, seed, lr=1e-2):
    torch.manual_seed(seed)
    model = Transformer(cfg)
    randomise_(model, seed)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def assert_same_model_and_optim(m1, o1, m2, o2):
    for (name, a), b in zip(m1.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(m1.parameters(), o2.param_groups[0]["params"]):
        s1, s2 = o1.state[p], o2.state[q]
        assert s1.keys() == s2.keys()
        for k in s1:
            assert torch.equal(s1[k], s2[k]), k
    assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"]


def env():
    return {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}


# --- resume is exact

def test_round_trip_restores_model_optimizer_and_train_state(tmp_path):
    cfg = tiny_cfg()
    model, optim = make(cfg, seed=0)
    train_steps(model, optim, 2)
    momentum = torch.randn(3, cfg.n_experts)
    train = {"step": 2, "loader": {"shard": 3, "offsets": [5, 7], "done": None}, "recent": [[2.5, 0.5]],
             "momentum": momentum, "bf16": torch.randn(3, dtype=torch.bfloat16)}
    save(str(tmp_path), 2, {"model": model, "optim": optim, "train": train}, {"lr": 1e-2, "model": cfg})
    state = json.loads((tmp_path / "step_00000002" / "state.json").read_text())  # plain JSON: no tensor in it
    assert state["train"] == {"step": 2, "loader": {"shard": 3, "offsets": [5, 7], "done": None},
                              "recent": [[2.5, 0.5]]}
    train_steps(model, optim, 1, seed=1)  # the uninterrupted run's next step

    resumed, resumed_optim = make(cfg, seed=1, lr=5.0)  # other weights, other lr: all must be overwritten
    into = {"momentum": torch.zeros(3, cfg.n_experts), "bf16": torch.zeros(3, dtype=torch.bfloat16)}
    got = load(latest(str(tmp_path)), {"model": resumed, "optim": resumed_optim, "train": into})
    assert got == state["train"]
    assert torch.equal(into["momentum"], momentum) and torch.equal(into["bf16"], train["bf16"])  # in place

    train_steps(resumed, resumed_optim, 1, seed=1)  # the resumed run takes the same step, bit for bit
    assert_same_model_and_optim(model, optim, resumed, resumed_optim)


def test_bad_train_state_fails_before_writing(tmp_path):
    model, optim = make(tiny_cfg(), seed=0)
    with pytest.raises(TypeError, match=r"the checkpoint's train holds <object object at .*> of type object"):
        save(str(tmp_path), 1, {"model": model, "optim": optim, "train": {"sampler": object()}}, {})
    assert os.listdir(tmp_path) == []


def test_asking_for_optimizer_state_a_checkpoint_lacks_is_one_sentence(tmp_path):
    """Another architecture is train.py's to refuse before loading (test_resume); here: no missing-key dump."""
    cfg = tiny_cfg()
    model, optim = make(cfg, seed=0)
    save(str(tmp_path), 1, {"model": model}, {"model": cfg})
    with pytest.raises(ValueError, match="saved without optimizer state"):
        load(str(tmp_path), {"model": model, "optim": optim})


# --- crash safety and pruning

def test_latest_ignores_incomplete_checkpoints(tmp_path):
    model, _ = make(tiny_cfg(), seed=0)
    save(str(tmp_path), 10, {"model": model}, {})
    (tmp_path / "step_00000020").mkdir()  # written by something, never marked complete
    (tmp_path / "step_00000020" / ".metadata").write_bytes(b"")
    (tmp_path / "step_00000030.tmp").mkdir()  # a save killed mid-write
    (tmp_path / "step_00000030.tmp" / checkpoint.MARKER).write_text("30\n")
    assert latest(str(tmp_path)) == str(tmp_path / "step_00000010")
    assert latest(str(tmp_path / "nowhere")) is None
    with pytest.raises(ValueError, match=r"step_00000020 is incomplete .*use .*step_00000010 instead"):
        load(str(tmp_path / "step_00000020"), {"model": model})


def test_keep_prunes_old_checkpoints_only(tmp_path):
    model, _ = make(tiny_cfg(), seed=0)
    (tmp_path / "step_00000000.tmp").mkdir()  # left by a killed save before any of these: garbage
    (tmp_path / "step_00000009.tmp").mkdir()  # newer than anything saved below: never touched
    for step in range(1, 5):
        save(str(tmp_path), step, {"model": model}, {}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004", "step_00000009.tmp"]
    save(str(tmp_path), 2, {"model": model}, {}, keep=2)  # a rewound run: the one just written stays
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000004", "step_00000009.tmp"]


def flip_a_bit(ckpt: Path, tensor: torch.Tensor) -> Path:
    """Flip one bit of `tensor`'s bytes where the checkpoint's .distcp file holds them: the file keeps its size."""
    file = next(ckpt.glob("*.distcp"))
    raw = bytearray(file.read_bytes())
    at = raw.find(tensor.detach().numpy().tobytes())
    assert at >= 0
    raw[at + 5] ^= 0x08
    file.write_bytes(raw)
    return file


def two_checkpoints(tmp_path, model, optim=None):
    """Steps 1 and 2 of `model` under tmp_path/ckpt: (the root, step 2, where a crafted pickle would create a file)."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        save(str(root), step, {"model": model, "optim": optim}, {"model": model.cfg})
    return root, root / "step_00000002", tmp_path / "created_by_the_pickle"


def assert_the_cli_refuses(damaged, message, capsys, ls_root=None):
    """sample and export of `damaged` fail with `message` alone and write nothing; ls lists it (step 2) damaged."""
    for argv in (["sample", str(damaged), "--prompt_ids=1,2", "--device=cpu"],
                 ["export", str(damaged), str(damaged.parent.parent / "hf")]):
        assert checkpoint.main(argv) == 2
        assert capsys.readouterr().err == f"checkpoint.py: error: {message}\n"
    assert not (damaged.parent.parent / "hf").exists()
    if ls_root is not None:
        assert checkpoint.main(["ls", str(ls_root)]) == 0
        assert [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:3]] == [["1", "complete"],
                                                                                           ["2", "damaged"]]


def test_a_flipped_bit_is_a_damaged_checkpoint_on_every_load_path(tmp_path, capsys):
    cfg = tiny_cfg()
    model, optim = make(cfg, seed=0)
    root = tmp_path / "ckpt"
    save(str(root), 1, {"model": model, "optim": optim}, {"model": cfg})
    step1 = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps(model, optim, 1)
    save(str(root), 2, {"model": model, "optim": optim}, {"model": cfg})
    newest = root / "step_00000002"
    file = flip_a_bit(newest, model.layers["1"].ffn.experts.gate_up_proj)
    message = f"checkpoint {newest} is damaged: {file} has changed since it was written (its sha256 differs)."

    fresh, fresh_optim = make(cfg, seed=1)
    with pytest.raises(checkpoint.CorruptCheckpoint, match="^" + re.escape(message) + "$"):
        load(str(newest), {"model": fresh, "optim": fresh_optim})
    said = []  # the root: the newest checkpoint that loads, saying which one it skipped
    path, _ = checkpoint.load_latest(str(root), {"model": fresh, "optim": fresh_optim}, say=said.append)
    assert path == str(root / "step_00000001")
    assert said == [f"{message} Skipping it, trying the previous checkpoint."]
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, step1[k]), k
    assert_the_cli_refuses(newest, message, capsys)
    # A checkpoint written before checksums existed loads as it did.
    (root / "step_00000001" / checkpoint.CHECKSUMS).unlink()
    load(str(root / "step_00000001"), {"model": fresh, "optim": fresh_optim})


def test_a_crafted_metadata_runs_no_code_on_any_load_path(tmp_path, capsys):
    cfg = tiny_cfg()
    model, _ = make(cfg, seed=0)
    root, crafted, created = two_checkpoints(tmp_path, model)
    (crafted / ".metadata").write_bytes(crafted_metadata(str(created)))
    (crafted / "checksums.json").unlink(missing_ok=True)  # as an attacker would: only the unpickler stands guard
    message = (f"checkpoint {crafted} is damaged: {crafted / '.metadata'} cannot be read (it names io.open, which "
               f"DCP's metadata never holds).")

    for call in (lambda: checkpoint.verify(str(crafted)), lambda: load(str(crafted), {"model": Transformer(cfg)})):
        with pytest.raises(checkpoint.CorruptCheckpoint) as damaged:
            call()
        assert not created.exists()  # the pickle did not run
        assert str(damaged.value) == message
    said = []
    path, _ = checkpoint.load_latest(str(root), {"model": Transformer(cfg)}, say=said.append)
    assert path == str(root / "step_00000001") and said[0].startswith(message)
    assert_the_cli_refuses(crafted, message, capsys, ls_root=root)
    assert not created.exists()


def test_a_crafted_metadata_of_allowed_classes_is_a_damaged_checkpoint(tmp_path, capsys):
    """A .metadata of allowed classes only, checksums recomputed: a tensor declared a bytes entry (DCP reads those with
    a full pickle) runs no code on any load path; one of another dtype, or data in another folder, is refused before
    any data is read."""
    cfg = tiny_cfg()
    model, optim = make(cfg, seed=0)
    root, crafted, created = two_checkpoints(tmp_path, model, optim)
    craft_bytes_entry(crafted, "model.embed.weight", str(created))
    message = (f"checkpoint {crafted} is damaged: {crafted / '.metadata'} cannot be read (it names torch.distributed."
               f"checkpoint.metadata.BytesStorageMetadata, which DCP's metadata never holds).")
    with pytest.raises(checkpoint.CorruptCheckpoint, match="^" + re.escape(message) + "$"):
        load(str(crafted), {"model": Transformer(cfg)})
    said = []
    path, _ = checkpoint.load_latest(str(root), {"model": Transformer(cfg)}, say=said.append)
    assert path == str(root / "step_00000001") and said == [f"{message} Skipping it, trying the previous checkpoint."]
    assert_the_cli_refuses(crafted, message, capsys, ls_root=root)
    assert not created.exists()

    def float64_embedding(metadata, _):
        metadata.state_dict_metadata["model.embed.weight"].properties.dtype = torch.float64
    shutil.rmtree(crafted)
    save(str(root), 2, {"model": model, "optim": optim}, {"model": cfg})
    rewrite_metadata(crafted, float64_embedding)
    message = (f"checkpoint {crafted} is damaged: its .metadata holds model.embed.weight as a torch.float64 tensor of "
               f"shape (256, 64), where a torch.float32 tensor of shape (256, 64) is expected.")
    with pytest.raises(checkpoint.CorruptCheckpoint, match="^" + re.escape(message) + "$"):
        load(str(crafted), {"model": Transformer(cfg)})
    with pytest.raises(checkpoint.CorruptCheckpoint, match=re.escape(message.replace("model.embed", "embed"))):
        export_hf(str(crafted), str(tmp_path / "hf"))  # (it warns that the checkpoint records no tokenizer)
    assert not (tmp_path / "hf").exists()

    def data_elsewhere(metadata, _):
        for info in metadata.storage_data.values():
            info.relative_path = os.path.join("..", "step_00000001", info.relative_path)
    shutil.rmtree(crafted)
    save(str(root), 2, {"model": model, "optim": optim}, {"model": cfg})
    rewrite_metadata(crafted, data_elsewhere)
    elsewhere = f"{crafted / '.metadata'} names '../step_00000001/__0_0.distcp' as a data file"
    with pytest.raises(checkpoint.CorruptCheckpoint, match=re.escape(elsewhere)):
        load(str(crafted), {"model": Transformer(cfg)})


def test_a_checkpoint_without_checksums_is_damaged_unless_named(tmp_path, capsys):
    """A deleted, empty or malformed checksums.json turns no check off: the checkpoint is damaged and the previous one
    loads; named explicitly, it loads unchecked with a warning."""
    cfg = tiny_cfg()
    model, optim = make(cfg, seed=0)
    root = tmp_path / "ckpt"
    save(str(root), 1, {"model": model, "optim": optim}, {"model": cfg})
    train_steps(model, optim, 1)
    save(str(root), 2, {"model": model, "optim": optim}, {"model": cfg})
    newest = root / "step_00000002"
    flip_a_bit(newest, model.layers["1"].ffn.experts.gate_up_proj)
    checksums = newest / checkpoint.CHECKSUMS
    fresh, fresh_optim = make(cfg, seed=1)
    named = "; to load it unchecked, name this checkpoint itself"
    for text, why in [(None, "is missing" + named),
                      ("{}", "lists no sha256 of .metadata, __0_0.distcp, config.json and 1 more" + named),
                      ("[]", "holds a JSON list, not an object")]:
        checksums.unlink(missing_ok=True)
        if text is not None:
            checksums.write_text(text)
        said = []
        path, _ = checkpoint.load_latest(str(root), {"model": fresh, "optim": fresh_optim}, say=said.append)
        assert path == str(root / "step_00000001")
        assert said == [f"checkpoint {newest} is damaged: {checksums} {why}. Skipping it, trying the previous "
                        f"checkpoint."]
        with pytest.raises(checkpoint.CorruptCheckpoint, match=re.escape(why)):
            load(str(root), {"model": fresh, "optim": fresh_optim})  # the root's newest: not named
    assert checkpoint.main(["ls", str(root)]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[:2] == ["2", "damaged"]
    checksums.unlink()
    with pytest.warns(UserWarning, match=f"^checkpoint {re.escape(str(newest))} has no sha256 of .metadata, "
                                         f"__0_0.distcp, config.json and 1 more: it loads unchecked, as it was named"):
        load(str(newest), {"model": fresh, "optim": fresh_optim})


def test_json_files_of_another_shape_are_a_damaged_checkpoint(tmp_path):
    """A state.json or config.json that parses but is not the object a load reads is damage, not a traceback."""
    cfg = tiny_cfg()
    model, _ = make(cfg, seed=0)
    root, newest, _ = two_checkpoints(tmp_path, model)
    for name, text, why in [("state.json", "[]", "holds a JSON list, not an object"),
                            ("state.json", '{"step": "2", "train": {}}', "lacks its integer step or its train state"),
                            ("config.json", "3", "holds a JSON int, not an object")]:
        shutil.rmtree(newest)
        save(str(root), 2, {"model": model}, {"model": cfg})
        (newest / name).write_text(text)
        rewrite_metadata(newest, lambda *_: None)  # checksums recomputed: the file is as written
        said = []
        path, _ = checkpoint.load_latest(str(root), {"model": Transformer(cfg)}, say=said.append)
        assert path == str(root / "step_00000001")
        assert said == [f"checkpoint {newest} is damaged: {newest / name} {why}. Skipping it, trying the previous "
                        f"checkpoint."]


def save_loop(root):
    """Worker for the kill test: a ~100 MB model saved over and over, every parameter equal to the step."""
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(24)])
    for step in range(1, 1000):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        save(root, step, {"model": model}, {"step": step}, keep=0)


def test_kill_during_save_leaves_previous_checkpoint_newest(tmp_path):
    def mid_write(root):
        """Saves newer than the newest complete one whose DCP data file is being written."""
        newest = latest(root)
        found = []
        for e in checkpoint._scan(root):
            try:
                files = os.listdir(e.path)
            except FileNotFoundError:  # renamed meanwhile: that save completed
                continue
            if newest and e.tmp and e.step > int(newest[-8:]) and ".metadata" not in files \
                    and any(f.endswith(".distcp") for f in files):
                found.append(e)
        return found

    for attempt in range(3):  # a kill may land after the data is written; then it proves less, so retry
        root = str(tmp_path / f"run{attempt}")
        proc = subprocess.Popen([sys.executable, __file__, "save-loop", root], env=env(), start_new_session=True)
        try:
            deadline = time.time() + 60
            while time.time() < deadline and proc.poll() is None and not mid_write(root):
                time.sleep(0.002)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        partial = mid_write(root)
        if partial:
            break
    assert partial, "the save was never caught mid-write"
    step = int(latest(root)[-8:])
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(24)])
    assert load(root, {"model": model}) == {}
    assert all(torch.all(p == step) for p in model.parameters())
    # The next save of the killed step replaces its leftovers and completes.
    save(root, partial[0].step, {"model": model}, {})
    assert latest(root).endswith(f"step_{partial[0].step:08d}")
    assert not any(e.tmp for e in checkpoint._scan(root))
    shutil.rmtree(tmp_path)  # a few hundred MB: do not leave them for pytest's kept temp dirs


# --- async saves

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("process_group", [False, True], ids=["no-process-group", "gloo-world-1"])
def test_async_save_round_trip(tmp_path, process_group):
    if process_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        cfg = tiny_cfg()
        model, optim = make(cfg, seed=0)
        train_steps(model, optim, 1)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        pending = save(str(tmp_path), 1, {"model": model, "optim": optim, "train": {"step": 1}}, {}, async_save=True)
        with torch.no_grad():  # the loop goes on while the write runs: the checkpoint must not see this
            for p in model.parameters():
                p.add_(1.0)
        assert latest(str(tmp_path)) is None  # complete only once waited for
        pending.wait()
        assert latest(str(tmp_path)) == str(tmp_path / "step_00000001")
        resumed, resumed_optim = make(cfg, seed=1)
        assert load(str(tmp_path), {"model": resumed, "optim": resumed_optim}) == {"step": 1}
        for k, v in resumed.state_dict().items():
            assert torch.equal(v, expected[k]), k
    finally:
        if process_group:
            dist.destroy_process_group()


# --- two FSDP ranks -> one plain process

def fsdp_worker(out_dir):
    """2 gloo ranks: train the tiny model under FSDP2 for a step, save synchronously (step 1) and asynchronously
    (step 2), reload step 2 into the sharded model, and write the full tensors (gathered without DCP) as the
    reference the test compares against."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = tiny_cfg()
    model, _ = make(cfg, seed=0)
    mesh = init_device_mesh("cpu", (2,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train_steps(model, optim, 1)

    def full(t):
        return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t.clone()

    ref = {"model": {k: full(v) for k, v in model.state_dict().items()},
           "optim": {n: {k: full(v) for k, v in optim.state[p].items()} for n, p in model.named_parameters()}}
    assert isinstance(model.layers["1"].ffn.experts.gate_up_proj, torch.distributed.tensor.DTensor)
    train = {"step": 1, "momentum": torch.arange(4.0)}
    save(os.path.join(out_dir, "ckpt"), 1, {"model": model, "optim": optim, "train": train}, {"model": cfg})

    pending = save(os.path.join(out_dir, "ckpt"), 2, {"model": model, "optim": optim, "train": train}, {"model": cfg},
                   async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    pending.wait()
    sha256, hashed = checkpoint._sha256, []
    checkpoint._sha256 = lambda path: hashed.append(os.path.basename(path)) or sha256(path)
    assert load(os.path.join(out_dir, "ckpt"), {"model": model, "optim": optim})["step"] == 1
    checkpoint._sha256 = sha256
    for k, v in model.state_dict().items():
        assert torch.equal(full(v), ref["model"][k]), k
    # A bit flipped in rank 1's data file: whichever rank reads it, both refuse the checkpoint with the same words.
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "ckpt", "step_00000002", "__1_0.distcp"), "r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    try:
        load(os.path.join(out_dir, "ckpt", "step_00000002"), {"model": model, "optim": optim})
        verdict = None
    except checkpoint.CorruptCheckpoint as e:
        verdict = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"hashed": hashed, "verdict": verdict}, f)
    if rank == 0:
        torch.save(ref, os.path.join(out_dir, "ref.pt"))  # run_worker tears the process group down


def test_two_fsdp_ranks_reshard_to_one_process(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "fsdp",
           str(tmp_path)]
    result = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    ckpt = tmp_path / "ckpt" / "step_00000001"
    assert (tmp_path / "ckpt" / "step_00000002" / checkpoint.MARKER).exists()
    # Every file either rank wrote has its checksum; loading on 2 ranks, each file was read by one rank only, and
    # both refused the damaged checkpoint alike.
    damaged = tmp_path / "ckpt" / "step_00000002"
    with open(damaged / checkpoint.CHECKSUMS) as f:
        checksums = json.load(f)
    assert set(checksums) == {".metadata", "__0_0.distcp", "__1_0.distcp", "config.json", "state.json"}
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(ranks[0]["hashed"] + ranks[1]["hashed"]) == sorted(checksums)
    assert ranks[0]["verdict"] == ranks[1]["verdict"] == (
        f"checkpoint {damaged} is damaged: {damaged / '__1_0.distcp'} has changed since it was written (its sha256 "
        f"differs).")

    model, optim = make(tiny_cfg(), seed=1)
    momentum = torch.zeros(4)
    train = load(str(ckpt), {"model": model, "optim": optim, "train": {"momentum": momentum}})
    assert train == {"step": 1} and torch.equal(momentum, torch.arange(4.0))
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref["model"][k]), k
    for n, p in model.named_parameters():
        for k, v in optim.state[p].items():
            assert torch.equal(v, ref["optim"][n][k]), (n, k)


def disk_full_worker(out_dir):
    """2 gloo ranks: rank 0 finds the disk full writing state.json of step 1; both ranks must give the save up
    together (no rank left in DCP's collectives), then both save step 2."""
    import errno

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Linear(4, 4)
    write = checkpoint.data.write_durably

    def disk_full_on_rank_0(path, *chunks):
        if rank == 0 and path.endswith("state.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write(path, *chunks)

    checkpoint.data.write_durably = disk_full_on_rank_0
    try:
        save(os.path.join(out_dir, "ckpt"), 1, {"model": model}, {})
    except checkpoint.SaveFailed as e:
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(str(e))
    checkpoint.data.write_durably = write
    save(os.path.join(out_dir, "ckpt"), 2, {"model": model}, {})


def test_disk_full_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "disk-full", str(tmp_path)]
    result = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        assert re.fullmatch(re.escape(f"no space left on {tmp_path / 'ckpt'} (") + r"\d+\.\d MiB free\): " +
                            re.escape("checkpoint step_00000001 not written (its partial files are removed); the "
                                      "newest checkpoint is still none."), (tmp_path / f"rank{rank}.txt").read_text())
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000002"]


# --- Hugging Face export and import

def test_export_loads_in_transformers_with_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_cfg()
    model, optim = make(cfg, seed=0)
    save(str(tmp_path / "ckpt"), 7, {"model": model, "optim": optim}, {"model": cfg})
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_bytes=400_000, dtype="float32")  # sharded
    files = sorted(os.listdir(tmp_path / "hf"))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["model_type"] == "afmoe"

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))  # > window
    with torch.no_grad():
        diff = (model.eval()(tokens) - hf(tokens).logits.float()).abs().max().item()
    assert diff <= 1e-4

    for out in ("hf", "hf_single"):  # the sharded folder, and one model.safetensors
        if out == "hf_single":
            export_hf(str(tmp_path / "ckpt" / "step_00000007"), str(tmp_path / out), dtype="float32")
            assert "model.safetensors" in os.listdir(tmp_path / out)
        got_cfg = hf_config(str(tmp_path / out))
        assert replace(got_cfg, aux_loss_coef=cfg.aux_loss_coef, z_loss_coef=cfg.z_loss_coef) == cfg
        fresh, _ = make(cfg, seed=1)  # load_hf_into: in place, through torch.distributed.checkpoint's HF reader
        load_hf_into(fresh, str(tmp_path / out))
        assert fresh.state_dict().keys() == model.state_dict().keys()
        for k, v in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v), k

    # A bf16 folder is converted to the model's fp32; a folder of another shape is refused in one sentence.
    from safetensors.torch import load_file, save_file
    os.makedirs(tmp_path / "hf_bf16")
    shutil.copy(tmp_path / "hf_single" / "config.json", tmp_path / "hf_bf16")
    save_file({k: v.bfloat16() for k, v in load_file(str(tmp_path / "hf_single" / "model.safetensors")).items()},
              str(tmp_path / "hf_bf16" / "model.safetensors"))
    fresh, _ = make(cfg, seed=1)
    load_hf_into(fresh, str(tmp_path / "hf_bf16"))
    for k, v in model.state_dict().items():
        assert fresh.state_dict()[k].dtype == v.dtype and torch.equal(fresh.state_dict()[k], v.bfloat16().float()), k
    other, _ = make(replace(cfg, expert_hidden=2 * cfg.expert_hidden), seed=1)
    with pytest.raises(ValueError, match="holds tensors of other shapes"):
        load_hf_into(other, str(tmp_path / "hf"))


def test_export_replaces_nothing_until_it_is_complete(tmp_path, capsys):
    cfg = tiny_cfg()
    model, _ = make(cfg, seed=0)
    root = tmp_path / "ckpt"
    save(str(root), 3, {"model": model}, {"model": cfg, "run_id": "a1b2c3"})
    hf = tmp_path / "hf"
    assert checkpoint.main(["export", str(root), str(hf)]) == 0
    with open(hf / "config.json") as f:  # which checkpoint an export came from
        assert json.load(f)["exported_from"] == {"checkpoint": str(root / "step_00000003"), "step": 3,
                                                 "run_id": "a1b2c3"}
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {name: stat.S_IMODE(os.stat(hf / name).st_mode) for name in os.listdir(hf)}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)  # as any new file, not safetensors' 0600
    exported = {name: (hf / name).read_bytes() for name in os.listdir(hf)}
    capsys.readouterr()

    # Another model there: refused in one sentence.
    train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 1)
    save(str(root), 4, {"model": model}, {"model": cfg, "run_id": "a1b2c3"})
    assert checkpoint.main(["export", str(root), str(hf)]) == 2
    assert capsys.readouterr().err == (f"checkpoint.py: error: {hf} already holds another model (config.json, "
                                       f"generation_config.json, model.safetensors); pass --overwrite to replace it, "
                                       f"or export to another folder.\n")
    # A damaged checkpoint exported over it: one sentence, and the earlier export is intact.
    file = flip_a_bit(root / "step_00000004", model.head.weight)
    assert checkpoint.main(["export", str(root), str(hf), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"checkpoint.py: error: checkpoint {root / 'step_00000004'} is damaged: {file} ")
    assert len(err.splitlines()) == 1
    assert {name: (hf / name).read_bytes() for name in os.listdir(hf)} == exported
    # A whole one replaces it with --overwrite; nothing is left beside it.
    save(str(root), 5, {"model": model}, {"model": cfg, "run_id": "a1b2c3"})
    assert checkpoint.main(["export", str(root), str(hf), "--overwrite"]) == 0
    with open(hf / "config.json") as f:
        assert json.load(f)["exported_from"]["step"] == 5
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]
    # Neither a folder of other files nor the checkpoints' own folder is replaced.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    assert checkpoint.main(["export", str(root), str(tmp_path / "notes")]) == 2
    assert "already holds other files (todo.txt); pass --overwrite" in capsys.readouterr().err
    assert checkpoint.main(["export", str(root / "step_00000005"), str(root), "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"checkpoint.py: error: {root} holds the checkpoint {root / 'step_00000005'} "
                                       f"being exported; export to another folder.\n")


def test_transformers_generate_stops_at_the_exported_end_of_text(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    cfg = tiny_cfg()
    model, _ = make(cfg, seed=0)
    prompt = torch.tensor([[5, 17, 42]])
    with torch.no_grad():
        first = model.eval()(prompt)[0, -1].argmax().item()  # the first token greedy decoding writes
    # A tokenizer whose end-of-text is that token: generate must stop right after it.
    words = [f"w{i}" for i in range(cfg.vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{first}").save_pretrained(tmp_path / "t")
    save(str(tmp_path / "ckpt"), 1, {"model": model}, {"model": cfg})
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), tokenizer=str(tmp_path / "t"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.generation_config.eos_token_id == first
    assert hf.generate(prompt, max_new_tokens=8, do_sample=False).tolist() == [[5, 17, 42, first]]


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB file system (tmpfs) at tmp_path/disk; skipped where it cannot be mounted (that needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a 1 MiB tmpfs needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_is_said_in_clear_words(small_disk, tmp_path, capsys):
    cfg = tiny_cfg()
    model, _ = make(cfg, seed=0)  # 1.7 MiB of weights
    # torch's writer reports this as "[enforce fail at inline_container.cc] unexpected pos", without an errno
    with pytest.raises(checkpoint.SaveFailed, match="^" + re.escape(f"no space left on {small_disk / 'ckpt'} (") +
                       r"\d+\.\d MiB free\): checkpoint step_00000001 not written \(its partial files are removed\); "
                       r"the newest checkpoint is still none\.$"):
        save(str(small_disk / "ckpt"), 1, {"model": model}, {"model": cfg})
    assert os.listdir(small_disk / "ckpt") == []
    save(str(tmp_path / "ckpt"), 1, {"model": model}, {"model": cfg})
    assert checkpoint.main(["export", str(tmp_path / "ckpt"), str(small_disk / "hf"), "--dtype=float32"]) == 2
    assert re.fullmatch(re.escape(f"checkpoint.py: error: no space left on {small_disk} (") + r"\d+\.\d MiB free\): " +
                        re.escape(f"the export to {small_disk / 'hf'} was not written; {small_disk / 'hf'} is "
                                  f"unchanged.\n"), capsys.readouterr().err)
    assert os.listdir(small_disk) == ["ckpt"]


def test_hf_folder_errors_name_the_problem(tmp_path):
    model = Transformer(tiny_cfg())
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_hf_into(model, str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'"):
        load_hf_into(model, str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(tiny_cfg().to_hf()))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_hf_into(model, str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="lacks 1 weight file"):
        load_hf_into(model, str(tmp_path))
    (tmp_path / "model.safetensors.index.json").unlink()
    tensors = to_hf_state_dict(model.state_dict())
    tensors.pop(sorted(tensors)[0])
    from safetensors.torch import save_file
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensors this config needs"):  # train.py says a ValueError in a line
        load_hf_into(model, str(tmp_path))


# --- command line

def test_cli(tmp_path, capsys):
    cfg = tiny_cfg()
    model, _ = make(cfg, seed=0)
    save(str(tmp_path / "ckpt"), 3, {"model": model}, {"model": cfg})
    (tmp_path / "ckpt" / "step_00000004.tmp").mkdir()
    assert checkpoint.main(["ls", str(tmp_path / "ckpt")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == ["3", "complete"] and lines[2].split()[:2] == ["4", "partial"]
    assert checkpoint.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors")

    run = [sys.executable, os.path.join(REPO, "checkpoint.py")]
    assert subprocess.run(run + ["--help"], env=env(), capture_output=True).returncode == 0
    # One real subprocess checks the exit status and the absence of a traceback; the other paths run in-process.
    result = subprocess.run(run + ["export", str(tmp_path / "nowhere"), str(tmp_path / "out")], env=env(),
                            capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"checkpoint.py: error: checkpoint path {tmp_path / 'nowhere'} does not exist; give a step_N directory or "
        f"the folder holding them."]
    for args, says in [(["export", str(tmp_path / "ckpt" / "step_00000004.tmp"), str(tmp_path / "o")], "incomplete"),
                       (["ls", str(tmp_path / "nowhere")], "does not exist")]:
        assert checkpoint.main(args) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1
    # A mistyped flag names the subcommand's closest one; a flag it lacks points at its --help; a bad value and an
    # extra argument are refused.
    ckpt = str(tmp_path / "ckpt")
    for args, says in [(["sample", ckpt, "--promt=hi", "--tempature=1"], "did you mean --prompt, --temperature?"),
                       (["ls", ckpt, "extra"], "unrecognized arguments: extra"),
                       (["export", ckpt, str(tmp_path / "o"), "--seed=1"], "checkpoint.py export --help lists"),
                       (["export", ckpt, str(tmp_path / "o"), "--dtype=bf16"], "invalid choice: 'bf16'"),
                       (["export", ckpt, str(tmp_path / "o"), "--max_shard_gb=0"], "--max_shard_gb: 0 must be above")]:
        with pytest.raises(SystemExit) as exit_:
            checkpoint.main(args)
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")

if __name__ == "__main__":
    run_worker({"fsdp": fsdp_worker, "save-loop": save_loop, "disk-full": disk_full_worker}[sys.argv[1]], sys.argv[2])
