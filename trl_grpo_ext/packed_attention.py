"""Attention of a packed group row, block by block: each completion against the prompt and itself.

`logprobs._shared_prompt_logits` packs the G completions of a prompt into one row of
`Q + G*T` tokens (the prompt once, then G blocks of T tokens) and hands the model a 4D mask that
lets each block see the prompt and, causally, itself. The attention kernel does not skip what
the mask hides: it computes all `(Q + G*T)^2` scores, of which a block's queries use `Q + T`
each. At the benchmark's shape (Q = 55, G = 8, T = 64) that is 5x the work, a sixth of the
forward and backward passes on SmolLM2.

After `register_packed_mask(config, mask, prefix_length, group_size)`, every attention layer of
the model that receives `mask` runs as two SDPA calls instead: the prompt's queries over the
prompt's keys, and the `U * G` blocks as a batch, each block's `T` queries over the prompt's keys
(shared, not copied per block until the kernel's input) and its own `T` keys. Both masks are cut
from `mask`, so the result is the same attention (up to floating-point rounding: the hidden
scores were exact zeros after the softmax). Layers that receive any other mask (another thread,
another model) run transformers' SDPA unchanged.

It works by registering one attention implementation with transformers (`ATTENTION`) and
selecting it in the model's config while the mask lives (through the backward pass where
gradient checkpointing keeps it for the recomputation); a model whose attention is not SDPA is
left as it is (`attends_by_blocks`). Selecting it writes the config's private
`_attn_implementation`: on transformers releases outside those it is tested on
(`internals.FAST_PATHS["attention_by_blocks"]`) a packed row attends under its whole-row mask,
and that is logged once.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from .internals import usable

__all__ = ["ATTENTION", "attends_by_blocks", "block_slots", "register_packed_mask"]

ATTENTION = "trl_grpo_ext_packed_sdpa"


@dataclass(frozen=True)
class _Layout:
    prefix_length: int  # Q
    group_size: int  # G
    block_length: int  # T
    prefix_mask: torch.Tensor  # (U, 1, Q, Q) bool
    block_mask: torch.Tensor  # (U * G, 1, T, Q + T) bool
    windows: tuple  # each layer's sliding window, None for full attention
    # window -> the two masks narrowed to it, for each window shorter than Q + T
    windowed: dict
    # Blocks of their completions' own lengths (T the longest): each block slot's packed
    # position `(U, G * T)` and each packed position's slot `(U, L - Q)`; None when every block
    # has T tokens, laid out one after the other.
    index: torch.Tensor | None = None
    inverse: torch.Tensor | None = None

    def masks(self, module, sliding_window=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's and the blocks' masks for the attention layer `module`: narrowed to the
        layer's sliding window where it has one shorter than a completion's row."""
        if not self.windowed:
            return self.prefix_mask, self.block_mask
        index = getattr(module, "layer_idx", None)
        if index is None:
            raise RuntimeError(
                "A packed row of a model with sliding windows needs each attention layer's index "
                f"(`layer_idx`), which {type(module).__name__} does not have; set "
                "attn_implementation='eager' to train on unpacked rows."
            )
        window = self.windows[index]
        if sliding_window is not None and sliding_window != window:
            raise RuntimeError(
                f"{type(module).__name__} {index} attends through a window of {sliding_window} "
                f"tokens where its config gives {window}: a packed row cannot be masked "
                "for it; set attn_implementation='eager' to train on unpacked rows."
            )
        return self.windowed.get(window, (self.prefix_mask, self.block_mask))


def layer_kinds(config) -> list[str]:
    """Each layer's kind in a (text) `config`: its `layer_types` ("full_attention",
    "sliding_attention", "linear_attention", ...), else one kind for every layer, from the
    config's window (Mistral's `sliding_window`) or chunk (`attention_chunk_size`)."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return list(kinds)
    if getattr(config, "attention_chunk_size", None):
        kind = "chunked_attention"
    elif getattr(config, "sliding_window", None):
        kind = "sliding_attention"
    else:
        kind = "full_attention"
    return [kind] * getattr(config, "num_hidden_layers", 1)


def layer_windows(config) -> list:
    """The sliding window of each layer of a (text) `config`, None for a layer without one."""
    window = getattr(config, "sliding_window", None)
    return [window if kind == "sliding_attention" else None for kind in layer_kinds(config)]


def _narrowed(prefix_mask, block_mask, window: int):
    """The prompt's `(U, 1, Q, Q)` and the blocks' `(U * G, 1, T, Q + T)` masks, a query
    seeing only keys fewer than `window` positions before it (transformers' sliding window:
    `q - k < window`). A block's queries sit at positions Q..Q+T-1, its keys at 0..Q+T-1."""
    prefix_length, block_length = prefix_mask.shape[-1], block_mask.shape[-2]
    positions = torch.arange(prefix_length + block_length, device=block_mask.device)
    prompt = positions[:prefix_length]
    in_prompt = (prompt[:, None] - prompt[None, :]) < window  # (Q, Q)
    in_block = (positions[prefix_length:, None] - positions[None, :]) < window  # (T, Q + T)
    return prefix_mask & in_prompt, block_mask & in_block


