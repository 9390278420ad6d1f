"""Compiled decoding: the transformers engine's default on CUDA.

On a GPU a decoding step is bound by the host: each step launches every layer's kernels from
Python. `generate` compiles the decoding steps' forward when the KV cache is a static one (CUDA
graphs: a step is one replay), and the engine's sampling loop runs the same compiled call
(`compacting.py`). A compiled graph holds for one shape: the rows of the batch and the length
of the static cache. Here both are bucketed (`decoding_shape`), so that a run whose prompts have
many lengths, and whose evaluation batches have other sizes, compiles a few graphs:

- the cache holds `prompt + max_new_tokens` positions rounded up to a bucket (not the model's
  maximum); `generate` keeps the longest cache a model has had, so the lengths only grow;
- the `B*G` rows are rounded up to a bucket with copies of the last row, which are sampled and
  dropped; the prompts keep their own left padding (the prompts' pass runs uncompiled).

Buckets are 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5 times them): at most a third
of the rows or positions is padding. The tokens are drawn from the same distribution as the
dynamic path's (each row's logits do not depend on the other rows), not the same draws: the
padded rows take random numbers too, and each prompt is encoded once per row.

It runs where nothing asks otherwise: `cache_implementation` left unset and no
`disable_compile` in `generation_kwargs` (either gives TRL's behaviour, the dynamic cache or
the cache asked for). Where it cannot run (`unavailable`: not CUDA, a model whose cache cannot
be static, ZeRO-3 or FSDP, torch before 2.6, multimodal inputs) the reason is logged once and
the dynamic path samples. A `compile_config` with `_compile_all_devices = True` (in
`generation_kwargs`) forces it on any device, as `generate` then compiles on any device: the
tests do this on the CPU.

transformers internals read here (tested with 5.19 and 5.25): `GenerationConfig.max_cache_len`
(public) and the model class's `_can_compile_fullgraph` (private: True where a static cache and
a compiled forward are supported); `generate` decides the compiling itself.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from transformers import CompileConfig, GenerationConfig
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.integrations.fsdp import is_fsdp_managed_module

from ..logprobs import adds_virtual_tokens, transformers_model
from . import compacting

logger = logging.getLogger(__name__)

MIN_TORCH = (2, 6)
# The inputs a compiled batch carries; others (a processor's image fields) are not padded here.
TEXT_INPUTS = frozenset({"input_ids", "attention_mask", "tokenizer"})
_said: set = set()  # the reasons (str) and shapes (DecodingShape) logged in this process


def bucket(value: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5 times them)
    that holds `value` (>= 1): at most a third of a bucket is padding."""
    if value < 1:
        raise ValueError(f"a bucket holds at least 1, not {value}")
    power = 1
    while power < value:
        if power >= 2 and power * 3 // 2 >= value:
            return power * 3 // 2
        power *= 2
    return power


@dataclass(frozen=True)
class DecodingShape:
    """The shape a compiled decoding step runs at: `rows` rows (the batch's, padded) and a
    static cache of `cache_length` positions (each row's prompt and completion, padded)."""

    rows: int
    cache_length: int


def decoding_shape(rows: int, prompt_length: int, max_new_tokens: int) -> DecodingShape:
    """The bucketed shape of a batch of `rows` rows, prompts left-padded to `prompt_length`
    tokens, sampling at most `max_new_tokens` tokens each."""
    return DecodingShape(bucket(rows), bucket(prompt_length + max_new_tokens))


def asked(generation_config: GenerationConfig) -> bool:
    """Whether the settings leave the cache to the engine: no `cache_implementation`, no
    `disable_compile`, and a cache at all (`use_cache`). Otherwise they are used as given."""
    return (
        generation_config.cache_implementation is None
        and not generation_config.disable_compile
        and generation_config.use_cache is not False
    )


def forced(generation_config: GenerationConfig) -> bool:
    """Whether a `compile_config` asks `generate` to compile on any device."""
    compile_config = generation_config.compile_config
    return bool(compile_config is not None and compile_config._compile_all_devices)


