"""Sampling on a CPU with each linear layer's weight laid out once for oneDNN's matrix kernels.

On a CPU, `F.linear` hands every call to MKL's sgemm, which copies the weight into its blocked
layout each time. In a decoding step a few dozen rows meet every weight of the model, so that
copy costs about as much as the products themselves: at SmolLM2-135M's shapes, the linear layers
of one decoding step over 32 rows took 88-106 ms with `F.linear` and 53 ms with each weight laid
out once (`torch.ops.mkldnn._reorder_linear_weight`, as torch.compile's CPU backend does to
frozen weights) and passed as it is to `torch.ops.mkldnn._linear_pointwise` (docs/benchmarks.md).
Laying out all of SmolLM2's weights takes about 0.2 s, once per generation batch.

`packed_linear_weights(model)` is the block in which every plain `nn.Linear` of `model` whose
weight is a float32 CPU tensor computes that way, with the weight as it was when the block was
entered (the merged weights, inside `merged_adapters.merged_lora`); afterwards the layers are
as before and the laid-out copies are freed. The products are the same up to float rounding
(about 1e-6 relative), so sampled tokens and their log-probs match those of `F.linear`
(tests/test_packed_weights.py). A layer computes with `F.linear` as before wherever the laid-out
weight does not apply: while autograd records, under autocast, or for inputs of another dtype.
Layers whose `forward` something else has replaced on the instance (`logprobs.float32_head`) are
left as they are.

Memory: the laid-out copies live for the block, the size of the model's linear weights again.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


# Measured on 2 AMD EPYC cores (docs/benchmarks.md): below about 2**18 weights (1 MiB in float32)
# `F.linear` is as fast, MKL's copy of a small weight costing little; the same above about 64
# rows (the prompts' pass), where the products outweigh the copy.
MIN_WEIGHTS = 1 << 18
MAX_ROWS = 64
# oneDNN builds and keeps a kernel (about 0.6 MB) for each number of rows it meets: the rows of
# a decoding step are padded to a multiple of ROW_MULTIPLE, so that a run meets few of them.
ROW_MULTIPLE = 8


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def _packable(module) -> bool:
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
    )


def _packed_forward(module, packed: torch.Tensor):
    weight, bias = module.weight, module.bias

    def forward(x):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (
            not 0 < rows <= MAX_ROWS
            or torch.is_grad_enabled()
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or torch.is_autocast_enabled("cpu")
        ):
            return F.linear(x, weight, bias)
        flat = x.reshape(rows, x.shape[-1])
        padding = -rows % ROW_MULTIPLE
        if padding:
            flat = F.pad(flat, (0, 0, 0, padding))
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])

    return forward


@contextlib.contextmanager
def packed_linear_weights(model, enabled: bool = True):
    """A block in which the plain float32 `nn.Linear` layers of `model` on the CPU compute with
    their weights laid out once for oneDNN (see the module's docstring). Yields the number of
    layers that do; 0 where none can (`enabled=False`, a GPU, other dtypes, a torch without
    oneDNN)."""
    layers = [m for m in model.modules() if _packable(m)] if enabled and _available() else []
    patched = []  # (layer, its forward)
    try:
        with torch.no_grad():
            for layer in layers:
                try:
                    packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
                except RuntimeError as error:  # a build of torch whose oneDNN does not take it
                    logger.info(
                        "Sampling with F.linear: oneDNN cannot lay out %s: %s", layer, error
                    )
                    break
                forward = _packed_forward(layer, packed)
                layer.forward = forward
                patched.append((layer, forward))
        yield len(patched)
    finally:
        for layer, forward in patched:
            if layer.__dict__.get("forward") is forward:
                del layer.forward
