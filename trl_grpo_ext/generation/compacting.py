"""A sampling loop in which finished rows leave the batch and the KV cache.

`generate` decodes every row until the longest ends: a row that has reached its end-of-sequence
token still runs through the model at each later step, its token replaced by padding. With
completions of spread lengths much of the last steps' compute goes to rows already done.
`compacting_sample` is `generate`'s own sampling loop (`GenerationMixin._sample`) with two
changes: after each step, the rows that have finished leave the batch, the KV cache
(`select_rows`) and the attention mask, so each forward pass costs the rows still running; and
the cache's layers grow in place (`kv_room.RoomyLayer`) rather than by one concatenation per
step. It is passed to `generate` as `custom_generate`, so the generation config, the logits
processors (temperature, top-k/p, min-p, repetition penalty, min_new_tokens, suppressed
tokens, ...), the stopping criteria and the cache are built by `generate` as for any call.
Where `generate` would compile the decoding steps' forward (a static cache on a GPU, or a
`compile_config` that asks for it), the steps run the same compiled call.

Sampling draws one uniform number per row and step, `u ~ U(0, 1)`, and takes the first token
whose cumulative probability exceeds `u` (inverse transform sampling, in float64): the
distribution of `generate`'s `torch.multinomial(probs, 1)`, which instead draws an exponential
number for every entry of the `(rows, V)` probabilities (a sixth of SmolLM2's sampling time on a
CPU, at V = 49,152). The uniforms are drawn for all rows each step, finished ones included, so
a row's tokens are the same whether finished rows leave the batch or not (`drop_finished`). A
row's logits can differ in the last bits with the number of rows in the forward pass (the
matrix products' blocking), so a near tie can sample differently on rare occasions; the tests
check the same tokens on the tiny model.

Rows are dropped only where that is exact: with an end-of-sequence criterion (finished rows
are then padding in `generate` too), logits processors and stopping criteria that look at
each row alone (`ROW_WISE_PROCESSORS`, `ROW_WISE_CRITERIA`), a cache whose rows can be
selected (`rows_selectable`: dynamic attention layers, hybrid models' recurrent ones), and
model inputs whose rows can be selected (`ROW_INPUTS`). Otherwise the loop runs as `generate`'s.
The loop calls `generate`'s private helpers: on transformers releases outside those it is tested
on (`internals.FAST_PATHS["sampling_loop"]`), `generate` samples itself, and says so once.
"""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import cache_utils
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation import (
    GenerateDecoderOnlyOutput,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.integrations.fsdp import is_fsdp_managed_module

from ..internals import usable
from ..logprobs import adds_virtual_tokens, transformers_model
from . import kv_room

# Processors whose output for a row depends on that row's tokens and scores only.
ROW_WISE_PROCESSORS = frozenset(
    {
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "RepetitionPenaltyLogitsProcessor",
        "NoRepeatNGramLogitsProcessor",
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
        "SuppressTokensLogitsProcessor",
        "SuppressTokensAtBeginLogitsProcessor",
        "NoBadWordsLogitsProcessor",
        "SequenceBiasLogitsProcessor",
        "ForcedBOSTokenLogitsProcessor",
        "ForcedEOSTokenLogitsProcessor",
        "InfNanRemoveLogitsProcessor",
    }
)
ROW_WISE_CRITERIA = frozenset(
    {"MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria", "StopStringCriteria"}
)
# Model inputs of shape (rows, length) that `generate` carries from step to step; position ids
# may also be (axes, rows, length): Qwen2-VL and kin compute them once, from each row's rotary
# offset (`rope_deltas`, kept on the model), and carry them from step to step like the others.
ROW_INPUTS = ("attention_mask", "token_type_ids", "mm_token_type_ids", "position_ids")
NOT_ROW_INPUTS = frozenset({"cache", "past_key_values", "use_cache", "cache_position"})


def generate(model, generation_config, compact: bool = True, **inputs):
    """`model.generate(**inputs, generation_config=generation_config)`, with `compacting_sample`
    as its loop where `can_compact(model)`, finished rows leaving the batch where `compact`: the
    same tokens either way."""
    if not can_compact(model):
        return model.generate(**inputs, generation_config=generation_config)
    tokenizer = inputs.pop("tokenizer", None)
    if generation_config.stop_strings and tokenizer is not None:
        # `generate` hands a `custom_generate` loop no tokenizer: the stop strings come as a
        # stopping criterion instead
        criterion = StopStringCriteria(tokenizer, generation_config.stop_strings)
        inputs["stopping_criteria"] = StoppingCriteriaList([criterion])
        generation_config = copy.deepcopy(generation_config)
        generation_config.stop_strings = None
    return model.generate(
        **inputs,
        generation_config=generation_config,
        custom_generate=compacting_sample,
        drop_finished=compact,
    )


def can_compact(model) -> bool:
    """Whether `compacting_sample` may run for this model: a decoder-only model whose ranks do
    not have to run forward passes in step (`generate`'s `synced_gpus` under ZeRO-3 or FSDP,
    which a shrinking batch would break)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    # A PEFT model's `generate` runs the transformers model's, with PEFT's input preparation,
    # which passes the loop's arguments on for adapters on the weights (LoRA and kin); prompt
    # learning adds virtual tokens to the inputs, which are not rows to select.
    if adds_virtual_tokens(model):
        return False
    inner = transformers_model(model)
    if inner is None or not _prepares_steps(inner):
        return False
    if is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model):
        return False
    # `generate`'s private helpers, on the transformers releases it is tested on (internals.py)
    return usable("sampling_loop")


def _prepares_steps(model) -> bool:
    """Whether the model prepares each step's inputs as `compacting_sample` calls it (a model
    of remote code may prepare them its own way)."""
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    return prepare is not None and "next_sequence_length" in inspect.signature(prepare).parameters


# Cache layers whose rows `batch_select_indices` selects (and repeats): attention's keys and
# values, nothing else.
_ATTENTION_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, kv_room.RoomyLayer)
# Hybrid models' layers (transformers 5.25): the recurrent states of linear attention or
# state-space layers, alone or beside attention's keys and values. `reorder_cache`, beam
# search's, selects the rows of all of them; `batch_select_indices` would leave the recurrent
# states as they were (these are `DynamicLayer`s too).
_RECURRENT_LAYERS = tuple(
    getattr(cache_utils, name)
    for name in (
        "LinearAttentionLayer",
        "LinearAttentionAndFullAttentionLayer",
        "LinearAttentionAndSlidingWindowAttentionLayer",
    )
    if hasattr(cache_utils, name)
)


def rows_selectable(cache) -> bool:
    """Whether the rows of `cache` can be selected and repeated exactly (`select_rows`): a
    `DynamicCache` of full or sliding-window attention layers and hybrid models' recurrent
    ones. Other layers, subclasses included, are not taken on trust (a static cache's rows are
    fixed, a quantized one holds more than keys and values)."""
    return isinstance(cache, DynamicCache) and all(
        type(layer) in _ATTENTION_LAYERS + _RECURRENT_LAYERS for layer in cache.layers
    )


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keeps the rows `rows` `(n,)` of every layer of `cache` (`rows_selectable`), in that
    order; a row listed twice is repeated."""
    for layer in cache.layers:
        if type(layer) in _RECURRENT_LAYERS:
            layer.reorder_cache(rows)
        else:
            layer.batch_select_indices(rows)


