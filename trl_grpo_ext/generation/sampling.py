"""The sampling settings of every `generate` call, built in one place from the configuration.

`transformers`' `generate` fills each field its `GenerationConfig` leaves unset from the model's
`generation_config.json`, then from its own global defaults (`top_k=50`). A checkpoint that ships
`top_k: 20, min_p: 0.05` (Qwen2.5-Instruct, Qwen3) would then sample from a truncated
distribution while the trainer computes log-probs on the full softmax. Here every field is given
explicitly, and `generate` runs with the checkpoint's defaults hidden (`isolated_from_checkpoint`),
so what the configuration says is what `generate` uses, whatever the checkpoint says.
"""

from __future__ import annotations

import contextlib

from transformers import GenerationConfig, PreTrainedModel


def sampling_config(
    *,
    max_new_tokens: int,
    eos_token_id: list[int],
    pad_token_id: int | None,
    num_return_sequences: int = 1,
    greedy: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    cache_implementation: str | None = None,
    generation_kwargs: dict | None = None,
) -> GenerationConfig:
    """A complete `GenerationConfig`: TRL's sampling fields, then `generation_kwargs` over them.

    `top_k=0` and `min_p=None` disable those filters (no logits processor is built for them), as
    in TRL. `greedy=True` decodes greedily (evaluation); the sampling fields are then unused.
    """
    settings = dict(
        do_sample=not greedy,
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_return_sequences,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        pad_token_id=pad_token_id,
        eos_token_id=list(eos_token_id),
        cache_implementation=cache_implementation,
    )
    if greedy:
        settings.update(temperature=1.0, top_p=1.0, top_k=0, min_p=None)
    settings.update(generation_kwargs or {})  # the user's overrides win
    return GenerationConfig(**settings)


def sampling_config_from_args(
    args,
    *,
    eos_token_id: list[int],
    pad_token_id: int | None,
    num_return_sequences: int,
) -> GenerationConfig:
    """The sampling settings of training (and of `evaluate()`) from a `GroupRelativeConfig`."""
    return sampling_config(
        max_new_tokens=args.max_completion_length,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        num_return_sequences=num_return_sequences,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        cache_implementation=args.cache_implementation,
        generation_kwargs=args.generation_kwargs,
    )


@contextlib.contextmanager
def isolated_from_checkpoint(model):
    """Hides the checkpoint's `generation_config` from `generate` inside the block.

    Every `transformers` model inside `model` (through PEFT and DDP wrappers) gets a blank
    `GenerationConfig` for the duration, so fields a `sampling_config` leaves at None (e.g.
    `min_p`) stay None instead of taking the checkpoint's value.
    """
    models = [
        module
        for module in model.modules()
        if isinstance(module, PreTrainedModel) and hasattr(module, "generation_config")
    ]
    saved = [inner.generation_config for inner in models]
    try:
        for inner in models:
            inner.generation_config = GenerationConfig()
        yield
    finally:
        for inner, config in zip(models, saved):
            inner.generation_config = config
