"""Lets tests import the stage files (model.py, train.py, ...) from the repository root, and adds the suite's
option (here, so that it is known however pytest is started)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser):
    parser.addoption("--nccl", action="store_true",
                     help="run tests/test_parallel.py's multi-rank layouts on NCCL, one GPU per rank (8 GPUs), "
                          "instead of gloo on CPU")
