"""The `transformers` engine: the policy's own `generate`, in this process.

`generate_with_transformers` samples a group of completions per prompt with batched `generate`
calls (each prompt encoded once), optionally with the log-probs of the sampled tokens from the
sampling pass's own logits. `TransformersEngine` puts it behind the engine interface of
`engines.py`; `seeded` and `generation_seed` give each generation batch a seed of its own.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers import GenerationConfig

from ..logprobs import adds_virtual_tokens, float32_head, token_logprobs, transformers_model
from . import compacting, compiled_decoding
from .merged_adapters import merged_for_sampling
from .packed_weights import packed_linear_weights
from .sampling import BEAMS_ON_THE_TRAINERS_GENERATE, beam_search, isolated_from_checkpoint


@torch.no_grad()
def generate_with_transformers(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    generation_config: GenerationConfig,
    return_logprobs: bool = False,
    tokenizer=None,
    image_inputs: dict[str, torch.Tensor] | None = None,
    compact_finished_rows: bool = True,
    pack_weights: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Samples a group of completions per prompt with batched `generate` calls.

    `generation_config` is used exactly as given: the model's own `generation_config` is hidden
    meanwhile (`generation.isolated_from_checkpoint`), so nothing is filled in from the checkpoint.

    Each prompt is run through the model once (`_generate_groups`): its first token is sampled
    G times from that one pass, and the rest of the group continues from the prompt's cache
    repeated G times (where its rows repeat exactly, `compacting.rows_selectable`; a static
    cache's do not, and its prompts are encoded G times). The number of forward passes is that
    of one `generate` call that expands each prompt into its group first, which encodes every
    prompt G times.

    Rows that have finished leave the batch and the KV cache at the next step
    (`compacting.compacting_sample`), so the last steps cost only the rows still sampling; the
    tokens are the same as with every row running to the end, for the same seed, each drawn
    from the distribution `generate` draws from (one uniform number per row and step). Where
    dropping rows would not be exact (an unknown logits processor, a cache whose rows cannot be
    selected), every row runs to the end; where the loop cannot run (ZeRO-3, FSDP,
    transformers before 5.24), `generate` itself samples.

    On CUDA, where the settings leave the cache to the engine (no `cache_implementation`, no
    `disable_compile`), the decoding steps run compiled with a static cache sized and bucketed
    to the batch (`compiled_decoding.py`): the same distribution, a few graphs per run; where
    it cannot run, the reason is logged once and the dynamic cache samples as above.

    With `return_logprobs=True`, also the behaviour log-probs: each sampled token's log-prob
    under the distribution it was drawn from, the processed scores of its decoding step
    (temperature, top-k, top-p, min-p, ... applied) renormalised, `log softmax(s_t)[o_t]`, as
    TRL asks vLLM for them (`logprobs_mode="processed_logprobs"`): no second forward pass. With
    TRL's default settings (no filter) that is `log softmax(z_t / tau)[o_t]`, the trainer's
    log-prob. The scores of all steps are held until the end, `T x B*G x V` float32 values.

    Args:
        prompt_ids, prompt_mask (`torch.Tensor`): left-padded prompts `(B, P)`
            (`generation.PromptEncoder.encode`).
        tokenizer (*optional*): lets `generate` stop at `generation_config.stop_strings`;
            without it sampling goes on past them, and the caller ends each completion at its
            stop (`generation.end_at_stop_strings`).
        image_inputs (`dict[str, torch.Tensor]`, *optional*): the processor's multimodal
            fields of the B prompts (`pixel_values`, ...), as it returned them; the vision tower
            runs on them once, in the pass that encodes the prompts.
        compact_finished_rows (`bool`, *optional*, defaults to `True`): finished rows leave
            the batch; `False` runs every row until the longest ends, as `generate` does, with
            the same tokens.
        pack_weights (`bool`, *optional*, defaults to `True`): on a CPU, the float32 linear
            layers compute with their weights laid out once for oneDNN
            (`packed_weights.py`), the same tokens and log-probs up to float rounding;
            `False` calls `F.linear` as the model does.

    Returns:
        `(prompt_ids, prompt_mask, completion_ids)`, of shapes `(B*G, P)`, `(B*G, P)`,
        `(B*G, T)`, and the log-probs `(B*G, T)` when `return_logprobs=True` (meaningful up to
        each completion's first eos).
    """
    encoded = {"input_ids": prompt_ids, "attention_mask": prompt_mask}
    encoded.update(image_inputs or {})
    encoded = {key: value.to(model.device) for key, value in encoded.items()}  # (B, P)
    if generation_config.stop_strings:
        if tokenizer is None:  # `generate` cannot match strings without it
            generation_config = copy.deepcopy(generation_config)
            generation_config.stop_strings = None
        else:
            encoded["tokenizer"] = tokenizer
    with isolated_from_checkpoint(model), packed_linear_weights(model, pack_weights):
        return _generate(model, encoded, generation_config, return_logprobs, compact_finished_rows)