def compacting_sample(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    drop_finished: bool = True,
    **model_kwargs,
):
    """`GenerationMixin._sample` (multinomial sampling) with finished rows leaving the batch
    (where `drop_finished`, and exact: see the module's docstring).

    Called by `generate(..., custom_generate=compacting_sample)`, with the arguments `generate`
    passes to its own loop. Returns the `generate` output for that config: the sequences
    `(N, L + T)` (padding after each row's end) and, with `output_logits`, the raw logits of
    each step `T x (N, V)` (zeros for the rows that had finished).
    """
    pad_token_id = generation_config._pad_token_tensor
    return_dict = generation_config.return_dict_in_generate
    output_logits = bool(return_dict and generation_config.output_logits)
    output_scores = return_dict and generation_config.output_scores
    do_sample = generation_config.do_sample
    has_end = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
    num_rows = input_ids.shape[0]
    unfinished = torch.ones(num_rows, dtype=torch.bool, device=input_ids.device)
    running = torch.arange(num_rows, device=input_ids.device)  # rows in the forward pass
    sequences = input_ids  # (N, L), all rows
    raw_logits, scores = [], []
    outputs = model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
    # the decoding steps write their keys and values in place, not by concatenation
    kv_room.make_room(model_kwargs.get("cache"), generation_config.max_length)
    compact = (
        drop_finished
        and has_end
        and rows_selectable(model_kwargs.get("cache"))
        and _row_wise(logits_processor, stopping_criteria, model_kwargs)
    )
    next_sequence_length = 1 if model_kwargs.get("use_cache") else None
    # As in `generate`: the decoding steps run a compiled forward where the cache allows it (a
    # static cache on a GPU, or `compile_config` asking for it), whose rows never leave.
    forward = (
        model.get_compiled_call(generation_config.compile_config)
        if model._valid_auto_compile_criteria(model_kwargs, generation_config)
        else model.__call__
    )
    with model._optimize_model_for_decode():
        while True:
            if outputs is None:
                model_inputs = model.prepare_inputs_for_generation(
                    sequences[running], next_sequence_length=next_sequence_length, **model_kwargs
                )
                outputs = forward(**model_inputs, return_dict=True)
                model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
            # (n, V); copied only where the step's raw logits are kept, as `generate` keeps them
            logits = outputs.logits[:, -1].to(copy=output_logits, dtype=torch.float32)
            outputs = None
            step_scores = logits_processor(sequences[running], logits)  # (n, V)
            next_tokens = _next_tokens(step_scores, running, num_rows, do_sample)  # (n,)
            if has_end:  # finished rows get padding, as in `generate`
                step_tokens = pad_token_id.to(next_tokens.device).expand(num_rows).clone()
                step_tokens[running] = torch.where(unfinished[running], next_tokens, pad_token_id)
            else:  # nothing finishes before the last step: every row runs
                step_tokens = next_tokens
            sequences = torch.cat([sequences, step_tokens[:, None]], dim=-1)  # (N, L + t + 1)
            if output_logits:
                raw_logits.append(_all_rows(logits, running, num_rows))
            if output_scores:
                scores.append(_all_rows(step_scores, running, num_rows))
            done = stopping_criteria(sequences[running], step_scores)  # (n,)
            unfinished[running] &= ~done
            still = unfinished[running]  # (n,); the finished rows not running are done anyway
            left = int(still.sum())  # the step's one wait on the device, as in `generate`
            if left == 0:
                break
            if compact and left < len(running):
                keep = still.nonzero().squeeze(1)  # (n',) in the running batch
                running = running[keep]
                _select_rows(model_kwargs, logits_processor, keep)
    if not return_dict:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(scores) if output_scores else None,
        logits=tuple(raw_logits) if output_logits else None,
        cache=model_kwargs.get("cache"),
    )


