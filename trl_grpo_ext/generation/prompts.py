"""Prompts: rendering (chat templates) and tokenisation, the same for training and evaluation.

A prompt is a string (standard) or a list of messages (conversational). Conversational prompts
are rendered with the tokenizer's chat template, whose text already holds the special tokens the
model expects, so they are tokenised without adding any. Plain strings are tokenised with the
tokenizer's special tokens (the BOS token of Llama, Mistral and Gemma base models), as in TRL.
"""

from __future__ import annotations

import warnings

import torch
from datasets import IterableDataset


def is_conversational(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def check_prompts(prompts: list) -> None:
    """Fails on a prompt that is neither a string nor a non-empty list of messages (dicts with
    a `role`), and on a batch that mixes the two kinds, naming the prompt and what a prompt is."""
    kinds = set()
    for prompt in prompts:
        if isinstance(prompt, str):
            kinds.add("a string")
        elif isinstance(prompt, list) and prompt and is_conversational(prompt):
            kinds.add("a list of messages")
        else:
            shown = repr(prompt)
            raise ValueError(
                f"A prompt is {shown[:120]}{'...' if len(shown) > 120 else ''} "
                f"({type(prompt).__name__}). A prompt is a string, or a non-empty list of "
                "messages such as [{'role': 'user', 'content': '...'}], each a dict with a "
                "'role'; fix or drop the dataset rows whose 'prompt' is not."
            )
    if len(kinds) > 1:
        raise ValueError(
            "The prompts of one batch mix strings and lists of messages, which are tokenised "
            "differently (only lists of messages go through the chat template): give every row "
            "of the dataset's 'prompt' column the same kind."
        )


def check_tokens(prompt_mask: torch.Tensor, texts: list[str]) -> None:
    """Fails on a prompt that tokenises to nothing (an empty string, with a tokenizer that adds
    no BOS token): there is nothing to continue from."""
    empty = (prompt_mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"The prompt {texts[empty[0]]!r} has no tokens: this tokenizer adds none to an empty "
            "string, so there is nothing to sample from. Give every row a non-empty prompt."
        )


def check_prompt_dataset(
    tokenizer, dataset, split: str = "train_dataset", needs_prompt: bool = True
) -> dict | None:
    """Fails early on a dataset without a `prompt` column (unless an environment's `reset`
    supplies the prompts: `needs_prompt=False`), or with conversational prompts and a tokenizer
    without a chat template. Returns the first row it read, for the other checks (None when it
    read none): a stream is read once, and one whose columns are unknown (`map` on a stream
    leaves them so) is judged by its first row's.
    """
    columns = getattr(dataset, "column_names", None)
    unknown = columns is None and isinstance(dataset, IterableDataset)
    first = first_row(dataset) if unknown or "prompt" in (columns or []) else None
    if unknown and first is not None:
        columns = list(first)
    if needs_prompt and columns is not None and "prompt" not in columns:
        raise ValueError(
            f"{split} has no 'prompt' column; it has {columns}. Rename the column that "
            "holds the prompts, e.g. dataset.rename_column('question', 'prompt')."
        )
    if first is not None and "prompt" in first:
        check_prompts([first["prompt"]])  # the first row: a wrong format fails at once
        check_chat_template(tokenizer, first, split)
    return first


def first_row(dataset) -> dict | None:
    """The first row of a dataset, streaming or not; None for an empty one."""
    if isinstance(dataset, IterableDataset):
        return next(iter(dataset), None)
    return dataset[0] if dataset is not None and len(dataset) else None


def check_chat_template(tokenizer, row: dict, split: str = "train_dataset") -> None:
    """Fails early when a conversational dataset (its first `row`) meets a tokenizer without
    a chat template."""
    if is_conversational(row["prompt"]) and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{split} holds conversational prompts (lists of messages), but the tokenizer "
            f"{type(tokenizer).__name__} has no chat template to render them. Use the tokenizer of "
            "an instruction-tuned model, set tokenizer.chat_template, or give the prompts as "
            "plain strings."
        )