def unavailable(model, generation_config: GenerationConfig, inputs: dict) -> str | None:
    """Why compiled decoding cannot sample this batch, or None where it can."""
    device = getattr(model, "device", torch.device("cpu"))
    if device.type != "cuda" and not forced(generation_config):
        return f"the model is on {device.type}, not CUDA"
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < MIN_TORCH:
        return f"torch {torch.__version__} is older than 2.6"
    if is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model):
        return "the model is sharded (ZeRO-3 or FSDP), whose ranks decode in step"
    if not generation_config.max_new_tokens:
        return "the sampling settings give no max_new_tokens to size the cache by"
    extra = sorted(set(inputs) - TEXT_INPUTS)
    if extra:
        return f"the prompts carry {', '.join(extra)}, whose rows are not bucketed"
    if adds_virtual_tokens(model):
        return "prompt-learning adapters add virtual tokens to the cache"
    inner = transformers_model(model)
    if inner is None or getattr(inner.config, "is_encoder_decoder", False):
        return "the model is not a transformers decoder-only model"
    if not getattr(type(inner), "_can_compile_fullgraph", False):
        return f"{type(inner).__name__} does not support a static cache with compiling"
    quantizer = getattr(inner, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        return "the model's quantization does not compile"
    if len(set((getattr(inner, "hf_device_map", None) or {}).values())) > 1:
        return "the model is spread over several devices (device_map)"
    return None


def runs(model, generation_config: GenerationConfig, inputs: dict) -> bool:
    """Whether compiled decoding samples this batch: asked for (`asked`) and available; where
    it is not available, the reason is logged once per process."""
    if not asked(generation_config):
        return False
    reason = unavailable(model, generation_config, inputs)
    if reason is None:
        return True
    if reason not in _said:
        _said.add(reason)
        # On a CPU nothing is lost (`generate` compiles on GPUs only); elsewhere the speed is.
        level = logging.INFO if reason.startswith("the model is on") else logging.WARNING
        logger.log(level, "Compiled decoding is off (%s): the dynamic cache samples.", reason)
    return False


def sample(model, inputs: dict, generation_config: GenerationConfig, compact: bool = True):
    """Completions `(B*G, T)` and, with `generation_config.output_scores`, the processed
    scores each token was drawn from at each step `T x (B*G, V)` (else None), decoded with a static cache of the bucketed shape.

    Args:
        inputs (`dict`): `input_ids` and `attention_mask` of the B left-padded prompts `(B, P)`,
            and optionally the `tokenizer` for stop strings.
        generation_config (`GenerationConfig`): the batch's settings (`asked`); its
            `num_return_sequences` G completions per prompt.
    """
    group_size = generation_config.num_return_sequences or 1
    input_ids = inputs["input_ids"].repeat_interleave(group_size, dim=0)  # (B*G, P)
    attention_mask = inputs["attention_mask"].repeat_interleave(group_size, dim=0)
    rows, prompt_length = input_ids.shape
    shape = decoding_shape(rows, prompt_length, generation_config.max_new_tokens)
    padding = shape.rows - rows
    if padding:  # copies of the last row, dropped below
        input_ids = torch.cat([input_ids, input_ids[-1:].expand(padding, -1)])  # (R, P)
        attention_mask = torch.cat([attention_mask, attention_mask[-1:].expand(padding, -1)])
    decoding = copy.deepcopy(generation_config)
    decoding.num_return_sequences = 1
    decoding.cache_implementation = "static"
    decoding.max_cache_len = shape.cache_length
    if decoding.compile_config is None:  # one graph per shape: what CUDA graphs record anyway
        decoding.compile_config = CompileConfig(dynamic=False)
    if shape not in _said:
        _said.add(shape)
        logger.info(
            "Compiled decoding: %d rows (%d padded), a static cache of %d positions.",
            shape.rows,
            padding,
            shape.cache_length,
        )
    output = compacting.generate(
        model,
        decoding,
        compact,
        input_ids=input_ids,
        attention_mask=attention_mask,
        tokenizer=inputs.get("tokenizer"),
    )  # (R, P + T)
    sequences = output.sequences if decoding.return_dict_in_generate else output
    completion_ids = sequences[:rows, prompt_length:]  # (B*G, T)
    if not decoding.output_scores:
        return completion_ids, None
    return completion_ids, [scores[:rows] for scores in output.scores]  # T x (B*G, V)
