"""The benchmark scripts against trl.GRPOTrainer run end to end on a tiny shape, on CPU."""

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import trl
from packaging.version import Version

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY_RUN = ["--rounds", "1", "--steps", "1", "--num-prompts", "2", "--num-generations", "4"]
TINY_RUN += ["--max-completion-length", "4", "--micro-batch", "4"]


def load(name):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def check_runs(runs, completions_per_step, max_length):
    for trainer in ("ours", "trl"):
        (run,) = runs[trainer]
        assert len(run["seconds"]) == len(run["tokens"]) == len(run["rewards"]) == 2
        assert all(seconds > 0 for seconds in run["seconds"])
        # the same count for both: completion tokens up to and including the first eos
        assert all(0 < tokens <= completions_per_step * max_length for tokens in run["tokens"])
        assert run["peak_bytes"] > 0


def test_vs_trl_on_the_tiny_model_in_subprocesses(tmp_path, capsys, monkeypatch):
    # Without --output-dir the runs go to a temporary folder, removed at the end: nothing stays
    # in the temp folder, the workers' included.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report = load("vs_trl").main(["--models", "tiny", *TINY_RUN])
    check_runs(report["models"]["tiny"], completions_per_step=8, max_length=4)
    table = capsys.readouterr().out
    for row in ("median s/step", "generated tokens/s", "s per 1,000 generated tokens", "peak RSS"):
        assert f"| {row}" in table
    assert list(tmp_path.iterdir()) == []


def test_a_failed_run_keeps_its_logs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    common = load("_common")
    with pytest.raises(RuntimeError), common.work_folder(None, "bench-") as folder:
        (folder / "stderr.log").write_text("ValueError: bad")
        raise RuntimeError("ours failed")
    assert (folder / "stderr.log").exists()
    assert f"logs are kept in {folder}" in capsys.readouterr().err
    with common.work_folder(str(tmp_path / "mine"), "bench-") as chosen:
        pass
    assert chosen == tmp_path / "mine" and chosen.is_dir()  # the user's folder stays


KILLED_RUN = """
import subprocess, sys
sys.path.insert(0, sys.argv[1])
import _common
with _common.work_folder(None, "bench-") as folder:
    (folder / "stderr.log").write_text("step 1")
    pid_file = folder / "trainer.pid"
    trainer = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
    subprocess.run([sys.executable, "-c", trainer, str(pid_file)])
"""


