"""Sampling alone, side by side: ours with the LoRA adapters merged, ours unmerged, and TRL's.

    .venv/bin/python benchmarks/merged_sampling.py --model smollm2 --repeats 3 --threads 1

Both trainers are built as `vs_trl.py` builds them (`_common._build_trainer`: LoRA r=16 on all
linear layers, 4 prompts x 8 completions, 64 tokens at most) in this one process, and one
generation batch of the same 4 prompts is sampled in turn by: our engine with the adapters merged
(`generation.merged_adapters`), our engine unmerged, and `trl.GRPOTrainer._generate`, `--repeats`
times, in rotation so that a busy machine slows all three alike. The adapters' B matrices are
made non-zero first (as after some training), the same in both trainers. Reported: seconds per
1,000 sampled tokens (each completion counted up to its first end-of-sequence token), and the
ratios. Merging and unmerging are inside our timings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def _non_zero_adapters(model, seed: int = 0) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "lora_B" in name:
                parameter.copy_(1e-3 * torch.randn(parameter.shape, generator=generator))


def main(argv=None) -> dict:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = {"tiny": _common.tiny_model_dir, "smollm2": _common.smollm2_model_dir}[args.model]()
    with tempfile.TemporaryDirectory(prefix="merged-sampling-") as output_dir:
        spec = {**_common.DEFAULTS, "model_dir": model_dir, "output_dir": output_dir}
        return _compare(spec, args.model, args.repeats)


def _compare(spec: dict, model_name: str, repeats: int) -> dict:
    from transformers import TrainerCallback

    from trl_grpo_ext.generation.transformers_engine import seeded

    dataset = _common.prompt_dataset(spec["num_prompts"], spec["difficulty"], True)
    rows = [dataset[i] for i in range(spec["num_prompts"])]
    ours = _common._build_trainer({**spec, "trainer": "ours"}, dataset, TrainerCallback())
    trl = _common._build_trainer({**spec, "trainer": "trl"}, dataset, TrainerCallback())
    _non_zero_adapters(ours.model)
    _non_zero_adapters(trl.model)
    engine = ours.rollouts.engine
    group = spec["num_generations"]
    prompts = [row["prompt"] for row in rows for _ in range(group)]
    eos = set(ours.eos_token_ids)

    def ours_sampling(merge: bool, seed: int):
        engine.merge_adapters = "exact" if merge else "never"
        with seeded(seed):  # merged and unmerged draw the same tokens
            rollout = ours.rollouts.generate(rows, 0)
        return int(rollout.completion_mask.sum())

    def trl_sampling():
        trl.model.train()  # as in its training step; `_generate` switches to eval itself
        output = trl._generate(prompts)
        completion_ids = output[1]  # per completion, up to its first eos
        return sum(_up_to_eos(ids, eos) for ids in completion_ids)

    runs = {
        "ours, merged": lambda seed: ours_sampling(True, seed),
        "ours, unmerged": lambda seed: ours_sampling(False, seed),
        "TRL": lambda seed: trl_sampling(),
    }
    for run in runs.values():  # warm-up
        run(-1)
    seconds = {name: [] for name in runs}
    tokens = {name: [] for name in runs}
    for repeat in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            tokens[name].append(run(repeat))
            seconds[name].append(time.perf_counter() - started)
    per_1k = {name: 1000 * sum(seconds[name]) / sum(tokens[name]) for name in runs}
    print(f"| {model_name}: sampling | s per batch (median) | tokens per batch | s per 1k tokens |")
    print("|---|---:|---:|---:|")
    for name in runs:
        print(
            f"| {name} | {statistics.median(seconds[name]):.2f} | "
            f"{statistics.mean(tokens[name]):.0f} | {per_1k[name]:.3f} |"
        )
    merged, unmerged, theirs = per_1k["ours, merged"], per_1k["ours, unmerged"], per_1k["TRL"]
    same = tokens["ours, merged"] == tokens["ours, unmerged"]
    print(
        f"\nmerged/unmerged {merged / unmerged:.2f} (same tokens sampled: {same}); "
        f"ours/TRL: merged {merged / theirs:.2f}, "
        f"unmerged {unmerged / theirs:.2f} (s per 1k tokens)"
    )
    return {"seconds": seconds, "tokens": tokens, "s_per_1k_tokens": per_1k}


def _up_to_eos(ids, eos: set) -> int:
    for index, token in enumerate(ids):
        if token in eos:
            return index + 1
    return len(ids)


if __name__ == "__main__":
    main()
