"""Sampling alone, side by side: finished rows leaving the batch (`generation.compacting`) or not.

    .venv/bin/python benchmarks/compact_sampling.py --model smollm2 --max-tokens 64 --threads 1
    .venv/bin/python benchmarks/compact_sampling.py --model smollm2 --max-tokens 256 --threads 1

The benchmark's prompts (4 synthetic sums as chat prompts with the system prompt, `_common`),
8 completions each at temperature 1.0, sampled by `generate_with_transformers` with and without
`compact_finished_rows`, `--repeats` times in rotation (so that a busy machine slows both
alike), each repeat with its own seed, the same for both. Reported: wall-clock and CPU seconds
per 1,000 sampled tokens (each completion counted up to its first end-of-sequence token), the
share of row-steps that a non-compacting loop spends on finished rows, the ratios, and whether
both sampled the same tokens.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def main(argv=None) -> dict:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = {"tiny": _common.tiny_model_dir, "smollm2": _common.smollm2_model_dir}[args.model]()
    return _compare(model_dir, args)


def _compare(model_dir: str, args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext.generation.rollout import completion_mask_from_ids
    from trl_grpo_ext.generation.transformers_engine import generate_with_transformers, seeded

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    *prompts, config, eos = _common.sampling_inputs(
        model, tokenizer, args.num_prompts, args.group_size, args.max_tokens
    )

    warm_up = copy.deepcopy(config)
    warm_up.max_new_tokens = min(8, args.max_tokens)

    def sample(compact: bool, seed: int, generation_config=config):
        with seeded(seed):
            return generate_with_transformers(
                model, *prompts, generation_config=generation_config, compact_finished_rows=compact
            )[2]

    runs = {"all rows to the end": False, "finished rows leave": True}
    for compact in runs.values():  # warm-up, a few tokens
        sample(compact, -1, warm_up)
    wall = {name: 0.0 for name in runs}
    cpu = {name: 0.0 for name in runs}
    tokens = {name: 0 for name in runs}
    row_steps, finished_steps, same = 0, 0, True
    completions, cpu_ratios = {}, []  # per repeat: CPU time compacting / every row
    for repeat in range(args.repeats):
        repeat_cpu = {}
        for name, compact in runs.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            completion_ids = sample(compact, repeat)  # (B*G, T)
            wall[name] += time.perf_counter() - started
            repeat_cpu[name] = time.process_time() - started_cpu
            cpu[name] += repeat_cpu[name]
            mask, _ = completion_mask_from_ids(completion_ids, eos)
            tokens[name] += int(mask.sum())
            completions[name] = completion_ids
        same = same and _same(*completions.values())
        cpu_ratios.append(repeat_cpu["finished rows leave"] / repeat_cpu["all rows to the end"])
        row_steps += mask.numel()
        finished_steps += int(mask.numel() - mask.sum())
    print(
        f"| {Path(model_dir).name}, {args.num_prompts} x {args.group_size} x <= {args.max_tokens}"
    )
    print("| loop | wall s per 1k tokens | CPU s per 1k tokens | tokens per batch |")
    print("|---|---:|---:|---:|")
    per_1k = {name: 1000 * wall[name] / tokens[name] for name in runs}
    cpu_per_1k = {name: 1000 * cpu[name] / tokens[name] for name in runs}
    for name in runs:
        print(
            f"| {name} | {per_1k[name]:.3f} | {cpu_per_1k[name]:.3f} | "
            f"{tokens[name] / args.repeats:.0f} |"
        )
    compact_name, full_name = "finished rows leave", "all rows to the end"
    print(
        f"\nrow-steps on finished rows without compaction: {finished_steps / row_steps:.1%}; "
        f"compacting/not: wall {per_1k[compact_name] / per_1k[full_name]:.2f}, "
        f"CPU {cpu_per_1k[compact_name] / cpu_per_1k[full_name]:.2f} (per repeat "
        f"{min(cpu_ratios):.2f} to {max(cpu_ratios):.2f}); same tokens: {same}"
    )
    return {"wall": wall, "cpu": cpu, "tokens": tokens, "same": same, "cpu_ratios": cpu_ratios}


def _same(first, second) -> bool:
    return first.shape == second.shape and bool((first == second).all())


if __name__ == "__main__":
    main()
