"""The images of multi-turn rollouts: each rollout's prompt images, then those its tools
returned, in the order they came.

A tool or environment may return content parts with images (`[{"type": "image", "image":
<PIL.Image>}, {"type": "text", "text": ...}]`, TRL's convention). `multi_turn.ToolCallFormat`
renders such a result with the processor's chat template and the processor expands its image
placeholders; the processor's fields for those images (`pixel_values`, ...) arrive here. From
then on the rollout carries them: every later turn is sampled with them (`generation_inputs`),
and the rollout's row of the per-sample layout of `images.py` holds them after the prompt's
(`rows`), so the old, reference and training forward passes see them too. The tokens of a
tool result, its image tokens included, stay out of the loss (the tool mask).
"""

from __future__ import annotations

import torch

from .images import (
    COMPLETION,
    PER_TOKEN_FIELDS,
    entries_of,
    flat_entries,
    model_inputs,
    stack_entries,
)
from .rollout import right_padded


class TurnImages:
    """The image fields of a batch of multi-turn rollouts while their turns are sampled.

    Args:
        rows (`dict[str, torch.Tensor]`, *optional*): the prompts' fields, one row per rollout
            (`images.per_sample`); None for prompts without images.
        prompt_mask (`torch.Tensor`): `(N, P)`, the left-padded prompts' mask.
    """

    def __init__(self, rows: dict[str, torch.Tensor] | None, prompt_mask: torch.Tensor):
        size = len(prompt_mask)
        self.prompt_rows = rows
        self.entries = [entries_of(rows, index) for index in range(size)]
        self.prompt_tokens = {
            name: [rows[name][index][prompt_mask[index].bool()] for index in range(size)]
            for name in PER_TOKEN_FIELDS
            if rows is not None and name in rows
        }
        # per rollout: (completion position where a result starts, its per-token values)
        self.results: list[list[tuple[int, dict]]] = [[] for _ in range(size)]
        self.any = rows is not None

    def add(self, index: int, offset: int, fields: dict[str, torch.Tensor]) -> None:
        """The processor's fields of a tool result of rollout `index`, whose tokens start at
        completion position `offset`: per-image entries after the rollout's others, per-token
        values over the result's tokens."""
        per_token = {}
        for name, value in fields.items():
            if name in PER_TOKEN_FIELDS:
                per_token[name] = value
                continue
            before = self.entries[index].get(name)
            self.entries[index][name] = value if before is None else torch.cat([before, value])
        if per_token:
            self.results[index].append((offset, per_token))
        self.any = True

    def _token_names(self) -> list[str]:
        names = set(self.prompt_tokens)
        names.update(name for results in self.results for _, values in results for name in values)
        return sorted(names)

    def _completion_tokens(self, index: int, name: str, length: int) -> torch.Tensor:
        """The per-token field `name` over the first `length` completion positions of rollout
        `index`: the tool results' values, 0 on the model's own tokens."""
        values = torch.zeros(length, dtype=torch.long)
        for offset, per_token in self.results[index]:
            if name in per_token:
                given = per_token[name][: max(length - offset, 0)]
                values[offset : offset + len(given)] = given
        return values

    def _prompt_tokens(self, index: int, name: str, length: int) -> torch.Tensor:
        if name in self.prompt_tokens:
            return self.prompt_tokens[name][index].long()
        return torch.zeros(length, dtype=torch.long)

    def prompt_inputs(self) -> dict | None:
        """The fields `generate` takes for the prompts, as the processor returned them."""
        if self.prompt_rows is None:
            return None
        return model_inputs(self.prompt_rows) or None

    def generation_inputs(self, indices: list[int], contexts: list[list[int]], prompt_lengths):
        """The fields `generate` takes for the rollouts `indices`, whose contexts (prompt and
        completion so far, `prompt_lengths` of them the prompt's) are left-padded together:
        their per-image entries concatenated in order, per-token fields left-padded like the
        contexts. None when none of these rollouts has an image."""
        if not self.any:
            return None
        inputs = flat_entries([self.entries[index] for index in indices])
        inputs = {name: value for name, value in inputs.items() if len(value)}
        if not inputs:
            return None
        width = max(len(context) for context in contexts)
        for name in self._token_names():
            rows = []
            for index, context, prompt_length in zip(indices, contexts, prompt_lengths):
                prompt = self._prompt_tokens(index, name, prompt_length)
                completion = self._completion_tokens(index, name, len(context) - prompt_length)
                row = torch.cat([prompt, completion])
                rows.append(torch.cat([row.new_zeros(width - len(row)), row]))
            inputs[name] = torch.stack(rows)  # (n, width), left-padded as the contexts
        return inputs

    def rows(self, completion_lengths: list[int], prompt_width: int) -> dict | None:
        """The rollouts' fields in the per-sample layout, tool results' images included (per-token
        values over the completions in `<name>:completion`); None without any image."""
        if not self.any:
            return None
        rows = stack_entries(self.entries)
        for name in self._token_names():
            if self.prompt_rows is not None and name in self.prompt_rows:
                rows[name] = self.prompt_rows[name]  # (N, P)
            else:
                rows[name] = torch.zeros((len(completion_lengths), prompt_width), dtype=torch.long)
            completions = [
                self._completion_tokens(index, name, length).tolist()
                for index, length in enumerate(completion_lengths)
            ]
            rows[name + COMPLETION] = right_padded(completions, 0, torch.long)  # (N, T)
        return rows