# id(mask) -> its layout, while the mask lives (so its id is not reused; the layout holds copies,
# not views, of it); dict reads and writes are atomic, so other threads only ever miss.
_LAYOUTS: dict[int, _Layout] = {}
# id(config) -> [the implementation to restore, registered masks alive], so that overlapping
# registrations (two micro-batches' graphs, two threads) restore it once, when the last one ends.
_SELECTED: dict[int, list] = {}
_LOCK = threading.Lock()


def attends_by_blocks(config) -> bool:
    """Whether a packed mask registered for this (text) config is attended block by block: the
    model runs SDPA (`register_packed_mask` refuses other implementations), on a transformers
    release this is tested on (`internals.FAST_PATHS["attention_by_blocks"]`)."""
    sdpa = getattr(config, "_attn_implementation", None) in ("sdpa", ATTENTION)
    return sdpa and usable("attention_by_blocks")


def block_slots(prefix_length: int, lengths: torch.Tensor, block_length: int):
    """`(valid, positions)`, each `(U, G, T)` for `T = block_length`: whether slot t of each
    block holds one of its `lengths` `(U, G)` tokens, and that token's position in the packed
    row, the blocks laid out one after the other from `prefix_length` (a slot past its block's
    end points at the block's last token)."""
    offsets = torch.arange(block_length, device=lengths.device)
    last = lengths.unsqueeze(-1) - 1  # (U, G, 1)
    starts = prefix_length + lengths.cumsum(1) - lengths  # (U, G)
    return offsets <= last, starts.unsqueeze(-1) + torch.minimum(offsets, last)


def _split_masks(mask: torch.Tensor, prefix_length: int, lengths: torch.Tensor):
    """The prompt's `(U, 1, Q, Q)` and the blocks' `(U * G, 1, T, Q + T)` parts of a packed
    row's `(U, 1, L, L)` boolean mask, for blocks of `lengths` `(U, G)` tokens each (one after
    the other from Q, padding after the last block of the shorter rows) padded to the longest,
    T: a padding slot is seen by no query and sees only itself. Also, where the blocks are not
    all T long, each slot's packed position `(U, G * T)` and each packed position's slot
    `(U, L - Q)`; else None for both (the blocks are the row's last G * T tokens in order)."""
    units, size = lengths.shape
    block_length = int(lengths.max())
    device = mask.device
    slot_valid, index = block_slots(prefix_length, lengths, block_length)  # (U, G, T) each
    square = mask[:, 0]  # (U, L, L)
    prefix_mask = square[:, :prefix_length, :prefix_length].clone()
    rows = torch.arange(units, device=device).view(units, 1, 1, 1)
    to_prefix = square[:, :, :prefix_length][rows.squeeze(-1), index]  # (U, G, T, Q)
    own = square[rows, index.unsqueeze(-1), index.unsqueeze(-2)]  # (U, G, T, T): query t, key s
    own = own & slot_valid.unsqueeze(2)  # no query sees a padding slot's key
    to_prefix = to_prefix & slot_valid.unsqueeze(-1)
    padding = ~slot_valid.unsqueeze(-1) & torch.eye(block_length, dtype=torch.bool, device=device)
    block_mask = torch.cat([to_prefix, own | padding], dim=3).flatten(0, 1)  # (U*G, T, Q+T)
    masks = prefix_mask.unsqueeze(1), block_mask.unsqueeze(1), block_length
    length = mask.shape[-1]
    if bool(slot_valid.all()) and length == prefix_length + size * block_length:
        return *masks, None, None
    inverse = torch.zeros(units, length - prefix_length, dtype=torch.long, device=device)
    slots = torch.arange(size * block_length, device=device).view(1, size, block_length)
    flat = (rows.view(units, 1, 1) * (length - prefix_length) + index - prefix_length)[slot_valid]
    inverse.view(-1)[flat] = slots.expand(units, -1, -1)[slot_valid]
    return *masks, index.flatten(1), inverse