def _generate(model, encoded, generation_config, return_logprobs, compact_finished_rows=True):
    group_size = generation_config.num_return_sequences or 1
    prompt_length = encoded["input_ids"].shape[1]
    prompt_ids = encoded["input_ids"].repeat_interleave(group_size, dim=0)  # (B*G, P)
    prompt_mask = encoded["attention_mask"].repeat_interleave(group_size, dim=0)  # (B*G, P)
    if beam_search(generation_config):
        if return_logprobs:
            raise ValueError(
                BEAMS_ON_THE_TRAINERS_GENERATE.format(beams=generation_config.num_beams)
            )
        return prompt_ids, prompt_mask, _beam_search(model, encoded, generation_config)
    if return_logprobs:
        generation_config = copy.deepcopy(generation_config)
        generation_config.output_scores = True
        generation_config.return_dict_in_generate = True
    generated = None
    if compiled_decoding.runs(model, generation_config, encoded):  # CUDA's default
        generated = compiled_decoding.sample(
            model, encoded, generation_config, compact_finished_rows
        )
    elif group_size > 1 and generation_config.do_sample:
        generated = _generate_groups(
            model, encoded, prompt_ids, prompt_mask, generation_config, compact_finished_rows
        )
    if generated is None:
        output = compacting.generate(
            model, generation_config, compact_finished_rows, **encoded
        )  # (B*G, P + T)
        if return_logprobs:
            generated = output.sequences[:, prompt_length:], output.scores
        else:
            generated = output[:, prompt_length:], None
    completion_ids, step_scores = generated
    if not return_logprobs:
        return prompt_ids, prompt_mask, completion_ids
    # log softmax of the processed scores: renormalised over the tokens the filters kept
    logps = [
        token_logprobs(scores.unsqueeze(1), completion_ids[:, t : t + 1])
        for t, scores in enumerate(step_scores)
    ]  # T x (B*G, 1)
    logps = torch.cat(logps, dim=1)  # (B*G, T)
    # After a row's end its forced padding may lie outside the filters (-inf): 0 there.
    return prompt_ids, prompt_mask, completion_ids, logps.masked_fill(~logps.isfinite(), 0.0)


def _beam_search(model, encoded, generation_config) -> torch.Tensor:
    """Completions `(B*G, T)` of beam search, as TRL runs it: `generate` on each prompt
    repeated G times, one returned sequence each (its best beam; without sampling, the G
    completions of a prompt are alike, as in TRL). There are no behaviour log-probs: as in TRL,
    the trainer's own log-probs of the completions are the old ones."""
    group_size = generation_config.num_return_sequences or 1
    extra = sorted(set(encoded) - {"input_ids", "attention_mask", "tokenizer"})
    if extra:
        raise ValueError(
            f"Beam search (generation_kwargs num_beams={generation_config.num_beams}) runs on "
            f"text prompts only; these prompts carry {', '.join(extra)}. Remove num_beams."
        )
    config = copy.deepcopy(generation_config)
    config.num_return_sequences = 1
    inputs = {
        key: value.repeat_interleave(group_size, dim=0) if key != "tokenizer" else value
        for key, value in encoded.items()
    }  # (B*G, P)
    output = model.generate(**inputs, generation_config=config)  # (B*G, P + T)
    return output[:, inputs["input_ids"].shape[1] :]


