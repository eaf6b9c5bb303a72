"""Shared fixtures: a small prepared corpus and the flags of a model small enough for many short CPU runs."""

import glob
import os
import sysconfig

import pytest

import data

# A structurally complete AfMoE (dense first layer, 3 local + 1 global, shared + routed experts) at toy width.
TINY_MODEL_FLAGS = ["--dim=64", "--n_heads=4", "--n_kv_heads=2", "--head_dim=16", "--dense_hidden=128",
                    "--n_experts=16", "--top_k=4", "--expert_hidden=16", "--window=16"]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """About 100k cl100k tokens of standard-library source, prepared once per test session."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "json", "*.py")) + glob.glob(os.path.join(stdlib, "email", "*.py")))
    out = str(tmp_path_factory.mktemp("corpus"))
    data.prepare(files, out_dir=out, val_fraction=0.1, workers=1, quiet=True)
    return out