def _next_tokens(scores, running, num_rows: int, do_sample: bool) -> torch.Tensor:
    """The running rows' tokens: the argmax, or one draw from `softmax(scores)` per row by
    inverse transform sampling, from uniform numbers drawn for all `num_rows` rows."""
    if not do_sample:
        return torch.argmax(scores, dim=-1)
    dtype = torch.float32 if scores.device.type == "mps" else torch.float64  # MPS has no float64
    uniform = torch.rand(num_rows, dtype=dtype, device=scores.device)[running]  # (n,)
    return sample_by_inversion(torch.softmax(scores, dim=-1), uniform)


def sample_by_inversion(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """For each row of `probs` `(n, V)` (not necessarily normalised), the first token whose
    cumulative probability exceeds `uniform` `(n,)` times the row's total: token `v` with
    probability `probs[v] / sum(probs)`. Sums in the uniforms' dtype (float64 but on MPS); a
    token of probability 0 is never taken."""
    cumulative = probs.cumsum(dim=-1, dtype=uniform.dtype)  # (n, V)
    total = cumulative[:, -1:]  # (n, 1)
    tokens = torch.searchsorted(cumulative, uniform.unsqueeze(1) * total, right=True)  # (n, 1)
    last = (cumulative < total).sum(dim=-1, keepdim=True)  # the last token of probability > 0
    return torch.minimum(tokens, last).squeeze(1)


def _row_wise(logits_processor, stopping_criteria, model_kwargs: dict) -> bool:
    """Whether every processor, criterion and carried model input treats rows independently."""
    for key, value in model_kwargs.items():
        if key in NOT_ROW_INPUTS or not isinstance(value, torch.Tensor):
            continue
        if _row_axis(key, value) is None:
            return False
    return all(
        type(processor).__name__ in ROW_WISE_PROCESSORS for processor in logits_processor
    ) and all(type(criterion).__name__ in ROW_WISE_CRITERIA for criterion in stopping_criteria)


def _row_axis(key: str, value: torch.Tensor) -> int | None:
    """The axis of the rows of a model input `generate` carries, None where it has none known."""
    if key in ROW_INPUTS and value.dim() == 2:
        return 0
    if key == "position_ids" and value.dim() == 3:  # (axes, rows, length)
        return 1
    return None


def _select_rows(model_kwargs: dict, logits_processor, keep: torch.Tensor) -> None:
    """Keeps the rows `keep` of the cache, the carried model inputs, and the one per-row state
    of a processor: the repetition penalty's prompt length to ignore, when given per row."""
    select_rows(model_kwargs["cache"], keep)
    for key in ROW_INPUTS:
        if model_kwargs.get(key) is not None:
            value = model_kwargs[key]
            model_kwargs[key] = value.index_select(_row_axis(key, value), keep.to(value.device))
    for processor in logits_processor:
        ignored = getattr(processor, "prompt_ignore_length", None)
        if isinstance(ignored, torch.Tensor):
            processor.prompt_ignore_length = ignored.to(keep.device)[keep]


def _all_rows(values: torch.Tensor, running: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`(n, V)` values of the running rows as `(N, V)`, zeros for the finished ones."""
    if values.shape[0] == num_rows:
        return values
    full = values.new_zeros((num_rows, values.shape[1]))
    full[running] = values
    return full
