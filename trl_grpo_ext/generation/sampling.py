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
from dataclasses import dataclass, fields

import torch
from transformers import GenerationConfig, PreTrainedModel


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling settings of a run, fixed for it: the trainer builds them once from its config
    (`SamplingSettings.from_config`); the evaluation harness builds its own. These defaults are
    the defaults of the matching `GroupRelativeConfig` fields, which read them from here.

    `top_k=0` and `min_p=None` disable those filters (no logits processor is built for them), as
    in TRL; `generation_kwargs` (any `GenerationConfig` field, and vLLM's `stop`) override the
    others. `cache_implementation=None` leaves the cache to the engine: on CUDA the transformers
    engine decodes compiled with a static cache (`compiled_decoding.py`); a value is used as
    given, as `disable_compile` in `generation_kwargs` is.
    """

    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None
    generation_kwargs: dict | None = None

    @classmethod
    def from_config(cls, args) -> SamplingSettings:
        """The settings of a `GroupRelativeConfig` (or any object with its field names)."""
        return cls(**{field.name: getattr(args, field.name) for field in fields(cls)})

    def generation_config(
        self,
        *,
        eos_token_id: list[int],
        pad_token_id: int | None,
        num_return_sequences: int = 1,
        greedy: bool = False,
        suppress_tokens: list[int] | None = None,
    ) -> GenerationConfig:
        """A complete `GenerationConfig` of these settings: every field given, so that nothing
        comes from the checkpoint's `generation_config.json` (`isolated_from_checkpoint`).
        `greedy=True` decodes greedily (evaluation); the sampling fields are then unused.
        `suppress_tokens` are never sampled (a VLM's image token, whose embedding would have no
        image features to match)."""
        settings = dict(
            do_sample=not greedy,
            max_new_tokens=self.max_completion_length,
            num_return_sequences=num_return_sequences,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            pad_token_id=pad_token_id,
            eos_token_id=list(eos_token_id),
            cache_implementation=self.cache_implementation,
        )
        if suppress_tokens:
            settings["suppress_tokens"] = list(suppress_tokens)
        if greedy:  # no filter; top_k unset, as transformers warns of top_k=0 without sampling
            settings.update(temperature=1.0, top_p=1.0, top_k=None, min_p=None)
        settings.update(_with_stop_strings(self.generation_kwargs or {}))  # the user's win
        if beam_search(settings):
            # transformers refuses more returned sequences than beams; the engines run each
            # prompt G times and keep one sequence of each, as TRL repeats each prompt G times
            config = GenerationConfig(**{**settings, "num_return_sequences": 1})
            config.num_return_sequences = settings["num_return_sequences"]  # G, read by engines
            return config
        return GenerationConfig(**settings)


def beam_search(settings) -> bool:
    """Whether a `GenerationConfig` (or a dict of its fields) asks for beam search
    (`num_beams > 1` in `generation_kwargs`, TRL's way to it): its tokens are not drawn from one
    distribution per step, so an engine has no behaviour log-probs to give for them."""
    beams = settings.get("num_beams") if isinstance(settings, dict) else settings.num_beams
    return (beams or 1) > 1


BEAMS_ON_THE_TRAINERS_GENERATE = (
    "generation_kwargs num_beams={beams} asks for beam search, which runs on transformers' "
    "generate in the trainer's process only, as in TRL (vLLM takes no num_beams, and the "
    "asynchronous worker corrects for its sampling distribution, which beam search does not "
    "have). Set use_vllm=False and leave max_staleness unset, or remove num_beams."
)


def sampling_config(
    *,
    max_new_tokens: int,
    eos_token_id: list[int],
    pad_token_id: int | None,
    num_return_sequences: int = 1,
    greedy: bool = False,
    **settings,
) -> GenerationConfig:
    """`SamplingSettings(max_completion_length=max_new_tokens, **settings).generation_config(...)`:
    a complete `GenerationConfig`, TRL's sampling fields, then `generation_kwargs` over them."""
    return SamplingSettings(max_completion_length=max_new_tokens, **settings).generation_config(
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        num_return_sequences=num_return_sequences,
        greedy=greedy,
    )


def _with_stop_strings(generation_kwargs: dict) -> dict:
    """`generation_kwargs` with vLLM's `stop` as transformers' `stop_strings` (a list).

    TRL's vLLM-only keys work with every engine: `stop` stops `generate` and vLLM alike.
    `include_stop_str_in_output` is kept for vLLM, where it only trims the text vLLM returns;
    no engine here uses that text (the completion is decoded from the sampled token ids, stop
    string included, as TRL decodes them too), so it changes nothing that is trained.
    """
    kwargs = dict(generation_kwargs)
    if "stop" in kwargs:
        if kwargs.get("stop_strings") is not None:
            raise ValueError(
                "generation_kwargs sets both 'stop' (vLLM's name) and 'stop_strings' "
                "(transformers'); they are the same setting: keep one."
            )
        kwargs["stop_strings"] = kwargs.pop("stop")
    stops = kwargs.get("stop_strings")
    if isinstance(stops, str):
        stops = kwargs["stop_strings"] = [stops]
    if stops is not None and not (
        isinstance(stops, (list, tuple)) and all(isinstance(stop, str) and stop for stop in stops)
    ):
        raise ValueError(
            f"generation_kwargs stop={stops!r} must be a string or a list of non-empty strings."
        )
    if stops is not None and not stops:
        kwargs["stop_strings"] = None
    flag = kwargs.get("include_stop_str_in_output", False)
    if not isinstance(flag, bool):
        raise ValueError(f"generation_kwargs include_stop_str_in_output={flag!r} must be a bool.")
    return kwargs


def end_at_stop_strings(
    tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor, stop_strings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ends each completion at the token that completes its first stop string, as the engines
    stop (vLLM, and `generate` with `stop_strings`): that token is kept, the rest masked out.

    The engines pad what follows a stop with the pad token, which the eos-based mask cannot tell
    from sampled tokens; deciding here, from the decoded tokens, gives the same ends whichever
    engine sampled (including one that kept sampling after the stop).

    Args:
        completion_ids, completion_mask (`torch.Tensor`): `(N, T)`, the mask up to the first eos.
        stop_strings (`list[str]`): the `stop` of `generation_kwargs`.

    Returns:
        `(completion_mask, stopped)`: the mask cut after each stop, `(N, T)`, and `(N,)` True
        where a stop string ended the completion.
    """

    def has_stop(ids):  # special tokens included, as `generate` and the vLLM engines match
        text = tokenizer.decode(ids, skip_special_tokens=False)
        return any(stop in text for stop in stop_strings)

    mask = completion_mask.clone()
    stopped = torch.zeros(len(mask), dtype=torch.bool, device=mask.device)
    lengths = mask.sum(dim=1).tolist()
    for row, length in enumerate(lengths):
        ids = completion_ids[row, : int(length)].tolist()
        if not has_stop(ids):
            continue
        # The shortest prefix that holds a stop (a longer prefix's text extends a shorter one's).
        low, high = 1, len(ids)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if has_stop(ids[:middle]) else (middle + 1, high)
        mask[row, low:] = 0
        stopped[row] = True
    return mask, stopped


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
