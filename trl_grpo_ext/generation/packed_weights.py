"""Sampling on a CPU with each linear layer's weight laid out once for oneDNN's matrix kernels.

On a CPU, `F.linear` hands every call to MKL's sgemm, which copies the weight into its blocked
layout each time. In a decoding step a few dozen rows meet every weight of the model, so that
copy costs about as much as the products themselves: at SmolLM2-135M's shapes, the linear layers
of one decoding step over 32 rows took 88-106 ms with `F.linear` and 53 ms with each weight laid
out once (`torch.ops.mkldnn._reorder_linear_weight`, as torch.compile's CPU backend does to
frozen weights) and passed as it is to `torch.ops.mkldnn._linear_pointwise` (docs/benchmarks.md).
Laying out all of SmolLM2's weights takes about 0.2 s, once per generation batch.

`packed_linear_weights(model)` is the block in which the plain `nn.Linear` layers of `model`
that pay for it (`packable`: float32 weights on the CPU, at least `MIN_WEIGHTS` of them)
compute decoding steps that way, with the weight as it was when the block was entered;
afterwards the layers are as before and the laid-out copies are freed. A merged LoRA layer is
laid out from `W + s B A` by `merged_adapters.merged_lora(lay_out=True)`, which keeps no dense
merged copy. The products are the same up to float rounding (about 1e-6 relative), so sampled
tokens and their log-probs match those of `F.linear` (tests/test_packed_weights.py). A layer
computes as before wherever the laid-out weight does not pay or apply: passes of more than
`MAX_ROWS` rows (the prompts'), while autograd records, under autocast, or for inputs of
another dtype. Layers whose `forward` something else has replaced on the instance
(`logprobs.float32_head`) are left as they are. The two oneDNN ops are torch's private ones: on a
torch outside the releases they are tested on (`internals.FAST_PATHS["packed_weights"]`) every
layer computes with `F.linear`, and that is logged once.

Memory: the laid-out copies live for the block, the size of those layers' weights again (in
place of the dense merged copies where adapters are merged).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from ..internals import fell_back, usable

# Measured on 2 AMD EPYC cores (docs/benchmarks.md): below about 2**18 weights (1 MiB in float32)
# `F.linear` is as fast, MKL's copy of a small weight costing little; the same above about 64
# rows (the prompts' pass), where the products outweigh the copy.
MIN_WEIGHTS = 1 << 18
MAX_ROWS = 64
# oneDNN builds and keeps a kernel (about 0.6 MB) for each number of rows it meets: the rows of
# a decoding step are padded to a multiple of ROW_MULTIPLE, so that a run meets few of them.
ROW_MULTIPLE = 8


def packable(module) -> bool:
    """Whether `module` is a plain `nn.Linear` whose weight can be laid out: float32, on the
    CPU, at least `MIN_WEIGHTS` of them, its `forward` not replaced already; and oneDNN's
    private ops on a torch they are tested on (`internals.FAST_PATHS["packed_weights"]`)."""
    if type(module) is not torch.nn.Linear or "forward" in module.__dict__:
        return False
    weight, bias = module.weight, module.bias
    return (
        type(weight.data) is torch.Tensor  # not a DTensor or another subclass (FSDP)
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.numel() >= MIN_WEIGHTS  # also: not partitioned away (DeepSpeed ZeRO-3)
        and not hasattr(weight, "ds_id")
        and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"))
        and usable("packed_weights")
    )


def lay_out(layer: torch.nn.Linear, weight: torch.Tensor | None = None, fallback=None):
    """Makes `layer` (`packable`) compute decoding steps with `weight` (by default its own)
    laid out for oneDNN, and everything else with `fallback(x)` (by default `F.linear` with its
    own weight and bias; give one that computes as `weight` does when that is another tensor).
    Returns the new forward, for `restore`, or None where oneDNN cannot lay it out."""
    bias = layer.bias
    if fallback is None:
        fallback = functools.partial(F.linear, weight=layer.weight, bias=bias)
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(
                (layer.weight if weight is None else weight).detach()
            )
    except RuntimeError as error:  # a build of torch whose oneDNN does not take it
        fell_back("packed_weights", f"oneDNN cannot lay out {layer}: {error}")
        return None

    def forward(x):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (
            not 0 < rows <= MAX_ROWS
            or torch.is_grad_enabled()
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or torch.is_autocast_enabled("cpu")
        ):
            return fallback(x)
        flat = x.reshape(rows, x.shape[-1])
        padding = -rows % ROW_MULTIPLE
        if padding:
            flat = F.pad(flat, (0, 0, 0, padding))
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])

    layer.forward = forward
    return forward


def restore(layer: torch.nn.Module, forward) -> None:
    """Undoes `lay_out`'s `forward` on `layer`, unless something has replaced it since."""
    if layer.__dict__.get("forward") is forward:
        del layer.forward


@contextlib.contextmanager
def packed_linear_weights(model, enabled: bool = True):
    """A block in which the plain float32 `nn.Linear` layers of `model` on the CPU compute with
    their weights laid out once for oneDNN (see the module's docstring). Yields the number of
    layers that do; 0 where none can (`enabled=False`, a GPU, other dtypes, a torch without
    oneDNN)."""
    layers = [m for m in model.modules() if packable(m)] if enabled else []
    patched = []  # (layer, its forward)
    try:
        for layer in layers:
            forward = lay_out(layer)
            if forward is None:
                break
            patched.append((layer, forward))
        yield len(patched)
    finally:
        for layer, forward in patched:
            restore(layer, forward)
