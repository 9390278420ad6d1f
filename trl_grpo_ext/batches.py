"""From a scored rollout to the micro-batches the Trainer's loop trains on.

`training_tensors` lays a generation batch out as the model reads it (prompt and completion ids
side by side, the completion mask of the tokens that get a gradient, the advantages);
`split_micro_batches` cuts it into micro-batches and gives each the token count of its whole
optimizer step over all processes, the "dapo" denominator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .generation.images import model_inputs
from .generation.rollout import Rollout

IMAGE_PREFIX = "image_inputs."  # the keys of the multimodal fields in a batch


def training_tensors(
    rollout: Rollout,
    advantages: torch.Tensor,
    device: torch.device,
    *,
    mask_truncated: bool = False,
    trainable: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of one generation batch, on `device`. `completion_mask` marks the tokens that
    get a gradient and enter the ratio and the KL: not tool results (`Rollout.tool_mask`), which
    the attention still reads.

    Args:
        advantages (`torch.Tensor`): `(N,)`, one per completion.
        mask_truncated (`bool`): completions cut at the length cap get no gradient
            (`mask_truncated_completions`).
        trainable (`torch.Tensor`, *optional*): `(N,)` bool; False rows get no gradient (the
            filler groups of dynamic sampling).
    """
    completion_mask = rollout.completion_mask.to(device)
    if mask_truncated:
        completion_mask = completion_mask * (~rollout.is_truncated).to(device).unsqueeze(1)
    if trainable is not None:
        completion_mask = completion_mask * trainable.to(device).unsqueeze(1)
    prompt_ids, completion_ids = rollout.prompt_ids.to(device), rollout.completion_ids.to(device)
    attention_mask = torch.cat([rollout.prompt_mask.to(device), completion_mask], 1)
    if rollout.tool_mask is not None:  # tool results are read, never trained on
        completion_mask = completion_mask * rollout.tool_mask.to(device)
    tensors = {
        "input_ids": torch.cat([prompt_ids, completion_ids], 1),
        "attention_mask": attention_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages.to(device),
    }
    if rollout.behaviour_logps is not None:
        tensors["behaviour_logps"] = rollout.behaviour_logps.to(device)
    for name, value in (rollout.image_inputs or {}).items():
        # One row per completion, so every slice of rows carries its own images.
        tensors[IMAGE_PREFIX + name] = value.to(device)
    return tensors


def image_model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The forward pass's multimodal keyword arguments for the rows of `batch` (a generation
    batch, a micro-batch or a chunk of one), from the per-completion fields that
    `training_tensors` put in it; empty for text."""
    rows = {k[len(IMAGE_PREFIX) :]: v for k, v in batch.items() if k.startswith(IMAGE_PREFIX)}
    if not rows:
        return {}
    return model_inputs(rows, batch["completion_ids"].shape[1])


def split_micro_batches(
    tensors: dict[str, torch.Tensor],
    micro_batch_size: int,
    accumulation_steps: int,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor],
) -> list[dict]:
    """Micro-batches of `micro_batch_size` rows; consecutive groups of `accumulation_steps`
    form one optimizer step, and each micro-batch's `num_items_in_batch` is the completion-token
    count of its step over all processes (at least 1)."""
    rows = len(tensors["input_ids"])
    micro_batches = [
        {key: value[i : i + micro_batch_size] for key, value in tensors.items()}
        for i in range(0, rows, micro_batch_size)
    ]
    for start in range(0, len(micro_batches), accumulation_steps):
        step = micro_batches[start : start + accumulation_steps]
        tokens = step_tokens(step, sum_over_processes)
        for batch in step:
            batch["num_items_in_batch"] = tokens
    return micro_batches


def step_tokens(
    micro_batches: list[dict], sum_over_processes: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The completion-token count of one optimizer step's micro-batches over all processes (at
    least 1): the "dapo" denominator."""
    tokens = sum(batch["completion_mask"].sum() for batch in micro_batches)
    return sum_over_processes(tokens.float()).clamp(min=1)
