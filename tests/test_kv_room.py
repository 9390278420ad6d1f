"""The KV cache that grows in place (`generation.kv_room`): the same keys and values as
transformers' `DynamicLayer` under every operation sampling does (steps, finished rows leaving,
cropping, offloading), buffers copied only when their room runs out, and the same completions and
log-probs as sampling with `DynamicLayer`'s concatenation."""

from unittest import mock

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from trl_grpo_ext.generation import PromptEncoder, kv_room, sampling_config
from trl_grpo_ext.generation.kv_room import RoomyLayer, make_room
from trl_grpo_ext.generation.transformers_engine import generate_with_transformers, seeded
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

ROWS, HEADS, HEAD_DIM = 6, 2, 4


def states(length: int, rows: int = ROWS, generator=None):
    shape = (rows, HEADS, length, HEAD_DIM)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def assert_same_layer(got, want):
    assert got.get_seq_length() == want.get_seq_length()
    torch.testing.assert_close(got.keys, want.keys, rtol=0, atol=0)
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=0)


def prompt_layers(length=5, max_length=None):
    """A `DynamicLayer` holding a prompt, and a `RoomyLayer` made from a copy of it."""
    keys, values = states(length, generator=torch.Generator().manual_seed(0))
    want, plain = DynamicLayer(), DynamicLayer()
    want.update(keys, values)
    plain.update(keys.clone(), values.clone())
    return RoomyLayer(plain, max_length), want


def test_steps_and_finished_rows_give_dynamic_layers_keys_and_values():
    got, want = prompt_layers(max_length=200)
    generator = torch.Generator().manual_seed(1)
    rows = ROWS
    for step in range(150):  # past the first room (64 tokens): the buffers grow
        keys, values = states(1, rows, generator)
        got_keys, got_values = got.update(keys, values)
        want.update(keys, values)
        assert_same_layer(got, want)
        torch.testing.assert_close(got_keys, want.keys, rtol=0, atol=0)
        if step in (10, 70, 120) and rows > 1:  # a row finishes
            keep = torch.tensor([row for row in range(rows) if row != step % rows])
            got.batch_select_indices(keep)
            want.batch_select_indices(keep)
            rows -= 1
            assert_same_layer(got, want)
    assert got.keys.shape[0] == ROWS - 3
    assert got._key_buffer.shape[-2] <= 200  # never past the longest sequence sampled


def test_buffers_are_copied_only_when_the_room_runs_out():
    got, _ = prompt_layers(length=5, max_length=40)
    assert got._key_buffer.shape[-2] == 40  # room up to max_length at once
    buffer = got._key_buffer
    for _ in range(35):
        got.update(*states(1))
        assert got._key_buffer is buffer  # written in place
        assert got.keys.data_ptr() == buffer.data_ptr()
    got.update(*states(3))  # past max_length: grows as far as the step needs
    assert got.get_seq_length() == 43
    assert got._key_buffer.shape[-2] == 43


def test_a_prefill_of_several_tokens_and_an_empty_layer():
    layer, want = RoomyLayer(DynamicLayer()), DynamicLayer()
    assert not layer.is_initialized and layer.get_seq_length() == 0
    layer.batch_select_indices(torch.tensor([0]))  # nothing to select yet
    for length in (7, 1, 9):
        chunk = states(length)
        layer.update(*chunk)
        want.update(*chunk)
        assert_same_layer(layer, want)
    assert layer._key_buffer.shape[-2] == 7 + kv_room.MIN_ROOM  # made at the first update


def test_cropping_offloading_and_reordering_stay_exact():
    got, want = prompt_layers()
    for _ in range(4):
        chunk = states(1)
        got.update(*chunk)
        want.update(*chunk)
    got.crop(-2)
    want.crop(-2)
    assert_same_layer(got, want)
    order = torch.tensor([5, 4, 3, 2, 1, 0])
    got.reorder_cache(order)  # replaces keys by a copy: taken into new buffers at the update
    want.reorder_cache(order)
    got.offload()
    want.offload()
    for _ in range(3):
        chunk = states(1)
        got.update(*chunk)
        want.update(*chunk)
        assert_same_layer(got, want)
    got.batch_select_indices(torch.tensor([0, 2]))
    want.batch_select_indices(torch.tensor([0, 2]))
    assert_same_layer(got, want)
    got.reset()
    assert not got.is_initialized and got.get_seq_length() == 0


def test_make_room_replaces_only_plain_dynamic_layers():
    cache = DynamicCache()
    sliding = DynamicSlidingWindowLayer(sliding_window=4)
    cache.layers = [DynamicLayer(), DynamicLayer(), sliding]
    cache.layers[0].update(*states(3))
    make_room(cache, max_length=10)
    assert type(cache.layers[0]) is RoomyLayer
    assert type(cache.layers[1]) is DynamicLayer  # not initialized: no keys to take yet
    assert cache.layers[2] is sliding
    make_room(None)  # no cache: nothing to do


@pytest.mark.parametrize("group_size", [1, 4])
def test_sampling_gives_the_completions_of_a_concatenated_cache(group_size):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    model.eval()
    prompts = PromptEncoder(tokenizer).encode(["1+2=", "10+17=", "3+3=?"])
    config = sampling_config(
        max_new_tokens=90,  # past the first room of the prompts' cache
        eos_token_id=[tokenizer.eos_token_id, *range(8)],
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=group_size,
        temperature=0.9,
    )
    grown = []
    original_grow = RoomyLayer._grow

    def counting_grow(layer, new):
        grown.append(new)
        return original_grow(layer, new)

    with mock.patch.object(RoomyLayer, "_grow", counting_grow), seeded(5):
        got = generate_with_transformers(
            model, *prompts, generation_config=config, return_logprobs=True
        )
    with mock.patch.object(kv_room, "make_room", lambda cache, max_length=None: None), seeded(5):
        want = generate_with_transformers(
            model, *prompts, generation_config=config, return_logprobs=True
        )
    for got_part, want_part in zip(got[:3], want[:3]):
        assert torch.equal(got_part, want_part)
    torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=1e-6)
    layers = model.config.num_hidden_layers
    assert layers <= len(grown) <= 2 * layers  # made with room once, grown at most once more
