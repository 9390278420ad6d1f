r"""One evaluation harness for math: greedy pass@1 and sampled pass@k with `math_accuracy`.

The recipe (before and after training, and every N steps) and `recipes/eval_math.py` call the
same functions, so their numbers are comparable. Every report carries what makes numbers
comparable: the number of problems, the token cap and the sampling settings.

Two accuracies per completion:

- **lenient** (the answer is right): `math_accuracy` on the completion; its final answer is the
  last `\boxed{}`, else what follows `####`, else the last number or expression at the end;
- **strict** (the format is followed too): lenient, and the final answer is in a `\boxed{}` after
  the reasoning, and the completion ended (end-of-sequence) within the token cap, and, when a
  format reward is given (e.g. the `<think>` format of the training run), that reward is 1.

pass@k uses the unbiased estimator of Chen et al. (2021), `1 - C(n - c, k) / C(n, k)` for `n`
samples of which `c` are right, averaged over problems.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers import TrainerCallback

from .generation import sampling_config
from .generation.images import text_tokenizer
from .rewards import math_accuracy
from .rewards._convention import completion_text
from .rewards._verify import boxed_answers
from .tools.results import is_failure


@dataclass
class EvalReport:
    """Accuracies of one model on one set of problems, with the settings that produced them."""

    num_problems: int
    max_new_tokens: int
    greedy_strict: float | None = None
    greedy_lenient: float | None = None
    num_samples: int = 0
    temperature: float | None = None
    pass_at_k: dict[str, float] = field(default_factory=dict)  # "pass@1" -> lenient value
    pass_at_k_strict: dict[str, float] = field(default_factory=dict)
    mean_completion_tokens: float | None = None
    truncated_fraction: float | None = None
    # With tools: the share of greedy completions that called one, and of calls that failed.
    tool_call_rate: float | None = None
    tool_error_rate: float | None = None
    samples: list[dict] = field(default_factory=list)  # a few greedy completions to read

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        parts = [f"{self.num_problems} problems, at most {self.max_new_tokens} new tokens"]
        if self.greedy_lenient is not None:
            parts.append(
                f"greedy pass@1 strict {self.greedy_strict:.1%}, lenient {self.greedy_lenient:.1%}"
            )
        for name, value in self.pass_at_k.items():
            strict = self.pass_at_k_strict[name]
            parts.append(
                f"{name} (n={self.num_samples}, T={self.temperature}) strict {strict:.1%}, "
                f"lenient {value:.1%}"
            )
        if self.tool_call_rate is not None:
            errors = "-" if self.tool_error_rate is None else f"{self.tool_error_rate:.1%}"
            parts.append(f"tool called in {self.tool_call_rate:.1%}, calls failed {errors}")
        return "; ".join(parts)


def transcript(completion) -> str:
    """A completion as text to read: itself, or a multi-turn one's messages, each tool call and
    result on lines of its own (`[call name] {arguments}`, `[name] result`)."""
    if isinstance(completion, str):
        return completion
    lines = []
    for message in completion:
        if message.get("role") == "tool":
            lines.append(f"[{message.get('name', 'tool')}] {completion_text([message])}")
            continue
        if message.get("content"):
            lines.append(completion_text([message]))
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            lines.append(f"[call {function.get('name')}] {json.dumps(function.get('arguments'))}")
    return "\n".join(lines)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem: the chance that k of the n samples include a right one."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def has_boxed_final_answer(text: str) -> bool:
    r"""Whether the answer section (after the last `</think>`) holds a complete `\boxed{}`."""
    return bool(boxed_answers(text.rsplit("</think>", 1)[-1]))


def score_completions(
    completions: list[str],
    answers: list[str],
    format_reward: Callable | None = None,
    truncated: list[bool] | None = None,
    accuracy: Callable | None = None,
    columns: dict[str, list] | None = None,
) -> tuple[list[float], list[float]]:
    """`(strict, lenient)` scores, 0.0 or 1.0, one per completion (a string, or the messages of
    a multi-turn one, whose last message holds the answer); `truncated` marks completions cut at
    the token cap (never strict). `accuracy`, when given, scores in place of `math_accuracy` and
    its boxed-answer check: a reward function in TRL's convention (e.g. an environment's), called
    with the completions, `answer` and the dataset's other `columns`; its value (None as 0) is
    the lenient score."""
    if accuracy is not None:
        scores = accuracy(completions=completions, answer=answers, **(columns or {}))
        lenient = [float(score or 0.0) for score in scores]
        formatted = [True] * len(completions)
    else:
        lenient = [
            float(score or 0.0) for score in math_accuracy(completions=completions, answer=answers)
        ]
        formatted = [has_boxed_final_answer(completion_text(c)) for c in completions]
    if truncated is not None:
        formatted = [ok and not cut for ok, cut in zip(formatted, truncated)]
    if format_reward is not None:
        format_scores = format_reward(completions=completions, answer=answers)
        formatted = [ok and (score or 0.0) >= 1.0 for ok, score in zip(formatted, format_scores)]
    strict = [score if ok else 0.0 for score, ok in zip(lenient, formatted)]
    return strict, lenient


class BareModel:
    """A model that samples alone, outside any trainer, as `generate`'s and `problem_scores`'
    `trainer`: its producer (`RolloutProducer.for_model`, whose keyword arguments it takes:
    through the tools of `agent` when given) and that producer's own `generate` as
    `generate_rollouts`. E.g. a tool-trained adapter evaluated with its tools:
    `problem_scores(model, tokenizer, rows, trainer=BareModel(model, tokenizer, agent=Agent(tools)))`."""

    def __init__(self, model, tokenizer, **for_model_kwargs):
        from .generation.producer import RolloutProducer

        self.rollouts = RolloutProducer.for_model(model, tokenizer, **for_model_kwargs)

    @torch.no_grad()
    def generate_rollouts(self, rows: list[dict]):
        return self.rollouts.generate(rows, 0)


def generate(
    model,
    tokenizer,
    prompts: list,
    *,
    max_new_tokens: int,
    num_samples: int = 1,
    temperature: float | None = None,
    top_p: float = 1.0,
    batch_size: int = 64,
    chat_template_kwargs: dict | None = None,
    engine=None,
    trainer=None,
    rows: list[dict] | None = None,
) -> tuple[list[list], list[list[int]], list[list[bool]]]:
    """Completions for each prompt: greedy when `temperature` is None, else `num_samples`
    sampled ones (no top-k or min-p filter, whatever the checkpoint's `generation_config`
    says), sampled through the public override point `generate_rollouts(rows)` inside the
    producer's `evaluating` block, so they are rendered, sampled, cut and counted as training
    rollouts are, and a subclass's override of `generate_rollouts` applies to them.

    `trainer` (any object with `rollouts`, a `RolloutProducer`, and `generate_rollouts`, e.g. a
    `GroupRelativeTrainer` or a subclass of it) samples with its engine at its current weights
    and its tools and environments, if any: each completion is then the list of messages reward
    functions get (the model's turns and the tools' results; the last one holds the answer),
    its token count includes the results, and `rows` (the dataset's rows, default
    `{"prompt": ...}`) reset the environments and give the prompts' images, if any. Without one,
    `model` alone samples (`RolloutProducer.for_model`, whose `generate_rollouts` is its own
    `generate`), by `engine` when given (`generation.engines`), else by its own `generate`, in
    eval mode, with prompts rendered with `chat_template_kwargs`.
    Returns `(completions, token_counts, truncated)`, each `[prompt][sample]`."""
    if trainer is None:
        trainer = BareModel(
            model, tokenizer, chat_template_kwargs=chat_template_kwargs, engine=engine
        )
    producer, generate_rollouts = trainer.rollouts, trainer.generate_rollouts
    greedy = temperature is None
    config = sampling_config(
        max_new_tokens=max_new_tokens,
        eos_token_id=producer.eos_token_ids,
        pad_token_id=text_tokenizer(tokenizer).pad_token_id,
        num_return_sequences=1 if greedy else num_samples,
        greedy=greedy,
        temperature=1.0 if greedy else temperature,
        top_p=top_p,
    )
    samples = config.num_return_sequences
    rows = rows or [{"prompt": prompt} for prompt in prompts]
    outputs, counts, truncated = [], [], []
    step = max(1, batch_size // samples)
    for start in range(0, len(rows), step):
        with producer.evaluating(config):
            rollout = generate_rollouts(rows[start : start + step])
        lengths = rollout.completion_mask.sum(dim=1).tolist()  # (N,)
        cut = rollout.is_truncated.tolist()
        for row in range(0, len(rollout), samples):
            outputs.append(rollout.completions[row : row + samples])
            counts.append(lengths[row : row + samples])
            truncated.append(cut[row : row + samples])
    return outputs, counts, truncated


def problem_scores(
    model,
    tokenizer,
    dataset,
    *,
    max_new_tokens: int = 512,
    greedy: bool = True,
    num_samples: int = 0,
    temperature: float = 0.7,
    top_p: float = 1.0,
    batch_size: int = 64,
    format_reward: Callable | None = None,
    chat_template_kwargs: dict | None = None,
    engine=None,
    trainer=None,
    accuracy: Callable | None = None,
) -> list[dict]:
    """Per-problem results: greedy strict/lenient scores and completion, number of right samples
    (strict, lenient), completion token counts and truncations, and with a `trainer` that has
    tools (see `generate`) the greedy completion's tool calls and failed calls. `summarize` turns them into
    an `EvalReport`; keeping them per problem lets processes evaluate shards and merge.
    `accuracy` scores in place of `math_accuracy` (see `score_completions`), given the
    dataset's columns."""
    prompts, answers = list(dataset["prompt"]), [str(a) for a in dataset["answer"]]
    columns = {  # the accuracy function's keyword arguments besides completions and answer
        ("prompts" if name == "prompt" else name): list(dataset[name])
        for name in (dataset.column_names if accuracy is not None else [])
        if name != "answer"
    }
    with_tools = trainer is not None and trainer.rollouts.tool_loop is not None
    sampling = dict(
        batch_size=batch_size,
        chat_template_kwargs=chat_template_kwargs,
        engine=engine,
        trainer=trainer,
        rows=list(dataset) if trainer is not None else None,  # decoded: images as PIL images
    )
    records = [
        {"prompt": prompt, "answer": answer, "tokens": [], "truncated": []}
        for prompt, answer in zip(prompts, answers)
    ]
    if greedy:
        outputs, counts, cut = generate(
            model,
            tokenizer,
            prompts,
            max_new_tokens=max_new_tokens,
            **sampling,
        )
        completions = [group[0] for group in outputs]
        strict, lenient = score_completions(
            completions,
            answers,
            format_reward,
            [group[0] for group in cut],
            accuracy,
            columns,
        )
        for i, record in enumerate(records):
            record.update(completion=completions[i], strict=strict[i], lenient=lenient[i])
            record["tokens"] += counts[i]
            record["truncated"] += cut[i]
            if with_tools:
                results = [m for m in completions[i] if m.get("role") == "tool"]
                record.update(calls=len(results), failed=sum(map(is_failure, results)))
    if num_samples:
        outputs, counts, cut = generate(
            model,
            tokenizer,
            prompts,
            max_new_tokens=max_new_tokens,
            num_samples=num_samples,
            temperature=temperature,
            top_p=top_p,
            **sampling,
        )
        flat = [text for group in outputs for text in group]
        strict, lenient = score_completions(
            flat,
            [a for a in answers for _ in range(num_samples)],
            format_reward,
            [flag for group in cut for flag in group],
            accuracy,
            {
                name: [value for value in values for _ in range(num_samples)]
                for name, values in columns.items()
            },
        )
        for i, record in enumerate(records):
            group = slice(i * num_samples, (i + 1) * num_samples)
            record.update(right_strict=int(sum(strict[group])), right=int(sum(lenient[group])))
            record["tokens"] += counts[i]
            record["truncated"] += cut[i]
    return records


