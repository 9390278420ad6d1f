"""Generates the figures of the documentation from the project's own functions and runs.

    python docs/figures.py                   # every figure whose inputs exist
    python docs/figures.py clipped_surrogate # only the named ones
    make figures                             # the same as the first line

Each figure is a function in `FIGURES` that writes `docs/img/<name>.png`. A figure whose inputs
(the output of a run made elsewhere) are missing raises `MissingInput`; it is reported as skipped
and the other figures are still made. Nothing is drawn by hand: the numbers come from
`trl_grpo_ext.objective` and from a real `GroupRelativeTrainer` run. Offline, CPU-only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

DOCS = Path(__file__).resolve().parent
IMG = DOCS / "img"
sys.path.insert(0, str(DOCS / "examples"))  # the toy task shared with the examples

from trl_grpo_ext.objective import LossSettings, group_advantages, policy_loss  # noqa: E402

BLUE, ORANGE, GREY = "#1f77b4", "#ff7f0e", "#7f7f7f"


class MissingInput(Exception):
    """The run or benchmark this figure plots has not been made (yet)."""


def _save(fig, name: str) -> Path:
    IMG.mkdir(exist_ok=True)
    path = IMG / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


# ------------------------------------------------------------------ (1) group -> advantages


def group_advantages_figure(options) -> Path:
    """Rewards of a group of G = 8 completions of one prompt and their advantages.

    The completions are illustrative strings; the rewards are what the toy task's `closeness`
    returns for them, and the advantages come from `group_advantages`.
    """
    from toy_task import closeness

    prompt, answer = "3+4=", "7"
    groups = {
        "a mixed group": ["7", "5", "7", "x", "8", "6", "2", "?"],
        "every completion right": ["7"] * 8,
    }
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True, layout="constrained")
    for ax, (title, completions) in zip(axes, groups.items()):
        rewards = torch.tensor(closeness(completions=completions, answer=[answer] * 8))  # (G,)
        advantages = group_advantages(rewards, group_size=len(completions))  # (G,)
        x = torch.arange(len(completions))
        ax.bar(x - 0.2, rewards, width=0.4, color=GREY, label="reward $r_i$ (closeness)")
        ax.bar(x + 0.2, advantages, width=0.4, color=BLUE, label="advantage $A_i$")
        ax.axhline(0, color="black", linewidth=0.6)
        ax.axhline(rewards.mean(), color=GREY, linestyle=":", linewidth=1, label="group mean")
        ax.set_xticks(x, [f'"{c}"' for c in completions])
        ax.set_xlabel(f"completions of the prompt “{prompt}” (answer {answer})")
        ax.set_title(title)
    axes[0].set_ylim(-2.2, 1.6)
    axes[0].legend(loc="lower left", fontsize=8, ncols=3)
    axes[1].text(
        3.5, -1.0, "zero variance: every $A_i = 0$,\nno gradient from this prompt",
        ha="center", fontsize=9, bbox={"facecolor": "white", "edgecolor": GREY},
    )  # fmt: skip
    fig.suptitle("Group-relative advantage $A_i = (r_i - \\mathrm{mean}(r)) / \\mathrm{std}(r)$")
    return _save(fig, "group_advantages")


# ------------------------------------------------------------- (2) the clipped surrogate


def clipped_surrogate_figure(options) -> Path:
    """The per-token objective -loss(rho) of `policy_loss` on a grid of ratios, A = +1 and -1.

    Where the gradient with respect to log pi_theta is 0 (the clipped branch is active), the
    curve is drawn flat and the region is shaded.
    """
    ratios = torch.linspace(0.05, 2.5, 500)
    variants = [
        ("$\\epsilon_{low} = \\epsilon_{high} = 0.2$", {}, "-", BLUE),
        ("clip-higher $\\epsilon_{high} = 0.28$", {"epsilon_high": 0.28}, "--", ORANGE),
        ("two-sided, $\\delta = 2$", {"delta": 2.0}, ":", "#2ca02c"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    for ax, advantage in zip(axes, (1.0, -1.0)):
        for label, kwargs, style, color in variants:
            if advantage > 0 and "delta" in kwargs:
                continue  # delta only changes negative advantages
            if advantage < 0 and "epsilon_high" in kwargs:
                continue  # epsilon_high only changes positive advantages
            values, grads = [], []
            for ratio in ratios:
                logps = torch.log(ratio).reshape(1, 1).requires_grad_(True)  # (1, 1)
                loss, _ = policy_loss(
                    logps,
                    torch.zeros(1, 1),
                    torch.tensor([advantage]),
                    torch.ones(1, 1),
                    LossSettings(**kwargs),
                )
                loss.backward()
                values.append(-loss.item())  # the surrogate that training maximises
                grads.append(logps.grad.item())
            ax.plot(ratios, values, style, color=color, label=label)
            if not kwargs:
                flat = torch.tensor(grads) == 0
                ax.fill_between(
                    ratios, 0, 1, where=flat, color=GREY, alpha=0.15,
                    transform=ax.get_xaxis_transform(), label="zero gradient (clipped)",
                )  # fmt: skip
        ax.axvline(1.0, color="black", linewidth=0.6)
        ax.set_xlabel("ratio $\\rho = \\pi_\\theta(o_t) / \\pi_{old}(o_t)$")
        ax.set_title(f"advantage $A = {advantage:+.0f}$")
        ax.legend(fontsize=8, loc="upper left" if advantage > 0 else "lower left")
    axes[0].set_ylabel("$\\min(\\rho A, \\mathrm{clip}(\\rho, 1-\\epsilon, 1+\\epsilon) A)$")
    fig.suptitle("The clipped surrogate per token, computed by policy_loss")
    return _save(fig, "clipped_surrogate")


# ----------------------------------------------------------- (3) a short real training run


def _toy_run(steps: int, **config) -> list[dict]:
    """Trains the tiny model with LoRA on the one-digit-sum task; returns the per-step logs, each
    with `time`, the seconds since training started (measured at the end of the step)."""
    import time

    from toy_task import closeness, digit_sum_dataset, exact, lora_config, tiny_policy
    from transformers import TrainerCallback

    from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start, self.times = time.perf_counter(), {}

        def on_step_end(self, args, state, control, **kwargs):
            self.times[state.global_step] = time.perf_counter() - self.start

    clock = Clock()
    model, tokenizer = tiny_policy()
    with tempfile.TemporaryDirectory() as output_dir:
        args = GroupRelativeConfig(
            output_dir=output_dir,
            num_generations=8,
            max_completion_length=2,
            per_device_train_batch_size=64,  # 8 prompts x 8 completions per step
            learning_rate=1e-2,
            max_steps=steps,
            logging_steps=1,
            reward_weights=[1.0, 0.0],  # train on closeness; exact is only logged
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
            **config,
        )
        trainer = GroupRelativeTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=[closeness, exact],
            args=args,
            train_dataset=digit_sum_dataset(),
            peft_config=lora_config(),
            callbacks=[clock],
        )
        trainer.train()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    return [{**log, "time": clock.times[log["step"]]} for log in logs]


def _smooth(values: torch.Tensor, window: int = 5) -> tuple[int, torch.Tensor]:
    """Trailing mean over `window` values; returns the number of leading values it skips."""
    window = min(window, len(values))
    return window - 1, values.unfold(0, window, 1).mean(dim=1)


def reward_curve_figure(options) -> Path:
    """Reward and accuracy of a real GRPO run: the tiny model, LoRA, the one-digit-sum task."""
    logs = _toy_run(options.steps)
    steps = [log["step"] for log in logs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    panels = (
        (left, "rewards/closeness/mean", "reward trained on (closeness)", BLUE),
        (left, "rewards/exact/mean", "exact-answer accuracy (logged only)", ORANGE),
        (right, "frac_reward_zero_std", "groups with zero reward variance", GREY),
        (right, "entropy", "mean token entropy (nats)", "#9467bd"),
    )
    for ax, key, label, color in panels:
        values = torch.tensor([log[key] for log in logs])
        ax.plot(steps, values, color=color, alpha=0.3)
        skip, smooth = _smooth(values)
        ax.plot(steps[skip:], smooth, color=color, label=f"{label}, 5-step mean")
    for ax in (left, right):
        ax.set_xlabel("optimizer step (8 prompts x 8 completions)")
        ax.legend(fontsize=8, loc="upper left")
    left.set_ylim(0, 1)
    left.set_title("Reward of a real run: tiny random model, LoRA, CPU")
    right.set_title("The group collapses: no variance, no gradient")
    print(
        f"reward_curve: closeness {logs[0]['rewards/closeness/mean']:.2f} -> "
        f"{sum(log['rewards/closeness/mean'] for log in logs[-10:]) / min(10, len(logs)):.2f} "
        "(mean of the last 10 steps)"
    )
    return _save(fig, "reward_curve")


def dynamic_sampling_figure(options) -> Path:
    """The reward-curve run with and without dynamic sampling: how much of each trained batch
    carries a gradient, how many sampled groups were dropped, how many extra rounds it took.

    The logged reward is not compared: under dynamic sampling it is the reward of the groups
    selected for training, not the policy's average, so the two would not measure the same.
    """
    plain = _toy_run(options.steps)
    dynamic = _toy_run(options.steps, dynamic_sampling=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    for logs, name, color in ((plain, "plain", GREY), (dynamic, "dynamic_sampling=True", BLUE)):
        left.plot(
            [log["step"] for log in logs],
            [1 - log["frac_reward_zero_std"] for log in logs],
            color=color,
            label=name,
        )
    steps = [log["step"] for log in dynamic]
    right.plot(
        steps,
        [log["dynamic_sampling/filtered_fraction"] for log in dynamic],
        color=GREY,
        label="sampled groups dropped (zero variance)",
    )
    right.plot(
        steps,
        [log["dynamic_sampling/rounds"] / 4 for log in dynamic],
        color=ORANGE,
        label="extra sampling rounds / max_resample_rounds (4)",
    )
    for ax in (left, right):
        ax.set_ylim(-0.02, 1.05)
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=8, loc="center right")
    left.set_ylabel("fraction of the trained groups")
    left.set_title("Groups in the trained batch that have a gradient")
    right.set_title("What dynamic sampling did to get them")
    return _save(fig, "dynamic_sampling")


# ------------------------------------- figures from runs made elsewhere (added as they land)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise MissingInput(f"{path} does not exist")
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def heldout_accuracy_figure(options) -> Path:
    """Reward and held-out accuracy of the embedded default (`make train`), from its metrics.

    Reads `<default_run>/metrics.jsonl`, which `make train` writes: one JSON object per line
    with `step` and any of `reward` and keys containing `accuracy`. Run `make train` first.
    """
    records = _read_jsonl(Path(options.default_run) / "metrics.jsonl")
    fig, ax = plt.subplots(figsize=(7, 3.6))
    keys = sorted(
        {k for r in records for k in r if "accuracy" in k and not k.startswith("rewards/")}
    )  # held-out accuracies (the recipe writes `heldout/accuracy`), not training rewards
    for key in ["reward", *keys]:
        points = [(r["step"], r[key]) for r in records if key in r and "step" in r]
        if points:
            ax.plot(*zip(*points), marker="o" if key != "reward" else None, label=key)
    if not ax.lines:
        raise MissingInput(f"no step/reward/accuracy values in {options.default_run}")
    ax.set_xlabel("optimizer step")
    ax.legend(fontsize=8)
    ax.set_title("The embedded default: reward and held-out accuracy")
    return _save(fig, "heldout_accuracy")


def tiny_vlm_cpu_figure(options) -> Path:
    """Reward and sampled held-out accuracy of the offline vision-language preset
    (`recipes/configs/tiny_vlm_cpu.yaml`), from its `metrics.jsonl`, drawn as the recipe draws
    its own `reward_curve.png`. Run the preset first (its header gives the command)."""
    from trl_grpo_ext.evaluation import plot_training_curve

    metrics = Path(options.vlm_run) / "metrics.jsonl"
    _read_jsonl(metrics)  # MissingInput when the run has not been made
    path = IMG / "tiny_vlm_cpu.png"
    IMG.mkdir(exist_ok=True)
    label = "held-out accuracy (4 samples per picture)"
    if plot_training_curve(str(metrics), str(path), accuracy_label=label) is None:
        raise MissingInput(f"no reward or held-out accuracy in {metrics}")
    return path


def async_vs_sync_figure(options) -> Path:
    """The reward-curve run, synchronous and with asynchronous rollouts (max_staleness 1, 2).

    Reward against optimizer steps: what training on rollouts up to k steps old (with the
    default off-policy correction) does to learning. Speed is not plotted: wall-clock on a
    shared machine says little; `benchmarks/async.py` measures it under control.
    """
    runs = {
        "synchronous": {},
        "async, max_staleness=1": {"max_staleness": 1},
        "async, max_staleness=2": {"max_staleness": 2},
    }
    fig, ax = plt.subplots(figsize=(7, 3.8), layout="constrained")
    for (name, config), color in zip(runs.items(), (GREY, BLUE, ORANGE)):
        logs = _toy_run(options.steps, **config)
        rewards = torch.tensor([log["rewards/closeness/mean"] for log in logs])
        skip, smooth = _smooth(rewards)
        ax.plot([log["step"] for log in logs][skip:], smooth, color=color, label=name)
        staleness = sum(log.get("async/staleness", 0.0) for log in logs) / len(logs)
        print(f"async_vs_sync: {name}: mean staleness {staleness:.2f}, final {smooth[-1]:.2f}")
    ax.set_xlabel("optimizer step (8 prompts x 8 completions)")
    ax.set_ylabel("reward (closeness), 5-step mean")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Synchronous vs asynchronous rollouts, same task and seed")
    return _save(fig, "async_vs_sync")


FIGURES: dict[str, Callable] = {
    "group_advantages": group_advantages_figure,
    "clipped_surrogate": clipped_surrogate_figure,
    "reward_curve": reward_curve_figure,
    "heldout_accuracy": heldout_accuracy_figure,
    "async_vs_sync": async_vs_sync_figure,
    "dynamic_sampling": dynamic_sampling_figure,
    "tiny_vlm_cpu": tiny_vlm_cpu_figure,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(FIGURES)}; default: all")
    parser.add_argument("--steps", type=int, default=60, help="steps of each toy training run")
    parser.add_argument("--default-run", default="runs/tiny_cpu", help="folder of `make train`")
    parser.add_argument(
        "--vlm-run", default="runs/tiny_vlm_cpu", help="folder of the tiny_vlm_cpu.yaml preset"
    )
    options = parser.parse_args(argv)
    unknown = sorted(set(options.names) - set(FIGURES))
    if unknown:
        parser.error(f"unknown figures {unknown}; choose from {list(FIGURES)}")
    torch.manual_seed(0)
    for name in options.names or FIGURES:
        try:
            path = FIGURES[name](options)
        except MissingInput as missing:
            print(f"skipped {name}: {missing}")
        else:
            shown = path.relative_to(DOCS.parent) if path.is_relative_to(DOCS.parent) else path
            print(f"wrote {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
