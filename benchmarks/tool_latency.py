"""Tool latency hidden by asynchronous rollouts: training steps per second with a tool that waits.

    python benchmarks/tool_latency.py [--tool-seconds 0.2] [--rounds 5] [--steps 3] [--repeats 3]
    python benchmarks/tool_latency.py --modes sync "k=1" --steps 2 --repeats 1   # a quick look

Remote sandboxes, search tools and LLM judges cost wall-clock time, not this machine's CPU. Here
the tool is `add` (tests/agent_helpers.py) that sleeps `--tool-seconds` per call, and the model is
a small Qwen3 (`--hidden-size`, `--layers`) with Qwen3's chat template and a BPE tokenizer
(`bpe_tokenizer`: a call is 24 tokens, as Qwen3's tokenizer writes it; `--tokenizer bytes`, the
byte-level tiny tokenizer, makes it 72) overfit with supervised steps to a conversation of
`--rounds` calls in a row, each on the last one's result (`agent_helpers.chain_conversation`):
"Add 2 and 3, then add 4, then add 5." -> `add(2, 3)`, `add(5, 4)`, `add(9, 5)`, "It is 14.".
It is then trained with GRPO (LoRA r=16, temperature `--temperature`, `transformers` generation)
for `--warmup-steps` + `--steps` optimizer steps of `--num-prompts` x `--num-generations`
rollouts, rewarded 1 when the last message's last number is the sum. The calls of a round (one
per rollout) run at once, the rounds of a rollout one after the other: a step waits
`--rounds` x `--tool-seconds` for its tools. The same work, the same seeds, four ways:

- `sync`: synchronous, torch on one thread, the calls of a tool round all at once on threads
  (`tool_call_workers` = rollouts, opt-in);
- `k=1`: `max_staleness: 1`: the rollout worker (a process of its own, one thread) samples batch
  s + 1, its tool rounds included, while the trainer (one thread) trains on batch s;
- `tools in turn`: `sync` with the default `tool_call_workers: 1`: the sync tool runs on the
  training thread and every call of a batch waits for the one before, as in TRL;
- `sync, all cores`: `sync` with torch on every core (on a busy machine, threads that wait on
  each other can make it slower than one thread). The baseline ("vs sync") is the faster of the
  two synchronous rows.

Each run is a subprocess; modes alternate within each repeat. Prints, per mode, the median
seconds per optimizer step after the warm-up (steps/s is its inverse) over all runs, the ratio
of steps/s to the baseline, the reward (mean over measured steps and runs, and the spread of the
run means), the tool calls per step, where the trainer's time went (waiting for its rollouts:
generation and tools when synchronous, the worker's lag when asynchronous; the rest, training),
the seconds per step spent sampling and in tool rounds (on whichever thread runs them), the
multi-turn loop's own Python work per batch (parsing calls, rendering results: what could hold
the GIL against the trainer), and the share of tool-round seconds that fell outside the trainer's waits,
i.e. hidden behind training.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# mode -> (max_staleness, tool_call_workers: None = every rollout's calls at once, torch threads
# of the trainer: None = every core)
MODES = {
    "sync": (None, None, 1),
    "k=1": (1, None, 1),
    "tools in turn": (None, 1, 1),
    "sync, all cores": (None, None, None),
}
SYNC_MODES = ("sync", "sync, all cores")
# single tokens in Qwen3's vocabulary
QWEN3_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def slow_add(seconds: float):
    """`agent_helpers.add` that sleeps `seconds` first: the same name, signature and docstring,
    so the prompt renders the schema the model was overfit on."""
    from agent_helpers import add

    def slow(a: int, b: int) -> int:
        time.sleep(seconds)
        return a + b

    slow.__name__, slow.__qualname__, slow.__doc__ = add.__name__, add.__qualname__, add.__doc__
    return slow


def answer_reward(answer: str):
    """A reward: 1.0 when the last message is the model's and its last number is `answer`."""

    def reward(completions, **kwargs) -> list[float]:
        rewards = []
        for messages in completions:
            last = messages[-1] if messages else {}
            numbers = re.findall(r"-?\d+", last.get("content") or "")
            rewards.append(float(last.get("role") == "assistant" and numbers[-1:] == [answer]))
        return rewards

    reward.__name__ = "answer_reward"
    return reward


