"""bench.py --save / --compare, the throughput and numerics guard: a planted regression is named with its kernels and
fails the run; a planted numerics change (another norm epsilon, attention in bf16) is named with its first step and
layer and exits 3; the same measurements and the same code stay quiet; another configuration is refused and another
environment is named.

    python -m pytest tests/test_guard.py -q

Timing on a shared CPU is noisy, so the verdict's thresholds are tested on records built from one measured run
(bench.compare and bench.compare_numerics are pure functions), and the one end-to-end comparison plants a regression
several times the noise. The numbers are deterministic on the CPU: the same code reproduces them bitwise."""

import copy
import json
import math

import pytest
from torch.nn.attention import SDPBackend, sdpa_kernel

import bench
import model
from conftest import TINY_MODEL_FLAGS

# Long sequences and few of them, so attention is a large share of the step and a slower attention moves the step
# far beyond the noise of a busy machine.
FLAGS = ["--preset=tiny", *TINY_MODEL_FLAGS, "--vocab_size=512", "--seq_len=256", "--max_seq_len=256",
         "--global_batch=2", "--micro_batch=2", "--warmup=1", "--iters=5", "--threads=1", "--clock=cpu"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("guard") / "baseline.json")
    assert bench.main(FLAGS + [f"--save={path}"]) == 0
    with open(path) as f:
        return path, json.load(f)


def test_baseline_records_times_components_kernels_and_environment(baseline):
    _, record = baseline
    for key in ("ms_median", "ms_p25", "ms_p75", "tokens_per_s", "peak_mem_gib"):
        assert record[key] > 0, key
    assert "mfu" in record and record["config"]["seq_len"] == 256 and record["config"]["model.dim"] == 64
    env = record["environment"]
    assert env["torch"] and env["cpu capability"] and env["device"] == "cpu (1 threads)"
    assert {"sdpa flash", "sdpa math", "float32 matmul precision"} <= set(env)
    attention = record["kernels"]["attention"]
    # One fused SDPA call per layer per micro-batch (4 layers, 1 micro-batch), and its backward once each.
    assert attention["aten::_scaled_dot_product_flash_attention_for_cpu"][0] == 4
    assert attention["aten::_scaled_dot_product_flash_attention_for_cpu_backward"][0] == 4
    assert record["step_kernels"] == bench.merged(record["kernels"])  # the step's fingerprint: its components'
    assert record["step_kernels"]["aten::_fused_adamw_"][0] >= 1
    assert 0 < record["components_ms"]["attention"]["share"] < 1


ATTEND = model.attend


def float64_math_attend(q, k, v, mask):
    """The regression: attention through SDPA's math path in float64 (other kernels, several times the work)."""
    with sdpa_kernel(SDPBackend.MATH):
        return ATTEND(q.double(), k.double(), v.double(), mask).to(q.dtype)


def test_compare_names_a_planted_attention_regression(baseline, monkeypatch, capsys):
    path, _ = baseline
    monkeypatch.setattr(model, "attend", float64_math_attend)
    code = bench.main(FLAGS + [f"--compare={path}", "--json"])
    out = capsys.readouterr().out
    verdict = json.loads(out.strip().splitlines()[-1])["compare"]
    assert code == 1 and "SLOWER beyond both: exit 1" in out
    assert verdict["step_change"] > max(verdict["noise_band"], 0.05)
    attention = verdict["components"]["attention"]
    assert attention["ms"][1] > 1.5 * attention["ms"][0]  # about 3x measured
    assert "aten::bmm" in attention["appeared"]  # the math path's matmuls
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in attention["disappeared"]
    assert "  attention: " in out and "new aten::bmm" in out


def shifted(record: dict, change: float) -> dict:
    """The record with its step slower by `change` (a fraction), its spread kept."""
    new = copy.deepcopy(record)
    for key in ("ms_median", "ms_p25", "ms_p75"):
        new[key] += change * record["ms_median"]
    return new


def test_compare_is_quiet_on_the_same_measurements(baseline):
    _, record = baseline
    verdict = bench.compare(record, copy.deepcopy(record), tolerance=0.05)
    assert verdict["exit"] == 0 and verdict["step_change"] == 0
    assert verdict["components"] == {} and verdict["environment"] == []
    assert not verdict["step_kernels"]["appeared"] and not verdict["step_kernels"]["disappeared"]
    assert verdict["lines"] == [verdict["lines"][0]] and "within them" in verdict["lines"][0]


@pytest.mark.parametrize("tolerance", [0.0, 0.05, 0.5])
def test_exit_code_follows_the_noise_band_and_the_tolerance(baseline, tolerance):
    _, record = baseline
    record = copy.deepcopy(record)
    record["ms_p75"] = record["ms_p25"] + 0.1 * record["ms_median"]  # a 10% interquartile range in each run
    assert bench.compare(record, record, tolerance)["noise_band"] == pytest.approx(0.1)  # half of each, added
    limit = max(tolerance, 0.1)
    for change, code in ((0.9 * limit, 0), (1.1 * limit, 1), (-0.5, 0)):  # faster never fails
        verdict = bench.compare(record, shifted(record, change), tolerance)
        assert verdict["exit"] == code, (change, verdict["lines"][0])
        assert verdict["step_change"] == pytest.approx(change)
    with_mfu = record | {"mfu": 0.4}  # a GPU in the peak table
    assert "MFU 40.0% -> 36.4%" in bench.compare(with_mfu, shifted(with_mfu, 0.1) | {"mfu": 0.4 / 1.1},
                                                 tolerance)["lines"][0]