def _generate_groups(
    model, encoded, prompt_ids, prompt_mask, generation_config, compact_finished=True
):
    """Completions `(B*G, T)` with each prompt encoded once, and the processed scores of each
    step (`T x (B*G, V)`, or None unless `generation_config.output_scores`); None where the model's
    `generate` does not return a reusable cache. With `compact_finished`, step 3 drops each row
    from the batch once it has ended (`compacting.generate`).

    1. `generate` one token for the B prompts, keeping the processed scores (temperature,
       top-k/p, ... applied) and the prompts' cache: one forward pass of B rows.
    2. Sample G first tokens per prompt from those scores (as `generate` samples).
    3. Repeat the cache G times and let `generate` continue the B*G rows for T - 1 tokens.
    None (each prompt encoded G times instead) where the cache's rows cannot be repeated
    exactly (`compacting.rows_selectable`).
    A row whose first token ends it continues in step 3 like the others; the completion mask
    ends it at that token.
    """
    group_size = generation_config.num_return_sequences
    # a cache other than the dynamic one (static, quantized, offloaded) has rows that do not
    # repeat: known from the config, before any pass; prompt learning's virtual tokens are
    # positions of the cache that PEFT's generate adds, not the prompt's
    if not generation_config.max_new_tokens or generation_config.cache_implementation not in (
        None,
        "dynamic",
    ):
        return None
    if adds_virtual_tokens(model):
        return None
    first_config = copy.deepcopy(generation_config)
    first_config.num_return_sequences = 1
    first_config.max_new_tokens = 1
    first_config.min_new_tokens = None
    first_config.output_scores = True
    first_config.return_dict_in_generate = True
    first = model.generate(**encoded, generation_config=first_config)
    cache = getattr(first, "cache", None) or getattr(first, "past_key_values", None)
    if cache is None or not compacting.rows_selectable(cache) or first.scores is None:
        return None  # e.g. a static cache, whose rows are fixed
    # Step 1 used the prompts only; min_new_tokens (no eos before it) still holds for step 2.
    scores = first.scores[0].float()  # (B, V), processed
    if generation_config.min_new_tokens:
        scores[:, _as_list(generation_config.eos_token_id)] = float("-inf")
    probs = torch.softmax(scores, dim=-1)  # (B, V)
    first_tokens = torch.multinomial(probs, group_size, replacement=True)  # (B, G)
    first_tokens = first_tokens.reshape(-1, 1)  # (B*G, 1)
    want_scores = bool(generation_config.output_scores)
    step_scores = [scores.repeat_interleave(group_size, dim=0)] if want_scores else None
    remaining = generation_config.max_new_tokens - 1
    if remaining < 1:
        return first_tokens, step_scores
    prompts = torch.arange(encoded["input_ids"].shape[0], device=first_tokens.device)  # (B,)
    rows = prompts.repeat_interleave(group_size)  # (B*G,): each prompt's row, G times
    compacting.select_rows(cache, rows)
    _repeat_rotary_offsets(model, rows, len(prompts))
    rest_config = copy.deepcopy(generation_config)
    rest_config.num_return_sequences = 1
    rest_config.max_new_tokens = remaining
    rest_config.cache_implementation = None  # the cache is given (`generate` refuses both)
    if generation_config.min_new_tokens:
        rest_config.min_new_tokens = max(generation_config.min_new_tokens - 1, 0)
    input_ids = torch.cat([prompt_ids, first_tokens], dim=1)  # (B*G, P + 1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(first_tokens)], dim=1)
    output = compacting.generate(
        model,
        rest_config,
        compact_finished,
        input_ids=input_ids,
        attention_mask=attention_mask,
        tokenizer=encoded.get("tokenizer"),  # for stop strings
        **{_cache_kwarg(model): cache},
    )  # (B*G, P + 1 + T - 1)
    if want_scores:
        return output.sequences[:, prompt_ids.shape[1] :], step_scores + list(output.scores)
    return output[:, prompt_ids.shape[1] :], None