def bpe_tokenizer(rounds: int):
    """A BPE tokenizer with Qwen3's chat template, its merges learnt (within words, GPT-2's
    pre-tokenisation) from the conversation of `rounds` calls, and `<tool_call>` and the
    like as single tokens as in Qwen3's vocabulary: a call is 24 tokens, as Qwen3's
    own tokenizer writes it, instead of 72 bytes."""
    from agent_helpers import add, qwen3_tokenizer, tool_conversation
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from trl_grpo_ext.tiny import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

    byte_tokenizer = qwen3_tokenizer()
    prompt_ids, completion_ids, _ = tool_conversation(byte_tokenizer, [add], rounds)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    backend.train_from_iterator([byte_tokenizer.decode(prompt_ids + completion_ids)], trainer)
    backend.add_tokens([AddedToken(t, normalized=False) for t in QWEN3_ADDED])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
        model_max_length=4096,
    )
    tokenizer.chat_template = byte_tokenizer.chat_template
    return tokenizer


def tool_model_dir(
    hidden_size: int,
    layers: int,
    overfit_steps: int,
    learning_rate: float,
    cache: Path,
    rounds: int = 2,
    tokenizer: str = "bpe",
) -> str:
    """The tool-calling model, overfit once and cached: a Qwen3 of this shape (heads of 32, one
    key-value head) with the `tokenizer` ("bpe": `bpe_tokenizer`; "bytes": the byte-level tiny
    tokenizer with Qwen3's chat template), trained with supervised AdamW steps to write the turns
    of the conversation of `rounds` calls in a row (`agent_helpers.chain_conversation`). Fails
    when greedy decoding, given the conversation so far, would not write every one of its turns'
    tokens."""
    import torch
    from agent_helpers import add, overfit_on_tool_conversation, qwen3_tokenizer, tool_conversation

    from trl_grpo_ext.tiny import build_tiny_model

    name = f"{tokenizer}-h{hidden_size}-l{layers}-r{rounds}-s{overfit_steps}-lr{learning_rate:g}"
    folder = cache / name
    if (folder / "config.json").exists():
        return str(folder)
    tokenizer = bpe_tokenizer(rounds) if tokenizer == "bpe" else qwen3_tokenizer()
    model = build_tiny_model(
        tokenizer,
        seed=0,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=1,
        intermediate_size=4 * hidden_size,
    )
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        loss = overfit_on_tool_conversation(
            model, tokenizer, [add], overfit_steps, learning_rate, rounds
        )
    # every token the model writes (the turns, not the prompt or the results) is its argmax
    prompt_ids, completion_ids, pieces = tool_conversation(tokenizer, [add], rounds)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + completion_ids])).logits[0]
    position, wrong = len(prompt_ids), 0
    for index, piece in enumerate(pieces):
        if index % 2 == 0:  # a turn; token i is predicted at position i - 1
            predicted = logits[position - 1 : position + len(piece) - 1].argmax(-1)
            wrong += int((predicted != torch.tensor(piece)).sum())
        position += len(piece)
    if wrong:
        raise RuntimeError(
            f"The model did not learn the conversation ({wrong} tokens of its turns are not its "
            f"greedy choice; loss {loss:.3f} after {overfit_steps} steps): raise --overfit-steps."
        )
    print(f"overfit the tool-calling model in {time.perf_counter() - started:.0f} s", flush=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


class _Timers:
    """The wall-clock intervals spent in wrapped methods, per name (each name is entered by one
    thread at a time). A context manager: the methods are restored on exit."""

    def __init__(self):
        self.intervals: dict[str, list[tuple[float, float]]] = {}
        self._wrapped: list[tuple[object, str, object]] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        for owner, method, function in reversed(self._wrapped):
            setattr(owner, method, function)

    def wrap(self, owner, method: str, name: str) -> None:
        function = owner.__dict__[method]
        self._wrapped.append((owner, method, function))
        intervals = self.intervals.setdefault(name, [])

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                intervals.append((started, time.perf_counter()))

        setattr(owner, method, timed)

    def seconds(self) -> dict[str, float]:
        return {name: sum(b - a for a, b in spans) for name, spans in self.intervals.items()}


def overlap(spans: list[tuple[float, float]], others: list[tuple[float, float]]) -> float:
    """Seconds of `spans` that fall inside `others` (each list without overlaps of its own)."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in others)


def worker(spec: dict) -> dict:
    """One training run; per optimizer step: seconds, reward, tool calls, and the seconds the
    trainer waited for its rollouts."""
    import torch

    threads = torch.get_num_threads()
    try:
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        with _Timers() as timers:
            return _train(spec, timers)
    finally:
        torch.set_num_threads(threads)


def _train(spec: dict, timers: _Timers) -> dict:
    from agent_helpers import chain_conversation, tool_conversation
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback

    from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
    from trl_grpo_ext.generation.multi_turn import ToolLoop
    from trl_grpo_ext.generation.process_worker import ProcessEngine
    from trl_grpo_ext.generation.producer import RolloutProducer
    from trl_grpo_ext.generation.transformers_engine import TransformersEngine
    from trl_grpo_ext.tools.runner import ToolRunner

    # the trainer's thread: waiting for a batch (sampled now, or by the rollout worker)
    timers.wrap(RolloutProducer, "generate", "wait")
    # whoever samples (the trainer's thread, or the rollout worker's): engine and tool rounds
    timers.wrap(TransformersEngine, "generate", "generate")
    timers.wrap(ProcessEngine, "generate", "generate")
    timers.wrap(ToolRunner, "run", "tools")
    timers.wrap(ToolLoop, "run", "loop")  # the whole multi-turn loop of a batch
    rollouts = spec["num_prompts"] * spec["num_generations"]
    records = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.seen = time.perf_counter(), timers.seconds()

        def on_step_end(self, args, state, control, **kwargs):
            now, seen = time.perf_counter(), timers.seconds()
            spent = {k: v - self.seen.get(k, 0.0) for k, v in seen.items()}
            records.append({"seconds": now - self.last, "end": now, **spent})
            self.last, self.seen = now, seen

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    prompt, turns, _ = chain_conversation(spec["rounds"])
    tool = slow_add(spec["tool_seconds"])
    _, conversation_ids, _ = tool_conversation(tokenizer, [tool], spec["rounds"])
    max_staleness, workers, _ = MODES[spec["mode"]]
    args = GroupRelativeConfig(
        output_dir=spec["output_dir"],
        num_generations=spec["num_generations"],
        per_device_train_batch_size=rollouts,
        # the whole conversation (results included; 261 tokens for 2 rounds) and a stray turn
        max_completion_length=len(conversation_ids) + 64,
        max_prompt_length=None,  # the tool's schema is long in bytes
        temperature=spec["temperature"],
        learning_rate=1e-4,
        max_steps=spec["warmup_steps"] + spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=spec["seed"],
        use_cpu=True,
        max_staleness=max_staleness,
        tool_call_workers=workers or rollouts,
    )
    trainer = GroupRelativeTrainer(
        model=spec["model_dir"],
        reward_funcs=answer_reward(re.findall(r"\d+", turns[-1])[-1]),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": prompt}] * (args.max_steps * rollouts)),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"),
        tools=[tool],
        callbacks=[Clock()],
    )
    try:
        trainer.train()
    finally:
        trainer.rollouts.shutdown()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    if len(logs) != len(records):
        raise RuntimeError(f"{len(records)} steps timed but {len(logs)} logged")
    for record, log in zip(records, logs):
        record["reward"] = log["reward"]
        record["tool_calls"] = log.get("tools/call_frequency", 0.0) * rollouts
    # tool rounds after the warm-up, and how much of them the trainer spent waiting
    measured_from = records[spec["warmup_steps"] - 1]["end"] if spec["warmup_steps"] else 0.0
    measured = {
        name: [span for span in spans if span[0] >= measured_from]
        for name, spans in timers.intervals.items()
    }
    seconds = {name: sum(b - a for a, b in spans) for name, spans in measured.items()}
    return {
        "steps": records,
        "warmup_steps": spec["warmup_steps"],
        "tool_seconds": seconds["tools"],
        "tool_seconds_waited": overlap(measured["tools"], timers.intervals["wait"]),
        # the loops' own work: parsing calls, rendering results, padding (not sampling or tools),
        # of the loops that started after the warm-up, each net of the sampling and tool rounds
        # within it (a loop that started earlier is left out with all of its parts)
        "loop_python_seconds": sum(
            (b - a)
            - overlap(timers.intervals["generate"], [(a, b)])
            - overlap(timers.intervals["tools"], [(a, b)])
            for a, b in measured["loop"]
        ),
        "loops": len(measured["loop"]),
    }


def run(spec: dict, in_process: bool = False) -> dict:
    """`worker(spec)` in a fresh Python process (or, for a smoke test, in this one)."""
    if in_process:
        return worker(spec)
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{spec['mode']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict]) -> dict:
    """Median seconds per measured step over all runs; the mean reward, tool calls and time
    split of the measured steps; the spread (standard deviation) of the runs' mean rewards."""
    steps = [step for run in runs for step in run["steps"][run["warmup_steps"] :]]
    run_rewards = [
        statistics.fmean(step["reward"] for step in run["steps"][run["warmup_steps"] :])
        for run in runs
    ]

    def mean(key):
        return statistics.fmean(step.get(key, 0.0) for step in steps)

    seconds = statistics.median(step["seconds"] for step in steps)
    tool_seconds = sum(run["tool_seconds"] for run in runs)
    hidden = 1 - sum(run["tool_seconds_waited"] for run in runs) / tool_seconds
    return {
        "hidden": hidden if tool_seconds else float("nan"),
        # per batch sampled (under max_staleness the worker is a batch ahead of the trainer)
        "loop_python": sum(run["loop_python_seconds"] for run in runs)
        / max(1, sum(run["loops"] for run in runs)),
        "s_per_step": seconds,
        "steps_per_s": 1 / seconds,
        "reward": statistics.fmean(step["reward"] for step in steps),
        "reward_spread": statistics.pstdev(run_rewards),
        "tool_calls": mean("tool_calls"),
        "wait": mean("wait"),
        "train": mean("seconds") - mean("wait"),
        "generate": mean("generate"),
        "tools": mean("tools"),
        "measured_steps": len(steps),
    }


def overlap_bound(row: dict) -> float:
    """What `max_staleness: 1` could reach from a synchronous row's time split, were the worker's
    side (sampling and tool rounds) and the trainer's (training) each on a core of their own:
    (sampling + tools + training) / max(sampling + tools, training)."""
    worker_side = row["generate"] + row["tools"]
    return (worker_side + row["train"]) / max(worker_side, row["train"])


def table(results: dict[str, list[dict]]) -> str:
    """A Markdown table, one row per mode; "vs sync" is steps/s over the faster synchronous row."""
    rows = {mode: summarise(runs) for mode, runs in results.items()}
    synchronous = [rows[mode]["steps_per_s"] for mode in SYNC_MODES if mode in rows]
    base = max(synchronous) if synchronous else None
    lines = [
        "| mode | s/step (median) | steps/s | vs sync | reward (mean) | reward spread (runs) "
        "| tool calls/step | trainer waits s/step | trainer trains s/step | sampling s/step "
        "| tool rounds s/step | loop's Python s/batch | tool time hidden |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, row in rows.items():
        ratio = f"{row['steps_per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {mode} | {row['s_per_step']:.2f} | {row['steps_per_s']:.3f} | {ratio} "
            f"| {row['reward']:.3f} | {row['reward_spread']:.3f} | {row['tool_calls']:.1f} "
            f"| {row['wait']:.2f} | {row['train']:.2f} | {row['generate']:.2f} "
            f"| {row['tools']:.2f} | {row['loop_python']:.2f} | {row['hidden']:.0%} |"
        )
    if "sync" in rows:
        lines.append(f"\nbound of k=1 from the sync split: {overlap_bound(rows['sync']):.2f}x")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tool-seconds", type=float, default=0.2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=6, help="measured optimizer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating")
    parser.add_argument(
        "--rounds", type=int, default=5, help="tool calls in a row in the trained conversation"
    )
    parser.add_argument(
        "--tokenizer",
        default="bpe",
        choices=["bpe", "bytes"],
        help="a BPE tokenizer (a call: 24 tokens) or the byte-level one (72)",
    )
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--overfit-steps", type=int, default=100)
    parser.add_argument("--overfit-learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default=str(ROOT / ".cache" / "bench-tool-latency"))
    parser.add_argument("--json", help="also write the per-step records here")
    parser.add_argument("--in-process", action="store_true", help="no subprocesses (a smoke test)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        print(json.dumps(worker(json.loads(options.worker))))
        return {}
    cache = Path(options.cache)
    cache.mkdir(parents=True, exist_ok=True)
    model_dir = tool_model_dir(
        options.hidden_size,
        options.layers,
        options.overfit_steps,
        options.overfit_learning_rate,
        cache,
        options.rounds,
        options.tokenizer,
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"tool call {options.tool_seconds} s; {options.num_prompts} x {options.num_generations} "
        f"rollouts per step; {options.warmup_steps} + {options.steps} steps, {options.repeats} "
        f"repeat(s); {os.cpu_count()} cores, load average {load:.1f} at the start",
        flush=True,
    )
    results: dict[str, list[dict]] = {mode: [] for mode in options.modes}
    with tempfile.TemporaryDirectory() as output_dir:
        for repeat in range(options.repeats):
            for mode in options.modes:
                spec = {
                    "mode": mode,
                    "threads": MODES[mode][2],
                    "model_dir": model_dir,
                    "output_dir": os.path.join(output_dir, f"{mode}-{repeat}"),
                    **{
                        key: getattr(options, key)
                        for key in (
                            "tool_seconds",
                            "steps",
                            "warmup_steps",
                            "num_prompts",
                            "num_generations",
                            "temperature",
                            "seed",
                            "rounds",
                        )
                    },
                }
                started = time.perf_counter()
                result = run(spec, options.in_process)
                results[mode].append(result)
                measured = [s["seconds"] for s in result["steps"][result["warmup_steps"] :]]
                print(
                    f"  repeat {repeat + 1}/{options.repeats} {mode:>14}: "
                    f"{time.perf_counter() - started:5.1f} s in all, steps "
                    + " ".join(f"{s:.2f}" for s in measured),
                    flush=True,
                )
    end_load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average {end_load:.1f} at the end")
    print(table(results), flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
