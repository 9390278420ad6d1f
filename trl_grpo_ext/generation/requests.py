"""A batch of rows as one request to an engine, built in one place, and the one function that
runs a request on an engine, for every caller: the synchronous trainer, the asynchronous
rollout worker (`engines.EngineWorker`) and evaluations.

`RequestBuilder.build(rows, group, slot)` decides once whether the batch runs tools (each of
the G rollouts of a row started with its environment of `slot`: its own prompt and tools),
whether it has images (asked once of `images.encode_with_images`: the processor's fields for
the engine and their per-sample split for training), and encodes the prompts once.
`run_request` samples it: one `generate` call, or the multi-turn `ToolLoop`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .images import encode_with_images, rows_have_images
from .prompts import is_conversational

NEEDS_CONVERSATIONAL = (
    "Tools and environments need conversational prompts (lists of messages), which the "
    "chat template renders with the tools' schemas; got plain strings. Give the "
    'prompts as [{"role": "user", "content": ...}].'
)


@dataclass
class Request:
    """One generation batch as an engine takes it.

    Attributes:
        prompts (`list`): one per row (one per rollout with tools), with their images in their
            messages; what the rollout records as its prompts.
        prompt_ids, prompt_mask (`torch.Tensor`): `(B, P)` left-padded (`(B*G, P)` with tools).
        engine_images (`dict`, *optional*): the multimodal fields the engine samples with: the
            processor's (single-turn), or one row per rollout (with tools).
        completion_images (`dict`, *optional*): each completion's fields (`images.per_sample`),
            for single-turn rollouts (a multi-turn rollout's come with its turns).
        tools, environments (`list`, *optional*): each rollout's, when the batch runs tools.
    """

    prompts: list
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    engine_images: dict | None = None
    completion_images: dict | None = None
    tools: list | None = None
    environments: list | None = None

    @property
    def engine_prompts(self) -> tuple:
        """`(prompt_ids, prompt_mask)`, with the engine's image fields third when there are
        some: what `run_request` and a rollout worker take."""
        images = () if self.engine_images is None else (self.engine_images,)
        return (self.prompt_ids, self.prompt_mask, *images)


class RequestBuilder:
    """Builds the `Request` of a batch of rows.

    Args:
        encoder (`PromptEncoder`): renders and tokenises the prompts.
        agent (*optional*): the run's tools and environments (`tools.Agent`).
        check_images (`Callable[[], None]`): raises when the engine cannot sample images.
    """

    def __init__(self, encoder, agent=None, check_images=lambda: None):
        self.encoder, self.agent, self.check_images = encoder, agent, check_images

    def build(self, rows: list[dict], group: int, slot=0) -> Request:
        """The request of `rows`, `group` completions each; with tools, the environments of
        `slot` are reset with the rows now."""
        with_images = rows_have_images(rows)
        if with_images:
            self.check_images()
        if self.agent is None:
            if not with_images:
                prompts = [row["prompt"] for row in rows]
                return Request(prompts, *self.encoder.encode(prompts))
            prompts, ids, mask, fields, per_completion = encode_with_images(
                self.encoder, rows, group
            )
            return Request(prompts, ids, mask, fields, completion_images=per_completion)
        prompts, tools, environments = self.agent.start(rows, group, slot)
        if not is_conversational(prompts[0]):
            raise ValueError(NEEDS_CONVERSATIONAL)
        functions = [t.functions for t in tools]
        if not with_images:
            ids, mask = self.encoder.encode(prompts, functions)
            return Request(prompts, ids, mask, tools=tools, environments=environments)
        expanded = [row for row in rows for _ in range(group)]  # one row per rollout
        prompts, ids, mask, _, per_rollout = encode_with_images(
            self.encoder, expanded, 1, prompts, functions
        )
        return Request(prompts, ids, mask, per_rollout, tools=tools, environments=environments)


def run_request(engine, generation_config, seed, prompts: tuple, tools=None, tool_loop=None):
    """Samples a request (`Request.engine_prompts`, and its `tools`) on `engine`: one
    `generate` call, or with tools every turn of the `tool_loop`. Returns `(prompt_ids,
    prompt_mask, completion_ids, behaviour_logps, turns)`: the engine's tensors (`turns` None),
    or a multi-turn batch's `Turns` (the tensors None)."""
    prompt_ids, prompt_mask, *images = prompts  # images: the engine's fields, if any
    if tools is None:
        return (*engine.generate(prompt_ids, prompt_mask, generation_config, seed, *images), None)
    turns = tool_loop.run(engine, generation_config, seed, prompt_ids, prompt_mask, tools, *images)
    return prompt_ids, prompt_mask, None, None, turns
