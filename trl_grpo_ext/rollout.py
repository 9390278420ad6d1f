"""Rollouts: G sampled completions per prompt, as tensors and text.

A `Rollout` holds one generation batch: for B prompts, B*G rows, the G completions of a prompt
in consecutive rows (a group). Prompts are left-padded, completions right-padded; the completion
mask covers each completion up to and including its first end-of-sequence token.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from .generation.sampling import isolated_from_checkpoint
from .logprobs import (
    FLOAT32_HEAD_NEEDS_A_PLAIN_HEAD,
    capture_head_inputs,
    head_token_logprobs,
    logit_transform,
    output_head,
)
from .objective import token_logprobs


@dataclass
class Rollout:
    """One generation batch of `num_prompts * group_size` completions.

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
            behaviour_logps=None if self.behaviour_logps is None else self.behaviour_logps[index],
            policy_version=self.policy_version,
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


@torch.no_grad()
def generate_with_transformers(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    generation_config: GenerationConfig,
    return_logprobs: bool = False,
    tokenizer=None,
) -> tuple[torch.Tensor, ...]:
    """Samples a group of completions per prompt with batched `generate` calls.

    `generation_config` is used exactly as given: the model's own `generation_config` is hidden
    meanwhile (`generation.isolated_from_checkpoint`), so nothing is filled in from the checkpoint.

    Each prompt is run through the model once (`_generate_groups`): its first token is sampled
    G times from that one pass, and the rest of the group continues from the prompt's cache
    repeated G times. The number of forward passes is that of one `generate` call that expands
    each prompt into its group first, which encodes every prompt G times.

    With `return_logprobs=True`, also the log-probs of the sampled tokens under the sampling
    policy, `log softmax(z_t / tau)[o_t]` from the raw logits of each decoding step (before
    top-k/top-p), as the trainer computes them: no second forward pass. The raw logits of all
    steps are held until the end, `T x B*G x V` float32 values.

    Args:
        prompt_ids, prompt_mask (`torch.Tensor`): left-padded prompts `(B, P)`
            (`generation.PromptEncoder.encode`).
        tokenizer (*optional*): lets `generate` stop at `generation_config.stop_strings`;
            without it sampling goes on past them, and the caller ends each completion at its
            stop (`generation.end_at_stop_strings`).

    Returns:
        `(prompt_ids, prompt_mask, completion_ids)`, of shapes `(B*G, P)`, `(B*G, P)`,
        `(B*G, T)`, and the log-probs `(B*G, T)` when `return_logprobs=True` (meaningful up to
        each completion's first eos).
    """
    encoded = {"input_ids": prompt_ids, "attention_mask": prompt_mask}
    encoded = {key: value.to(model.device) for key, value in encoded.items()}  # (B, P)
    if generation_config.stop_strings:
        if tokenizer is None:  # `generate` cannot match strings without it
            generation_config = copy.deepcopy(generation_config)
            generation_config.stop_strings = None
        else:
            encoded["tokenizer"] = tokenizer
    with isolated_from_checkpoint(model):
        return _generate(model, encoded, generation_config, return_logprobs)


def _generate(model, encoded, generation_config, return_logprobs):
    group_size = generation_config.num_return_sequences or 1
    prompt_length = encoded["input_ids"].shape[1]
    prompt_ids = encoded["input_ids"].repeat_interleave(group_size, dim=0)  # (B*G, P)
    prompt_mask = encoded["attention_mask"].repeat_interleave(group_size, dim=0)  # (B*G, P)
    if return_logprobs:
        generation_config = copy.deepcopy(generation_config)
        generation_config.output_logits = True
        generation_config.return_dict_in_generate = True
    generated = None
    if group_size > 1 and generation_config.do_sample:
        generated = _generate_groups(model, encoded, prompt_ids, prompt_mask, generation_config)
    if generated is None:
        output = model.generate(**encoded, generation_config=generation_config)  # (B*G, P + T)
        if return_logprobs:
            generated = output.sequences[:, prompt_length:], output.logits
        else:
            generated = output[:, prompt_length:], None
    completion_ids, step_logits = generated
    if not return_logprobs:
        return prompt_ids, prompt_mask, completion_ids
    logps = [
        token_logprobs(
            logits.unsqueeze(1), completion_ids[:, t : t + 1], generation_config.temperature
        )
        for t, logits in enumerate(step_logits)
    ]  # T x (B*G, 1)
    return prompt_ids, prompt_mask, completion_ids, torch.cat(logps, dim=1)


