"""
Writes the Megatron-LM indexed dataset the tests read (text_document.bin and text_document.idx, beside this file)
with Megatron-LM's own writer, and documents.json to check it against: each document as the texts of its sequences,
each sequence the cl100k_base tokens of its text.

    pip install --no-deps megatron-core==0.16.1   # its writer imports beside torch and numpy; not a requirement
    python tests/megatron/make_fixture.py

As Megatron-LM's tools/preprocess_data.py does for a vocabulary above 65,500 tokens: cl100k_base token ids as
int32, no end-of-text token appended (its default), every third document added a sentence per sequence (as with
--split-sentences), the others as one sequence.
"""

import json
import os
import random
import sys

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import data  # noqa: E402  (the repository's tokenizer: cl100k_base, bundled)

WORDS = ["the", "expert", "router", "sends", "each", "token", "to", "four", "of", "sixteen", "experts", "and", "a",
         "shared", "one", "sees", "all", "tokens", "model", "learns"]


def main():
    rng = random.Random(0)
    enc = data.get_encoding("cl100k_base")
    prefix = os.path.join(HERE, "text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    documents = []
    for d in range(60):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + ". "
                     for _ in range(rng.randint(2, 8))]
        documents.append(sentences if d % 3 == 0 else ["".join(sentences)])
        if d % 3 == 0:
            for sentence in sentences:
                builder.add_item(torch.tensor(enc.encode_ordinary(sentence)))
            builder.end_document()
        else:
            tokens = enc.encode_ordinary(documents[-1][0])
            builder.add_document(torch.tensor(tokens), [len(tokens)])
    builder.finalize(prefix + ".idx")
    with open(os.path.join(HERE, "documents.json"), "w") as f:
        json.dump({"tokenizer": "cl100k_base", "documents": documents}, f, indent=0)


if __name__ == "__main__":
    main()
