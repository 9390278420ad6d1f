"""How far merging the LoRA adapters moves the sampled tokens' log-probs in half precision,
next to how far half precision itself moves them from the float32 policy.

    .venv/bin/python benchmarks/merge_precision.py --model smollm2 --adapter runs/smollm2_cpu

Our engine samples with the adapters merged into the base weights (`W + s B A`) in float32 and
unmerged in bfloat16 or float16, where rounding the merged weight to the half-precision grid
could lose an update smaller than its spacing. This measures that choice: completions sampled
from the float32 policy (`--num-prompts` x `--group-size`, at most `--max-tokens` tokens), then
their tokens' log-probs as the trainer computes them (`logprobs.completion_logprobs`) under

* float32, adapters off: how much the adapter changes the policy (its effect);
* float32, merged: the float32 merge (rounding only);
* `--dtype`, unmerged and merged, and with the adapters off.

Each is reported against float32 unmerged (the policy): the mean and largest difference per
token, and per completion (the sum over its tokens, the log of an importance weight); and
for the half-precision pair, the share of the adapter's effect each keeps (the slope of its
change from its own adapter-off log-probs on the float32 change).

`--adapter` takes a saved LoRA adapter (a training run's output folder, e.g. `make
train-smollm2`'s runs/smollm2_cpu); without one the model gets LoRA r=16 on all linear layers
with B ~ 1e-3 N(0, 1). `--scales` multiplies the B matrices: 0.05 stands for an adapter early in
training, whose update is a twentieth of the trained one's.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

MODELS = {"tiny": _common.tiny_model_dir, "smollm2": _common.smollm2_model_dir}


def main(argv=None) -> dict:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=list(MODELS))
    parser.add_argument("--adapter", default=None, help="a saved LoRA adapter's folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--scales", default="1,0.05", help="comma-separated factors on B")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = MODELS[args.model]()
    report = {}
    for scale in [float(text) for text in args.scales.split(",")]:
        report[scale] = _measure(model_dir, args, scale)
    return report


def _lora_model(model_dir: str, adapter: str | None, dtype, scale: float):
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    if adapter:
        model = PeftModel.from_pretrained(base, adapter)
    else:
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
        model = get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "lora_B" in name:
                if not adapter:
                    parameter.copy_(1e-3 * torch.randn(parameter.shape, generator=generator))
                parameter.mul_(scale)
    return model.eval()


def _measure(model_dir: str, args, scale: float) -> dict:
    import torch
    from transformers import AutoTokenizer

    from trl_grpo_ext.generation import merged_adapters
    from trl_grpo_ext.generation.rollout import completion_mask_from_ids
    from trl_grpo_ext.generation.transformers_engine import generate_with_transformers, seeded
    from trl_grpo_ext.logprobs import completion_logprobs

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    half = getattr(torch, args.dtype)
    model = _lora_model(model_dir, args.adapter, torch.float32, scale)
    prompt_ids, prompt_mask, config, eos = _common.sampling_inputs(
        model, tokenizer, args.num_prompts, args.group_size, args.max_tokens
    )
    with seeded(0):
        prompt_ids, prompt_mask, completion_ids = generate_with_transformers(
            model, prompt_ids, prompt_mask, generation_config=config
        )
    mask, _ = completion_mask_from_ids(completion_ids, eos)
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, mask.to(prompt_mask.dtype)], 1)

    def logps(model, merge: bool = False, adapter: bool = True):
        """The completion tokens' log-probs `(N, T)`, as the trainer computes them."""
        with contextlib.ExitStack() as stack, torch.no_grad():
            if merge:
                merge = merged_adapters.merged_lora(model, low_precision=True)
                assert stack.enter_context(merge)
            if not adapter:
                stack.enter_context(model.disable_adapter())
            return completion_logprobs(model, ids, attention_mask, completion_ids).float()

    policy = logps(model)
    rows = {"float32, adapters off": logps(model, adapter=False)}
    rows["float32, merged"] = logps(model, merge=True)
    del model
    model = _lora_model(model_dir, args.adapter, half, scale)
    rows[f"{args.dtype}, unmerged"] = logps(model)
    rows[f"{args.dtype}, merged"] = logps(model, merge=True)
    rows[f"{args.dtype}, adapters off"] = logps(model, adapter=False)
    del model

    kept = mask.bool()
    print(f"\nB x {scale}: {int(kept.sum())} tokens in {kept.shape[0]} completions")
    print(
        "| against float32 unmerged | token mean | token max | completion mean | completion max |"
    )
    print("|---|---:|---:|---:|---:|")
    report = {}
    for name, values in rows.items():
        token = (values - policy)[kept].abs()
        completion = ((values - policy) * mask).sum(1).abs()
        report[name] = {
            "token_mean": float(token.mean()),
            "token_max": float(token.max()),
            "completion_mean": float(completion.mean()),
            "completion_max": float(completion.max()),
        }
        print(
            f"| {name} | {token.mean():.2e} | {token.max():.2e} | "
            f"{completion.mean():.2e} | {completion.max():.2e} |"
        )
    effect = (policy - rows["float32, adapters off"])[kept]
    for variant in ("unmerged", "merged"):
        change = (rows[f"{args.dtype}, {variant}"] - rows[f"{args.dtype}, adapters off"])[kept]
        kept_share = float((change * effect).sum() / (effect * effect).sum())
        report[f"{args.dtype}, {variant}"]["effect_kept"] = kept_share
        print(f"{args.dtype} {variant} keeps {kept_share:.2f} of the adapter's effect")
    return report


if __name__ == "__main__":
    main()