def _generate_groups(model, encoded, prompt_ids, prompt_mask, generation_config):
    """Completions `(B*G, T)` with each prompt encoded once, and the raw logits of each step
    (`T x (B*G, V)`, or None unless `generation_config.output_logits`); None where the model's
    `generate` does not return a reusable cache.

    1. `generate` one token for the B prompts, keeping the processed scores (temperature,
       top-k/p, ... applied) and the prompts' cache: one forward pass of B rows.
    2. Sample G first tokens per prompt from those scores (as `generate` samples).
    3. Repeat the cache G times and let `generate` continue the B*G rows for T - 1 tokens.
    A row whose first token ends it continues in step 3 like the others; the completion mask
    ends it at that token.
    """
    group_size = generation_config.num_return_sequences
    if not generation_config.max_new_tokens:
        return None
    first_config = copy.deepcopy(generation_config)
    first_config.num_return_sequences = 1
    first_config.max_new_tokens = 1
    first_config.min_new_tokens = None
    first_config.output_scores = True
    first_config.return_dict_in_generate = True
    first = model.generate(**encoded, generation_config=first_config)
    cache = getattr(first, "cache", None) or getattr(first, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_repeat_interleave") or first.scores is None:
        return None
    # Step 1 used the prompts only; min_new_tokens (no eos before it) still holds for step 2.
    scores = first.scores[0].float()  # (B, V), processed
    if generation_config.min_new_tokens:
        scores[:, _as_list(generation_config.eos_token_id)] = float("-inf")
    probs = torch.softmax(scores, dim=-1)  # (B, V)
    first_tokens = torch.multinomial(probs, group_size, replacement=True)  # (B, G)
    first_tokens = first_tokens.reshape(-1, 1)  # (B*G, 1)
    want_logits = bool(generation_config.output_logits)
    step_logits = [first.logits[0].repeat_interleave(group_size, dim=0)] if want_logits else None
    remaining = generation_config.max_new_tokens - 1
    if remaining < 1:
        return first_tokens, step_logits
    cache.batch_repeat_interleave(group_size)  # (B*G, heads, P, head_dim) per layer
    rest_config = copy.deepcopy(generation_config)
    rest_config.num_return_sequences = 1
    rest_config.max_new_tokens = remaining
    if generation_config.min_new_tokens:
        rest_config.min_new_tokens = max(generation_config.min_new_tokens - 1, 0)
    input_ids = torch.cat([prompt_ids, first_tokens], dim=1)  # (B*G, P + 1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(first_tokens)], dim=1)
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=rest_config,
        tokenizer=encoded.get("tokenizer"),  # for stop strings
        **{_cache_kwarg(model): cache},
    )  # (B*G, P + 1 + T - 1)
    if want_logits:
        return output.sequences[:, prompt_ids.shape[1] :], step_logits + list(output.logits)
    return output[:, prompt_ids.shape[1] :], None


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _cache_kwarg(model) -> str:
    """`cache` where the model's forward takes it (recent transformers), else `past_key_values`."""
    import inspect

    from transformers import PreTrainedModel

    for module in model.modules():  # through DDP / PEFT wrappers to the transformers model
        if isinstance(module, PreTrainedModel):
            parameters = inspect.signature(module.forward).parameters
            return "cache" if "cache" in parameters else "past_key_values"
    return "past_key_values"


def _unwrapped_config(model):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


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
    return rollout