def _packed_sdpa(module, query, key, value, attention_mask, **kwargs):
    """An attention implementation for transformers: block by block for a registered packed
    mask, transformers' SDPA for anything else. query `(U, H, L, D)`, key and value
    `(U, KV, L, D)`; returns `(U, L, H, D)` and no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = None if attention_mask is None else _LAYOUTS.get(id(attention_mask))
    # the whole packed row in one pass (no cache): queries and keys both span the mask
    if layout is None or not query.shape[2] == key.shape[2] == attention_mask.shape[-1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    units = query.shape[0]
    prefix, size, block = layout.prefix_length, layout.group_size, layout.block_length

    def blocks(states):  # (U, h, L, D) -> (U*G, h, T, D)
        if layout.index is None:
            states = states[:, :, prefix:]
        else:  # each block's tokens, padded to T
            states = torch.gather(
                states,
                2,
                layout.index[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3]),
            )  # (U, h, G*T, D)
        return states.unflatten(2, (size, block)).transpose(1, 2).flatten(0, 1)

    def with_prefix(states):  # (U*G, h, Q + T, D): each block's keys after the prompt's
        shared = states[:, :, :prefix].unsqueeze(1).expand(-1, size, -1, -1, -1).flatten(0, 1)
        return torch.cat([shared, blocks(states)], dim=2)

    prefix_mask, block_mask = layout.masks(module, kwargs.get("sliding_window"))
    prompt_out = _sdpa(
        module,
        query[:, :, :prefix],
        key[:, :, :prefix],
        value[:, :, :prefix],
        prefix_mask,
        **kwargs,
    )  # (U, Q, H, D)
    blocks_out = _sdpa(
        module, blocks(query), with_prefix(key), with_prefix(value), block_mask, **kwargs
    )  # (U*G, T, H, D)
    blocks_out = blocks_out.unflatten(0, (units, size)).flatten(1, 2)  # (U, G*T, H, D)
    if layout.inverse is not None:  # back to the packed positions, (U, L - Q, H, D)
        blocks_out = blocks_out[torch.arange(units, device=query.device)[:, None], layout.inverse]
    return torch.cat([prompt_out, blocks_out], dim=1), None


def _sdpa(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA under a boolean mask, `(N, L, H, D)`. On a CPU, grouped-query
    attention runs in the kernel (`enable_gqa`) rather than on keys and values repeated for each
    head of their group, as transformers does under a mask: the same values, and a third of the
    keys and values kept for the backward pass with SmolLM2's 3 heads per group. (CUDA's kernels
    under a mask fall back to the math kernel with `enable_gqa`.)"""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    special = (
        kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions")
    )
    if groups == 1 or query.device.type != "cpu" or special:
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs
        )[0]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # (N, H, L, D)
    return out.transpose(1, 2).contiguous()


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, _packed_sdpa)
    # Masks for this implementation are SDPA's (only used where a 2D mask is given).
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def register_packed_mask(
    config,
    mask: torch.Tensor,
    prefix_length: int,
    group_size: int,
    block_lengths: torch.Tensor | None = None,
):
    """Until `mask` is freed, attention layers reading `config` that receive it (a packed row's
    `(U, 1, L, L)` boolean mask: a prompt of `prefix_length` tokens, then `group_size` blocks,
    of equal length or of `block_lengths` `(U, G)` tokens each) attend block by block.
    `config` is the model's (text) config; see `attends_by_blocks`.
    A layer with a sliding window (`layer_windows`) attends within it: transformers would hand
    it `mask` as it is, a whole-row mask being taken as already made for every layer.

    Tied to the mask's life rather than to a block of code, so that gradient checkpointing,
    which runs each layer again in the backward pass with the mask it kept, attends as the
    forward pass did. The config selects `ATTENTION` while any registered mask of it lives,
    then what it had before."""
    if not attends_by_blocks(config):
        raise ValueError(
            f"block attention runs in place of SDPA, not {config._attn_implementation!r}"
        )
    _register()
    if block_lengths is None:  # G blocks of equal length fill the row after the prompt
        block_length = (mask.shape[-1] - prefix_length) // group_size
        block_lengths = torch.full((mask.shape[0], group_size), block_length, device=mask.device)
    prefix_mask, block_mask, block_length, index, inverse = _split_masks(
        mask, prefix_length, block_lengths
    )
    windows = tuple(layer_windows(config))
    windowed = {
        window: _narrowed(prefix_mask, block_mask, window)
        for window in set(windows) - {None}
        if window < prefix_length + block_length
    }
    key = id(mask)
    _LAYOUTS[key] = _Layout(
        prefix_length,
        group_size,
        block_length,
        prefix_mask,
        block_mask,
        windows,
        windowed,
        index,
        inverse,
    )
    with _LOCK:
        selected = _SELECTED.setdefault(id(config), [config._attn_implementation, 0])
        selected[1] += 1
        config._attn_implementation = ATTENTION
    weakref.finalize(mask, _release, key, config, selected)


def _release(key: int, config, selected: list) -> None:
    """A registered mask was freed: forget its layout, and hand the config back its own
    implementation when no other registered mask of it lives."""
    _LAYOUTS.pop(key, None)
    with _LOCK:
        selected[1] -= 1
        if selected[1] == 0:
            config._attn_implementation = selected[0]
            del _SELECTED[id(config)]
