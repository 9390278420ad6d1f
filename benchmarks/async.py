"""Wall-clock of N optimizer steps: synchronous vs asynchronous rollouts (max_staleness 1 and 2).

    python benchmarks/async.py                        # tiny model and SmolLM2-135M-Instruct
    python benchmarks/async.py --models tiny --steps 12 --rounds 3

Each run is a subprocess (its own cores, threads and memory); runs alternate between the modes
to cancel machine drift. The first step (worker start-up, warm-up) is not timed. The synchronous
trainer runs with every core and with one thread (the faster one is the baseline: on a busy
machine, extra threads can slow it down); the asynchronous one gives one core to the rollout
worker (`rollout_worker_threads=1`) and keeps the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# mode -> (max_staleness, torch threads of the trainer; None: all cores)
MODES = {"sync": (None, None), "sync, 1 thread": (None, 1), "k=1": (1, None), "k=2": (2, None)}
MODEL_SETTINGS = {  # max_completion_length per model: what 2 CPU cores finish in minutes
    "tiny": {"max_completion_length": 32, "difficulty": 1},
    "smollm2": {"max_completion_length": 24, "difficulty": 1},
}


def worker(spec: dict) -> dict:
    """One training run; returns seconds per step after the first and the final reward."""
    from _common import prompt_dataset, smollm2_model_dir, sum_reward, tiny_model_dir
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback

    from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer

    if spec["threads"]:
        import torch

        torch.set_num_threads(spec["threads"])
    model_dir = tiny_model_dir() if spec["model"] == "tiny" else smollm2_model_dir()
    settings = MODEL_SETTINGS[spec["model"]]
    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    args = GroupRelativeConfig(
        output_dir=spec["output_dir"],
        num_generations=8,
        per_device_train_batch_size=32,  # 4 prompts x 8 completions
        max_completion_length=settings["max_completion_length"],
        temperature=1.0,
        learning_rate=1e-4,
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        max_staleness=spec["max_staleness"],
    )
    trainer = GroupRelativeTrainer(
        model=model_dir,
        reward_funcs=sum_reward,
        args=args,
        train_dataset=prompt_dataset(256, settings["difficulty"], system_prompt=False),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
        callbacks=[Clock()],
    )
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    return {
        "seconds_per_step": (stamps[-1] - stamps[0]) / (len(stamps) - 1),
        "final_reward": statistics.fmean(rewards[-3:]),
        "mean_reward": statistics.fmean(rewards),
    }


def run(model: str, mode: str, steps: int) -> dict:
    spec = {
        "model": model,
        "max_staleness": MODES[mode][0],
        "threads": MODES[mode][1],
        "steps": steps,
        "output_dir": f".cache/bench-async/{model}-{mode}",
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{model} {mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(json.loads(options.worker))))
        return
    print(f"{options.steps} steps, {options.rounds} rounds, {os.cpu_count()} CPU cores")
    print("| model | mode | s/step (median) | steps/s vs best sync | final reward | mean reward |")
    print("|---|---|---|---|---|---|")
    for model in options.models.split(","):
        results = {mode: [] for mode in MODES}
        for _ in range(options.rounds):
            for mode in MODES:
                results[mode].append(run(model, mode, options.steps))
        sync_time = min(  # the faster of the two synchronous settings
            statistics.median(r["seconds_per_step"] for r in results[mode])
            for mode in ("sync", "sync, 1 thread")
        )
        for mode, runs in results.items():
            seconds = statistics.median(r["seconds_per_step"] for r in runs)
            final = statistics.fmean(r["final_reward"] for r in runs)
            mean = statistics.fmean(r["mean_reward"] for r in runs)
            print(
                f"| {model} | {mode} | {seconds:.3f} | {sync_time / seconds:.2f}x | "
                f"{final:.3f} | {mean:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
