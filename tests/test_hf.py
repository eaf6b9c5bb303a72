"""Hugging Face folders in the layout transformers' save_pretrained writes, as published checkpoints and inference
engines have them (routed experts one tensor each): a save_pretrained folder loads with transformers' logits on one
process and on 2 expert-parallel ranks (each reading its own experts) and trains; an export is file for file what
save_pretrained writes; a float32 round trip is bitwise; two exports into one folder at once do not mix.

    python -m pytest tests/test_hf.py -q

This file is also the worker of the 2-rank test:
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/test_hf.py ep HF_DIR OUT_DIR
"""

import json
import os
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import checkpoint
import data
import parallel
import train
from checkpoint import export_hf, hf_config, load_hf_into, save, to_hf_state_dict
from conftest import run_worker, torchrun
from model import ModelConfig, Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is", "ignore:checkpoint .* records no tokenizer")

SHARD_BYTES = 60_000  # several files for the tiny models, experts of one layer spread over two of them


def tiny_cfg(**kw):
    base = dict(vocab_size=256, dim=64, n_layers=4, n_dense_layers=1, dense_hidden=96, n_heads=4, n_kv_heads=2,
                head_dim=16, window=8, max_seq_len=64, n_experts=16, n_shared_experts=1, top_k=4,
                route_scale=2.448, expert_hidden=16, init_std=0.05)
    return ModelConfig(**{**base, **kw})


def randomise_(model, seed):
    """Random values for every weight and the expert bias (transformers' init zeroes the router and the bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dtype.is_floating_point and "inv_freq" not in name:
                t.copy_(torch.randn(t.shape, generator=g) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def hf_model(cfg: ModelConfig):
    transformers = pytest.importorskip("transformers")  # a requirement: CI installs it, so this never skips there
    config = transformers.AfmoeConfig(**{k: v for k, v in cfg.to_hf().items() if k != "model_type"})
    config._attn_implementation = "eager"
    return transformers.AfmoeForCausalLM(config).eval()


def published(cfg: ModelConfig, folder, **kw):
    """A random AfmoeForCausalLM saved by transformers' own save_pretrained; returns the model."""
    hf = randomise_(hf_model(cfg), seed=0)
    hf.save_pretrained(str(folder), **kw)
    return hf


def tensors(folder) -> dict:
    """Every tensor of a Hugging Face folder, by name, with the file that holds it."""
    found = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(str(folder / file), "pt") as f:
            found.update({name: (file, f.get_tensor(name)) for name in f.keys()})
    return found


