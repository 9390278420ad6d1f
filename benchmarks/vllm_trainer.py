"""The trainer's step with each generation engine: where the time goes, and what asynchrony buys.

    .venv-vllm/bin/python benchmarks/vllm_trainer.py                     # tiny model
    .venv-vllm/bin/python benchmarks/vllm_trainer.py --models tiny,smollm2 --steps 3

Run in `.venv-vllm` (vLLM's CPU build, `make test-vllm` builds it). For each model, our trainer
runs the same work (`_common.DEFAULTS`: LoRA r=16, 4 prompts x 8 completions per step, at most 64
tokens, temperature 1) with:

- `transformers`: `generate` in the training process;
- `vllm colocate`: a `vllm.LLM` in the training process (in-process engine);
- `vllm server`, synchronous and with `max_staleness` 1 and 2: an unmodified vLLM server that this
  script starts on a free port (`python -m vllm.entrypoints.openai.api_server`, float32, eager).

Each run is its own subprocess; the first step (engine warm-up) is not measured. Per step:
generation (the engine's `generate`), weight publishing (saving the adapter and loading it into
the engine) and the rest (rewards, log-probs, forward and backward passes, optimizer), medians over
the measured steps. With `max_staleness`, generation and publishing run on the rollout thread
while the trainer trains, so only the step time is comparable. The machine's cores are shared by
the trainer and the server: nothing is pinned, and the trainer runs with `--threads` torch threads
(default 1, as `vs_trl.py --threads 1`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

MODELS = {"tiny": _common.tiny_vllm_model_dir, "smollm2": _common.smollm2_model_dir}
# name -> (engine settings, server needed)
ENGINES = {
    "transformers": ({}, False),
    "vllm colocate": ({"use_vllm": True, "vllm_mode": "colocate"}, False),
    "vllm server": ({"use_vllm": True, "vllm_mode": "server"}, True),
    "vllm server k=1": ({"use_vllm": True, "vllm_mode": "server", "max_staleness": 1}, True),
    "vllm server k=2": ({"use_vllm": True, "vllm_mode": "server", "max_staleness": 2}, True),
}


def worker(spec: dict) -> dict:
    """One run of our trainer; per-step seconds of the step, generation and publishing."""
    for name, value in _common.VLLM_CPU_ENV.items():
        os.environ.setdefault(name, value)
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    spec = {**_common.DEFAULTS, **spec, "trainer": "ours"}
    steps = spec["warmup_steps"] + spec["steps"]
    dataset = _common.prompt_dataset(
        steps * spec["num_prompts"], spec["difficulty"], spec["system_prompt"]
    )
    timer = _common._make_timer("cpu")
    trainer = _common._build_trainer(spec, dataset, timer)
    spent = {"generation": 0.0, "publishing": 0.0}
    per_step = {"generation": [], "publishing": []}

    def timed(function, key):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - started

        return wrapper

    trainer.rollouts.engine.generate = timed(trainer.rollouts.engine.generate, "generation")
    if trainer.rollouts.publisher is not None:
        publisher = trainer.rollouts.publisher
        publisher.snapshot = timed(publisher.snapshot, "publishing")
        publisher.load = timed(publisher.load, "publishing")
    step_end = timer.on_step_end

    def on_step_end(*args, **kwargs):
        step_end(*args, **kwargs)
        for key in spent:
            per_step[key].append(spent[key])
            spent[key] = 0.0

    timer.on_step_end = on_step_end
    trainer.train()
    return {"seconds": timer.seconds, **per_step, "warmup_steps": spec["warmup_steps"]}


def run(spec: dict) -> dict:
    """`worker(spec)` in a fresh process."""
    result_path = Path(spec["output_dir"]) / "result.json"
    result_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_common.ROOT), env.get("PYTHONPATH")]))
    log_path = result_path.parent / "stderr.log"
    with open(log_path, "w") as log:
        process = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(spec), str(result_path)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    if process.returncode:
        raise RuntimeError(f"run failed: {_common.last_error(log_path)} (log: {log_path})")
    return json.loads(result_path.read_text())


def start_server(model_dir: str, lora_rank: int, log_path: Path):
    """An unmodified vLLM server for `model_dir` on a free port; returns (process, base URL)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **_common.VLLM_CPU_ENV}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine in its own process
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1",
    ]  # fmt: skip
    log = open(log_path, "w")
    # A session of its own, so that a kill reaches its engine core and workers too.
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited; see {log_path}")
        try:
            urllib.request.urlopen(f"{base_url}/health", timeout=2).read()
            return process, base_url
        except OSError:
            if time.monotonic() > deadline:
                os.killpg(process.pid, signal.SIGKILL)
                raise RuntimeError(f"the vLLM server did not start; see {log_path}") from None
            time.sleep(1)