def summarize(
    records: list[dict],
    *,
    max_new_tokens: int,
    num_samples: int = 0,
    k_values: tuple[int, ...] = (1,),
    temperature: float | None = None,
    num_examples: int = 3,
) -> EvalReport:
    """An `EvalReport` from the records of `problem_scores` (of one or several processes)."""
    count = max(len(records), 1)
    report = EvalReport(num_problems=len(records), max_new_tokens=max_new_tokens)
    if records and "lenient" in records[0]:
        report.greedy_strict = sum(r["strict"] for r in records) / count
        report.greedy_lenient = sum(r["lenient"] for r in records) / count
        report.samples = [
            {
                "prompt": completion_text(r["prompt"])
                if not isinstance(r["prompt"], str)
                else r["prompt"],
                "answer": r["answer"],
                "completion": transcript(r["completion"]),
                "correct": bool(r["lenient"]),
            }
            for r in records[:num_examples]
        ]
        if "calls" in records[0]:
            calls = sum(r["calls"] for r in records)
            report.tool_call_rate = sum(r["calls"] > 0 for r in records) / count
            report.tool_error_rate = sum(r["failed"] for r in records) / calls if calls else None
    if num_samples and records and "right" in records[0]:
        if max(k_values) > num_samples:
            raise ValueError(f"pass@k needs k <= num_samples; got k={k_values}, n={num_samples}.")
        report.num_samples, report.temperature = num_samples, temperature
        for k in k_values:
            report.pass_at_k[f"pass@{k}"] = (
                sum(pass_at_k(num_samples, r["right"], k) for r in records) / count
            )
            report.pass_at_k_strict[f"pass@{k}"] = (
                sum(pass_at_k(num_samples, r["right_strict"], k) for r in records) / count
            )
    tokens = [n for r in records for n in r["tokens"]]
    truncated = [t for r in records for t in r["truncated"]]
    if tokens:
        report.mean_completion_tokens = sum(tokens) / len(tokens)
        report.truncated_fraction = sum(truncated) / len(truncated)
    return report


