"""What the vLLM engines share: one `GenerationConfig` turned into vLLM's sampling settings, and
vLLM's per-sequence outputs turned back into the tensors of `generate_with_transformers`.

The sampling settings are the `GenerationConfig` of `generation.sampling_config`, field for field,
so the `transformers` engine and vLLM sample from the same distribution. A field vLLM has no
equivalent for is an error, never dropped silently.

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"` (as TRL 1.16 does), so the
sampled token's log-prob is taken after temperature, repetition penalty, min-p, top-k and top-p,
renormalised over the tokens that survive: the distribution the token was actually drawn from.
With TRL's default sampling settings (top_p=1, top_k=0, min_p=None, repetition_penalty=1) that is
`log softmax(z / T)[o_t]`, the trainer's log-prob. With a truncating filter it is larger by
`-log(kept mass)`. `generate_with_transformers` returns the same definition (docs/async.md).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

# GenerationConfig fields that have a vLLM equivalent, or no effect on what is sampled.
HONOURED_FIELDS = {
    "do_sample",
    "max_new_tokens",
    "min_new_tokens",
    "num_return_sequences",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
    "cache_implementation",  # the engine manages its own cache
    "use_cache",
    "output_logits",
    "output_scores",
    "return_dict_in_generate",
    "transformers_version",
    "stop_strings",  # vLLM's `stop`
    "include_stop_str_in_output",  # vLLM's own (see `sampling._with_stop_strings`)
}


def unsupported_fields(generation_config: GenerationConfig) -> list[str]:
    """The fields of `generation_config` set away from `transformers`' default that vLLM cannot
    honour (beam search, `no_repeat_ngram_size`, `typical_p`, ...)."""
    changed = generation_config.to_diff_dict()
    return sorted(name for name in changed if name not in HONOURED_FIELDS)


def check_supported(generation_config: GenerationConfig) -> None:
    """Raises `ValueError` naming the settings of `generation_config` that vLLM cannot honour."""
    fields = unsupported_fields(generation_config)
    if generation_config.max_new_tokens is None:
        fields.append("max_new_tokens=None (set max_completion_length)")
    if fields:
        raise ValueError(
            f"vLLM cannot sample with these generation settings: {', '.join(fields)}. Remove "
            "them from `generation_kwargs`, or generate with `use_vllm=False` (transformers)."
        )


def eos_ids(generation_config: GenerationConfig) -> list[int]:
    eos = generation_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def sampling_fields(generation_config: GenerationConfig, seed: int | None) -> dict:
    """The sampling settings of `generation_config` as keyword arguments of `vllm.SamplingParams`
    (and fields of a completions request): every field explicit, nothing from the checkpoint.

    Greedy decoding is `temperature=0`. `top_k=0` (or None) and `min_p=None` disable those filters
    in both libraries. Only the eos ids of the config stop a sequence (`ignore_eos=True` keeps
    the checkpoint's own eos out; `stop_token_ids` still stop), and the stop token is kept in
    the output, as `generate` keeps it. `stop_strings` are vLLM's `stop`: the tokens up to the
    one that completes a stop string are returned (whatever `include_stop_str_in_output` says,
    which only trims vLLM's text).
    """
    check_supported(generation_config)
    greedy = not generation_config.do_sample
    return dict(
        n=generation_config.num_return_sequences or 1,
        temperature=0.0 if greedy else float(generation_config.temperature),
        top_p=1.0 if greedy else float(generation_config.top_p),
        top_k=0 if greedy else int(generation_config.top_k or 0),
        min_p=0.0 if greedy or generation_config.min_p is None else float(generation_config.min_p),
        repetition_penalty=float(generation_config.repetition_penalty or 1.0),
        max_tokens=int(generation_config.max_new_tokens),
        min_tokens=int(generation_config.min_new_tokens or 0),
        stop_token_ids=eos_ids(generation_config),
        ignore_eos=True,
        seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        stop=list(generation_config.stop_strings or []),
        include_stop_str_in_output=bool(
            getattr(generation_config, "include_stop_str_in_output", False)
        ),
    )


def sampling_params(generation_config: GenerationConfig, seed: int | None = None):
    """A `vllm.SamplingParams` with exactly the settings of `generation_config`.

    `seed` seeds the request: vLLM gives its `n` samples the seeds `seed, seed + 1, ...`.
    """
    from vllm import SamplingParams

    fields = sampling_fields(generation_config, seed)
    # vLLM matches stop strings on its detokenized text (no text is needed without them), here
    # with the special tokens in it, as the server requests and `generate` match them.
    return SamplingParams(**fields, detokenize=bool(fields["stop"]), skip_special_tokens=False)


def prompt_seeds(seed: int | None, num_prompts: int, group_size: int) -> list[int | None]:
    """One seed per prompt such that no two samples of one call share a random stream: vLLM seeds
    the G samples of a prompt `s, s + 1, ..., s + G - 1`."""
    if seed is None:
        return [None] * num_prompts
    return [seed + index * group_size for index in range(num_prompts)]


def unpadded_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """The token ids of each left-padded prompt row `(B, P)`, without its padding."""
    return [row[mask.bool()].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]


def to_tensors(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completions: list[list[int]],
    logprobs: list[list[float]],
    generation_config: GenerationConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four tensors of `generate_with_transformers(..., return_logprobs=True)` from the B*G
    completions (groups consecutive) and their sampled-token log-probs.

    Returns:
        `(prompt_ids, prompt_mask, completion_ids, logps)` of shapes `(B*G, P)`, `(B*G, P)`,
        `(B*G, T)` right-padded with the pad id, `(B*G, T)` float32 with 0 after each end.
    """
    group_size = len(completions) // max(prompt_ids.shape[0], 1)
    pad = generation_config.pad_token_id
    if pad is None:
        pad = (eos_ids(generation_config) or [0])[0]
    length = max((len(tokens) for tokens in completions), default=0)
    completion_ids = torch.full((len(completions), length), pad, dtype=torch.long)  # (B*G, T)
    logps = torch.zeros((len(completions), length), dtype=torch.float32)  # (B*G, T)
    for row, (tokens, values) in enumerate(zip(completions, logprobs)):
        completion_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logps[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    device = prompt_ids.device
    return (
        prompt_ids.repeat_interleave(group_size, dim=0),  # (B*G, P)
        prompt_mask.repeat_interleave(group_size, dim=0),  # (B*G, P)
        completion_ids.to(device),
        logps.to(device),
    )


def adapter_rank(adapter_dir) -> int:
    """The LoRA rank `r` of a PEFT adapter folder (the largest, with `rank_pattern`)."""
    import json
    import os

    with open(os.path.join(adapter_dir, "adapter_config.json")) as handle:
        config = json.load(handle)
    ranks = [int(config.get("r", 0))] + [
        int(r) for r in (config.get("rank_pattern") or {}).values()
    ]
    return max(ranks)
