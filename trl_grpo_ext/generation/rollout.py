"""Rollouts: G sampled completions per prompt, as tensors and text.

A `Rollout` holds one generation batch: for B prompts, B*G rows, the G completions of a prompt
in consecutive rows (a group). Prompts are left-padded, completions right-padded; the completion
mask covers each completion up to and including its first end-of-sequence token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .images import PER_TOKEN_FIELDS, concat_rows, select_rows


@dataclass
class Rollout:
    """One generation batch of `num_prompts * group_size` completions. Its tensors are on the
    CPU, whichever device sampled it (`assemble_rollout`); `batches.training_tensors` moves them.

    Attributes:
        prompts (`list`): the prompt of each completion (string or message list), repeated per group.
        completions (`list`): decoded completions, strings or `[{"role": "assistant", ...}]`.
        prompt_ids (`torch.LongTensor`): left-padded prompt tokens, shape `(N, P)`.
        prompt_mask (`torch.LongTensor`): 1 on prompt tokens, shape `(N, P)`.
        completion_ids (`torch.LongTensor`): right-padded completion tokens, shape `(N, T)`.
        completion_mask (`torch.LongTensor`): 1 up to and including the first eos, shape
            `(N, T)`.
        is_truncated (`torch.BoolTensor` of shape `(N,)`): completions that never emitted eos.
        columns (`dict[str, list]`): the other dataset columns, repeated per completion.
        group_size (`int`): completions per prompt.
        behaviour_logps (`torch.Tensor` of shape `(N, T)`, *optional*): log-probs of the sampled
            tokens under the policy that generated them, when known.
        policy_version (`int`): optimizer step of the weights that generated the batch.
        tool_mask (`torch.LongTensor` of shape `(N, T)`, *optional*): multi-turn rollouts: 1 on
            the tokens the model sampled, 0 on tool results (no gradient, ratio or KL there).
        tool_calls, tool_failures (`torch.LongTensor` of shape `(N,)`, *optional*): tool calls
            each rollout made, and how many of them came back as errors.
        environments (`list`, *optional*): the environment of each rollout
            (`environment_factory`), which reward functions receive as `environments`.
        image_inputs (`dict[str, torch.Tensor]`, *optional*): prompts with images: the
            processor's multimodal fields, one row per completion (`images.per_sample`).
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
    tool_mask: torch.Tensor | None = None
    tool_calls: torch.Tensor | None = None
    tool_failures: torch.Tensor | None = None
    environments: list | None = None
    image_inputs: dict[str, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)

    def select_groups(self, groups: list[int]) -> Rollout:
        """A rollout holding only the given groups (indices of prompts), in that order."""
        size = self.group_size
        rows = [group * size + member for group in groups for member in range(size)]
        index = torch.tensor(rows, dtype=torch.long)

        def pick(values):
            return [values[row] for row in rows]

        def rows_of(tensor):
            return None if tensor is None else tensor[index]

        return Rollout(
            prompts=pick(self.prompts),
            completions=pick(self.completions),
            prompt_ids=self.prompt_ids[index],
            prompt_mask=self.prompt_mask[index],
            completion_ids=self.completion_ids[index],
            completion_mask=self.completion_mask[index],
            is_truncated=self.is_truncated[index],
            group_size=size,
            columns={key: pick(values) for key, values in self.columns.items()},
            behaviour_logps=rows_of(self.behaviour_logps),
            policy_version=self.policy_version,
            tool_mask=rows_of(self.tool_mask),
            tool_calls=rows_of(self.tool_calls),
            tool_failures=rows_of(self.tool_failures),
            environments=None if self.environments is None else pick(self.environments),
            image_inputs=select_rows(self.image_inputs, index),
        )

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


