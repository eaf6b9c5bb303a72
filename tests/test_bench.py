"""bench.py: each command's output on tiny shapes. Speed goals live in bench.py's printed ratios, never in these tests.

    python -m pytest tests/test_bench.py -q
"""

import json

import pytest

import bench
import parallel
import train
from conftest import TINY_MODEL_FLAGS


def run_json(capsys, argv) -> tuple[int, dict]:
    """bench.main's exit code and the JSON object on its last line. The timed commands run on one thread: two on a
    2-core machine that others are using can be 100x slower (bench.py's docstring)."""
    code = bench.main(argv)
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------------------------
# moe, vs-hf, the training step

def test_moe_reports_the_three_paths_and_they_agree(capsys):
    code, out = run_json(capsys, ["moe", *TINY_MODEL_FLAGS, "--tokens=256", "--seq_len=64", "--iters=1",
                                  "--warmup=0", "--threads=1", "--json"])
    assert code == 0
    for key in ("grouped_ms", "loop_ms", "dense_ms", "moe_to_dense"):
        assert out[key] > 0, key
    # The dense comparator is a GEMM-friendly width (a multiple of 128) at least the MoE's active width; the ratio is
    # per FLOP: the dense time scaled to the MoE's active FLOPs.
    assert out["dense_hidden"] % 128 == 0 and 0 <= out["dense_hidden"] - out["active_hidden"] < 128
    dense_at_active = out["dense_ms"] * out["active_hidden"] / out["dense_hidden"]
    assert out["moe_to_dense"] == pytest.approx(out["grouped_ms"] / dense_at_active)
    assert out["grouped_vs_loop_max_diff"] < 1e-5
    assert {"router", "routed experts", "MoE permutation, combine, z-loss"} <= set(out["components_ms"])
    assert out["components_ms"]["routed experts"]["bwd"] > 0  # backward ops found their forward's component


def test_vs_hf_times_both_on_the_same_config(capsys):
    code, out = run_json(capsys, ["vs-hf", *TINY_MODEL_FLAGS, "--vocab_size=512", "--seq_len=32", "--iters=1",
                                  "--warmup=0", "--threads=1", "--json"])
    assert code == 0 and out["ours_ms"] > 0 and out["hf_ms"] > 0
    assert out["speedup"] == pytest.approx(out["hf_ms"] / out["ours_ms"])
    assert out["speedup_paired"] == pytest.approx(out["speedup"])  # one pair: its ratio is the ratio of medians
    assert out["first_loss_diff"] < 1e-4  # the same weights give the same LM loss: the same model was timed


def test_an_unwritable_save_path_is_refused_before_the_benchmark(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train, "build", None)  # reaching the build would be too late
    for path in (tmp_path, tmp_path / "missing" / "base.json"):
        assert bench.main([f"--save={path}", *TINY_MODEL_FLAGS, "--vocab_size=512", "--seq_len=32", "--threads=1"]) == 2
        assert capsys.readouterr().err == (f"error: --save={path} cannot be written; pass a file path in a folder you "
                                           f"can write to.\n")


def test_training_step_report(capsys):
    code, out = run_json(capsys, ["--preset=tiny", *TINY_MODEL_FLAGS, "--vocab_size=512", "--seq_len=32",
                                  "--global_batch=4", "--micro_batch=2", "--warmup=1", "--iters=2", "--threads=1",
                                  "--json"])
    assert code == 0
    for key in ("ms_median", "ms_min", "ms_max", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
                "peak_mem_gib", "flops_per_token"):
        assert out[key] > 0, key
    assert out["mfu"] is None  # CPU: no peak in the table
    assert out["tflops_per_device"] == pytest.approx(out["tokens_per_s"] * out["flops_per_token"] / 1e12)
    # The phases are the step's own profiler ranges (train.phase); grad clip and the expert-bias update are
    # components too.
    assert {"forward", "backward", "grad clip", "optimizer", "expert-bias update"} <= set(out["phases_ms"])
    assert out["phases_ms"]["forward"] > 0 and out["phases_ms"]["backward"] > 0
    components = out["components_ms"]
    assert {"attention", "router", "routed experts", "output head, cross-entropy", "optimizer", "grad clip",
            "expert-bias update"} <= set(components)
    assert components["attention"]["bwd"] > 0 and components["optimizer"]["total"] > 0
    assert components["output head, cross-entropy"]["bwd"] > 0  # the fused function's backward found its forward


def test_training_step_without_micro_batch_takes_the_rank_s_whole_share(capsys):
    """No --micro_batch: as in train.py, each rank's share of the global batch in one forward."""
    code, out = run_json(capsys, ["--preset=tiny", *TINY_MODEL_FLAGS, "--vocab_size=512", "--seq_len=32",
                                  "--global_batch=4", "--warmup=0", "--iters=1", "--threads=1", "--breakdown=false",
                                  "--json"])
    assert code == 0 and out["config"]["micro_batch"] == 4


def test_model_flags_mean_in_bench_what_they_mean_in_train():
    """--vocab_size=1000 is a 1000-row vocabulary in both (train.py pads only a tokenizer's vocabulary)."""
    tc, overrides = train.parse_args(["--preset=tiny", "--vocab_size=1000", "--n_layers=2"])
    assert bench.model_config(tc, overrides) == train.model_config(tc, overrides, 100277)
    assert bench.model_config(tc, overrides).vocab_size == 1000


# ------------------------------------------------------------------------------------------------------------------
# The command line

def test_data_times_prepare_and_the_library_on_the_same_text(capsys):
    code, out = run_json(capsys, ["data", "--mb=0.3", "--workers", "1", "2", "--repeat=1", "--json"])
    assert code == 0 and out["library"] == "tiktoken encode_ordinary_batch"
    assert out["prepare_tokens"] == out["tokens"] > 50_000
    assert [row["workers"] for row in out["rows"]] == [1, 2]
    for row in out["rows"]:
        assert min(row.values()) > 0
        assert row["per_core_ratio"] == pytest.approx(row["prepare_tokens_per_cpu_s"] / row["library_tokens_per_cpu_s"])


@pytest.mark.parametrize("argv, message", [
    (["moe", "--tokns=5"], "did you mean --tokens"),
    (["--iter=3"], "did you mean --iters"),
    (["mo"], "did you mean moe"),
    (["--iters=0"], "argument --iters: 0 must be at least 1"),
    (["moe", "--tokens=-5"], "argument --tokens: -5 must be at least 1"),
    (["--learning_rate=1"], "did you mean --lr"),
    (["data", "--worker=2"], "did you mean --workers"),
    (["--lr=-1"], "--lr=-1.0 must be 0 or more."),
])
def test_mistyped_or_out_of_range_flags_and_commands_are_one_sentence(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert message in str(e.value) + capsys.readouterr().err


def test_moe_layer_too_big_for_memory_is_refused_before_allocation(capsys, monkeypatch):
    monkeypatch.setattr(parallel, "host_memory_available", lambda: 1 << 20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert bench.main(["moe", "--tokens=64", "--seq_len=64", "--iters=1"]) == 2
    assert "error: one MoE layer's weights and their gradients need" in capsys.readouterr().err