def _repeat_rotary_offsets(model, rows: torch.Tensor, num_prompts: int) -> None:
    """Qwen2-VL-style models keep each prompt's rotary offset (`rope_deltas`, `(B, 1)`) on the
    model between `generate` calls, for the positions of the tokens after the cache: each row
    of a group takes its prompt's, as `generate` computes them for prompts repeated G times."""
    for module in model.modules():
        offsets = getattr(module, "rope_deltas", None)
        if isinstance(offsets, torch.Tensor) and offsets.shape[0] == num_prompts:
            module.rope_deltas = offsets[rows.to(offsets.device)]


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _cache_kwarg(model) -> str:
    """`cache` where the model's forward takes it (recent transformers), else `past_key_values`."""
    import inspect

    inner = transformers_model(model)
    parameters = inspect.signature((model if inner is None else inner).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | None = None):
    """Runs the block with the global RNG seeded by `seed`, restoring the RNG afterwards.

    Each generation batch samples from its own seed, so a resumed run, a rollout worker and
    the synchronous trainer draw the same completions for the same batch and weights.
    """
    devices = [device.index or 0] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def generation_seed(seed: int, process_index: int, batch_index: int, round_index: int = 0) -> int:
    """A distinct, reproducible seed for each generation batch of each process."""
    return (seed * 1_000_003 + process_index * 10_007 + batch_index * 101 + round_index) % 2**62


class TransformersEngine:
    """`generate` of the policy, in this process.

    Args:
        policy (`Callable[[], ContextManager]`): enters a block in which it yields the model to
            generate with (unwrapped from DDP, gathered under ZeRO-3, in eval mode).
        cast_lm_head_to_fp32 (`bool`): the output head computes the logits in float32
            (`logprobs.float32_head`), as TRL's `cast_lm_head_to_fp32` does for generation.
        tokenizer (*optional*): lets `generate` stop at the config's `stop_strings`.
        merge_adapters (`str`, *optional*, defaults to `"exact"`): samples with the LoRA
            adapters merged into the base weights where that is exact enough
            (`merged_adapters.py`), fewer matmuls per decoding step; `"always"` merges bfloat16
            and float16 weights too, `"never"` samples unmerged. The base weights are restored
            bit for bit after.
        compact_finished_rows (`bool`, *optional*, defaults to `True`): finished rows leave the
            batch while sampling (`compacting.py`), the same tokens for the same seed.
        pack_weights (`bool`, *optional*, defaults to `True`): on a CPU, the float32 linear
            layers (merged ones included) sample with their weights laid out once for oneDNN
            (`packed_weights.py`), the same tokens and log-probs up to float rounding.
    """

    own_weights = False  # it samples with the trainer's model: nothing to publish
    version = None
    takes_images = True  # `generate` takes the processor's multimodal fields

    def __init__(
        self,
        policy,
        cast_lm_head_to_fp32: bool = False,
        tokenizer=None,
        merge_adapters="exact",
        compact_finished_rows=True,
        pack_weights=True,
    ):
        self.policy, self.cast_lm_head_to_fp32 = policy, cast_lm_head_to_fp32
        self.pack_weights = pack_weights
        self.tokenizer, self.merge_adapters = tokenizer, merge_adapters
        self.compact_finished_rows = compact_finished_rows
        self._said_why_unmerged = False

    def generate(self, prompt_ids, prompt_mask, generation_config, seed=None, image_inputs=None):
        with self.policy() as model, contextlib.ExitStack() as stack:
            merge = merged_for_sampling(
                model, self.merge_adapters, not self._said_why_unmerged, self.pack_weights
            )
            stack.enter_context(merge)
            self._said_why_unmerged = True
            if self.cast_lm_head_to_fp32:
                stack.enter_context(float32_head(model))
            with seeded(seed, model.device) if seed is not None else contextlib.nullcontext():
                prompt_ids, prompt_mask, completion_ids = generate_with_transformers(
                    model,
                    prompt_ids,
                    prompt_mask,
                    generation_config=generation_config,
                    tokenizer=self.tokenizer,
                    image_inputs=image_inputs,
                    compact_finished_rows=self.compact_finished_rows,
                    pack_weights=self.pack_weights,
                )
        return prompt_ids, prompt_mask, completion_ids, None

    def publish(self, version: int) -> None:
        pass

    def publish_later(self, version: int):
        return lambda: None

    def close(self) -> None:
        pass
