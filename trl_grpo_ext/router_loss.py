"""The load-balancing loss of Mixture-of-Experts models (Qwen3-MoE, GPT-OSS, GLM-4-MoE, ...),
added to the GRPO loss as TRL 1.16 adds it.

A model whose config has `output_router_logits` returns, when asked for its router logits, its
auxiliary loss `outputs.aux_loss` (transformers' `load_balancing_loss_func` over the attended
tokens of the forward pass: prompt and completion, every row in full). The training loss of a
micro-batch is then `L + router_aux_loss_coef * aux_loss` (scaled for gradient accumulation
like the rest), with the coefficient of `router_aux_loss_coef`, or, when that is None, the
model config's own (0.0 where it declares none). Only the training forward pass asks for it.
"""

from __future__ import annotations

import contextlib

import torch

from .logprobs import transformers_model


def router_aux_loss_coef(model, args) -> tuple[float, bool]:
    """`(coefficient, enabled)` of the auxiliary loss for `model`, as TRL decides them; an error
    for `router_aux_loss_coef` on a model without router logits."""
    config = transformers_model(model).config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    is_moe = hasattr(text_config, "output_router_logits")
    coef = args.router_aux_loss_coef
    if coef and not is_moe:
        raise ValueError(
            f"`router_aux_loss_coef` is set to {coef} but {type(transformers_model(model)).__name__} "
            "is not a Mixture-of-Experts model that returns its router logits, so there is no "
            "auxiliary loss to weight: leave router_aux_loss_coef unset (or 0.0)."
        )
    if coef is None:
        coef = getattr(text_config, "router_aux_loss_coef", 0.0)
    return coef, is_moe and coef != 0.0


@contextlib.contextmanager
def captured_aux_losses(model):
    """While active, collects `aux_loss` of every forward pass of `model`'s transformers model
    (a list, in order); the forward passes must be asked for `output_router_logits=True`."""
    captured = []
    handle = transformers_model(model).register_forward_hook(
        lambda module, inputs, output: captured.append(output.aux_loss)
    )
    try:
        yield captured
    finally:
        handle.remove()


def with_aux_loss(loss, aux_losses: list, coef: float, accumulation_steps: int):
    """`(loss + coef * aux_loss / accumulation_steps, aux_loss detached)`, `aux_loss` the mean of
    the forward passes' router losses: as TRL, scaled for gradient accumulation like the policy
    loss."""
    aux_loss = torch.stack(aux_losses).mean()
    return loss + coef * aux_loss / accumulation_steps, aux_loss.detach()