def left_padded(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as a left-padded `(N, P)` tensor and its mask."""
    width = max(len(ids) for ids in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if len(sequence):
            ids[row, width - len(sequence) :] = torch.as_tensor(sequence, dtype=torch.long)
            mask[row, width - len(sequence) :] = 1
    return ids, mask


def right_padded(rows: list[list], value, dtype=None) -> torch.Tensor:
    """Lists as a right-padded `(N, T)` tensor (`value` after each row)."""
    width = max([len(row) for row in rows] + [1])  # one column at least: all rows may be empty
    return torch.tensor([list(row) + [value] * (width - len(row)) for row in rows], dtype=dtype)


@dataclass(frozen=True)
class CompletionEnds:
    """The one rule for where a sampled turn ends, whichever engine sampled it and whichever path
    (single-turn, multi-turn, a `rollout_func`, evaluation) assembles it.

    A turn ends at its first eos token, or at the token that completes its first stop string
    (`generation_kwargs={"stop": [...]}`), that token kept; whatever an engine put after it (its
    padding, or tokens sampled on past a stop) is not part of the completion. A turn that reached
    neither is truncated.

    Attributes:
        eos_token_ids (`tuple[int, ...]`): the tokens that end a turn.
        stop_strings (`tuple[str, ...]`): the stop strings; empty for none.
        tokenizer (*optional*): decodes turns to find stop strings (special tokens included, as
            `generate` and the vLLM engines match them); needed only with stop strings.
    """

    eos_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...] = ()
    tokenizer: object = None

    @classmethod
    def of(cls, eos_token_ids, stop_strings=None, tokenizer=None) -> CompletionEnds:
        if stop_strings and tokenizer is None:
            raise ValueError("Ending completions at stop strings needs the tokenizer.")
        return cls(tuple(eos_token_ids), tuple(stop_strings or ()), tokenizer)

    def cut(
        self, completion_ids: torch.Tensor, logps: torch.Tensor | None = None
    ) -> tuple[list[list[int]], list[list[float]] | None, list[bool]]:
        """Each row of an engine's `(N, T)` output up to its end, its log-probs cut alike, and
        whether it ended (True) or was truncated (False)."""
        from .sampling import end_at_stop_strings

        mask, no_eos = completion_mask_from_ids(completion_ids, list(self.eos_token_ids))
        ended = ~no_eos  # (N,)
        if self.stop_strings:
            mask, stopped = end_at_stop_strings(
                self.tokenizer, completion_ids, mask, list(self.stop_strings)
            )
            ended = ended | stopped
        lengths = mask.sum(dim=1).tolist()
        ids = [row[:length] for row, length in zip(completion_ids.tolist(), lengths)]
        if logps is not None:
            logps = [row[:length] for row, length in zip(logps.tolist(), lengths)]
        return ids, logps, ended.tolist()

    def finished(self, ids: list[int]) -> bool:
        """Whether a whole completion (a `rollout_func`'s) ended rather than being truncated: its
        last token is an eos, or completes a stop string."""
        if not ids:
            return False
        if ids[-1] in self.eos_token_ids:
            return True
        if not self.stop_strings:
            return False

        def text(tokens):
            return self.tokenizer.decode(tokens, skip_special_tokens=False)

        return not any(s in text(ids[:-1]) for s in self.stop_strings) and any(
            s in text(ids) for s in self.stop_strings
        )


def assemble_rollout(
    prompts: list,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: list[list[int]],
    ended: list[bool],
    completions: list,
    *,
    columns: dict[str, list],
    group_size: int,
    pad_token_id: int,
    logps: list[list] | None = None,
    tool_mask: list[list[int]] | None = None,
    version: int = 0,
    pad_to_multiple_of: int | None = None,
    image_inputs: dict[str, torch.Tensor] | None = None,
) -> Rollout:
    """The one function that turns sampled ids into a `Rollout`, for every generation path.

    Each completion is kept whole as given (already cut where it ends, `CompletionEnds`): the
    mask covers exactly its tokens, so no padding is ever trained; `ended[i]` False marks it
    truncated. Log-probs that are None (vLLM's for a NaN) become NaN; the tool mask is 1 on the
    model's own tokens.

    Args:
        prompts (`list`): the prompt of each completion (repeated per group).
        prompt_ids, prompt_mask (`torch.Tensor`): left-padded prompts, `(N, P)`.
        completion_ids (`list[list[int]]`): each completion's tokens, no padding.
        ended (`list[bool]`): whether each completion ended (eos or stop string).
        completions (`list`): the decoded completions (strings or messages).
        pad_to_multiple_of (`int`, *optional*): pad both widths to a multiple of it.
        image_inputs (`dict[str, torch.Tensor]`, *optional*): the multimodal fields of each
            completion's prompt (`images.per_sample`).
    """
    lengths = torch.tensor([len(ids) for ids in completion_ids])  # (N,)
    positions = torch.arange(max(int(lengths.max()), 1)).unsqueeze(0)  # (1, T)
    behaviour = None
    if logps is not None:
        rows = [[float("nan") if x is None else x for x in row] for row in logps]
        behaviour = right_padded(rows, 0.0, torch.float32)  # (N, T)
    rollout = Rollout(
        prompts=prompts,
        completions=completions,
        prompt_ids=prompt_ids.cpu(),  # the engine's are on the model's device
        prompt_mask=prompt_mask.cpu(),
        completion_ids=right_padded(completion_ids, pad_token_id, torch.long),  # (N, T)
        completion_mask=(positions < lengths.unsqueeze(1)).long(),  # (N, T)
        is_truncated=~torch.tensor(ended, dtype=torch.bool).reshape(-1),
        group_size=group_size,
        columns=columns,
        behaviour_logps=behaviour,
        policy_version=version,
        tool_mask=None if tool_mask is None else right_padded(tool_mask, 1, torch.long),
        image_inputs=image_inputs and {name: value.cpu() for name, value in image_inputs.items()},
    )
    if pad_to_multiple_of:
        rollout = pad_rollout(rollout, pad_to_multiple_of, pad_token_id)
    return rollout


def _pad_to(tensor: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    filler = torch.full((tensor.shape[0], missing), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([filler, tensor] if left else [tensor, filler], dim=1)


def pad_rollout(rollout: Rollout, multiple: int, pad_token_id: int) -> Rollout:
    """Pads prompts (left) and completions (right) to a multiple of `multiple` tokens
    (`pad_to_multiple_of`: compilers that specialise on shapes then see few distinct ones)."""

    def width(tensor):
        return -(-tensor.shape[1] // multiple) * multiple

    prompt_width, completion_width = width(rollout.prompt_ids), width(rollout.completion_ids)
    rollout.prompt_ids = _pad_to(rollout.prompt_ids, prompt_width, pad_token_id, left=True)
    rollout.prompt_mask = _pad_to(rollout.prompt_mask, prompt_width, 0, left=True)
    rollout.completion_ids = _pad_to(
        rollout.completion_ids, completion_width, pad_token_id, left=False
    )
    rollout.completion_mask = _pad_to(rollout.completion_mask, completion_width, 0, left=False)
    if rollout.behaviour_logps is not None:
        rollout.behaviour_logps = _pad_to(rollout.behaviour_logps, completion_width, 0.0, False)
    if rollout.tool_mask is not None:
        rollout.tool_mask = _pad_to(rollout.tool_mask, completion_width, 1, left=False)
    if rollout.image_inputs is not None:
        rollout.image_inputs = {
            name: _pad_to(value, prompt_width, 0, left=True) if name in PER_TOKEN_FIELDS else value
            for name, value in rollout.image_inputs.items()
        }
    return rollout


def concat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Joins rollouts of the same group size, re-padding prompts (left) and completions (right)."""
    first = rollouts[0]
    prompt_width = max(r.prompt_ids.shape[1] for r in rollouts)
    completion_width = max(r.completion_ids.shape[1] for r in rollouts)

    def stack(name, width, value, left):
        return torch.cat([_pad_to(getattr(r, name), width, value, left) for r in rollouts])

    def stack_if_all(name, width=None, value=None):
        if any(getattr(r, name) is None for r in rollouts):
            return None
        if width is None:  # one value per row
            return torch.cat([getattr(r, name) for r in rollouts])
        return stack(name, width, value, left=False)

    environments = None
    if all(r.environments is not None for r in rollouts):
        environments = [e for r in rollouts for e in r.environments]
    return Rollout(
        prompts=[p for r in rollouts for p in r.prompts],
        completions=[c for r in rollouts for c in r.completions],
        prompt_ids=stack("prompt_ids", prompt_width, pad_token_id, left=True),
        prompt_mask=stack("prompt_mask", prompt_width, 0, left=True),
        completion_ids=stack("completion_ids", completion_width, pad_token_id, left=False),
        completion_mask=stack("completion_mask", completion_width, 0, left=False),
        is_truncated=torch.cat([r.is_truncated for r in rollouts]),
        group_size=first.group_size,
        columns={key: [v for r in rollouts for v in r.columns[key]] for key in first.columns},
        behaviour_logps=stack_if_all("behaviour_logps", completion_width, 0.0),
        policy_version=min(r.policy_version for r in rollouts),
        tool_mask=stack_if_all("tool_mask", completion_width, 1),
        tool_calls=stack_if_all("tool_calls"),
        tool_failures=stack_if_all("tool_failures"),
        environments=environments,
        image_inputs=concat_rows(
            [r.image_inputs for r in rollouts],
            [r.prompt_ids.shape[1] for r in rollouts],
            prompt_width,
            [len(r) for r in rollouts],
        ),
    )
