"""A packed group row attended block by block (`trl_grpo_ext.packed_attention`): the same
log-probs and gradients as the whole row under its 4D mask, each block's queries over the prompt
and its own keys only, and the model's attention implementation handed back as it was."""

import gc

import pytest
import torch

from trl_grpo_ext import logprobs, packed_attention
from trl_grpo_ext.logprobs import completion_logprobs, packing_pays
from trl_grpo_ext.tiny import tiny_model_and_tokenizer


@pytest.fixture
def tiny():
    model, _ = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    assert model.config._attn_implementation == "sdpa"
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    return model


def group_batch(vocab, groups=3, group_size=4, prompt_length=10, completion_length=5):
    """Groups of completions sharing left-padded prompts (the first prompt shorter)."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (groups, prompt_length), generator=generator)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[0, :3] = 0
    rows = groups * group_size
    completion_ids = torch.randint(3, vocab, (rows, completion_length), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 3:] = 0
    input_ids = torch.cat([prompts.repeat_interleave(group_size, 0), completion_ids], 1)
    attention_mask = torch.cat([prompt_mask.repeat_interleave(group_size, 0), completion_mask], 1)
    return input_ids, attention_mask, completion_ids, completion_mask


class AttentionCalls:
    """Records the query shape and the key heads of every SDPA kernel call."""

    def __init__(self, monkeypatch):
        self.shapes, self.key_heads = [], []
        kernel = torch.nn.functional.scaled_dot_product_attention

        def recording(query, key, *args, **kwargs):
            self.shapes.append(tuple(query.shape))
            self.key_heads.append(key.shape[1])
            return kernel(query, key, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)


def logps_and_gradients(model, inputs):
    input_ids, attention_mask, completion_ids, mask = inputs
    logps, entropy = completion_logprobs(
        model, input_ids, attention_mask, completion_ids, 0.8, return_entropy=True
    )
    upstream = torch.linspace(-1, 1, logps.numel()).view_as(logps)
    (logps * upstream * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return logps * mask, entropy * mask, grads


@pytest.mark.parametrize("lora", [False, True])
def test_blocks_give_the_whole_rows_values_and_gradients(tiny, monkeypatch, lora):
    model = tiny
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=4, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM"
        )
        model = get_peft_model(tiny, config)
    inputs = group_batch(tiny.config.vocab_size)
    calls = AttentionCalls(monkeypatch)
    got = logps_and_gradients(model, inputs)
    # Per layer: the 3 prompts (9 of the 10 prompt tokens each), then 3 x 4 blocks of 5 tokens.
    heads, layers = tiny.config.num_attention_heads, tiny.config.num_hidden_layers
    head_dim = tiny.config.head_dim
    assert calls.shapes == [(3, heads, 9, head_dim), (12, heads, 5, head_dim)] * layers
    # on a CPU, grouped-query attention in the kernel: the keys not repeated per head
    assert calls.key_heads == [tiny.config.num_key_value_heads] * 2 * layers
    assert tiny.config._attn_implementation == "sdpa"

    calls.shapes.clear()
    monkeypatch.setattr(logprobs, "attends_by_blocks", lambda config: False)
    want = logps_and_gradients(model, inputs)
    assert calls.shapes == [(3, heads, 9 + 4 * 5, head_dim)] * layers  # the whole packed rows
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    assert got[2].keys() == want[2].keys() and got[2]
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=1e-4, rtol=1e-4, msg=name)


def test_gradient_checkpointing_recomputes_block_by_block(tiny, monkeypatch):
    # The backward pass runs each layer again with the mask it kept: by blocks, as the forward.
    inputs = group_batch(tiny.config.vocab_size)
    tiny.train()
    want = logps_and_gradients(tiny, inputs)
    tiny.gradient_checkpointing_enable({"use_reentrant": False})
    calls = AttentionCalls(monkeypatch)
    got = logps_and_gradients(tiny, inputs)
    layers = tiny.config.num_hidden_layers
    assert [shape[:3] for shape in calls.shapes] == [(3, 4, 9), (12, 4, 5)] * 2 * layers
    for g, w in zip(got[:2], want[:2]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=1e-4, rtol=1e-4, msg=name)
    assert tiny.config._attn_implementation == "sdpa"


def test_the_implementation_is_selected_while_a_registered_mask_lives(tiny):
    other, _ = tiny_model_and_tokenizer(seed=1, initializer_range=0.2)
    input_ids, attention_mask = group_batch(tiny.config.vocab_size)[:2]
    models = (tiny, other)
    with torch.no_grad():
        before = [m(input_ids=input_ids, attention_mask=attention_mask).logits for m in models]
    masks = [torch.ones(1, 1, 9, 9, dtype=torch.bool).tril() for _ in range(2)]
    for mask in masks:  # two at once (two micro-batches' graphs)
        packed_attention.register_packed_mask(tiny.config, mask, prefix_length=3, group_size=2)
    del mask
    assert tiny.config._attn_implementation == packed_attention.ATTENTION
    assert other.config._attn_implementation == "sdpa"
    with torch.no_grad():  # a 2D mask, in the model whose attention is switched: as before
        during = [m(input_ids=input_ids, attention_mask=attention_mask).logits for m in models]
    for b, d in zip(before, during):
        torch.testing.assert_close(d, b, atol=0, rtol=0)
    masks.pop()
    assert tiny.config._attn_implementation == packed_attention.ATTENTION  # one still lives
    masks.pop()
    assert tiny.config._attn_implementation == "sdpa"
    assert not packed_attention._LAYOUTS and not packed_attention._SELECTED


def test_the_implementation_is_handed_back_after_an_error(tiny, monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("inside the forward pass")

    monkeypatch.setattr(tiny.model.layers[-1].mlp, "forward", failing)
    inputs = group_batch(tiny.config.vocab_size)
    with pytest.raises(RuntimeError, match="inside") as raised:
        completion_logprobs(tiny, *inputs[:3])
    del raised  # its traceback's frames held the mask
    gc.collect()
    assert tiny.config._attn_implementation == "sdpa"
    assert not packed_attention._LAYOUTS and not packed_attention._SELECTED


def test_eager_attention_keeps_the_whole_row(tiny):
    model, _ = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)  # tiny's weights
    model.set_attn_implementation("eager")
    assert not packed_attention.attends_by_blocks(model.config)
    with pytest.raises(ValueError, match="not 'eager'"):
        packed_attention.register_packed_mask(model.config, torch.ones(1, 1, 9, 9).bool(), 3, 2)
    input_ids, attention_mask, completion_ids, _ = group_batch(model.config.vocab_size)
    with torch.no_grad():  # the whole row's additive mask: the hidden states SDPA's blocks give
        eager = logprobs._shared_prompt_logits(model, input_ids, attention_mask, 5)
        blocks = logprobs._shared_prompt_logits(tiny, input_ids, attention_mask, 5)
    assert eager is not None and eager.shape == (12, 5, tiny.config.vocab_size)
    torch.testing.assert_close(eager, blocks, atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation == "eager" and not packed_attention._LAYOUTS


def test_packing_pays_for_long_completions_by_blocks():
    # SmolLM2-135M's sizes, a 57-token prompt and G = 8: 64-token completions pay either way;
    # 256-token ones paid only by blocks (the whole row's attention measured 1.40x the rows').
    class Config:
        hidden_size, intermediate_size = 576, 1536

    class Model:
        config = Config()

    assert packing_pays(Model(), 57, 64, 8) and packing_pays(Model(), 57, 64, 8, by_blocks=True)
    assert not packing_pays(Model(), 57, 256, 8)
    assert packing_pays(Model(), 57, 256, 8, by_blocks=True)


def test_a_sliding_window_needs_the_layers_index_and_its_configs_window():
    """A layer is masked to its window by its index in `layer_types`: without an index, or
    with a window other than its config's, it cannot be, and says so."""
    from transformers import MistralConfig

    config = MistralConfig(num_hidden_layers=2, sliding_window=3)
    config._attn_implementation = "sdpa"
    length = 2 + 2 * 3  # a prompt of 2 tokens, 2 blocks of 3
    mask = torch.ones(1, 1, length, length, dtype=torch.bool).tril()
    packed_attention.register_packed_mask(config, mask, prefix_length=2, group_size=2)
    states = torch.randn(1, 2, length, 4)

    class Layer(torch.nn.Module):
        num_key_value_groups = 1

    layer = Layer()
    with pytest.raises(RuntimeError, match="layer_idx"):
        packed_attention._packed_sdpa(layer, states, states, states, mask)
    layer.layer_idx = 1
    with pytest.raises(RuntimeError, match="window of 5 tokens where its config gives 3"):
        packed_attention._packed_sdpa(layer, states, states, states, mask, sliding_window=5)
    out, _ = packed_attention._packed_sdpa(layer, states, states, states, mask, sliding_window=3)
    # The same row without a window: queries at positions 0-2 (the prompt's two, each block's
    # first) see all their keys either way; the later ones lose the keys 3 or more back.
    full_config = MistralConfig(num_hidden_layers=2, sliding_window=None)
    full_config._attn_implementation = "sdpa"
    full_mask = mask.clone()
    packed_attention.register_packed_mask(full_config, full_mask, prefix_length=2, group_size=2)
    full, _ = packed_attention._packed_sdpa(layer, states, states, states, full_mask)
    within = [0, 1, 2, 5]  # prompt 0, 1; block 0 token 0; block 1 token 0 (positions 0, 1, 2, 2)
    past = [3, 4, 6, 7]
    torch.testing.assert_close(out[:, within], full[:, within])
    assert all(not torch.allclose(out[:, i], full[:, i]) for i in past)
