"""Stragglers and hangs, on two gloo ranks under torchrun: a rank made slower is named with its host at each log, every
rank's step time is in metrics.jsonl; a rank that hangs is named by rank 0 as the one that never reached the
collective the other waits in, from each rank's Flight Recorder, and every rank writes its stack and last collectives.

    python -m pytest tests/test_watch.py -q

The verdicts themselves (watch.slowest, watch.hang_verdict) are pure functions, tested on built records for the cases
two ranks cannot show: eight ranks with a median, several process groups, a rank that sends no record."""

import json
import socket

import pytest

import watch
from conftest import TINY_MODEL_FLAGS, torchrun

HOST = socket.gethostname()


def args(corpus_dir, out_dir, *extra) -> list[str]:
    return ["train.py", f"--data={corpus_dir}", f"--out_dir={out_dir}", "--seq_len=32", "--global_batch=4",
            "--eval_every=0", "--sample_tokens=0", "--ckpt_every=0", *TINY_MODEL_FLAGS, "--dim=32", *extra]


def records(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_slow_rank_is_named_with_its_host(corpus_dir, tmp_path):
    out = torchrun(2, *args(corpus_dir, tmp_path, "--steps=4", "--log_every=2", "--drill=straggle@1"))
    assert f"straggler: rank 1 on {HOST} takes " in out and "above the other ranks' median" in out
    assert "straggler: rank 0" not in out
    logged = [r for r in records(tmp_path) if "slowest_rank" in r]
    assert [r["step"] for r in logged] == [1, 2, 4]  # the first step and every --log_every
    for r in logged:
        assert r["slowest_rank"] == 1 and r["slowest_vs_median"] > 0.5  # its own time about doubled
        assert len(r["data_s_ranks"]) == len(r["compute_s_ranks"]) == len(r["wait_s_ranks"]) == 2
        assert r["compute_s_ranks"][1] > r["compute_s_ranks"][0]
        assert r["wait_s_ranks"][0] > r["wait_s_ranks"][1]  # rank 0 waits for it in the step's closing all-reduce


def test_a_hang_names_the_rank_that_never_reached_the_collective(corpus_dir, tmp_path):
    """The stall drill hangs the last rank in step 2; both watchdogs fire, each rank writes its report, rank 0 names
    rank 1, both exit 3 and torchrun's restart finishes the run."""
    out = torchrun(2, "--max-restarts=1",
                   *args(corpus_dir, tmp_path, "--steps=4", "--log_every=1", "--drill=stall@2", "--step_timeout=3"))
    verdict = next(line for line in out.splitlines() if line.startswith("hang: "))
    assert verdict.startswith(f"hang: rank 1 ({HOST}) never reached gloo:"), verdict
    assert f"of process group 0 (ranks 0, 1), in which rank 0 ({HOST}) waits; each rank's stack and last collectives " \
           f"are in {tmp_path}/hang/" in verdict
    waited_in = int(verdict.split(" #")[1].split(" ")[0])
    stalled = (tmp_path / "hang" / "rank_00001.txt").read_text()
    assert stalled.startswith(f"rank 1 of 2 on {HOST}, pid ") and "no step completed for 3s after step 2" in stalled
    assert f"process group 0 (ranks [0, 1]): the last collective entered is #{waited_in - 1}, the last completed " \
           f"#{waited_in - 1}" in stalled
    assert "in before_step" in stalled.split("stacks:")[1]  # the drill's sleep, in faulthandler's stack
    waiting = (tmp_path / "hang" / "rank_00000.txt").read_text()
    assert f"the last collective entered is #{waited_in}, the last completed #{waited_in - 1}" in waiting
    assert f"  0 #{waited_in} gloo:" in waiting.split("stacks:")[0]  # the collective, in its last collectives
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4]  # the restarted job finished


def test_the_slowest_rank_is_named_against_the_median_of_the_others():
    hosts = [f"node{r // 4}" for r in range(8)]
    times_RP = [[0.01, 0.5, 0.3] for _ in range(8)]
    times_RP[3] = [0.01, 0.5 * 1.1, 0.25]  # 10% slower, in a run with one rank 60% slower
    times_RP[6] = [0.31, 0.5, 0.0]  # a slow read: data 0.31 s, own time 0.81 s against 0.51 s
    record, sentence = watch.slowest(times_RP, hosts, threshold=0.2)
    assert record["slowest_rank"] == 6 and record["slowest_vs_median"] == pytest.approx(0.3 / 0.51, abs=1e-4)
    assert record["data_s_ranks"][6] == 0.31 and record["wait_s_ranks"][3] == 0.25
    assert len(record["compute_s_ranks"]) == 8
    assert sentence == ("straggler: rank 6 on node1 takes 0.810s per step of its own (data 0.310s, compute 0.500s), "
                        "59% above the other ranks' median of 0.510s; they wait 0.300s per step for it")
    times_RP[6] = [0.01, 0.5, 0.3]
    record, sentence = watch.slowest(times_RP, hosts, threshold=0.2)
    assert record["slowest_rank"] == 3 and sentence is None  # 10% is within the threshold
    assert watch.slowest(times_RP, hosts, threshold=0.05)[1].startswith("straggler: rank 3 on node0 takes 0.560s")
    assert watch.slowest(times_RP, hosts, threshold=0.0)[1] is None  # 0: never named
    assert watch.slowest(times_RP[:1], hosts, threshold=0.2) == ({"data_s_ranks": [0.01], "compute_s_ranks": [0.5],
                                                                  "wait_s_ranks": [0.3]}, None)


def test_the_hang_verdict_names_the_ranks_behind_in_each_group():
    """Four ranks as two replicas of two shards: in shard group 2 (ranks 0, 1) rank 0 waits in all_gather #7 that rank
    1 never entered; group 3 (ranks 2, 3) is even; rank 3 sent no record; the world group is even."""
    def record(host, groups, last=()):
        return {"host": host, "groups": groups, "last": list(last)}

    world = {"ranks": [0, 1, 2, 3], "entered": 40, "completed": 40}
    records = {0: record("a", {"0": world, "2": {"ranks": [0, 1], "entered": 7, "completed": 6}},
                         [{"group": "2", "seq": 6, "op": "nccl:all_gather", "sizes": [[8]]},
                          {"group": "2", "seq": 7, "op": "nccl:all_gather", "sizes": [[8]]}]),
               1: record("a", {"0": world, "2": {"ranks": [0, 1], "entered": 6, "completed": 6}}),
               2: record("b", {"0": world, "3": {"ranks": [2, 3], "entered": 7, "completed": 7}})}
    assert watch.hang_verdict(records, 4) == ("hang: rank 1 (a) never reached nccl:all_gather #7 of process group 2 "
                                              "(ranks 0, 1), in which rank 0 (a) waits; rank 3 sent no record (stuck "
                                              "holding the interpreter, or gone)")
    even = {r: record("a", {"0": world}) for r in range(4)}
    assert watch.hang_verdict(even, 4) == "hang: no rank is behind another in a collective; read their stacks"
    without = {0: {"host": "a", "error": "torch 2.4 has no Flight Recorder for gloo"}}
    assert watch.hang_verdict(without, 1) == ("hang: no rank is behind another in a collective; read their stacks "
                                              "(torch 2.4 has no Flight Recorder for gloo)")