def evaluate_math(
    model,
    tokenizer,
    dataset,
    *,
    max_new_tokens: int = 512,
    greedy: bool = True,
    num_samples: int = 0,
    k_values: tuple[int, ...] = (1,),
    temperature: float = 0.7,
    top_p: float = 1.0,
    batch_size: int = 64,
    format_reward: Callable | None = None,
    num_examples: int = 3,
    chat_template_kwargs: dict | None = None,
    engine=None,
    accuracy: Callable | None = None,
) -> EvalReport:
    """Greedy pass@1 and/or sampled pass@k of `model` on `dataset` (`prompt` and `answer`).

    Args:
        max_new_tokens (`int`): the token cap of every completion (reported).
        greedy (`bool`): compute greedy pass@1 (strict and lenient).
        num_samples (`int`): samples per problem for pass@k; 0 skips sampling.
        k_values (`tuple[int]`): the k of pass@k; each must be at most `num_samples`.
        temperature, top_p (`float`): sampling settings of pass@k.
        format_reward (callable, *optional*): a reward that must be 1 for "strict".
        num_examples (`int`): greedy completions kept in the report to read.
        chat_template_kwargs (`dict`, *optional*): as the training run's (e.g. Qwen3's
            `{"enable_thinking": False}`), so prompts are rendered the same way.
        engine (*optional*): samples the completions (`generation.engines`); by default
            `model`'s own `generate`.
        accuracy (callable, *optional*): a reward function in TRL's convention that scores in
            place of `math_accuracy`, given the dataset's columns (e.g. an environment's reward:
            reasoning-gym's `score_answer`); see `score_completions`.
    """
    if num_samples and max(k_values) > num_samples:
        raise ValueError(f"pass@k needs k <= num_samples; got k={k_values}, n={num_samples}.")
    records = problem_scores(
        model,
        tokenizer,
        dataset,
        max_new_tokens=max_new_tokens,
        greedy=greedy,
        num_samples=num_samples,
        temperature=temperature,
        top_p=top_p,
        batch_size=batch_size,
        format_reward=format_reward,
        chat_template_kwargs=chat_template_kwargs,
        engine=engine,
        accuracy=accuracy,
    )
    return summarize(
        records,
        max_new_tokens=max_new_tokens,
        num_samples=num_samples,
        k_values=k_values,
        temperature=temperature,
        num_examples=num_examples,
    )


