"""Time of the tool calls of a multi-turn batch: ours against trl.GRPOTrainer, side by side.

    python benchmarks/tools.py [--tool-seconds 0.2] [--rollouts 4 8 16] [--repeats 3]
    python benchmarks/tools.py --modes default threads trl --rollouts 8 --repeats 1  # a quick look

Both trainers sample one batch of `--rollouts` conversational rollouts (2 prompts, G = rollouts
/ 2) whose model writes one call of a tool that waits `--tool-seconds`, then an answer. The
model's turns are scripted (the same token ids for both: the tiny tokenizer with Qwen3's chat
template), so what is timed is everything around them: parsing the calls, running the tools,
rendering the results and continuing. The modes (`--modes`, all by default):

- `default`: ours with the default `tool_call_workers: 1` and a sync tool (`time.sleep`): the
  calls run on the training thread one after another, as TRL runs them;
- `async`: ours, default settings, the same tool as `async def` (`asyncio.sleep`): the calls of
  different rollouts overlap on the event loop;
- `threads`: ours with the sync tool and `tool_call_workers` = rollouts (threads, opt-in);
- `trl`: trl.GRPOTrainer with the sync tool, each rollout's calls in turn;
- `trl async`: trl.GRPOTrainer with the async tool, which it awaits rollout by rollout.

Prints the median seconds per batch of each mode, and TRL's time over ours for the sync tool
(`trl` / `threads`) and the async one (`trl async` / `async`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def slow_add_tool(seconds: float):
    def add(a: int, b: int) -> int:
        """Adds two integers, slowly.

        Args:
            a: The first integer.
            b: The second integer.
        """
        time.sleep(seconds)
        return a + b

    return add


def slow_async_add_tool(seconds: float):
    async def add(a: int, b: int) -> int:
        """Adds two integers, slowly.

        Args:
            a: The first integer.
            b: The second integer.
        """
        await asyncio.sleep(seconds)
        return a + b

    return add


def scripted_turns(tokenizer):
    from agent_helpers import call, encode

    call_ids = encode(tokenizer, call("add", a=2, b=3))
    answer_ids = encode(tokenizer, "It is 5.")
    marker = tokenizer("<tool_response>", add_special_tokens=False)["input_ids"]

    def turn(context: list[int]) -> list[int]:
        n = len(marker)
        seen = any(context[i : i + n] == marker for i in range(len(context) - n + 1))
        return answer_ids if seen else call_ids

    return turn


def ours(rollouts: int, tool, workers: int, output_dir: str):
    """`workers`: `tool_call_workers`."""
    from agent_helpers import ScriptedEngine, qwen3_tokenizer
    from datasets import Dataset

    from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
    from trl_grpo_ext.tiny import build_tiny_model

    tokenizer = qwen3_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": f"{a} + 3?"}]} for a in range(2)]
    args = GroupRelativeConfig(
        output_dir=output_dir,
        num_generations=rollouts // 2,
        per_device_train_batch_size=rollouts,
        max_completion_length=256,
        max_prompt_length=None,
        tool_call_workers=workers,
        report_to="none",
        use_cpu=True,
    )
    trainer = GroupRelativeTrainer(
        model=build_tiny_model(tokenizer, seed=0),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        tools=[tool],
    )
    trainer.rollouts.engine = ScriptedEngine(scripted_turns(tokenizer))
    return lambda: trainer.generate_rollouts(rows)


def trl_side(rollouts: int, tool, output_dir: str):
    import torch
    import trl
    from agent_helpers import qwen3_tokenizer
    from datasets import Dataset

    from trl_grpo_ext.tiny import build_tiny_model

    tokenizer = qwen3_tokenizer()
    prompts = [[{"role": "user", "content": f"{a} + 3?"}] for a in range(2)]
    args = trl.GRPOConfig(
        output_dir=output_dir,
        num_generations=rollouts // 2,
        per_device_train_batch_size=rollouts,
        max_completion_length=256,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    trainer = trl.GRPOTrainer(
        model=build_tiny_model(tokenizer, seed=0),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=tokenizer,
        tools=[tool],
    )
    turn = scripted_turns(tokenizer)

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, **kwargs):
        completions = [turn(list(ids)) for ids in prompt_ids]
        return completions, [[0.0] * len(ids) for ids in completions]

    trainer._generate_single_turn = single_turn
    inputs = [p for p in prompts for _ in range(rollouts // 2)]
    is_async = asyncio.iscoroutinefunction(tool)
    trainer._sync_tool_dicts = [{} if is_async else {tool.__name__: tool} for _ in inputs]
    trainer._async_tool_dicts = [{tool.__name__: tool} if is_async else {} for _ in inputs]

    def sample():
        with torch.no_grad():
            return trainer._generate(inputs)

    return sample


def timed(sample, repeats: int) -> float:
    sample()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


MODES = ("default", "async", "threads", "trl", "trl async")


def sampler(mode: str, rollouts: int, seconds: float, output_dir: str):
    sync_tool, async_tool = slow_add_tool(seconds), slow_async_add_tool(seconds)
    if mode == "default":
        return ours(rollouts, sync_tool, 1, output_dir)
    if mode == "async":
        return ours(rollouts, async_tool, 1, output_dir)
    if mode == "threads":
        return ours(rollouts, sync_tool, rollouts, output_dir)
    return trl_side(rollouts, async_tool if mode == "trl async" else sync_tool, output_dir)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tool-seconds", type=float, default=0.2)
    parser.add_argument("--rollouts", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    options = parser.parse_args(argv)
    modes = [mode for mode in MODES if mode in options.modes]
    ratios = [(a, b) for a, b in (("trl", "threads"), ("trl async", "async")) if {a, b} <= {*modes}]
    report = {}
    print(f"tool call: {options.tool_seconds} s; median seconds per batch of {options.repeats}")
    header = ["rollouts", *modes, *(f"{a} / {b}" for a, b in ratios)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as folder:
        for rollouts in options.rollouts:
            row = {
                mode: timed(sampler(mode, rollouts, options.tool_seconds, folder), options.repeats)
                for mode in modes
            }
            report[rollouts] = row
            cells = [f"{row[mode]:.3f}" for mode in modes]
            cells += [f"{row[a] / row[b]:.1f}" for a, b in ratios]
            print(f"| {rollouts} | " + " | ".join(cells) + " |")
    return report


if __name__ == "__main__":
    main()
