"""Engine output -> `Rollout`: each completion cut where it ends, decoded, and assembled with
the rows' columns by `rollout.assemble_rollout`, for single-turn batches, multi-turn ones
(`Turns`) and a user's `rollout_func` alike. `RolloutProducer` holds one `RolloutAssembler`."""

from __future__ import annotations

import torch

from .images import ROLLOUT_FUNC_WITH_IMAGES, rows_have_images
from .prompts import is_conversational
from .rollout import CompletionEnds, Rollout, assemble_rollout, left_padded


class RolloutAssembler:
    """Turns sampled ids into `Rollout`s.

    Args:
        tokenizer: decodes the completions; its `pad_token_id` pads.
        eos_token_ids (`list[int]`): the tokens that end a completion.
        ends (`CompletionEnds`): where each completion ends (eos, stop strings).
        pad_to_multiple_of (`int`, *optional*): the rollouts' tensors' widths.
    """

    def __init__(self, tokenizer, eos_token_ids, ends: CompletionEnds, pad_to_multiple_of=None):
        self.tokenizer, self.eos_token_ids, self.ends = tokenizer, eos_token_ids, ends
        self.pad_to_multiple_of = pad_to_multiple_of

    def build_rollout(
        self,
        rows,
        prompt_ids,
        prompt_mask,
        completion_ids,
        behaviour_logps,
        version,
        prompts=None,
        image_inputs=None,
    ) -> Rollout:
        """A `Rollout` from an engine's `(N, T)` output: each completion cut where it ends
        (`CompletionEnds`), decoded, the columns repeated per completion. `prompts` (one per
        row) default to the rows' `prompt`; `image_inputs` are the completions' multimodal
        fields (`images.per_sample`)."""
        group_size = len(completion_ids) // len(rows)
        prompts = prompts or [row["prompt"] for row in rows]
        prompts = [prompt for prompt in prompts for _ in range(group_size)]
        ids, logps, ended = self.ends.cut(completion_ids, behaviour_logps)
        return self.assemble(
            rows,
            prompts,
            prompt_ids,
            prompt_mask,
            ids,
            ended,
            logps=logps,
            version=version,
            image_inputs=image_inputs,
        )

    def assemble(self, rows, prompts, prompt_ids, prompt_mask, ids, ended, **fields) -> Rollout:
        """`rollout.assemble_rollout` with this run's padding, decoding (unless `completions`
        are given) and the rows' columns (with `columns` added to them)."""
        group_size = len(ids) // len(rows)
        completions = fields.pop("completions", None) or self.decoded(prompts[0], ids)
        columns = {**_columns(rows, group_size), **fields.pop("columns", {})}
        return assemble_rollout(
            prompts,
            prompt_ids,
            prompt_mask,
            ids,
            ended,
            completions,
            columns=columns,
            group_size=group_size,
            pad_token_id=self.tokenizer.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            **fields,
        )

    def turns_rollout(self, rows, request, prompt_ids, prompt_mask, turns, version) -> Rollout:
        """The `Rollout` of a multi-turn batch from its `Turns`."""
        rollout = self.assemble(
            rows,
            request.prompts,
            prompt_ids,
            prompt_mask,
            turns.completion_ids,
            turns.ended,
            completions=turns.completions,
            logps=turns.logps,
            tool_mask=turns.tool_mask,
            version=version,
            image_inputs=turns.image_inputs,
        )
        rollout.tool_calls = torch.tensor(turns.calls)
        rollout.tool_failures = torch.tensor(turns.failures)
        rollout.environments = request.environments
        return rollout

    def from_rollout_func(self, rows, rollout_func, group: int, version: int) -> Rollout:
        """The rollout a user's `rollout_func(prompts)` sampled (TRL's, the trainer bound as
        its second argument): it gets each row's prompt once
        per completion (G consecutive copies, as TRL's per-completion inputs) and returns, per
        completion, `prompt_ids`, `completion_ids` and `logprobs` (None, or the sampled tokens'
        log-probs), optionally `env_mask` (0 on tokens it did not sample) and further fields,
        which reward functions receive as keyword arguments."""
        if rows_have_images(rows):
            raise ValueError(ROLLOUT_FUNC_WITH_IMAGES)
        prompts = [row["prompt"] for row in rows for _ in range(group)]
        output = rollout_func(prompts)
        missing = {"prompt_ids", "completion_ids", "logprobs"} - set(output)
        if missing:
            raise ValueError(f"rollout_func must return keys {sorted(missing)} in its output dict.")
        extra = {k: v for k, v in output.items() if k not in ("prompt_ids", "completion_ids")}
        logps, tool_mask = extra.pop("logprobs"), extra.pop("env_mask", None)
        # A field that is not a list (`env_name: "maze"`) is every completion's, as in TRL.
        extra = {k: v if isinstance(v, list) else [v] * len(prompts) for k, v in extra.items()}
        for key, values in [("prompt_ids", output["prompt_ids"]), *extra.items()]:
            if len(values) != len(prompts):
                raise ValueError(
                    f"rollout_func returned {len(values)} {key!r} for {len(prompts)} completions "
                    f"({len(rows)} prompts x num_generations={group}); return one per completion."
                )
        prompt_ids, prompt_mask = left_padded(output["prompt_ids"], self.tokenizer.pad_token_id)
        completion_ids = [list(ids) for ids in output["completion_ids"]]
        # Kept whole (tool results may sit between its turns); a trailing pad ends one too.
        ends = CompletionEnds.of(
            [*self.eos_token_ids, self.tokenizer.pad_token_id],
            self.ends.stop_strings,
            self.tokenizer,
        )
        ended = [ends.finished(ids) for ids in completion_ids]
        return self.assemble(
            rows,
            prompts,
            prompt_ids,
            prompt_mask,
            completion_ids,
            ended,
            columns=extra,
            logps=logps,
            tool_mask=tool_mask,
            version=version,
        )

    def decoded(self, prompt, completion_ids: list[list[int]]) -> list:
        """Completions as text: strings, or one assistant message each when the prompts are
        conversational (`prompt` is one of them)."""
        decoded = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if is_conversational(prompt):
            decoded = [[{"role": "assistant", "content": text}] for text in decoded]
        return decoded


def _columns(rows: list[dict], group: int) -> dict[str, list]:
    """The dataset columns but the prompt, one entry per completion."""
    return {
        key: [row[key] for row in rows for _ in range(group)] for key in rows[0] if key != "prompt"
    }
