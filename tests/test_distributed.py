"""Two CPU processes with gloo: groups stay on one process and the logs match one process."""

import json
import math
import os
import socket
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from deadline import run_with_deadline

SCRIPT = Path(__file__).with_name("distributed_run.py")
ENTROPY_SCRIPT = Path(__file__).with_name("distributed_entropy_run.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(script, processes, *arguments):
    if processes == 1:
        command = [sys.executable, str(script)]
    else:
        # `--cpu --num_processes 2` silently starts one process; --multi_gpu uses gloo on CPU.
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", str(processes), "--mixed_precision", "no",
            "--main_process_port", str(free_port()), str(script),
        ]  # fmt: skip
    # torchrun's agent leaves a torchelastic_* folder in the temp folder: one of the run's own.
    temp = Path(arguments[0]) / "tmp"
    temp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TMPDIR": str(temp)}
    done = run_with_deadline([*command, *map(str, arguments)], 600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def run(output_dir, processes, per_device, *options):
    output_dir.mkdir()
    launch(SCRIPT, processes, output_dir, per_device, *options)
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


@pytest.mark.parametrize("data", ["rows", "stream"])
def test_dynamic_sampling_rounds_take_every_process(tmp_path, data):
    """A process whose groups all carry a learning signal still samples in the rounds another
    process needs (each round's sampling and the gradient are collective): both score the same
    number of batches, and they end with the same weights."""
    options = ["stream", "dynamic"] if data == "stream" else ["dynamic"]
    results, calls = run(tmp_path / data, 2, 8, *options)
    assert results[0]["weights"] == pytest.approx(results[1]["weights"], rel=1e-6)
    rounds = [entry["dynamic_sampling/rounds"] for entry in results[0]["log"]
              if "dynamic_sampling/rounds" in entry]  # fmt: skip
    assert len(rounds) == 3 and sum(rounds) > 0
    # Each process scores once per round, in each reward function's calls file; per step.
    for step in range(3):
        per_process = [sum(call["step"] == step for call in calls[rank]) for rank in (0, 1)]
        assert per_process[0] == per_process[1] >= 1


def test_two_processes_share_out_a_stream(tmp_path):
    """Each process reads the whole (shuffled) stream and keeps its own slice of each
    generation batch: whole groups on one process, no prompt on both, none twice in the epoch,
    and both processes with the same weights."""
    results, calls = run(tmp_path / "stream", 2, 8, "stream")
    assert results[0]["weights"] == pytest.approx(results[1]["weights"], rel=1e-6)
    seen = []
    for step in range(3):
        per_process = [
            Counter(
                prompt for call in calls[rank] if call["step"] == step for prompt in call["prompts"]
            )
            for rank in (0, 1)
        ]
        for counts in per_process:
            assert len(counts) == 2 and set(counts.values()) == {4}  # 2 groups of 4 each
        assert not set(per_process[0]) & set(per_process[1])
        seen += [prompt for counts in per_process for prompt in counts]
    assert len(seen) == len(set(seen)) == 12  # 3 steps of 4 prompts from 16, none twice


def test_logged_rewards_match_one_process_on_the_same_data(runs):
    (one, one_calls), (two, _) = runs
    key = "rewards/prompt_value/mean"
    single = [entry[key] for entry in one[0]["log"] if key in entry]
    double = [entry[key] for entry in two[0]["log"] if key in entry]
    assert len(single) == 3 and single == pytest.approx(double)
    assert len(one_calls[0]) == 3


def test_metrics_and_table_of_all_processes(runs):
    """`log_metric` values over all processes (each name, whichever process logged it), the
    clip ratios' extremes, and the completions table with every process's rows."""
    (one, _), (two, _) = runs
    for entry in [e for e in two[0]["log"] if "reward" in e]:
        assert entry["rank/0"] == 1.0 and entry["rank/1"] == 2.0
        assert entry["rank/all"] == 0.5  # (0 + 1) / 2
        assert "clip_ratio/low_min" in entry and "step_time" in entry
    assert [e["rank/all"] for e in one[0]["log"] if "reward" in e] == [0.0] * 3
    table = two[0]["table"]
    assert len(table["prompt"]) == 16 and len(table["advantage"]) == 16  # 2 processes x 8
    assert table["rank_0_only"] == ["x"] * 8 + [None] * 8
    assert table == two[1]["table"]  # the same on every process


def quantile(values, q):
    """The q-quantile with linear interpolation between order statistics (torch.quantile's)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def test_top_entropy_quantile_pools_the_tokens_of_all_processes(tmp_path):
    """TRL's rule: one threshold, the (1 - rho)-quantile of the completion-token entropies of the
    micro-batches of all processes; each process keeps its tokens at or above it."""
    launch(ENTROPY_SCRIPT, 2, tmp_path)
    runs = [json.loads((tmp_path / f"entropy-{rank}.json").read_text()) for rank in (0, 1)]
    rho = runs[0]["quantile"]
    assert len(runs[0]["calls"]) == len(runs[1]["calls"]) >= 2
    local_rule_differs = False
    for calls in zip(runs[0]["calls"], runs[1]["calls"]):
        pooled = calls[0]["entropy"] + calls[1]["entropy"]
        threshold = quantile(pooled, 1 - rho)
        for call in calls:
            for entropy, kept in zip(call["entropy"], call["kept"]):
                if abs(entropy - threshold) > 1e-5:  # float32 rounding at the threshold itself
                    assert kept == (entropy > threshold), (entropy, threshold)
            local = quantile(call["entropy"], 1 - rho)
            local_rule_differs |= [e >= local for e in call["entropy"]] != call["kept"]
    # The check above can fail: each process's own quantile keeps other tokens.
    assert local_rule_differs


def test_a_hung_launch_fails_and_leaves_no_process(tmp_path):
    """A launch that never ends (ranks out of step in a collective wait forever) fails at its
    deadline, and the launcher's children are killed with it."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(pytest.fail.Exception, match="deadline of 10 s"):
        run_with_deadline([sys.executable, "-c", script], 10)  # time to start the child
    status = Path(f"/proc/{int(pid_file.read_text())}/status")

    def ended() -> bool:  # gone, or a zombie that only waits for its new parent to collect it
        try:
            return "\nState:\tZ" in status.read_text()
        except FileNotFoundError:
            return True

    # SIGKILL takes effect as the kernel gets to it: a loaded machine may take a moment
    waited = time.monotonic() + 10
    while not ended() and time.monotonic() < waited:
        time.sleep(0.1)
    assert ended()