def summary(result: dict) -> dict:
    skip = result["warmup_steps"]
    step = statistics.median(result["seconds"][skip:])
    generation = statistics.median(result["generation"][skip:])
    publishing = statistics.median(result["publishing"][skip:])
    return {
        "step": step,
        "generation": generation,
        "publishing": publishing,
        "rest": step - generation - publishing,
    }


def table(model: str, summaries: dict[str, dict]) -> str:
    baseline = summaries["transformers"]["step"]
    lines = [
        f"| {model} | s/step | generation | publishing | rest (training) | step vs transformers |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in summaries.items():
        overlapped = "max_staleness" in ENGINES[name][0]
        cells = [f"{row[key]:.2f}" for key in ("generation", "publishing", "rest")]
        if overlapped:  # measured on the rollout thread, overlapping the step
            cells = [f"({cells[0]})", f"({cells[1]})", "-"]
        lines.append(
            f"| {name} | {row['step']:.2f} | {' | '.join(cells)} | {row['step'] / baseline:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny", help="comma-separated: tiny, smollm2")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the trainer (0: torch's default). With 2 threads on a busy "
        "2-core machine, OpenMP's spinning barriers slowed vLLM's CPU LoRA kernels 100-fold",
    )
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    parser.add_argument("--json", default=None, help="also write the raw records here")
    args = parser.parse_args(argv)
    with _common.work_folder(args.output_dir, "bench-vllm-trainer-") as output_dir:
        report, tables = {}, []
        for model in args.models.split(","):
            model_dir = MODELS[model]()
            base = {
                "model_dir": model_dir,
                "steps": args.steps,
                "warmup_steps": args.warmup_steps,
                "max_completion_length": args.max_completion_length,
                "threads": args.threads,
            }
            engines = args.engines.split(",")
            server, base_url = None, None
            if any(ENGINES[name][1] for name in engines):
                started = time.perf_counter()
                server, base_url = start_server(
                    model_dir, _common.DEFAULTS["lora_r"], output_dir / f"{model}-server.log"
                )
                print(f"{model}: server up in {time.perf_counter() - started:.0f} s", flush=True)
            summaries, report[model] = {}, {}
            try:
                for index, name in enumerate(engines):
                    settings = dict(ENGINES[name][0])
                    if settings.get("vllm_mode") == "server":
                        settings["vllm_server_base_url"] = base_url
                    if settings.get("vllm_mode") == "colocate":
                        settings["vllm_max_model_length"] = 1024
                    spec = {
                        **base,
                        "engine_args": settings,
                        "output_dir": str(output_dir / model / f"{index}"),
                    }
                    started = time.perf_counter()
                    result = run(spec)
                    summaries[name] = summary(result)
                    report[model][name] = result
                    print(
                        f"  {name}: {time.perf_counter() - started:.0f} s in all, "
                        f"{summaries[name]['step']:.2f} s/step",
                        flush=True,
                    )
            finally:
                if server is not None:
                    server.terminate()
                    server.wait(timeout=60)
            tables.append(table(model, summaries))
        print("\n\n".join(tables))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return report


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        result = worker(json.loads(sys.argv[2]))
        Path(sys.argv[3]).write_text(json.dumps(result))
    else:
        main()