def test_a_component_that_moved_is_named_with_its_kernels(baseline):
    """A regression planted in a copy of the measured record: the router's share triples and its matmul is replaced
    by another kernel; only the router is named, with both kernels."""
    _, old = baseline
    old, new = copy.deepcopy(old), copy.deepcopy(old)
    share = old["components_ms"]["router"]["share"]
    old["components_ms"]["router"] |= {"share_p25": 0.95 * share, "share_p75": 1.05 * share}
    new["components_ms"]["router"] |= {"share": 3 * share, "share_p25": 2.95 * share, "share_p75": 3.05 * share}
    kernels = new["kernels"]["router"]
    calls, ms = kernels.pop("aten::mm")
    kernels["aten::_planted_fp64_mm"] = [calls, 3 * ms]
    new["step_kernels"] = bench.merged(new["kernels"])
    verdict = bench.compare(old, new, tolerance=0.0)
    assert set(verdict["components"]) == {"router"}
    router = verdict["components"]["router"]
    assert router["ms"] == pytest.approx([share * old["ms_median"], 3 * share * old["ms_median"]])
    assert set(router["appeared"]) == {"aten::_planted_fp64_mm"} and set(router["disappeared"]) == {"aten::mm"}
    assert any("router:" in line and "new aten::_planted_fp64_mm" in line for line in verdict["lines"])
    assert "kernels of the whole step" not in verdict["lines"][-1]  # named once, in its component


def test_a_kernel_swap_without_a_time_change_still_shows(baseline):
    _, old = baseline
    new = copy.deepcopy(old)
    new["step_kernels"]["sm90_xmma_gemm_tf32"] = new["step_kernels"].pop("aten::_fused_adamw_")
    verdict = bench.compare(old, new, tolerance=0.05)
    assert verdict["exit"] == 0 and verdict["components"] == {}
    assert "new sm90_xmma_gemm_tf32" in verdict["lines"][-1] and "gone aten::_fused_adamw_" in verdict["lines"][-1]


def test_without_the_breakdown_only_the_step_is_compared(baseline):
    _, old = baseline
    new = {k: v for k, v in old.items() if k not in ("components_ms", "kernels", "step_kernels")}  # --breakdown=false
    for a, b in ((old, new), (new, old)):
        verdict = bench.compare(a, b, tolerance=0.05)
        assert verdict["exit"] == 0 and verdict["components"] == {} and len(verdict["lines"]) == 1


def test_another_environment_is_named(baseline):
    _, old = baseline
    new = copy.deepcopy(old)
    new["environment"]["torch"] = "9.9.9"
    new["environment"]["sdpa flash"] = not old["environment"]["sdpa flash"]
    verdict = bench.compare(old, new, tolerance=0.05)
    assert verdict["exit"] == 0
    assert verdict["environment"] == [f"sdpa flash {old['environment']['sdpa flash']} -> "
                                      f"{new['environment']['sdpa flash']}", f"torch {old['environment']['torch']} "
                                      f"-> 9.9.9"]
    assert verdict["lines"][-1].startswith("warning: the environment differs from the baseline's: sdpa flash")