def test_a_terminated_run_keeps_its_logs_and_says_where(tmp_path):
    # `timeout` or a job scheduler ends a benchmark with SIGTERM: its temporary folder stays,
    # named on stderr, rather than lying unnamed in the temp folder; the trainer subprocess it
    # waits for is killed with it.
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", KILLED_RUN, str(BENCHMARKS)], env=env, stderr=stderr
        )
    deadline = time.monotonic() + 60
    while not any(f.read_text() for f in tmp_path.glob("tmp/bench-*/trainer.pid")):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)
    (folder,) = tmp_path.glob("tmp/bench-*")
    trainer = int((folder / "trainer.pid").read_text())
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
        assert f"logs are kept in {folder}" in (tmp_path / "stderr").read_text()
        assert (folder / "stderr.log").read_text() == "step 1"
        with pytest.raises(ProcessLookupError):  # killed and reaped by subprocess.run
            os.kill(trainer, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(trainer, signal.SIGKILL)


def test_gpu_script_with_a_tiny_shape_on_cpu(tmp_path, capsys, monkeypatch):
    gpu, common = load("gpu"), load("_common")
    caches, build = [], common._build_trainer

    def recorded(spec, dataset, timer):
        trainer = build(spec, dataset, timer)
        caches.append((spec["trainer"], trainer.args.cache_implementation))
        return trainer

    monkeypatch.setattr(common, "_build_trainer", recorded)
    report = gpu.main(
        ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--in-process", *TINY_RUN]
        + ["--output-dir", str(tmp_path), "--json", str(tmp_path / "gpu.json")]
        + ["--cache-implementation", "static"]  # both trainers take it (compiled on a GPU)
    )
    check_runs(report["results"], completions_per_step=8, max_length=4)
    assert "| reward, last step |" in capsys.readouterr().out
    assert (tmp_path / "gpu.json").exists()
    assert sorted(caches) == [("ours", "static"), ("trl", "static")]


def test_gpu_script_spreads_lengths_alike_in_both_trainers(tmp_path):
    # --eos-rate: the same biased model object in both trainers, so both sample lengths from
    # one distribution (geometric, mean about 1 / rate) instead of running to the cap.
    gpu = load("gpu")
    run = [*TINY_RUN, "--max-completion-length", "32"]  # the last value counts
    report = gpu.main(
        ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--in-process", *run]
        + ["--eos-rate", "0.2", "--output-dir", str(tmp_path)]
    )
    for trainer in ("ours", "trl"):
        (records,) = report["results"][trainer]
        # 8 completions of 5 tokens on average (at most 32): far under the cap's 256
        assert all(8 <= tokens <= 128 for tokens in records["tokens"]), (trainer, records)


def test_an_eos_bias_makes_the_token_as_likely_as_asked():
    import torch
    from transformers import AutoModelForCausalLM

    common, gpu = load("_common"), load("gpu")
    model = AutoModelForCausalLM.from_pretrained(
        common.random_model_dir(gpu.SHAPES["tiny"], "float32")
    )
    common.bias_end_of_sequence(model, eos_token_id=3, rate=0.1)
    tokens = torch.randint(
        0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        probs = model(tokens).logits.softmax(-1)
    assert 0.07 < probs[..., 3].mean() < 0.14  # nearly uniform logits: e^b / (V - 1 + e^b)
    assert probs[..., 4].mean() < 0.01  # the other words share the rest
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied


def test_shape_argument():
    gpu = load("gpu")
    assert gpu.parse_shape("qwen2.5-0.5b")["vocab"] == 151936
    assert gpu.parse_shape("layers=2,hidden=64")["layers"] == 2
    with pytest.raises(SystemExit):
        gpu.parse_shape("depth=3")


def test_table_ratios():
    common = load("_common")
    run = {"seconds": [9.0, 2.0, 4.0], "tokens": [100, 100, 300], "rewards": [0, 0.5, 1.0]}
    ours = [{**run, "peak_bytes": 2**20, "warmup_steps": 1}]
    trl = [{**run, "seconds": [9.0, 4.0, 8.0], "peak_bytes": 2**21, "warmup_steps": 1}]
    summary = common.summarise(ours)
    assert summary["s_per_step"] == 3.0  # the warm-up step is left out
    assert summary["s_per_1k_tokens"] == pytest.approx(1000 * 6 / 400)
    table = common.table("m", {"ours": ours, "trl": trl})
    assert "| s per 1,000 generated tokens | 15.00 | 30.00 | 0.50 |" in table
    assert "| peak RSS (MiB) | 1 | 2 | 0.50 |" in table


def test_each_round_seeds_both_trainers_alike_and_draws_anew(monkeypatch, tmp_path):
    # Within a round both trainers start from the same seed; the next round draws other
    # completions, so the tokens per step average over rounds instead of repeating one draw.
    common = load("_common")
    seen = []

    def worker(spec):
        seen.append((spec["trainer"], spec["seed"], Path(spec["output_dir"]).name))
        return {"seconds": [1.0], "warmup_steps": 0}

    monkeypatch.setattr(common, "run_worker", worker)
    spec = {"output_dir": str(tmp_path), "seed": 7}
    results = common.run_alternating(spec, 3, log=lambda *a, **k: None, in_process=True)
    assert seen == [
        ("ours", 7, "ours-0"),
        ("trl", 7, "trl-0"),
        ("ours", 8, "ours-1"),
        ("trl", 8, "trl-1"),
        ("ours", 9, "ours-2"),
        ("trl", 9, "trl-2"),
    ]
    assert len(results["ours"]) == len(results["trl"]) == 3
    seen.clear()
    common.run_alternating(
        {"output_dir": str(tmp_path)}, 1, log=lambda *a, **k: None, in_process=True
    )
    assert [seed for _, seed, _ in seen] == [common.DEFAULTS["seed"]] * 2


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_vllm_cpu_settings_only_on_cpu(tmp_path, monkeypatch, device):
    """vLLM's CPU settings (a 1 GiB KV cache, the engine in the trainer's process) on a GPU would
    put the engine's memory into the trainer's peak-memory figure."""
    common = load("_common")
    seen = {}

    def run(command, env, **kwargs):
        seen.update(env)
        (tmp_path / "run" / "result.json").write_text("{}")
        return type("Done", (), {"returncode": 0})()

    for name in common.VLLM_CPU_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(common.subprocess, "run", run)
    spec = {"trainer": "ours", "device": device, "output_dir": str(tmp_path / "run")}
    common.run_subprocess({**spec, "engine_args": {"use_vllm": True}})
    on_cpu = {name: seen.get(name) for name in common.VLLM_CPU_ENV}
    assert on_cpu == (common.VLLM_CPU_ENV if device == "cpu" else dict.fromkeys(on_cpu))


@pytest.mark.skipif(
    Version(trl.__version__) < Version("1.16"), reason="tools need trl>=1.16 (both trainers)"
)
def test_tools_benchmark_times_both_trainers_on_the_same_scripted_turns(capsys):
    report = load("tools").main(["--tool-seconds", "0.01", "--rollouts", "4", "--repeats", "1"])
    assert set(report[4]) == {"default", "async", "threads", "trl", "trl async"}
    assert all(seconds > 0 for seconds in report[4].values())
    assert "| 4 |" in capsys.readouterr().out


def test_overlap_and_hidden_tool_time():
    latency = load("tool_latency")
    assert latency.overlap([(0.0, 2.0), (5.0, 6.0)], [(1.0, 5.5)]) == pytest.approx(1.5)
    assert latency.overlap([(0.0, 1.0)], [(1.0, 2.0)]) == 0.0
    step = {"seconds": 2.0, "wait": 0.5, "reward": 1.0}
    run = {"steps": [step, step], "warmup_steps": 1, "tool_seconds": 0.4}
    run |= {"loop_python_seconds": 0.3, "loops": 2}  # two batches sampled: 0.15 s each
    # the trainer waited through a quarter of the tool rounds: three quarters were hidden
    summary = latency.summarise([{**run, "tool_seconds_waited": 0.1}])
    assert summary["hidden"] == pytest.approx(0.75)
    assert summary["loop_python"] == pytest.approx(0.15)
    assert summary["train"] == pytest.approx(1.5) and summary["measured_steps"] == 1


@pytest.mark.skipif(Version(trl.__version__) < Version("1.16"), reason="tools need trl>=1.16")
def test_tool_latency_conversation_and_its_bpe_tokenizer():
    from agent_helpers import (
        TOOL_PROMPT,
        TOOL_RESULTS,
        TOOL_TURNS,
        add,
        chain_conversation,
        tool_conversation,
    )

    assert chain_conversation(2) == (TOOL_PROMPT, TOOL_TURNS, TOOL_RESULTS)
    prompt, turns, results = chain_conversation(4)  # 2 + 3 = 5, + 4 = 9, + 5 = 14, + 6 = 20
    assert prompt[0]["content"] == "Add 2 and 3, then add 4, then add 5, then add 6."
    assert results == ["5", "9", "14", "20"] and turns[-1] == "It is 20." and len(turns) == 5
    tokenizer = load("tool_latency").bpe_tokenizer(4)
    prompt_ids, completion_ids, pieces = tool_conversation(tokenizer, [add], 4)
    assert tokenizer.decode(pieces[0]) == turns[0] + "<|im_end|>"
    # a call as Qwen3's tokenizer writes it: <tool_call> one token, words merged, 24 in all
    assert len(pieces[0]) == 24 and tokenizer.convert_ids_to_tokens(pieces[0][0]) == "<tool_call>"
    assert len(prompt_ids) < 300  # the byte-level tokenizer: 779


@pytest.mark.skipif(Version(trl.__version__) < Version("1.16"), reason="tools need trl>=1.16")
def test_tool_latency_benchmark_trains_sync_and_async_on_a_model_that_calls_the_tool(
    tmp_path, capsys
):
    """The smallest run: a 64-wide model overfit to call the tool, one warm-up and one measured
    step per mode, in this process."""
    arguments = ["--modes", "sync", "k=1", "--steps", "1", "--repeats", "1", "--in-process"]
    arguments += ["--hidden-size", "64", "--overfit-learning-rate", "3e-3", "--temperature", "0.1"]
    arguments += ["--num-prompts", "1", "--num-generations", "2", "--tool-seconds", "0.01"]
    report = load("tool_latency").main([*arguments, "--cache", str(tmp_path)])
    assert set(report) == {"sync", "k=1"}
    sync = load("tool_latency").summarise(report["sync"])
    assert sync["tool_calls"] > 0  # the model calls the tool
    assert sync["hidden"] == pytest.approx(0.0)  # synchronous: every tool round is waited for
    for runs in report.values():
        (run,) = runs
        assert len(run["steps"]) == 2 and all(0 <= s["reward"] <= 1 for s in run["steps"])
    assert "| k=1 |" in capsys.readouterr().out


def test_profile_step_splits_a_step_of_each_trainer(capsys):
    timers = load("profile_step").main(["--model", "tiny", "--steps", "1", "--trl"])
    for name in ("ours", "TRL"):
        (warmup, measured) = timers[name].steps
        assert measured["sampling"] > 0 and measured["backward"] > 0
        phases = sum(measured.get(key, 0.0) for key in load("profile_step").TOP_LEVEL)
        assert phases <= measured["step"]  # the phases are parts of the step
    assert timers["ours"].counts["micro-batches"] == 2 * 4  # 32 completions in batches of 8
    table = capsys.readouterr().out
    assert "| sampling (generate) |" in table and "| other (loop" in table


def test_profile_step_takes_the_gpu_benchmarks_case_by_its_shape(capsys):
    """`--shape` profiles gpu.py's step (8 x 8 completions of 256 tokens, micro-batches of 8)
    on a random model of that shape; a GPU session runs it with the Qwen2.5-0.5B shape."""
    module = load("profile_step")
    timers = module.main(["--shape", "tiny", "--steps", "1", "--dtype", "float32"])
    assert timers["ours"].counts["micro-batches"] == 2 * 8  # warm-up and measured step
    assert timers["ours"].counts["sampling"] == 2
    with pytest.raises(SystemExit, match="unknown key"):
        module.main(["--shape", "depth=3"])


def test_merged_sampling_draws_the_same_tokens_as_unmerged(capsys):
    report = load("merged_sampling").main(["--model", "tiny", "--repeats", "1"])
    assert report["tokens"]["ours, merged"] == report["tokens"]["ours, unmerged"]
    assert "same tokens sampled: True" in capsys.readouterr().out


def test_compact_sampling_draws_the_same_tokens_both_ways(capsys):
    report = load("compact_sampling").main(
        ["--model", "tiny", "--repeats", "1", "--max-tokens", "8"]
    )
    assert report["same"]
    assert report["tokens"]["finished rows leave"] == report["tokens"]["all rows to the end"]
    assert "same tokens: True" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["tiny", "hybrid-random"])
def test_levers_on_and_off_compute_the_same(capsys, model):
    report = load("levers").main(["--model", model, "--repeats", "1", "--max-tokens", "16"])
    same = report["sampling"]["same"]
    assert "KV cache grown by concatenation" in same
    assert all(same.values())  # merged or not, compacting or not, the cache grown in place or not
    assert report["sampling"]["merge_logp_max"] < 1e-5  # float32: the merge's rounding only
    for name, (logp_error, grad_error) in report["logprobs"]["errors"].items():
        assert logp_error < 1e-5 and grad_error < 1e-5, name  # against the unpacked rows
    assert "| ours: packed, by blocks, probabilities kept |" in capsys.readouterr().out


def test_levers_spread_a_random_models_lengths_with_an_eos_bias():
    args = ["--model", "tiny-random", "--repeats", "1", "--max-tokens", "64", "--eos-rate", "0.05"]
    shortest, mean, longest = load("levers").main(args)["sampling"]["lengths"]
    # Ending with probability 0.05 per step: 19 tokens on average (at most 64); with the
    # vocabulary's 1 / 512, 60.
    assert mean < 40 and shortest < longest


def test_merge_precision_on_the_tiny_model(capsys):
    report = load("merge_precision").main(["--num-prompts", "2", "--group-size", "2"])
    for rows in report.values():  # B x 1 and x 0.05
        # float32's merge is rounding only; the adapter's effect and bfloat16's are far larger
        assert rows["float32, merged"]["token_max"] < 1e-5
        assert (
            rows["float32, adapters off"]["token_mean"] > 10 * rows["float32, merged"]["token_mean"]
        )
        assert rows["bfloat16, unmerged"]["token_mean"] > 10 * rows["float32, merged"]["token_mean"]
        assert -1 < rows["bfloat16, merged"]["effect_kept"] < 2
    assert "| bfloat16, merged |" in capsys.readouterr().out
