"""Rollouts: G sampled completions per prompt, as tensors and text.

A `Rollout` holds one generation batch: for B prompts, B*G rows, the G completions of a prompt
in consecutive rows (a group). Prompts are left-padded, completions right-padded; the completion
mask covers each completion up to and including its first end-of-sequence token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig


@dataclass
class Rollout:
    """One generation batch of `num_prompts * group_size` completions.

    Attributes:
        prompts (`list`): the prompt of each completion (string or message list), repeated per group.
        completions (`list`): decoded completions, strings or `[{"role": "assistant", ...}]`.
        prompt_ids, prompt_mask (`torch.LongTensor` of shape `(N, P)`): left-padded prompts.
        completion_ids, completion_mask (`torch.LongTensor` of shape `(N, T)`): right-padded
            completions; the mask ends at the first eos, inclusive.
        is_truncated (`torch.BoolTensor` of shape `(N,)`): completions that never emitted eos.
        columns (`dict[str, list]`): the other dataset columns, repeated per completion.
        group_size (`int`): completions per prompt.
        behaviour_logps (`torch.Tensor` of shape `(N, T)`, *optional*): log-probs of the sampled
            tokens under the policy that generated them, when known.
        policy_version (`int`): optimizer step of the weights that generated the batch.
    """

    prompts: list
    completions: list
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    is_truncated: torch.Tensor
    group_size: int
    columns: dict[str, list] = field(default_factory=dict)
    behaviour_logps: torch.Tensor | None = None
    policy_version: int = 0

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)

    def completion_id_lists(self) -> list[list[int]]:
        """Token ids of each completion without padding (TRL's `completion_ids` argument)."""
        lengths = self.completion_lengths.tolist()
        return [ids[:length] for ids, length in zip(self.completion_ids.tolist(), lengths)]


def completion_mask_from_ids(
    completion_ids: torch.Tensor, eos_token_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask up to and including the first eos of each row, and which rows have no eos.

    Works when the pad token equals eos: only the first eos counts, the padding after it does not.
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    length = completion_ids.shape[1]
    has_eos = is_eos.any(dim=1)  # (N,)
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), length)  # (N,)
    positions = torch.arange(length, device=completion_ids.device).unsqueeze(0)  # (1, T)
    completion_mask = (positions <= first_eos.unsqueeze(1)).long()  # (N, T)
    return completion_mask, ~has_eos


def eos_token_ids(model, tokenizer) -> list[int]:
    """All token ids that end a completion: the tokenizer's eos and the generation config's."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    ids.discard(None)
    return sorted(ids)


@torch.no_grad()
def generate_with_transformers(
    model,
    tokenizer,
    prompt_texts: list[str],
    *,
    generation_config: GenerationConfig,
    max_prompt_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples a group of completions per prompt in one batched `generate` call.

    Each prompt is tokenised once; `generation_config.num_return_sequences` (the group size)
    expands it into its group inside `generate`.

    Returns:
        `(prompt_ids, prompt_mask, completion_ids)`, of shapes `(B*G, P)`, `(B*G, P)`, `(B*G, T)`.
    """
    encoded = tokenizer(
        prompt_texts,
        return_tensors="pt",
        padding=True,
        padding_side="left",
        add_special_tokens=False,
    ).to(model.device)  # (B, P)
    if max_prompt_length is not None:
        # Left padding, so keeping the last tokens truncates long prompts from the left.
        encoded = {key: value[:, -max_prompt_length:] for key, value in encoded.items()}
    group_size = generation_config.num_return_sequences
    output = model.generate(**encoded, generation_config=generation_config)  # (B*G, P + T)
    prompt_length = encoded["input_ids"].shape[1]
    prompt_ids = encoded["input_ids"].repeat_interleave(group_size, dim=0)  # (B*G, P)
    prompt_mask = encoded["attention_mask"].repeat_interleave(group_size, dim=0)  # (B*G, P)
    return prompt_ids, prompt_mask, output[:, prompt_length:]