@pytest.mark.parametrize("flags, message", [
    (["--seq_len=128"], "error: the baseline was measured with other flags (seq_len 256 -> 128); use its flags or "
                        "--save a new baseline."),
    (["--dim=128"], "(model.dim 64 -> 128)"),
    (["--clock=wall", "--compile"], "(clock cpu -> wall, compile False -> True)"),
])
def test_another_configuration_is_refused_in_one_sentence(baseline, capsys, flags, message):
    path, _ = baseline
    assert bench.main(FLAGS + flags + [f"--compare={path}"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_missing_or_foreign_baseline_is_one_sentence(tmp_path, capsys):
    assert bench.main(FLAGS + [f"--compare={tmp_path}/none.json"]) == 2
    assert f"--compare={tmp_path}/none.json does not exist; record a baseline first" in capsys.readouterr().err
    (tmp_path / "metrics.json").write_text('{"step": 3}')
    assert bench.main(FLAGS + [f"--compare={tmp_path}/metrics.json"]) == 2
    assert "is not a baseline written by bench.py --save" in capsys.readouterr().err
    assert bench.main(FLAGS + [f"--save={tmp_path}/no/such/folder/baseline.json"]) == 2
    assert "baseline.json cannot be written; pass a file path in a folder you can write to." in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.main(["--tolerance=-0.1"])
    assert "argument --tolerance: -0.1 must be at least 0" in str(e.value) + capsys.readouterr().err


# --- the numbers: the first training steps from the seeded initialisation, beside the speed

LAYERS = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]


def test_baseline_records_the_first_steps_numbers(baseline):
    _, record = baseline
    trajectory = record["trajectory"]
    assert trajectory["dtype"] == "fp32" and len(trajectory["steps"]) == bench.NUMERICS_STEPS
    assert list(trajectory["initial"]) == LAYERS
    assert trajectory["initial"]["norm"] == [64.0, 8.0]  # the final norm's 64 gains start at 1: sum 64, norm 8
    first = trajectory["steps"][0]
    assert abs(first["loss"] - math.log(512)) < 0.2  # about uniform over the 512-token vocabulary at initialisation
    assert first["grad_norm"] > 0 and list(first["layers"]) == LAYERS
    assert first["layers"]["head"] != trajectory["initial"]["head"]  # the weights after the step's update


def compare_again(path: str, capsys) -> tuple[int, dict, str]:
    """bench.main --compare on the baseline's flags, quick (no profile, one timed step): exit code, report, output."""
    code = bench.main(FLAGS + [f"--compare={path}", "--breakdown=false", "--warmup=0", "--iters=1", "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out.strip().splitlines()[-1]), out


def test_the_same_code_reproduces_its_numbers(baseline, capsys):
    path, _ = baseline
    code, report, out = compare_again(path, capsys)
    assert report["numerics"]["moved"] is None and report["numerics"]["tolerance"] == 1e-4
    assert code == report["compare"]["exit"]  # only the speed verdict (noisy here) can fail the run
    assert ("numerics: the initial weights and the first 3 steps match the baseline's within 1e-04 (relative): loss, "
            "gradient norm, every layer's weights") in out


def bf16_attend(q, k, v, mask):
    """Attention computed in bf16: the kind of precision change a new kernel choice makes."""
    return ATTEND(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask).to(q.dtype)


def wide_epsilon_norm(self, x):
    """RMSNorm with ten times its epsilon, 1e-4 instead of 1e-5."""
    return model._RMSNorm.apply(x, self.weight, 10 * self.eps)


@pytest.mark.parametrize("owner, name, planted", [(model, "attend", bf16_attend),
                                                  (model.RMSNorm, "forward", wide_epsilon_norm)])
def test_compare_names_the_first_step_and_layer_a_planted_change_moved(baseline, monkeypatch, capsys, owner, name,
                                                                       planted):
    path, record = baseline
    monkeypatch.setattr(owner, name, planted)
    code, report, out = compare_again(path, capsys)
    moved = report["numerics"]["moved"]
    assert code == (4 if report["compare"]["exit"] else 3)  # 3: the numbers moved; 4: and the step is slower
    assert moved["step"] == 1 and moved["first_layer"] == "embed"  # the first update already differs
    assert moved["changes"]["grad_norm"] > 1e-4
    assert set(moved["changes"]) - {"loss", "grad_norm"} <= set(LAYERS) and moved["most_moved_layer"] in LAYERS
    assert "numerics MOVED beyond 1e-04 (relative) at step 1 of 3: " in out and "first layer embed" in out
    assert "grad norm {:.6g} -> ".format(record["trajectory"]["steps"][0]["grad_norm"]) in out


def planted(trajectory: dict, step: int, layer: str, change: float) -> dict:
    """The trajectory with `layer`'s weight sum moved by `change` times its norm after `step` (0: initially)."""
    new = copy.deepcopy(trajectory)
    weights = new["initial"] if step == 0 else new["steps"][step - 1]["layers"]
    weights[layer][0] += change * weights[layer][1]
    return new


@pytest.mark.parametrize("tolerance", [0.0, 1e-3])
def test_numerics_verdict_follows_the_tolerance_step_by_step(baseline, tolerance):
    _, record = baseline
    trajectory = record["trajectory"]
    limit = tolerance or 1e-4  # 0: the fp32 default
    assert bench.compare_numerics(trajectory, copy.deepcopy(trajectory), tolerance)["moved"] is None
    within = bench.compare_numerics(trajectory, planted(trajectory, 2, "layers.2", 0.9 * limit), tolerance)
    assert within["moved"] is None
    verdict = bench.compare_numerics(trajectory, planted(trajectory, 2, "layers.2", 1.1 * limit), tolerance)
    assert verdict["moved"]["step"] == 2 and verdict["moved"]["changes"] == {"layers.2": pytest.approx(1.1 * limit)}
    assert verdict["lines"][0].startswith(f"numerics MOVED beyond {limit:.0e} (relative) at step 2 of 3: first layer "
                                          f"layers.2")
    initial = bench.compare_numerics(trajectory, planted(trajectory, 0, "head", 1.1 * limit), tolerance)
    assert initial["moved"]["step"] == 0 and "at the initial weights: first layer head" in initial["lines"][0]
    broken = copy.deepcopy(trajectory)
    broken["steps"][2]["loss"] = math.nan
    assert bench.compare_numerics(trajectory, broken, tolerance)["moved"]["changes"] == {"loss": math.inf}


def test_a_baseline_without_numbers_is_compared_on_speed_only(baseline):
    _, record = baseline
    verdict = bench.compare_numerics(None, record["trajectory"], 0.0)
    assert verdict["moved"] is None and "the baseline has no trajectory" in verdict["lines"][0]