def evaluate_on_processes(trainer, dataset, *, k_values=(1,), num_examples=3, **kwargs):
    """`evaluate_math` with the trainer's model, each process taking a shard of the problems;
    every process gets the same report, and every process must call it. Completions come from
    the trainer's `generate_rollouts` (a subclass's override included) with its current
    weights: its engine,
    transformers (under DeepSpeed ZeRO-3 with the weights gathered, under FSDP sharded) or vLLM,
    through the trainer's tools and environments when it has some, with the dataset's images
    when it has some (a vision-language model's trainer).
    Before training, the model is first moved to the accelerator's device: under DeepSpeed and
    FSDP the Trainer leaves it where it was loaded (the CPU) until `train()`."""
    model = place_on_device(trainer)
    return evaluate_sharded(
        model,
        trainer.processing_class,
        dataset,
        trainer=trainer,
        k_values=k_values,
        num_examples=num_examples,
        **kwargs,
    )


def place_on_device(trainer):
    """The trainer's model, unwrapped, moved to the accelerator's device unless it is already
    there or its weights are sharded (DeepSpeed ZeRO-3 partitions, FSDP's DTensors), where the
    engine gathers or shards them. Under DDP or one device the Trainer has placed it already."""
    from torch.distributed.tensor import DTensor

    accelerator = trainer.accelerator
    model = accelerator.unwrap_model(trainer.model)
    parameters = list(model.parameters())
    sharded = any(hasattr(p, "ds_id") or isinstance(p, DTensor) for p in parameters)
    device = accelerator.device
    if parameters and not sharded and parameters[0].device.type != device.type:
        model.to(device)
    return model


