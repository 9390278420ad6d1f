"""Sampling from LoRA weights merged into the base layers, and restoring the base weights bit
for bit afterwards.

A LoRA layer computes `x W^T + s (x A^T) B^T`: each decoding step runs three matmuls and the
adapter's Python per layer. With `W' = W + s B A` it is one matmul, `x W'^T`, the same numbers
up to float rounding. `merged_lora(model)` builds `W'` next to `W` for every LoRA layer of the
block (out of place: `W` itself is never written, so the trained-on base weights after the block
are the same bits as before it, which an in-place merge and unmerge, `(W + d) - d`, does not
promise) and marks the layer merged, so that PEFT's forward calls the base layer alone.

It merges only where the merge is exact enough, and otherwise samples from the adapters as they
are, saying why once:
- float32 (or float64) weights: `W + s B A` rounds each weight by at most half a unit in the
  last place, about 6e-8 relative, far below the update an optimizer step makes; sampled tokens
  and their log-probs match the unmerged adapters (tests/test_merged_adapters.py). In bfloat16
  or float16 that rounding (up to 2e-3 or 2.5e-4 of each weight) is as large as an adapter's
  update early in training: on SmolLM2 in bfloat16 the merge nearly doubled how far the
  sampled tokens' log-probs move from the float32 policy, and kept less of an early adapter's
  update (benchmarks/merge_precision.py, docs/benchmarks.md), so the adapters stay unmerged
  there unless the user asks for the merge (`sample_with_merged_adapters="always"`): on a GPU,
  where a decoding step costs its kernel launches, it took 0.70-0.88x the unmerged time at
  Qwen2.5-0.5B's shape. Then `W + s B A` is summed in float32 and rounded once.
- not quantized: a 4-bit or 8-bit base layer cannot hold `W + s B A` (QLoRA samples unmerged);
- plain LoRA on `nn.Linear` layers only (no DoRA or other variants, no adapter biases, no
  sharded or partitioned weights);
- a PEFT release it is tested on (`internals.FAST_PATHS["merged_lora"]`): marking a layer
  merged sets PEFT's own state, `merged_adapters`.

Memory: the merged copies of the adapted weights exist during sampling only, next to the base
weights (the size of the adapted layers again). On a CPU (`lay_out=True`, the engines'
default) a float32 layer's merged weight exists only laid out for oneDNN
(`packed_weights.py`), not as a dense copy too.

The log-probs of a sampling pass with merged weights are those of the merged weights, so the
behaviour log-probs an engine returns stay those of the weights that sampled.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F

from ..internals import usable, why_off
from . import packed_weights

logger = logging.getLogger(__name__)

MERGEABLE_DTYPES = (torch.float32, torch.float64)


def lora_layers(model) -> list:
    """The LoRA layers of a PEFT model (`peft.tuners.lora.LoraLayer`), empty for any other."""
    if not hasattr(model, "peft_config"):
        return []
    from peft.tuners.lora import LoraLayer

    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def why_not_merged(model, layers: list, low_precision: bool = False) -> str | None:
    """Why the LoRA `layers` of `model` are sampled unmerged, or None when they can be merged;
    `low_precision`: bfloat16 and float16 weights are merged too."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        return "the base model is loaded in 4-bit or 8-bit"
    for layer in layers:
        base = getattr(layer, "base_layer", None)
        if not isinstance(layer, LoraLinear) or type(base) is not torch.nn.Linear:
            return (
                f"{type(layer).__name__} over {type(base).__name__} is not plain LoRA on nn.Linear"
            )
        if any(name in layer.lora_variant for name in layer.active_adapters):
            return "an adapter is a LoRA variant (DoRA, ...)"
        if any(getattr(layer, "lora_bias", {}).get(name) for name in layer.active_adapters):
            return "an adapter has a bias of its own (lora_bias=True), which W + s B A leaves out"
        weight = base.weight
        partitioned = hasattr(weight, "ds_id") or weight.untyped_storage().size() == 0
        if type(weight.data) is not torch.Tensor or weight.numel() == 0 or partitioned:
            return "the base weights are sharded or partitioned (FSDP, DeepSpeed ZeRO-3)"
        if weight.dtype not in MERGEABLE_DTYPES and not (
            low_precision and weight.dtype in (torch.bfloat16, torch.float16)
        ):
            return (
                f"the base weights are {weight.dtype}, where rounding W + BA to that precision "
                "moves each weight by as much as an early adapter update (set "
                "sample_with_merged_adapters='always' to merge anyway)"
            )
        if getattr(layer, "merged", False):
            return "the adapters are merged already"
    if not usable("merged_lora"):  # marks the layers merged as PEFT's merge would
        return why_off("merged_lora")
    return None


