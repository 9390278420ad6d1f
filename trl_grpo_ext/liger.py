"""`use_liger_kernel=True`: Liger's layer kernels, as TRL 1.16 applies them to GRPO.

TRL 1.16 no longer computes the GRPO loss with Liger's fused linear loss
(`liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`): its trainer computes the completion
log-probs with a fused LM head (chunks of the vocabulary, never the full `(B, T, V)` logits),
for every run, and `use_liger_kernel` only adds Liger's layer kernels (RMSNorm, RoPE, SwiGLU,
...), which `transformers.Trainer` patches into the model when `train()` starts. Here the
fused head is `logprobs.head_token_logprobs` (every run, too), so this module does what TRL's
constructor does with the setting:

- warns that it is deprecated (TRL's `FutureWarning`: the Hub kernels, with
  `model_init_kwargs={"use_kernels": True}`, replace it);
- refuses `liger_kernel_config={"fused_linear_cross_entropy": True}`, whose patched forward
  would bypass the fused head, and otherwise sets it to False;

and, earlier than TRL (whose run fails when `train()` patches the model), says at construction
what cannot run: Liger's kernels are Triton kernels, for a GPU, not the CPU; and without
`liger-kernel` installed, the `ImportError` names the package.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

# Devices where Triton has no backend, so Liger's kernels cannot run.
NO_TRITON_DEVICES = ("cpu", "mps")


def prepare_liger_kernel(args, device: torch.device | None = None) -> None:
    """Checks `args.use_liger_kernel` and sets `args.liger_kernel_config` as TRL 1.16's
    constructor does, then that Liger's kernels can run on `device` (defaults to
    `args.device`). Nothing happens when `use_liger_kernel` is False.

    Raises:
        ValueError: `fused_linear_cross_entropy=True` in `liger_kernel_config`, or a device that
            Triton does not run on (the CPU).
        ImportError: `liger-kernel` (or Triton, which it needs) is not installed.
    """
    if not args.use_liger_kernel:
        return
    warnings.warn(
        "`use_liger_kernel=True` is deprecated and will be removed in v2.0.0. Use the Hub "
        'kernels instead, with `model_init_kwargs={"use_kernels": True}`.',
        FutureWarning,
        stacklevel=3,
    )
    kernel_config = args.liger_kernel_config or {}
    if kernel_config.get("fused_linear_cross_entropy"):
        raise ValueError(
            '`liger_kernel_config={"fused_linear_cross_entropy": True}` is not supported: it '
            "replaces the model's forward, which this trainer runs with a fused LM head (the "
            "completion log-probs in chunks of the vocabulary, `logprob_chunk_tokens`). Leave "
            "fused_linear_cross_entropy unset or False."
        )
    args.liger_kernel_config = {**kernel_config, "fused_linear_cross_entropy": False}
    device = args.device if device is None else torch.device(device)
    if device.type in NO_TRITON_DEVICES:
        raise ValueError(
            f"`use_liger_kernel=True` needs a GPU: Liger's kernels are Triton kernels, which do "
            f"not run on the {device.type.upper()} ({device}). Set use_liger_kernel=False here; "
            "the completion log-probs are computed in chunks (no full logits) either way."
        )
    for module, package in (("liger_kernel", "liger-kernel"), ("triton", "triton")):
        if importlib.util.find_spec(module) is None:
            raise ImportError(
                f"`use_liger_kernel=True` needs {package}, which is not installed: "
                f"`pip install {package}` (or `pip install trl_grpo_ext[liger]`), or set "
                "use_liger_kernel=False."
            )