def shard_indices(num_problems: int, process_index: int, num_processes: int) -> list[int]:
    """This process's problems: every `num_processes`-th, padded with repeats to the same count
    on every process, so that all processes make the same number of `generate` calls (under
    ZeRO-3 and FSDP each is a collective; a process with one call fewer would leave the others
    waiting forever). `unpad` drops the repeats from the gathered records."""
    indices = list(range(process_index, num_problems, num_processes))
    per_process = -(-num_problems // num_processes)
    return indices + [indices[0] if indices else 0] * (per_process - len(indices))


def unpad(records: list, num_problems: int, num_processes: int) -> list:
    """The gathered records (`per_process` of each process, in process order) without the
    repeats that `shard_indices` added."""
    per_process = -(-num_problems // num_processes)
    kept = []
    for rank in range(num_processes):
        real = len(range(rank, num_problems, num_processes))
        kept += records[rank * per_process : rank * per_process + real]
    return kept


def evaluate_sharded(model, tokenizer, dataset, *, k_values=(1,), num_examples=3, **kwargs):
    """`evaluate_math` with the problems split across the processes and the records gathered:
    the same report on every process, and the same number of `generate` calls on each, so that
    sharded weights (ZeRO-3, FSDP), whose forward passes are collectives, work. Every process
    must call it. One process: `evaluate_math`."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    state = PartialState()
    world = state.num_processes
    indices = shard_indices(len(dataset), state.process_index, world)
    records = problem_scores(model, tokenizer, dataset.select(indices), **kwargs)
    if world > 1:
        records = unpad(gather_object(records), len(dataset), world)
    return summarize(
        records,
        max_new_tokens=kwargs.get("max_new_tokens", 512),
        num_samples=kwargs.get("num_samples", 0),
        k_values=k_values,
        temperature=kwargs.get("temperature"),
        num_examples=num_examples,
    )


def load_model_for_eval(base_model: str, adapter: str | None = None, **model_kwargs):
    """`(model, tokenizer)`: a base model (hub id or folder), plus a LoRA adapter from a local
    folder or a Hub repository when `adapter` is given. The tokenizer comes from the adapter
    when it holds one (it may add tokens), else from the base model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_model, **model_kwargs)
    tokenizer_source = base_model
    if adapter is not None:
        from peft import PeftModel

        from .generation.engines import without_checkpointing_alias_warning

        with without_checkpointing_alias_warning():  # PeftModel reads the deprecated alias
            model = PeftModel.from_pretrained(model, adapter)
        if os.path.exists(os.path.join(adapter, "tokenizer_config.json")):
            tokenizer_source = adapter
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


class PeriodicEvalCallback(TrainerCallback):
    """Greedy held-out accuracy every `eval_every` optimizer steps; keeps the best adapter.

    Each result is one JSON line in `metrics_path` (`step`, `heldout/accuracy`,
    `heldout/accuracy_strict`, `heldout/label`). When a periodic result beats every earlier one,
    the model (the adapter under LoRA) is saved to `best_dir`: published GRPO runs often peak and
    then decline, and the best checkpoint is the one to keep. `history` holds
    `(step, strict, lenient)`.

    Every process evaluates a shard of the problems (`evaluate_sharded`) and every process
    saves: under DeepSpeed ZeRO-3 and FSDP the weights are sharded, and generating with them or
    saving them needs all processes. The main process alone writes the files.

    `trainer`, when given, returns the trainer to sample with (`lambda: trainer`, as the
    callback is built before it): its `generate_rollouts` (a subclass's override included), its
    engine, which gathers ZeRO-3 weights, and its tools, as in training (see `generate`); else
    the model's own `generate`. `save_model`, when given, saves the best model to a folder and is
    called on every process (the trainer's `save_model`, which gathers sharded weights); else
    the main process calls the model's `save_pretrained`. `skip_last_step` leaves out the
    evaluation at the run's last step, for a caller that evaluates (and `record`s) the final
    weights after training anyway, as the recipe does. `accuracy` scores in place of
    `math_accuracy` (see `score_completions`).
    """

    def __init__(
        self,
        tokenizer,
        dataset,
        *,
        eval_every: int,
        max_new_tokens: int,
        metrics_path: str | None = None,
        best_dir: str | None = None,
        format_reward: Callable | None = None,
        batch_size: int = 64,
        trainer: Callable | None = None,
        save_model: Callable[[str], None] | None = None,
        skip_last_step: bool = False,
        accuracy: Callable | None = None,
    ):
        self.tokenizer, self.dataset, self.trainer = tokenizer, dataset, trainer
        self.save_model, self.skip_last_step = save_model, skip_last_step
        self.eval_every, self.max_new_tokens = eval_every, max_new_tokens
        self.metrics_path, self.best_dir = metrics_path, best_dir
        self.format_reward, self.batch_size = format_reward, batch_size
        self.accuracy = accuracy
        self.history: list[tuple[int, float, float]] = []
        self.best: tuple[int, float] | None = None

    def record(self, step: int, report: EvalReport, model=None, label: str = "periodic") -> None:
        """Adds one result to the history and the JSONL file; saves `model` if it is the best.
        `label` says which evaluation it was ("before", "periodic", "after"). Call it on every
        process, with the same report (the saving may be a collective)."""
        from accelerate import PartialState

        is_main = PartialState().is_main_process
        self.history.append((step, report.greedy_strict, report.greedy_lenient))
        if self.metrics_path and is_main:
            append_jsonl(
                self.metrics_path,
                {
                    "step": step,
                    "heldout/accuracy": report.greedy_lenient,
                    "heldout/accuracy_strict": report.greedy_strict,
                    "heldout/label": label,
                },
            )
        if model is None or not self.best_dir:
            return
        if self.best is not None and report.greedy_lenient <= self.best[1]:
            return
        self.best = (step, report.greedy_lenient)
        if self.save_model is not None:
            self.save_model(self.best_dir)
        elif is_main:
            model.save_pretrained(self.best_dir)
        if is_main:
            self.tokenizer.save_pretrained(self.best_dir)
            append_jsonl(
                os.path.join(self.best_dir, "best.jsonl"),
                {"step": step, "heldout/accuracy": report.greedy_lenient},
            )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.eval_every or state.global_step % self.eval_every or model is None:
            return control
        if self.skip_last_step and state.global_step >= state.max_steps:
            return control
        report = evaluate_sharded(
            model,
            self.tokenizer,
            self.dataset,
            max_new_tokens=self.max_new_tokens,
            format_reward=self.format_reward,
            batch_size=self.batch_size,
            num_examples=0,
            chat_template_kwargs=args.chat_template_kwargs,
            trainer=self.trainer() if self.trainer else None,
            accuracy=self.accuracy,
        )
        self.record(state.global_step, report, model=model)
        return control


class MetricsJsonlCallback(TrainerCallback):
    """Appends every training log (reward, loss, ...) as one JSON line with its step."""

    def __init__(self, path: str):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and state.is_world_process_zero:
            append_jsonl(self.path, {"step": state.global_step, **logs})
        return control


def append_jsonl(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def set_aside(path: str) -> str:
    """Renames `path` (`metrics.jsonl`) to the first free `metrics.<n>.jsonl` beside it, so a
    new run never overwrites an earlier run's log; returns the new path."""
    stem, extension = os.path.splitext(path)
    number = 1
    while os.path.exists(f"{stem}.{number}{extension}"):
        number += 1
    os.rename(path, f"{stem}.{number}{extension}")
    return f"{stem}.{number}{extension}"


def keep_records_up_to(path: str, step: int) -> str | None:
    """For a run resumed from the checkpoint of `step`: sets the log aside (`set_aside`) and
    starts `path` anew with its records of steps up to `step` (the later ones are trained again,
    and logged again), without the before and after evaluations (the resumed run records them).
    Returns where the full log was kept."""
    if not os.path.exists(path):
        return None
    records = read_jsonl(path)
    kept = set_aside(path)
    for record in records:
        if record.get("step", 0) <= step and record.get("heldout/label") not in ("before", "after"):
            append_jsonl(path, record)
    return kept


# ------------------------------------------------------------------------- reports


def before_after_table(before: EvalReport, after: EvalReport, boxed: bool = True) -> str:
    """A markdown table of the held-out accuracies before and after training. `boxed=False`
    when an `accuracy` function scored in place of `math_accuracy`: strict is then the answer
    right and the completion finished (see `score_completions`)."""

    def percent(value):
        return "-" if value is None else f"{value:.1%}"

    rows = [
        ("greedy pass@1, answer right (lenient)", before.greedy_lenient, after.greedy_lenient),
        (
            f"greedy pass@1, {'boxed and ' if boxed else ''}finished too (strict)",
            before.greedy_strict,
            after.greedy_strict,
        ),
    ]
    for name in after.pass_at_k:
        label = f"sampled {name} (n={after.num_samples}, T={after.temperature}), lenient"
        rows.append((label, before.pass_at_k.get(name), after.pass_at_k[name]))
    lines = ["| held-out | before | after |", "|---|---|---|"]
    lines += [f"| {label} | {percent(b)} | {percent(a)} |" for label, b, a in rows]
    lines.append(f"| problems | {before.num_problems} | {after.num_problems} |")
    lines.append(f"| max new tokens | {before.max_new_tokens} | {after.max_new_tokens} |")
    if before.mean_completion_tokens is not None and after.mean_completion_tokens is not None:
        lines.append(
            f"| mean completion tokens | {before.mean_completion_tokens:.1f} | "
            f"{after.mean_completion_tokens:.1f} |"
        )
    if before.tool_call_rate is not None and after.tool_call_rate is not None:
        lines.append(
            f"| tool called | {percent(before.tool_call_rate)} | {percent(after.tool_call_rate)} |"
        )
        lines.append(
            f"| tool calls that failed | {percent(before.tool_error_rate)} | "
            f"{percent(after.tool_error_rate)} |"
        )
    if before.truncated_fraction is not None and after.truncated_fraction is not None:
        lines.append(
            f"| cut at the token cap | {percent(before.truncated_fraction)} | "
            f"{percent(after.truncated_fraction)} |"
        )
    return "\n".join(lines)


def plot_training_curve(
    metrics_path: str, png_path: str, accuracy_label: str = "held-out accuracy (greedy)"
) -> str | None:
    """Reward per logging step and held-out accuracy per evaluation, from `metrics.jsonl`, as a
    PNG (matplotlib, Agg backend). Returns the path, or None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not os.path.exists(metrics_path):
        return None
    records = read_jsonl(metrics_path)
    rewards = [(r["step"], r["reward"]) for r in records if "reward" in r]
    accuracy = sorted(
        (r["step"], r["heldout/accuracy"]) for r in records if "heldout/accuracy" in r
    )
    if not rewards and not accuracy:
        return None
    figure, axis = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    if rewards:
        axis.plot(*zip(*rewards), color="tab:blue", label="mean reward (training samples)")
    if accuracy:
        axis.plot(*zip(*accuracy), "o-", color="tab:orange", label=accuracy_label)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("reward / accuracy")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(png_path)
    plt.close(figure)
    return png_path


def draw_reward_curve(metrics_path: str, png_path: str, **kwargs) -> bool:
    """Draws a recipe's `reward_curve.png` (`plot_training_curve`); without matplotlib, or if
    drawing fails, warns and returns False: a run's other outputs never depend on it."""
    import warnings

    try:
        return plot_training_curve(metrics_path, png_path, **kwargs) is not None
    except ImportError as error:
        reason = f"{error}; install matplotlib (`pip install matplotlib`) to get it"
    except Exception as error:  # noqa: BLE001 - everything else is saved; the plot is extra
        reason = f"{type(error).__name__}: {error}"
    warnings.warn(
        f"The reward curve was not drawn ({reason}). The adapter, metrics.jsonl and "
        f"before_after.md are saved; `plot_training_curve` draws it from metrics.jsonl later.",
        stacklevel=2,
    )
    return False
