"""Evaluate a model, or a model plus a LoRA adapter, on math problems with the recipe's harness.

    python recipes/eval_math.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name gsm8k
    python recipes/eval_math.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --adapter user/qwen2.5-0.5b-gsm8k-grpo --num_samples 8 --k 1 8     # adapter on the Hub
    python recipes/eval_math.py --adapter runs/tiny_cpu --dataset_name synthetic \
        --system_prompt "" --max_new_tokens 12   # local adapter; base model from its config

Greedy pass@1 and, with `--num_samples n`, sampled pass@k for each `--k`; strict (boxed final
answer, and the `<think>` format with `--require_think_format`) and lenient (answer right)
accuracy; the number of problems and the token cap are printed with the numbers. `--output`
writes the report as JSON.
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

from transformers import HfArgumentParser, set_seed

from trl_grpo_ext.data import SYSTEM_PROMPT, load_math_dataset
from trl_grpo_ext.evaluation import evaluate_math, load_model_for_eval
from trl_grpo_ext.rewards import get_reward


@dataclass
class EvalArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Base model: Hub id or local folder; default: the adapter's base."},
    )
    adapter: str | None = field(
        default=None, metadata={"help": "LoRA adapter: local folder or Hub repository."}
    )
    dataset_name: str = field(
        default="gsm8k", metadata={"help": "gsm8k, math500, synthetic, a Hub id or a local file."}
    )
    dataset_split: str = field(default="test", metadata={"help": "Split to evaluate."})
    dataset_question_column: str | None = field(default=None)
    dataset_answer_column: str | None = field(default=None)
    num_problems: int | None = field(default=None, metadata={"help": "First N problems only."})
    synthetic_difficulty: int = field(default=2)
    system_prompt: str = field(default=SYSTEM_PROMPT, metadata={"help": "Empty for none."})
    max_new_tokens: int = field(default=512, metadata={"help": "Token cap of each completion."})
    num_samples: int = field(default=0, metadata={"help": "Samples per problem for pass@k."})
    k: list[int] = field(default_factory=lambda: [1], metadata={"help": "k of pass@k."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature of pass@k."})
    batch_size: int = field(default=64, metadata={"help": "Prompts per generate call."})
    require_think_format: bool = field(
        default=False, metadata={"help": "Strict also needs the <think> format reward."}
    )
    dtype: str = field(default="auto", metadata={"help": "Weights dtype (auto, bfloat16, ...)."})
    seed: int = field(default=0)
    output: str | None = field(default=None, metadata={"help": "Write the report here (JSON)."})


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
    )
    if args.model_name_or_path is None:
        if args.adapter is None:
            raise ValueError("Give --model_name_or_path, --adapter, or both.")
        from peft import PeftConfig

        args.model_name_or_path = PeftConfig.from_pretrained(args.adapter).base_model_name_or_path
    model, tokenizer = load_model_for_eval(args.model_name_or_path, args.adapter, dtype=args.dtype)
    report = evaluate_math(
        model,
        tokenizer,
        dataset,
        max_new_tokens=args.max_new_tokens,
        num_samples=args.num_samples,
        k_values=tuple(args.k),
        temperature=args.temperature,
        batch_size=args.batch_size,
        format_reward=get_reward("format") if args.require_think_format else None,
    )
    name = args.model_name_or_path + (f" + {args.adapter}" if args.adapter else "")
    print(f"{name} on {args.dataset_name}/{args.dataset_split}: {report.summary()}")
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"model": name, "dataset": args.dataset_name, **report.to_dict()}, handle)
    return report


if __name__ == "__main__":
    main(*HfArgumentParser(EvalArguments).parse_args_into_dataclasses())