def merged_for_sampling(
    model, setting: str = "exact", log_reason: bool = True, lay_out: bool = True
):
    """The block a sampling pass runs in under `sample_with_merged_adapters=setting`: "exact"
    merges where that is exact enough (`merged_lora`), "always" merges bf16 and fp16 weights
    too, "never" leaves the adapters as they are. `lay_out`: `merged_lora`'s."""
    if setting == "never":
        return contextlib.nullcontext(False)
    return merged_lora(model, log_reason, low_precision=setting == "always", lay_out=lay_out)


@contextlib.contextmanager
def merged_lora(model, log_reason: bool = True, low_precision: bool = False, lay_out: bool = False):
    """A block in which every active LoRA adapter of `model` is merged into its base layer.

    Yields True when the adapters are merged, False when the block runs unmerged (no LoRA
    layers, or `why_not_merged` gives a reason, logged at INFO level when `log_reason`).
    `low_precision`: merge bfloat16 and float16 weights too. `lay_out`: a base layer whose
    weight `packed_weights` can lay out for oneDNN (float32, on a CPU) gets `W + s B A` laid
    out, and no dense merged copy is kept: its other passes (the prompts') compute as the
    unmerged layer does. Afterwards each base layer holds its original weight tensor again,
    untouched.
    """
    layers = lora_layers(model)
    reason = why_not_merged(model, layers, low_precision) if layers else "no LoRA layers"
    if reason is not None:
        if layers and log_reason:
            logger.info("Sampling with the LoRA adapters unmerged: %s.", reason)
        yield False
        return
    saved = []  # (layer, base weight tensor, merged adapter names before)
    laid_out = []  # (base layer, its laid-out forward)
    try:
        with torch.no_grad():
            for layer in layers:
                active = [name for name in layer.active_adapters if name in layer.lora_A]
                if not active:
                    continue
                weight = layer.base_layer.weight
                # summed in float32 at least, rounded to the weight's dtype once
                merged = weight.data.to(torch.promote_types(weight.dtype, torch.float32), copy=True)
                for name in active:
                    merged += layer.get_delta_weight(name).to(merged.dtype)
                saved.append((layer, weight.data, list(layer.merged_adapters)))
                forward = None
                if lay_out and packed_weights.packable(layer.base_layer):
                    unmerged = functools.partial(_unmerged_forward, layer, active)
                    forward = packed_weights.lay_out(layer.base_layer, merged, unmerged)
                if forward is not None:
                    laid_out.append((layer.base_layer, forward))
                else:
                    weight.data = merged.to(weight.dtype)
                layer.merged_adapters = active  # PEFT's forward now calls the base layer alone
                del merged
        yield True
    finally:
        for base_layer, forward in laid_out:
            packed_weights.restore(base_layer, forward)
        for layer, original, merged_adapters in saved:
            layer.base_layer.weight.data = original
            layer.merged_adapters = merged_adapters


def _unmerged_forward(layer, active: list, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s output as its `active` adapters compute it unmerged, without dropout (sampling
    runs in eval mode): `x W^T + b + sum of s (x A^T) B^T`."""
    base = layer.base_layer
    out = F.linear(x, base.weight, base.bias)
    for name in active:
        lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
        out = out + lora_B(lora_A(x.to(lora_A.weight.dtype))).to(out.dtype) * layer.scaling[name]
    return out
