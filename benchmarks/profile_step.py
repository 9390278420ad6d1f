"""Where one training step of ours goes, phase by phase, at the shape of `vs_trl.py`.

    .venv/bin/python benchmarks/profile_step.py --model tiny --steps 3
    .venv/bin/python benchmarks/profile_step.py --model smollm2 --steps 1 --trl
    python benchmarks/profile_step.py --shape qwen2.5-0.5b --device cuda --steps 1 --trl  # a GPU

The trainer is built exactly as `vs_trl.py` builds it (`_common._build_trainer`) and trained for
`--warmup-steps + --steps` steps; timers wrapped around its phases give each measured step's
split: sampling (the engine's `generate`), the rest of building the rollout (encoding, cutting,
decoding), rewards, the old and reference log-probs, the objective's forward pass, the backward
pass, the optimizer, logging, and what is left ("other": the Trainer's loop, advantages,
metrics, bookkeeping). Shares of the step, not seconds, are what compare across runs on a busy
machine. `--trl` splits `trl.GRPOTrainer`'s step the same way (sampling, rewards, forward,
backward, optimizer), in this process after ours.

`--shape` profiles `gpu.py`'s case instead (a random model of that shape, 8 prompts x 8
completions of 256 tokens, gradient checkpointing), on `--device` in `--dtype` (bf16 by
default there); on CUDA every phase waits for the device before and after, so each phase's
kernels count in it rather than in the next phase that waits.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
from gpu import parse_shape  # noqa: E402

# gpu.py's step: 8 prompts x 8 completions of 256 tokens, micro-batches of 8, checkpointing.
GPU_CASE = {
    "num_prompts": 8,
    "num_generations": 8,
    "max_completion_length": 256,
    "micro_batch": 8,
    "gradient_checkpointing": True,
    "system_prompt": True,
}


class PhaseTimer:
    """Seconds spent in named phases, per optimizer step; nested phases are not subtracted."""

    def __init__(self, synchronize=None):
        self.synchronize = synchronize or (lambda: None)  # waits for the device's queued work
        self.current: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            self.synchronize()
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.synchronize()
                self.current[phase] += time.perf_counter() - started
                self.counts[phase] += 1

        setattr(owner, name, timed)

    def end_step(self, seconds: float) -> None:
        self.steps.append({**self.current, "step": seconds})
        self.current = defaultdict(float)


def _timed_optimizer(trainer, timer: PhaseTimer) -> None:
    create = trainer.create_optimizer

    def create_optimizer(*args, **kwargs):
        optimizer = create(*args, **kwargs)
        timer.wrap(optimizer, "step", "optimizer")
        timer.wrap(optimizer, "zero_grad", "optimizer")
        return optimizer

    trainer.create_optimizer = create_optimizer


def instrument_ours(trainer, timer: PhaseTimer) -> list[str]:
    """Times the phases of `GroupRelativeTrainer`; returns them in display order."""
    timer.wrap(trainer.rollouts.engine, "generate", "sampling")
    timer.wrap(trainer.rollouts, "generate", "rollout (with sampling)")
    timer.wrap(trainer, "score_rollouts", "rewards")
    timer.wrap(trainer, "_logps_in_chunks", "old/ref log-probs")
    timer.wrap(trainer, "compute_objective", "objective (with forward)")
    timer.wrap(trainer, "_token_logprobs", "forward")
    timer.wrap(trainer.accelerator, "backward", "backward")
    timer.wrap(trainer, "log", "log")
    no_signal = trainer._carries_no_signal

    def carries_no_signal(batch):
        result = no_signal(batch)
        timer.counts["micro-batches"] += 1
        timer.counts["without signal"] += int(result)
        return result

    trainer._carries_no_signal = carries_no_signal
    _timed_optimizer(trainer, timer)
    return ["sampling", "rollout (with sampling)", "rewards", "old/ref log-probs", "forward"]


def instrument_trl(trainer, timer: PhaseTimer) -> list[str]:
    """Times the phases of `trl.GRPOTrainer`."""
    timer.wrap(trainer, "_generate", "rollout (with sampling)")
    timer.wrap(trainer, "_generate_single_turn", "sampling")
    timer.wrap(trainer, "_calculate_rewards", "rewards")
    timer.wrap(trainer, "compute_loss", "objective (with forward)")
    timer.wrap(trainer, "_get_per_token_logps_and_entropies", "forward")
    timer.wrap(trainer.accelerator, "backward", "backward")
    timer.wrap(trainer, "log", "log")
    _timed_optimizer(trainer, timer)
    return []


def profile(spec: dict, which: str) -> PhaseTimer:
    import torch
    from transformers import TrainerCallback

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    spec = {**_common.DEFAULTS, **spec, "trainer": which}
    steps = spec["warmup_steps"] + spec["steps"]
    dataset = _common.prompt_dataset(
        steps * spec["num_prompts"], spec["difficulty"], spec["system_prompt"]
    )
    timer = PhaseTimer(torch.cuda.synchronize if spec["device"] == "cuda" else None)

    class StepEnd(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            timer.end_step(now - self.last)
            self.last = now

    trainer = _common._build_trainer(spec, dataset, StepEnd())
    (instrument_ours if which == "ours" else instrument_trl)(trainer, timer)
    trainer.train()
    timer.warmup_steps = spec["warmup_steps"]
    return timer


PHASES = [
    ("sampling", "sampling (generate)"),
    ("rollout (with sampling)", "rollout, sampling included"),
    ("rewards", "rewards"),
    ("old/ref log-probs", "old/reference log-probs"),
    ("objective (with forward)", "objective, forward included"),
    ("forward", "forward (log-probs, entropy)"),
    ("backward", "backward"),
    ("optimizer", "optimizer"),
    ("log", "log"),
]
TOP_LEVEL = [
    "rollout (with sampling)",
    "rewards",
    "old/ref log-probs",
    "objective (with forward)",
    "backward",
    "optimizer",
    "log",
]


def table(timers: dict[str, PhaseTimer]) -> str:
    """Median-free: the sums over the measured steps, as shares of the measured steps' time."""
    lines = ["| phase | " + " | ".join(timers) + " |", "|---|" + "---:|" * len(timers)]
    sums = {}
    for name, timer in timers.items():
        measured = timer.steps[timer.warmup_steps :]
        total = defaultdict(float)
        for step in measured:
            for key, value in step.items():
                total[key] += value
        total["other"] = total["step"] - sum(total[key] for key in TOP_LEVEL)
        total["per step"] = total["step"] / len(measured)
        sums[name] = total
    for key, label in [*PHASES, ("other", "other (loop, advantages, metrics, bookkeeping)")]:
        cells = [
            f"{100 * sums[n][key] / sums[n]['step']:.1f}% "
            f"({sums[n][key] / len(timers[n].steps[timers[n].warmup_steps :]):.3f} s)"
            for n in timers
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append(
        "| s per step | " + " | ".join(f"{sums[n]['per step']:.2f}" for n in timers) + " |"
    )
    return "\n".join(lines)


def main(argv=None) -> dict[str, PhaseTimer]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--trl", action="store_true", help="also split TRL's step")
    parser.add_argument(
        "--reward",
        default="shaped",
        choices=sorted(_common.REWARDS),
        help="shaped (vs_trl.py's) or binary (most groups then carry no learning signal)",
    )
    parser.add_argument("--shape", default=None, help="gpu.py's case: " + parse_shape.__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("No CUDA device; run with --device cpu.")
    case = {"device": args.device, "dtype": args.dtype or "float32"}
    if args.shape:  # gpu.py's case (its spec), bf16 unless asked otherwise
        case = {**GPU_CASE, "device": args.device, "dtype": args.dtype or "bfloat16"}
        model_dir = _common.random_model_dir(parse_shape(args.shape), case["dtype"])
    else:
        models = {"tiny": _common.tiny_model_dir, "smollm2": _common.smollm2_model_dir}
        model_dir = models[args.model]()
    with tempfile.TemporaryDirectory(prefix="profile-step-") as output_dir:
        spec = {
            **case,
            "model_dir": model_dir,
            "output_dir": output_dir,
            "steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "threads": args.threads,
            "reward": args.reward,
        }
        timers = {"ours": profile(spec, "ours")}
        ours = timers["ours"]
        print(
            f"micro-batches: {ours.counts['micro-batches']}, "
            f"without signal: {ours.counts['without signal']}",
            flush=True,
        )
        if args.trl:
            timers["TRL"] = profile(spec, "trl")
    print(table(timers))
    return timers


if __name__ == "__main__":
    main()
