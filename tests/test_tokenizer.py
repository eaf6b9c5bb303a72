"""Tokenizers travel with the model: an export carries the data's tokenizer in Hugging Face's format (cl100k_base
converted exactly), and a Hugging Face tokenizer folder prepares data, trains, and guards the vocabulary."""

import glob
import json
import os
import random
import shutil
import sysconfig

import numpy as np
import pytest
import torch

import checkpoint
import data
import train
from model import ModelConfig, Transformer
from test_train import run_args

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

STDLIB = sysconfig.get_paths()["stdlib"]
# code, accents, CJK, emoji, a zero-width space, contractions, digit runs, CRLF, tabs and trailing whitespace runs
VARIED = ("def f(x):\n    return x  \n\n\n   \t\nhéllo wörld 日本語 🚀🚀\u200b I'M we'll 1234567 3.14\r\n"
          "  <|endoftext|>  tail   ")


def bpe_folder(path, files, vocab_size=300):
    """A byte-level BPE trained on `files` and saved by transformers as a tokenizer folder, </s> its eos."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator([open(f).read() for f in files], trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return str(path)


def stdlib(package):
    return sorted(glob.glob(os.path.join(STDLIB, package, "*.py")))


def our_model(ckpt_root):
    """Our Transformer with the weights of the newest checkpoint under ckpt_root, read back through DCP."""
    path = checkpoint.latest(ckpt_root)
    with open(os.path.join(path, "config.json")) as f:
        model = Transformer(ModelConfig(**json.load(f)["model"]))
    checkpoint.load(path, {"model": model})
    return model.eval()


def assert_same_logits(model, hf_dir, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        tokens = torch.tensor([ids])
        assert (model(tokens) - hf(tokens).logits.float()).abs().max().item() <= 1e-4


def test_export_carries_cl100k_as_an_exact_hugging_face_tokenizer(corpus_dir, tmp_path):
    tc, overrides = train.parse_args(run_args(corpus_dir, tmp_path / "run", "--steps=1"))
    train.main(tc, overrides)
    checkpoint.export_hf(str(tmp_path / "run" / "checkpoints"), str(tmp_path / "hf"), dtype="float32")  # cl100k

    enc = data.get_encoding("cl100k_base")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = enc.encode(VARIED, allowed_special="all")
    assert hf_tok(VARIED)["input_ids"] == ids and enc.eot_token in ids and hf_tok.decode(ids) == VARIED
    assert hf_tok.eos_token_id == enc.eot_token
    rng = random.Random(0)  # random mixes of the characters where pre-tokenizer regexes tend to disagree
    pool = [" ", "  ", "\n", "\r\n", "\t", "a", "Z", "é", "日", "🚀", "'s", "'LL", "7", "123", "_", ".", "<|", "|>"]
    for _ in range(300):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 24)))
        assert hf_tok(text)["input_ids"] == enc.encode(text, allowed_special="all"), repr(text)
    assert_same_logits(our_model(str(tmp_path / "run" / "checkpoints")), str(tmp_path / "hf"), ids)

    data.check_vocabulary(data.load_manifest(corpus_dir), str(tmp_path / "hf"))  # same vocabulary: accepted
    other = bpe_folder(tmp_path / "bpe", stdlib("json"))
    with pytest.raises(data.DataError, match="was trained with another vocabulary than the cl100k_base tokens"):
        data.check_vocabulary(data.load_manifest(corpus_dir), other)


def test_hugging_face_tokenizer_folder_prepares_trains_and_exports(tmp_path):
    tok_dir = bpe_folder(tmp_path / "my tokenizer", stdlib("json"))
    reference = tokenizers.Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    reference.encode_special_tokens = True  # a literal "</s>" inside a document is text
    eos = reference.token_to_id("</s>")
    docs = [open(f).read() for f in stdlib("json") + stdlib("email")]
    docs[3] += " a literal </s> is text, not a separator"
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    out = {w: str(tmp_path / f"data{w}") for w in (1, 2)}
    for workers, out_dir in out.items():  # the worker processes load the folder by its path
        manifest = data.prepare([str(tmp_path / "docs.jsonl")], out_dir, tok_dir, val_fraction=1 / len(docs),
                                shuffle_docs=False, workers=workers, quiet=True)
    name = manifest["tokenizer"]
    assert name == "mytokenizer-" + manifest["tokenizer_sha256"][:16] and manifest["tokenizer_path"] == tok_dir
    assert manifest["eot_id"] == eos and manifest["vocab_size"] == reference.get_vocab_size()
    first_shard = manifest["splits"]["train"][0]["file"]
    with open(os.path.join(out[2], first_shard), "rb") as f:
        assert data.HEADER.unpack(f.read(data.HEADER.size))[-1].rstrip(b"\0").decode() == name
    # document 0 is held out for val; the train split is all the others in order, each ended by the eos token
    expected = np.concatenate([reference.encode(d).ids + [eos] for d in docs[1:]])
    for out_dir in out.values():
        train_tokens = np.fromfile(os.path.join(out_dir, first_shard), np.uint16, offset=data.HEADER_BYTES)
        assert np.array_equal(train_tokens, expected) and (train_tokens == eos).sum() == len(docs) - 1
    moved = str(shutil.copytree(tok_dir, tmp_path / "moved"))  # the same tokenizer elsewhere: prepared again
    assert data.prepare([str(tmp_path / "docs.jsonl")], out[1], moved, val_fraction=1 / len(docs), shuffle_docs=False,
                        workers=1, quiet=True, overwrite=True)["tokenizer_path"] == moved

    run = tmp_path / "run"
    tc, overrides = train.parse_args(run_args(out[2], run, "--steps=2", "--sample_tokens=4", f"--tokenizer={tok_dir}"))
    train.main(tc, overrides)
    checkpoint.export_hf(str(run / "checkpoints"), str(tmp_path / "hf"), dtype="float32")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = hf_tok("def f(x):\n    return x  # héllo")["input_ids"]
    assert ids == reference.encode("def f(x):\n    return x  # héllo").ids and hf_tok.eos_token_id == eos
    assert_same_logits(our_model(str(run / "checkpoints")), str(tmp_path / "hf"), ids)

    # continuing from the export on the same data passes the vocabulary check and trains
    tc, overrides = train.parse_args(run_args(out[2], tmp_path / "cont", "--steps=1", f"--tokenizer={tok_dir}",
                                              f"--init_from_hf={tmp_path / 'hf'}"))
    assert train.main(tc, overrides)["step"] == 1


def test_checkpoint_of_another_vocabulary_is_refused(tmp_path, capsys):
    tok_a, tok_b = (bpe_folder(tmp_path / n, stdlib(p)) for n, p in (("a", "json"), ("b", "email")))
    files = stdlib("json") + stdlib("email")
    data_a, data_b = (data.prepare(files, str(tmp_path / f"data_{t}"), tok, val_fraction=0.1, workers=1, quiet=True)
                      for t, tok in (("a", tok_a), ("b", tok_b)))
    run = tmp_path / "run"
    tc, overrides = train.parse_args(run_args(tmp_path / "data_a", run, "--steps=1", f"--tokenizer={tok_a}"))
    train.main(tc, overrides)
    assert checkpoint.main(["export", str(run / "checkpoints"), str(tmp_path / "hf_a"), f"--tokenizer={tok_a}"]) == 0

    # both vocabularies pad to the same model size, so only the tokenizer check tells them apart
    b_flags = run_args(tmp_path / "data_b", run, "--steps=2", f"--tokenizer={tok_b}")
    with pytest.raises(ValueError, match=f"--tokenizer={data_b['tokenizer']} is not the tokenizer checkpoint .* was "
                                         f"trained on \\({data_a['tokenizer']}\\); resume with"):
        train.main(*train.parse_args(b_flags))
    with pytest.raises(data.DataError, match=f"was trained with another vocabulary than the {data_b['tokenizer']} "
                                             f"tokens of the data; prepare the data with"):
        train.main(*train.parse_args(run_args(tmp_path / "data_b", tmp_path / "run_b", "--steps=2",
                                              f"--tokenizer={tok_b}", f"--init_from_hf={tmp_path / 'hf_a'}")))
    weights_only = shutil.copytree(tmp_path / "hf_a", tmp_path / "weights_only",
                                   ignore=shutil.ignore_patterns("tokenizer*"))
    data.check_vocabulary(data_b, str(weights_only))  # nothing to compare with: a warning, not a refusal
    assert "has no tokenizer.json, so nothing shows that its model knows the data's" in capsys.readouterr().err
    with pytest.raises(data.DataError, match=f"was tokenized with {data_b['tokenizer']} but the model is configured "
                                             f"for {data_a['tokenizer']}"):
        train.main(*train.parse_args(run_args(tmp_path / "data_b", tmp_path / "x", f"--tokenizer={tok_a}")))


def test_bad_tokenizer_folder_is_one_sentence(tmp_path):
    with pytest.raises(data.DataError, match="is not a folder holding tokenizer.json"):
        data.get_encoding(str(tmp_path))
    tok_dir = bpe_folder(tmp_path / "t", stdlib("json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|nope|>"}, f)
    with pytest.raises(data.DataError, match=r"names no end-of-text token that its vocabulary holds \(its eos_token "
                                             r"is '<\|nope\|>'\); set eos_token in tokenizer_config.json"):
        data.get_encoding(tok_dir)
