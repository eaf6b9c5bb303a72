"""Generation: the KV-cached decode against a full forward recomputed every step, the top-k / top-p filters against
brute force, and `checkpoint.py sample` end to end on a saved checkpoint, an exported Hugging Face folder, and a
sharded (FSDP + EP) model on 2 ranks."""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

import checkpoint
import parallel
from conftest import run_worker, torchrun
from model import ModelConfig, Transformer, sample_next, top_p_filter

# Layers 1 and 3 global, 0 and 2 local with an 8-token window; a dense first layer, then MoE. A wide init spreads
# the logits, so greedy choices are not near-ties that fp32 rounding could flip.
CFG = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_dense_layers=1, dense_hidden=128, n_heads=4, n_kv_heads=2,
                  head_dim=16, window=8, global_every=2, max_seq_len=64, n_experts=16, top_k=4, expert_hidden=16,
                  init_std=0.2)


def tiny_model(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for moe in model.moe_layers():  # a trained-looking selection bias: routing must use it
            moe.expert_bias.normal_(0, 0.2)
    return model


@torch.no_grad()
def greedy_by_recompute(model, tokens_BT, n):
    for _ in range(n):
        tokens_BT = torch.cat([tokens_BT, model(tokens_BT)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens_BT


@pytest.mark.parametrize("prompt_len", [5, 13])  # shorter and longer than the window (a prefill past the ring)
def test_cached_greedy_decode_matches_full_recompute(prompt_len):
    model = tiny_model()
    prompt_BT = torch.randint(0, CFG.vocab_size, (3, prompt_len), generator=torch.Generator().manual_seed(1))
    out_BS = model.generate(prompt_BT, 30, temperature=0)  # 30 new tokens: the local layers' ring wraps
    assert torch.equal(out_BS, greedy_by_recompute(model, prompt_BT, 30))


def test_generation_stops_at_end_of_text():
    """A row that samples stop_id keeps it from then on while the others go on as without a stop; sampling ends once
    every row has stopped; a stop no row samples changes nothing."""
    model = tiny_model()
    prompt_BT = torch.randint(0, CFG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    free_BS = model.generate(prompt_BT, 12, temperature=0)
    new = free_BS[:, 5:].tolist()
    stop = next(t for t in new[0] if t not in new[1])  # row 0 draws it, row 1 never does
    end = 5 + new[0].index(stop) + 1
    out_BS = model.generate(prompt_BT, 12, temperature=0, stop_id=stop)
    assert torch.equal(out_BS[0, :end], free_BS[0, :end]) and (out_BS[0, end:] == stop).all()
    assert torch.equal(out_BS[1], free_BS[1])
    assert torch.equal(model.generate(prompt_BT[:1], 12, temperature=0, stop_id=stop), free_BS[:1, :end])
    unused = next(t for t in range(CFG.vocab_size) if t not in sum(new, []))
    assert torch.equal(model.generate(prompt_BT, 12, temperature=0, stop_id=unused), free_BS)


@torch.no_grad()
def test_cached_logits_match_the_full_forward():
    model = tiny_model()
    tokens_BS = torch.randint(0, CFG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    full_BSV = model(tokens_BS)
    cache, prompt = model.new_cache(40), 11
    logits_BV = model(tokens_BS[:, :prompt], cache=cache)[:, -1]
    torch.testing.assert_close(logits_BV, full_BSV[:, prompt - 1], rtol=1e-4, atol=1e-4)
    for t in range(prompt, 40):
        logits_BV = model(tokens_BS[:, t:t + 1], cache=cache)[:, -1]
        torch.testing.assert_close(logits_BV, full_BSV[:, t], rtol=1e-4, atol=1e-4)
    assert [c.k_BGSDh.shape[2] for c in cache] == [8, 40, 8, 40]  # local layers hold only their window


def test_top_k_and_top_p_keep_what_brute_force_keeps():
    g = torch.Generator().manual_seed(3)
    logits_BV = torch.randn(64, 20, generator=g) * 3
    for k in (1, 3, 7):  # 400 draws per row land on exactly the k largest logits, each of them drawn
        torch.manual_seed(k)
        drawn_BN = torch.cat([sample_next(logits_BV / 4, 1.0, top_k=k) for _ in range(400)], dim=1)
        drawn = [set(row) for row in drawn_BN.tolist()]
        assert drawn == [set(row) for row in logits_BV.topk(k).indices.tolist()]
    for p in (0.05, 0.5, 0.9, 0.999):
        kept = torch.isfinite(top_p_filter(logits_BV, p))
        for row, kept_V in zip(torch.softmax(logits_BV, -1).tolist(), kept):
            order = sorted(range(len(row)), key=lambda i: -row[i])
            n = next(i + 1 for i in range(len(row)) if math.fsum(row[j] for j in order[:i + 1]) >= p)
            assert sorted(kept_V.nonzero().flatten().tolist()) == sorted(order[:n]), (p, row)
    # Known numbers: 0.5, 0.3, 0.15, 0.05; p=0.75 needs the first two, p=0.45 the first alone.
    logits_1V = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.isfinite(top_p_filter(logits_1V, 0.75)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits_1V, 0.45)).tolist() == [[True, False, False, False]]
    torch.manual_seed(0)
    drawn = torch.cat([sample_next(logits_1V, top_p=0.75) for _ in range(400)], dim=1)
    assert set(drawn.flatten().tolist()) == {0, 1} and 0.55 < (drawn == 0).float().mean() < 0.7  # 0.5 / 0.8


def test_top_k_1_is_greedy_and_only_allowed_ids_come_out():
    model = tiny_model()
    prompt_BT = torch.randint(0, CFG.vocab_size, (2, 4), generator=torch.Generator().manual_seed(4))
    assert torch.equal(model.generate(prompt_BT, 12, temperature=1.5, top_k=1),
                       model.generate(prompt_BT, 12, temperature=0))
    logits_BV = torch.zeros(3, 10)
    logits_BV[:, 9] = 100.0  # a padding id that a tokenizer of 9 tokens can never decode
    allowed_V = torch.arange(10) < 9
    assert (sample_next(logits_BV, allowed_V=allowed_V) < 9).all() and (sample_next(logits_BV) == 9).all()
    assert (sample_next(logits_BV, temperature=0, allowed_V=allowed_V) < 9).all()


def test_decodable_ids_skip_cl100k_holes_and_padding():
    import data
    allowed_V = checkpoint.decodable_ids(data.get_encoding("cl100k_base"), 100352)
    holes = {100256, *range(100261, 100276), *range(100277, 100352)}  # unassigned in cl100k_base, then padding
    assert set((~allowed_V).nonzero().flatten().tolist()) == holes


def test_the_seed_decides_the_samples():
    model = tiny_model()
    prompt_BT = torch.zeros(4, 3, dtype=torch.long)

    def draw(seed):
        torch.manual_seed(seed)
        return model.generate(prompt_BT, 20, temperature=1.0, top_p=0.9)

    first = draw(7)
    assert torch.equal(first, draw(7)) and not torch.equal(first, draw(8))
    assert len({tuple(row) for row in first.tolist()}) > 1  # the batched samples differ from one another


def test_compiled_blocks_decode_eagerly_without_compiling():
    from torch._dynamo.utils import counters
    model = tiny_model()
    prompt_BT = torch.randint(0, CFG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(5))
    expected = model.generate(prompt_BT, 12, temperature=0)
    parallel.apply_compile(model, "aot_eager")
    frames = counters["stats"]["calls_captured"]
    assert torch.equal(model.generate(prompt_BT, 12, temperature=0), expected)
    assert counters["stats"]["calls_captured"] == frames  # not one graph per new sequence length


# ------------------------------------------------------------------------------------------------------------------
# The command line

CLI_CFG = ModelConfig(vocab_size=100352, dim=32, n_layers=4, n_dense_layers=1, dense_hidden=64, n_heads=2,
                      n_kv_heads=1, head_dim=16, window=4, max_seq_len=64, n_experts=8, top_k=2, expert_hidden=16,
                      init_std=0.2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint root as train.py writes it (cl100k_base data) and the Hugging Face export of one that records no
    tokenizer."""
    out = tmp_path_factory.mktemp("sample")
    model = tiny_model(CLI_CFG)
    config = {"train": {"tokenizer": "cl100k_base"}, "model": CLI_CFG,
              "tokenizer": {"name": "cl100k_base", "source": "cl100k_base"}}
    checkpoint.save(str(out / "ckpt"), 5, {"model": model}, config)
    checkpoint.save(str(out / "bare"), 5, {"model": model}, {"model": CLI_CFG})
    checkpoint.export_hf(str(out / "bare"), str(out / "hf"), dtype="float32")
    return model, out


def sample_cli(capsys, *argv):
    code = checkpoint.main(["sample", *argv, "--device=cpu"])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_threads_set_the_cpu_threads_and_keep_the_samples(saved, capsys):
    """--threads=1: on a busy machine many times faster than a thread per core (README), the same tokens."""
    _, out = saved
    threads = torch.get_num_threads()
    try:
        greedy = [str(out / "ckpt"), "--prompt=def ", "--max_new_tokens=6", "--temperature=0"]
        one = sample_cli(capsys, *greedy, "--threads=1")
        assert one[0] == 0 and "tokens/s on cpu, 1 threads)" in one[2] and torch.get_num_threads() == 1
        torch.set_num_threads(threads)
        assert sample_cli(capsys, *greedy)[1] == one[1]
    finally:
        torch.set_num_threads(threads)


def test_cli_samples_a_checkpoint_and_its_hf_export(saved, capsys):
    import data
    model, out = saved
    enc = data.get_encoding("cl100k_base")
    code, text, err = sample_cli(capsys, str(out / "ckpt"), "--prompt=def ", "--max_new_tokens=10",
                                 "--num_samples=2", "--seed=3", "--top_p=0.9")
    assert code == 0 and "2 x 10 tokens in" in err and "tokens/s on cpu" in err
    torch.manual_seed(3)
    expected = model.generate(torch.tensor([enc.encode("def ")] * 2), 10, 0.8, 50, 0.9,
                              checkpoint.decodable_ids(enc, CLI_CFG.vocab_size), enc.eot_token)
    assert text == "".join(f"--- sample {i + 1}/2\n{enc.decode(row)}\n" for i, row in enumerate(expected.tolist()))

    # The export has no tokenizer: the prompt goes in as ids and ids come out, drawn from the whole (padded) vocab.
    ids = ",".join(map(str, enc.encode("def ")))
    code, text, _ = sample_cli(capsys, str(out / "hf"), f"--prompt_ids={ids}", "--max_new_tokens=10",
                               "--num_samples=2", "--seed=3", "--top_p=0.9")
    torch.manual_seed(3)
    expected = model.generate(torch.tensor([enc.encode("def ")] * 2), 10, 0.8, 50, 0.9)
    assert code == 0 and text.splitlines()[1::2] == [str(row) for row in expected.tolist()]
    code, _, err = sample_cli(capsys, str(out / "hf"), "--prompt=def ")
    assert code == 2 and err.strip() == (f"checkpoint.py: error: {out / 'hf'} names no tokenizer, so --prompt cannot "
                                         f"be encoded; give token ids with --prompt_ids=1,2,3.")


def test_cli_uses_a_hf_folders_tokenizer(saved, capsys, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    _, out = saved
    hf_dir = tmp_path / "hf"
    shutil.copytree(out / "hf", hf_dir)
    words = ["[UNK]", "def", "x", "return", "(", ")", ":", "y"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # A tokenizer that names no end-of-text token: --prompt is refused in one sentence that says what to set.
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(hf_dir)
    code, _, err = sample_cli(capsys, str(hf_dir), "--prompt=def x")
    assert code == 2 and len(err.splitlines()) == 1 and "set eos_token in tokenizer_config.json" in err
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="y").save_pretrained(hf_dir)
    code, text, _ = sample_cli(capsys, str(hf_dir), "--prompt=def x", "--max_new_tokens=6", "--temperature=0")
    sample = text.splitlines()[1].split()  # greedy never writes "y" here: 6 new tokens
    assert code == 0 and sample[:2] == ["def", "x"] and len(sample) == 8 and set(sample) <= set(words) - {"y"}
    # With the third word as the tokenizer's end-of-text, the sample ends there, and the report says so.
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token=sample[2]).save_pretrained(hf_dir)
    code, text, err = sample_cli(capsys, str(hf_dir), "--prompt=def x", "--max_new_tokens=6", "--temperature=0")
    assert code == 0 and text.splitlines()[1].split() == sample[:3]
    assert "1 x 1 tokens in" in err and "every sample reached end-of-text" in err


def test_a_checkpoint_samples_with_the_tokenizer_its_data_recorded(tmp_path, monkeypatch):
    """The tokenizer is config.json's "tokenizer" source, as train.py records it (a Hugging Face folder's absolute
    path) and export_hf reads it, not train's --tokenizer, which may be relative to where training ran."""
    import data
    data.save_hf_tokenizer("cl100k_base", str(tmp_path / "run" / "tok"))
    config = {"train": {"tokenizer": "tok"}, "model": CLI_CFG,
              "tokenizer": {"name": "tok", "source": str(tmp_path / "run" / "tok")}}
    checkpoint.save(str(tmp_path / "ckpt"), 1, {"model": tiny_model(CLI_CFG)}, config)
    monkeypatch.chdir(tmp_path)  # not run/, where training found "tok"
    _, tokenizer, why_none = checkpoint.sampling_model(str(tmp_path / "ckpt"), torch.device("cpu"))
    assert why_none is None and tokenizer.encode("def f") == data.get_encoding("cl100k_base").encode("def f")


def test_cli_a_checkpoint_and_its_export_read_the_same_prompts(saved, capsys, tmp_path):
    """"<|endoftext|>" in a prompt is that token from a checkpoint and from its export (with cl100k_base as
    tokenizer.json), and both draw only the ids cl100k_base assigns: the same samples."""
    import data
    model, out = saved
    checkpoint.export_hf(str(out / "ckpt"), str(tmp_path / "hf"), tokenizer="cl100k_base", dtype="float32")
    flags = ["--prompt=<|endoftext|>def", "--max_new_tokens=10", "--num_samples=2", "--seed=3", "--top_k=0"]
    code, from_checkpoint, _ = sample_cli(capsys, str(out / "ckpt"), *flags)
    assert code == 0
    code, from_export, _ = sample_cli(capsys, str(tmp_path / "hf"), *flags)
    assert code == 0 and from_export == from_checkpoint
    enc = data.get_encoding("cl100k_base")
    prompt = [enc.eot_token, *enc.encode("def")]
    torch.manual_seed(3)
    expected = model.generate(torch.tensor([prompt] * 2), 10, 0.8, None, 1.0,
                              checkpoint.decodable_ids(enc, CLI_CFG.vocab_size), enc.eot_token)
    rows = [checkpoint.up_to_stop(row, len(prompt), enc.eot_token) for row in expected.tolist()]
    assert from_checkpoint == "".join(f"--- sample {i + 1}/2\n{enc.decode(row)}\n" for i, row in enumerate(rows))
    _, tokenizer, _ = checkpoint.sampling_model(str(tmp_path / "hf"), torch.device("cpu"))
    allowed_V = checkpoint.decodable_ids(tokenizer, CLI_CFG.vocab_size)
    holes = {100256, *range(100261, 100276), *range(100277, 100352)}  # unassigned in cl100k_base, then padding
    assert set((~allowed_V).nonzero().flatten().tolist()) == holes


@pytest.mark.parametrize("flags, message", [
    (["--top_p=0", "--num_samples=0"], "--top_p=0.0 must be above 0 and at most 1 (1: off); --num_samples=0 must be "
                                       "at least 1."),
    (["--temperature=-1"], "--temperature=-1.0 must be 0 (greedy) or more."),
    (["--prompt_ids=5,100352"], "the prompt must be 1 or more token ids in [0, 100352), not [5, 100352]"),
    (["--prompt="], "the prompt must be 1 or more token ids in [0, 100352), not []"),
])
def test_cli_bad_input_is_one_sentence(saved, capsys, flags, message):
    _, out = saved
    code, _, err = sample_cli(capsys, str(out / "ckpt"), *flags)
    assert code == 2 and err.startswith("checkpoint.py: error: ") and message in err and len(err.splitlines()) == 1


def test_cli_names_a_missing_checkpoint(capsys, tmp_path):
    code, _, err = sample_cli(capsys, str(tmp_path / "nowhere"), "--prompt=x")
    assert code == 2 and err.strip() == (f"checkpoint.py: error: checkpoint path {tmp_path / 'nowhere'} does not "
                                         f"exist; give a step_N directory or the folder holding them.")


# ------------------------------------------------------------------------------------------------------------------
# Sharded models: every rank takes part in each forward (FSDP all-gathers, the EP all-to-all)

def worker(out_dir):
    out_dir = Path(out_dir)
    rank, world, device = parallel.init_distributed(timeout_s=120)
    layout = parallel.Layout(world, dp_replicate=1, ep=2)
    model = parallel.build_model(CFG, layout, parallel.build_mesh(layout, device.type), device, ac="full",
                                 compile="aot_eager")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(model, torch.load(out_dir / "model.pt"), options=StateDictOptions(full_state_dict=True))
    model.eval()
    prompt_BT = torch.load(out_dir / "prompt.pt")
    torch.manual_seed(5)  # the same seed on every rank, as train.py does, so every rank draws the same tokens
    out_BS = model.generate(prompt_BT, 20, temperature=1.0, top_k=20)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out_BS.tolist()))


def test_sharded_model_samples_what_one_process_samples(tmp_path):
    model = tiny_model()
    prompt_BT = torch.randint(0, CFG.vocab_size, (2, 6), generator=torch.Generator().manual_seed(6))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(prompt_BT, tmp_path / "prompt.pt")
    torchrun(2, str(Path(__file__).resolve()), str(tmp_path), timeout_s=300)
    torch.manual_seed(5)
    expected = model.generate(prompt_BT, 20, temperature=1.0, top_k=20).tolist()
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [expected, expected]


if __name__ == "__main__":
    run_worker(worker, sys.argv[1])
