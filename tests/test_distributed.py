"""Two CPU processes with gloo: groups stay on one process and the logs match one process."""

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("distributed_run.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(output_dir, processes, per_device):
    output_dir.mkdir()
    if processes == 1:
        command = [sys.executable, str(SCRIPT)]
    else:
        # `--cpu --num_processes 2` silently starts one process; --multi_gpu uses gloo on CPU.
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", str(processes), "--mixed_precision", "no",
            "--main_process_port", str(free_port()), str(SCRIPT),
        ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, str(output_dir), str(per_device)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(path.read_text()) for path in sorted(output_dir.glob("result-*.json"))]
    calls = {
        int(path.stem.split("-")[1]): [json.loads(line) for line in path.read_text().splitlines()]
        for path in output_dir.glob("calls-*.jsonl")
    }
    return results, calls


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("distributed")
    return run(base / "one", 1, 16), run(base / "two", 2, 8)


def test_two_processes_complete_and_stay_in_sync(runs):
    _, (results, _) = runs
    assert len(results) == 2
    assert all(result["log"][-1]["step"] == 3 for result in results)
    assert results[0]["weights"] == pytest.approx(results[1]["weights"], rel=1e-6)


def test_each_group_stays_on_one_process(runs):
    _, (_, calls) = runs
    assert sorted(calls) == [0, 1]
    for step in range(3):
        per_process = [
            Counter(call["prompts"])
            for rank in (0, 1)
            for call in calls[rank]
            if call["step"] == step
        ]
        assert len(per_process) == 2
        for counts in per_process:
            assert set(counts.values()) == {4}  # num_generations completions of each prompt
        assert not set(per_process[0]) & set(per_process[1])  # no prompt on both processes


def test_logged_rewards_match_one_process_on_the_same_data(runs):
    (one, one_calls), (two, _) = runs
    key = "rewards/prompt_value/mean"
    single = [entry[key] for entry in one[0]["log"] if key in entry]
    double = [entry[key] for entry in two[0]["log"] if key in entry]
    assert len(single) == 3 and single == pytest.approx(double)
    assert len(one_calls[0]) == 3