def header(path) -> dict:
    """A safetensors file's header: each tensor's dtype, shape and place in the file."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return {k: v for k, v in json.loads(f.read(size)).items() if k != "__metadata__"}


def test_a_save_pretrained_folder_loads_with_transformers_logits(tmp_path):
    """The published layout, sharded or in one file, and the experts stacked (transformers' names in memory, which
    earlier exports wrote): our model computes transformers' logits."""
    cfg = tiny_cfg()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))  # > window
    per_expert, stacked = "model.layers.1.mlp.experts.15.up_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"
    for name, kw, expert in (("sharded", {"max_shard_size": SHARD_BYTES}, per_expert),  # as published
                             ("single", {}, per_expert),
                             ("stacked", {"max_shard_size": SHARD_BYTES, "save_original_format": False}, stacked)):
        hf = published(cfg, tmp_path / name, **kw)
        assert ("model.safetensors.index.json" in os.listdir(tmp_path / name)) == (name != "single")
        assert expert in tensors(tmp_path / name)
        ours = Transformer(hf_config(str(tmp_path / name))).eval()
        assert replace(ours.cfg, aux_loss_coef=cfg.aux_loss_coef, z_loss_coef=cfg.z_loss_coef) == cfg
        assert load_hf_into(ours, str(tmp_path / name)) == sum(t.nbytes for _, t in tensors(tmp_path / name).values())
        with torch.no_grad():
            assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def ep_worker(hf_dir: str, out_dir: str, *train_flags: str):
    """2 gloo ranks, experts split over both (--ep=2): load the folder, write the logits and the bytes each read; then
    train.py's main with TRAIN_FLAGS on the same ranks (one launch, not two: keeps the test fast on 2 cores)."""
    dist.init_process_group("gloo")
    layout = parallel.Layout(dist.get_world_size(), ep=dist.get_world_size())
    mesh = parallel.build_mesh(layout, "cpu")
    model = parallel.build_model(hf_config(hf_dir), layout, mesh, torch.device("cpu"))
    read = load_hf_into(model, hf_dir)
    experts = model.layers["1"].ffn.experts.gate_up_proj
    with torch.no_grad():
        logits = model.eval()(torch.load(os.path.join(out_dir, "tokens.pt")))
    torch.save({"logits": logits, "read": read, "local_experts": experts.to_local().shape[0]},
               os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()
    train.main(*train.parse_args(list(train_flags)))


def test_two_expert_parallel_ranks_load_their_own_experts_and_train(corpus_dir, tmp_path):
    """With --ep=2 each rank reads its half of the experts (and, FSDP-sharded, its half of every other weight's rows;
    the unsharded expert bias whole: the ranks' bytes add up to the folder's plus one bias more) and computes
    transformers' logits; train.py --init_from_hf --ep=2 starts at transformers' loss and trains."""
    cfg = tiny_cfg(vocab_size=100352, n_experts=8, top_k=2)  # cl100k_base's ids, for train.py on the corpus
    hf = published(cfg, tmp_path / "hf", max_shard_size=SHARD_BYTES)
    tokens = torch.randint(0, 100277, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    # then train.py from the folder, on the same ranks: its first loss, before any update, is transformers' on the same
    # batch (no document mask, so both see the same attention), then it trains.
    flags = [f"--data={corpus_dir}", f"--out_dir={tmp_path / 'run'}", "--seq_len=32", "--global_batch=4",
             "--micro_batch=2", "--doc_mask=false", "--steps=3", "--log_every=1", "--eval_every=0",
             "--eval_batches=1", "--sample_tokens=0", f"--init_from_hf={tmp_path / 'hf'}", "--ep=2"]
    output = torchrun(2, __file__, "ep", str(tmp_path / "hf"), str(tmp_path), *flags, timeout_s=180)
    with torch.no_grad():
        expected = hf(tokens).logits
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    on_disk = tensors(tmp_path / "hf")
    total = sum(t.nbytes for _, t in on_disk.values())
    bias = sum(t.nbytes for name, (_, t) in on_disk.items() if name.endswith("expert_bias"))
    for r in ranks:
        assert r["local_experts"] == 4
        assert (r["logits"] - expected).abs().max().item() <= 1e-4
        assert r["read"] < 0.51 * total
    assert ranks[0]["read"] + ranks[1]["read"] == total + bias
    print(f"bytes read: rank 0 {ranks[0]['read']:,}, rank 1 {ranks[1]['read']:,} of {total:,} in the folder")

    assert f"initialised from {tmp_path / 'hf'}" in output
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3]
    tokens_BT, targets_BT, _ = data.DataLoader(corpus_dir, "train", 32, 4, seed=0).batch(0)
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(hf(tokens_BT).logits.flatten(0, 1), targets_BT.flatten()).item()
    assert abs(records[0]["lm_loss"] - hf_loss) <= 1e-4, (records[0]["lm_loss"], hf_loss)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_export_writes_what_save_pretrained_writes(tmp_path, dtype):
    cfg = tiny_cfg()  # 16 experts: transformers orders expert 10 after 9, not after 1
    model = randomise_(Transformer(cfg), seed=1).eval()
    save(str(tmp_path / "ckpt"), 1, {"model": model}, {"model": cfg})
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "ours"), max_shard_bytes=SHARD_BYTES, dtype=dtype)
    hf = hf_model(cfg)
    hf.load_state_dict(to_hf_state_dict(model.state_dict()))
    hf.to(getattr(torch, dtype)).save_pretrained(str(tmp_path / "theirs"), max_shard_size=SHARD_BYTES)

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    weights = [f for f in os.listdir(theirs) if f.endswith(".safetensors")]
    assert len(weights) > 2
    for file in weights:  # the same tensors, dtypes and shapes at the same places of the same files
        assert header(ours / file) == header(theirs / file), file
    with open(ours / "model.safetensors.index.json") as a, open(theirs / "model.safetensors.index.json") as b:
        assert json.load(a) == json.load(b)
    ours_tensors, their_tensors = tensors(ours), tensors(theirs)
    for name, (_, t) in their_tensors.items():
        assert torch.equal(ours_tensors[name][1], t), name
    with open(ours / "config.json") as f:
        config = json.load(f)
    assert (config["architectures"], config["dtype"], config["torch_dtype"]) == (["AfmoeForCausalLM"], dtype, dtype)

    transformers = pytest.importorskip("transformers")
    loaded = {folder.name: transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager")
              for folder in (ours, theirs)}
    assert loaded["ours"].dtype == getattr(torch, dtype)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = {name: m.eval()(tokens).logits for name, m in loaded.items()}
        assert torch.equal(logits["ours"], logits["theirs"])
        if dtype == "float32":
            assert (logits["ours"] - model(tokens)).abs().max().item() <= 1e-4