def concat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Joins rollouts of the same group size, re-padding prompts (left) and completions (right)."""
    first = rollouts[0]
    prompt_width = max(r.prompt_ids.shape[1] for r in rollouts)
    completion_width = max(r.completion_ids.shape[1] for r in rollouts)

    def stack(name, width, value, left):
        return torch.cat([_pad_to(getattr(r, name), width, value, left) for r in rollouts])

    behaviour = None
    if all(r.behaviour_logps is not None for r in rollouts):
        behaviour = stack("behaviour_logps", completion_width, 0.0, left=False)
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
        behaviour_logps=behaviour,
        policy_version=min(r.policy_version for r in rollouts),
    )


def completion_logprobs(
    model,
    input_ids,
    attention_mask,
    completion_ids,
    temperature=1.0,
    return_entropy=False,
    logprob_chunk_tokens=None,
    cast_lm_head_to_fp32=False,
):
    """Log-probs `(B, T)` of the completion tokens at the end of `input_ids` (and entropy).

    The model runs its usual forward pass (through any DDP or PEFT wrapper), but its output head
    only hands over the last hidden states of the completion positions; the log-probs come from
    them in chunks of `logprob_chunk_tokens` positions (`logprobs.head_token_logprobs`), so the
    `(B, T, V)` logits never exist at once. Where the head's weight cannot be used directly (LoRA
    on the output layer, FSDP, DeepSpeed ZeRO-3), the model's head computes the logits of the
    completion positions only (`logits_to_keep`).

    Consecutive rows that share their prompt (the completions of one group) are packed into one
    sequence that holds the prompt once (`_shared_prompt_logits`), where that costs less
    (`packing_pays`): the same numbers as running every row in full, up to floating-point
    rounding, for (G - 1) / G less work on the prompt tokens.

    Args:
        logprob_chunk_tokens (`int`, *optional*):
            Completion positions whose logits exist at once; None for
            `logprobs.DEFAULT_CHUNK_TOKENS` (1024). Peak extra memory is a few float32 buffers
            of `logprob_chunk_tokens * V` values.
        cast_lm_head_to_fp32 (`bool`, *optional*, defaults to `False`):
            Compute the logits in float32 from float32 hidden states and head weight, as TRL's
            `cast_lm_head_to_fp32` (here without changing the model's parameters).
    """
    completion_length = completion_ids.shape[1]
    head = output_head(model)
    if head is None and cast_lm_head_to_fp32:
        raise ValueError(FLOAT32_HEAD_NEEDS_A_PLAIN_HEAD)
    outputs = _shared_prompt_logits(
        model, input_ids, attention_mask, completion_length, head=head
    )  # (B, T, H) hidden states with a usable head, else (B, T, V) logits
    if outputs is None:
        outputs = _head_outputs(
            model,
            head,
            input_ids=input_ids,
            attention_mask=attention_mask,
            logits_to_keep=completion_length + 1,
            use_cache=False,
        )[:, :-1]  # position t predicts completion token t
    if head is None:
        return token_logprobs(
            outputs, completion_ids, temperature=temperature, return_entropy=return_entropy
        )
    softcap, scale = logit_transform(model)
    return head_token_logprobs(
        outputs,
        head.weight,
        completion_ids,
        bias=head.bias,
        temperature=temperature,
        chunk_tokens=logprob_chunk_tokens,
        return_entropy=return_entropy,
        final_logit_softcapping=softcap,
        logit_scale=scale,
        upcast=cast_lm_head_to_fp32,
    )


def _head_outputs(model, head, **inputs):
    """The logits of a forward pass, or with `head` (the model's output head) its inputs."""
    if head is None:
        return model(**inputs).logits
    with capture_head_inputs(head) as captured:
        model(**inputs)
    if len(captured) != 1:
        raise RuntimeError(f"expected the output head to run once, it ran {len(captured)} times")
    return captured[0]


def packing_pays(model, prompt_length: int, completion_length: int, group_size: int) -> bool:
    """Whether one packed row of `P + G*T` tokens costs fewer FLOPs than `G` rows of `P + T`.

    Per layer, a token costs `2 * (4 d^2 + 3 d m)` in its linear layers (hidden size d, MLP
    width m) and `4 d L` in attention over a row of L tokens: the packed row's mask hides most
    keys, but the attention kernel still computes them. So packing pays when the prompt is long
    next to the completions, and loses when the completions are long. Measured on SmolLM2-135M
    (float32, CPU, forward and backward, G = 8): P = 57, T = 64: 0.60x the time of the rows
    (predicted 0.66x); P = 57, T = 256: 1.40x (predicted 1.24x, so not packed).
    """
    config = _unwrapped_config(model)
    hidden = getattr(config, "hidden_size", None)
    if not hidden:
        return True
    width = getattr(config, "intermediate_size", None) or 4 * hidden
    linear = 2 * (4 * hidden * hidden + 3 * hidden * width)
    packed = prompt_length + group_size * completion_length
    row = prompt_length + completion_length
    packed_cost = packed * (linear + 4 * hidden * packed)
    rows_cost = group_size * row * (linear + 4 * hidden * row)
    return packed_cost < rows_cost


def _shared_prompt_logits(model, input_ids, attention_mask, completion_length: int, head=None):
    """Logits `(B, T, V)` predicting the `T` completion tokens, with each distinct prompt run
    once, in one forward pass; None when it does not apply (no two consecutive rows share a
    prompt, groups of unequal size, or an attention implementation that ignores custom masks)
    or does not pay (`packing_pays`). With `head` (the model's output head), the hidden states
    `(B, T, H)` that enter it instead of the logits.

    Each run of `n` consecutive rows with the same prompt becomes one packed row: the prompt
    but its last token, then for every completion a block of `T` tokens (the last prompt token
    and the completion but its last token). A 4D mask lets each block attend to the prompt and
    causally to itself only, and position ids restart at the prompt's end in every block, so
    each block computes exactly what its full row would; gradients of all the blocks add up in
    the one copy of the prompt. Right padding needs no mask (no real token attends to it).
    """
    rows, total_length = input_ids.shape
    prompt_length = total_length - completion_length
    if prompt_length < 2 or rows < 2 or completion_length < 1:
        return None
    implementation = getattr(_unwrapped_config(model), "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return None
    prompt_ids, prompt_mask = input_ids[:, :prompt_length], attention_mask[:, :prompt_length]
    same_as_previous = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (
        prompt_mask[1:] == prompt_mask[:-1]
    ).all(1)  # (B - 1,)
    if not bool(same_as_previous.all()):
        starts = torch.cat([same_as_previous.new_ones(1), ~same_as_previous]).nonzero()
        sizes = torch.diff(torch.cat([starts.squeeze(1), starts.new_tensor([rows])]))
        if len(sizes) == rows or not bool((sizes == sizes[0]).all()):
            return None
    group_size = rows if bool(same_as_previous.all()) else int(sizes[0])
    num_prompts = rows // group_size
    # Columns that are padding in every row carry nothing; drop them.
    padded = int((prompt_mask.sum(0) == 0).long().cumprod(0).sum())
    if not packing_pays(model, prompt_length - padded, completion_length, group_size):
        return None
    first_rows = torch.arange(0, rows, group_size, device=input_ids.device)  # (U,)
    prefix_ids = prompt_ids[first_rows, padded:-1]  # (U, Q)
    prefix_mask = prompt_mask[first_rows, padded:-1].bool()  # (U, Q)
    prefix_length = prefix_ids.shape[1]
    if prefix_length == 0:
        return None
    blocks = input_ids[:, prompt_length - 1 : -1]  # (B, T)
    packed_ids = torch.cat(
        [prefix_ids, blocks.reshape(num_prompts, group_size * completion_length)], 1
    )  # (U, L) with L = Q + n * T
    length = packed_ids.shape[1]
    position = torch.arange(length, device=input_ids.device)  # (L,)
    block = torch.where(
        position < prefix_length, -1, (position - prefix_length) // completion_length
    )  # (L,): -1 for the prompt, else the completion's index in its group
    position_ids = torch.where(
        position < prefix_length,
        position,
        prefix_length + (position - prefix_length) % completion_length,
    )  # (L,)
    allowed = (position[None, :] <= position[:, None]) & (
        (block[None, :] == -1) | (block[None, :] == block[:, None])
    )  # (L, L): causal, and a block sees the prompt and itself
    key_is_real = torch.cat(
        [prefix_mask, prefix_mask.new_ones(num_prompts, length - prefix_length)], 1
    )  # (U, L)
    allowed = (allowed.unsqueeze(0) & key_is_real.unsqueeze(1)) | torch.eye(
        length, dtype=torch.bool, device=input_ids.device
    )  # (U, L, L); a padding query sees itself, so no row is empty
    if implementation == "sdpa":
        mask = allowed  # boolean, True where attention is allowed
    else:  # eager attention adds the mask to the scores
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        mask = torch.zeros(allowed.shape, dtype=dtype, device=input_ids.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    outputs = _head_outputs(
        model,
        head,
        input_ids=packed_ids,
        attention_mask=mask.unsqueeze(1),  # (U, 1, L, L)
        position_ids=(position_ids + padded).expand(num_prompts, -1),
        use_cache=False,
        logits_to_keep=group_size * completion_length,
    )  # (U, n * T, V), or (U, n * T, H) with `head`
    return outputs.reshape(rows, completion_length, outputs.shape[-1])  # (B, T, V) or (B, T, H)


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