class PromptEncoder:
    """Renders and tokenises prompts into left-padded id tensors.

    Args:
        tokenizer: the tokenizer (its chat template renders conversational prompts).
        max_prompt_length (`int`, *optional*): longer prompts keep their last tokens; the first
            time this happens a warning says how many prompts of that batch were cut. Prompts
            rendered with tools are measured without the tools' schemas, and never cut: one
            longer than this without them is an error.
        chat_template_kwargs (`dict`, *optional*): extra arguments of `apply_chat_template`
            (e.g. `{"enable_thinking": False}` for Qwen3).
        chat_template (`str`, *optional*): renders instead of the tokenizer's own (the
            prefix-preserving template of multi-turn rollouts, `multi_turn.ToolCallFormat`).
        processor (*optional*): the model's multimodal processor, which `encode_with_images`
            renders and tokenises prompts with images with.
    """

    def __init__(
        self,
        tokenizer,
        max_prompt_length=None,
        chat_template_kwargs=None,
        chat_template=None,
        processor=None,
    ):
        self.tokenizer, self.processor = tokenizer, processor
        self.max_prompt_length = max_prompt_length
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.chat_template = chat_template
        self.num_truncated = 0  # prompts cut so far

    def render(self, prompt, tools: list | None = None) -> str:
        """The prompt's text; `tools` (functions) are rendered by the chat template."""
        if not is_conversational(prompt):
            return prompt
        continue_final = prompt[-1]["role"] == "assistant"
        return self.tokenizer.apply_chat_template(
            prompt,
            tools=tools or None,  # `or None`: Llama's template writes tool boilerplate for []
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            **self.chat_template_kwargs,
        )

    def encode(self, prompts: list, tools: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(prompt_ids, prompt_mask)`, both `(B, P)`, left-padded; `tools`, when given, holds
        each prompt's tools."""
        check_prompts(prompts)
        tools = tools or [None] * len(prompts)
        texts = [self.render(prompt, tool) for prompt, tool in zip(prompts, tools)]
        encoded = self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=not is_conversational(prompts[0]),
        )
        prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]  # (B, P)
        check_tokens(prompt_mask, texts)
        limit = self.max_prompt_length
        if limit is not None and prompt_ids.shape[1] > limit and any(tools):
            # The limit is on what the user wrote, never on the tools' schemas, which the chat
            # template renders first: a prompt fits when it fits rendered without them, and is
            # then kept whole. One whose own messages do not fit is an error, not a cut (a cut
            # from the left would drop the schemas).
            own = self.tokenizer(
                [self.render(prompt) for prompt in prompts], add_special_tokens=False
            )["input_ids"]
            too_long = [len(ids) for ids in own if len(ids) > limit]
            if too_long:
                raise ValueError(
                    f"{len(too_long)} of {len(texts)} prompts are longer than "
                    f"max_prompt_length={limit} tokens without their tools' schemas (the longest "
                    f"has {max(too_long)}). Cutting them from the left would drop the tools' "
                    "descriptions, which the chat template puts first: raise max_prompt_length, "
                    "or set it to None (TRL does not cut prompts)."
                )
            return prompt_ids, prompt_mask
        if limit is not None and prompt_ids.shape[1] > limit:
            cut = int((prompt_mask.sum(dim=1) > limit).sum())
            if cut and not self.num_truncated:
                warnings.warn(
                    f"{cut} of {len(texts)} prompts in this batch are longer than "
                    f"max_prompt_length={limit} tokens and were cut from the left (their first "
                    "tokens dropped). Raise max_prompt_length, or set it to None to keep whole "
                    "prompts; this warning is shown once per run.",
                    stacklevel=2,
                )
            self.num_truncated += cut
            # Left padding, so keeping the last tokens truncates long prompts from the left.
            prompt_ids, prompt_mask = prompt_ids[:, -limit:], prompt_mask[:, -limit:]
        return prompt_ids, prompt_mask

    def encode_with_images(self, prompts: list, images: list[list], tools: list | None = None):
        """`(prompt_ids, prompt_mask, fields)` of conversational prompts with images (and each
        prompt's `tools`, when given): rendered
        by the processor's chat template and tokenised by the processor, which expands each
        image placeholder into the model's image tokens; `fields` are its other outputs
        (`pixel_values`, ...), flattened over the images of the batch. Prompts are never cut
        here: a cut could drop image tokens that the image features must match, so a prompt
        longer than `max_prompt_length` (without its tools' schemas) is an error."""
        if self.processor is None:
            raise ValueError(
                "These prompts have images, but processing_class is a tokenizer, which would "
                "train on their text alone. Pass the model's processor as processing_class "
                "(AutoProcessor.from_pretrained(model_id)), or drop the images from the dataset."
            )
        check_prompts(prompts)
        tools = tools or [None] * len(prompts)
        texts = [
            self.processor.apply_chat_template(
                prompt,
                tools=tool or None,  # `or None`: Llama's template writes tool boilerplate for []
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=prompt[-1]["role"] != "assistant",
                continue_final_message=prompt[-1]["role"] == "assistant",
                **self.chat_template_kwargs,
            )
            for prompt, tool in zip(prompts, tools)
        ]
        encoded = self.processor(
            text=texts,
            images=[list(row) for row in images] if any(images) else None,  # [] for none
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        )
        prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]  # (B, P)
        limit = self.max_prompt_length
        longest = int(prompt_mask.sum(dim=1).max())
        if limit is not None and longest > limit and any(tools):
            # As for text: the limit is on the prompts' own messages, not the tools' schemas.
            own = self.encode_with_images(prompts, images)[1]
            longest = int(own.sum(dim=1).max())
        if limit is not None and longest > limit:
            raise ValueError(
                f"A prompt with images has {longest} tokens (its image tokens included), more "
                f"than max_prompt_length={limit}. Prompts with images are not cut, as a cut "
                "could drop image tokens: raise max_prompt_length, or set it to None (TRL does "
                "not cut prompts)."
            )
        fields = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
        return prompt_ids, prompt_mask, fields