def test_a_float32_round_trip_is_bitwise(tmp_path):
    """Published layout -> our model -> a training checkpoint -> export: the same files and the same bits."""
    cfg = tiny_cfg()
    published(cfg, tmp_path / "published", max_shard_size=SHARD_BYTES)
    ours = Transformer(hf_config(str(tmp_path / "published")))
    load_hf_into(ours, str(tmp_path / "published"))
    save(str(tmp_path / "ckpt"), 1, {"model": ours}, {"model": ours.cfg})
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "exported"), max_shard_bytes=SHARD_BYTES, dtype="float32")
    before, after = tensors(tmp_path / "published"), tensors(tmp_path / "exported")
    assert before.keys() == after.keys()
    for name, (file, t) in before.items():
        assert after[name][0] == file and after[name][1].dtype == t.dtype and torch.equal(after[name][1], t), name


def test_folders_that_do_not_fit_are_named_in_one_sentence(tmp_path):
    cfg = tiny_cfg()
    folder = tmp_path / "hf"
    published(cfg, folder)
    everything = {name: t for name, (_, t) in tensors(folder).items()}
    model = Transformer(cfg)
    from safetensors.torch import save_file
    save_file({k: v for k, v in everything.items() if ".experts.3." not in k or ".layers.2." not in k},
              str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"^" + str(folder) + r" lacks 3 tensors this config needs, e\.g\. "
                       r"\['model\.layers\.2\.mlp\.experts\.3\.gate_proj\.weight', 'model\.layers\.2\.mlp\.experts\.3\."
                       r"up_proj\.weight', 'model\.layers\.2\.mlp\.experts\.3\.down_proj\.weight'\]; is it an afmoe "
                       r"model with the same number of layers and experts\?$"):
        load_hf_into(model, str(folder))
    save_file(everything, str(folder / "model.safetensors"))
    wider = Transformer(replace(cfg, expert_hidden=32))
    with pytest.raises(ValueError, match=r"holds tensors of other shapes \(model\.layers\.1\.mlp\.experts\.0\."
                       r"gate_proj\.weight \(16, 64\) in the folder vs \(32, 64\) here;"):
        load_hf_into(wider, str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match=r"holds a model_type='qwen3_moe' model; only 'afmoe' \(Trinity\) models"):
        load_hf_into(model, str(folder))


def test_two_exports_into_one_folder_at_once_do_not_mix(tmp_path, monkeypatch, capsys):
    """A second export into the folder while the first is writing is refused; the first completes with its own
    files, and leaves no temporary folder or lock beside it."""
    cfg = tiny_cfg()
    model = randomise_(Transformer(cfg), seed=1)
    save(str(tmp_path / "ckpt"), 1, {"model": model}, {"model": cfg})
    randomise_(model, seed=2)
    save(str(tmp_path / "ckpt"), 2, {"model": model}, {"model": cfg})
    hf = tmp_path / "hf"
    second = []
    write_durably = checkpoint.data.write_durably

    def write_and_export_again(path, *chunks):
        write_durably(path, *chunks)
        if path.endswith("config.json") and not second:  # the first export is half written: a second one starts
            second.append(None)
            second[0] = checkpoint.main(["export", str(tmp_path / "ckpt" / "step_00000002"), str(hf)])

    (tmp_path / ".hf.export.killed.tmp").mkdir()  # what an export killed midway leaves: removed by the next one
    monkeypatch.setattr(checkpoint.data, "write_durably", write_and_export_again)
    assert checkpoint.main(["export", str(tmp_path / "ckpt" / "step_00000001"), str(hf)]) == 0
    assert second == [2]
    err = capsys.readouterr().err
    assert f"checkpoint.py: error: another export into {hf} is running (pid {os.getpid()} on " in err
    assert err.rstrip().endswith("); wait for it to finish, or export to another folder.")
    with open(hf / "config.json") as f:
        assert json.load(f)["exported_from"]["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]


if __name__ == "__main__":
    run_worker({"ep": ep_worker}[sys.argv[1]], *sys.argv[2:])
