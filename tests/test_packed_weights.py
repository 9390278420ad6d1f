"""Sampling with the linear layers' weights laid out once for oneDNN
(`generation.packed_weights`): the same tokens and log-probs as `F.linear`, the layers as they
were after the block, and `F.linear` wherever the laid-out weight does not apply."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_merged_adapters import PROMPTS, Policy, lora_model, sampling

from trl_grpo_ext.generation import PromptEncoder, packed_weights
from trl_grpo_ext.generation.merged_adapters import merged_lora
from trl_grpo_ext.generation.packed_weights import packed_linear_weights
from trl_grpo_ext.generation.transformers_engine import (
    TransformersEngine,
    generate_with_transformers,
    seeded,
)
from trl_grpo_ext.logprobs import float32_head

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch is built without oneDNN"
)


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    """The tiny model's layers are all below the size from which laying out pays
    (`MIN_WEIGHTS`); the products are the same at any size, so here every layer is laid out."""
    monkeypatch.setattr(packed_weights, "MIN_WEIGHTS", 0)


class Counted:
    """`torch.ops.mkldnn._linear_pointwise`, counting its calls."""

    def __init__(self):
        self.calls, self.function = 0, torch.ops.mkldnn._linear_pointwise

    def __call__(self, *args):
        self.calls += 1
        return self.function(*args)


def sample(model, tokenizer, pack: bool, seed=0):
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)
    counted = Counted()
    with seeded(seed), mock.patch.object(torch.ops.mkldnn, "_linear_pointwise", counted):
        _, _, ids, logps = generate_with_transformers(
            model,
            prompt_ids,
            prompt_mask,
            generation_config=sampling(tokenizer),
            return_logprobs=True,
            pack_weights=pack,
        )
    return ids, logps, counted.calls


def linear_layers(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_laid_out_weights_sample_the_same_tokens_and_log_probs(seed):
    model, tokenizer = lora_model()
    plain_ids, plain_logps, plain_calls = sample(model, tokenizer, pack=False, seed=seed)
    ids, logps, calls = sample(model, tokenizer, pack=True, seed=seed)

    assert plain_calls == 0
    # every linear layer (the LoRA A and B matrices and the head too) ran oneDNN's product at
    # every forward pass of the batch
    assert calls > 0 and calls % len(linear_layers(model)) == 0
    assert torch.equal(ids, plain_ids)
    torch.testing.assert_close(logps, plain_logps, atol=1e-5, rtol=1e-5)


def test_the_engine_samples_merged_and_laid_out_as_the_plain_adapters_do():
    """The engine's defaults (adapters merged, weights laid out) against neither."""
    model, tokenizer = lora_model()
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)

    engine = TransformersEngine(Policy(model))
    counted = Counted()
    with mock.patch.object(torch.ops.mkldnn, "_linear_pointwise", counted):
        _, _, ids, _ = engine.generate(prompt_ids, prompt_mask, sampling(tokenizer), seed=5)
    with seeded(5):
        _, _, plain_ids = generate_with_transformers(
            model,
            prompt_ids,
            prompt_mask,
            generation_config=sampling(tokenizer),
            pack_weights=False,
        )
    assert counted.calls > 0
    assert torch.equal(ids, plain_ids)


def test_after_the_block_the_layers_compute_as_before_and_hold_the_same_weights():
    model, _ = lora_model()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    layers = linear_layers(model)
    with torch.no_grad(), packed_linear_weights(model) as count:
        assert count == len(layers)
        assert all("forward" in layer.__dict__ for layer in layers)
    assert not any("forward" in layer.__dict__ for layer in layers)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_inside_the_block_autograd_and_other_dtypes_compute_with_f_linear():
    """While autograd records, the gradient is that of `F.linear`; an input of another dtype
    gets `F.linear`'s answer (or its error), not oneDNN's."""
    layer = torch.nn.Linear(16, 8)
    model = torch.nn.Sequential(layer)
    x = torch.randn(5, 16)
    expected = layer(x)
    expected.sum().backward()
    expected_grad = layer.weight.grad.clone()
    layer.weight.grad = None
    counted = Counted()
    with (
        packed_linear_weights(model),
        mock.patch.object(torch.ops.mkldnn, "_linear_pointwise", counted),
    ):
        out = layer(x)
        out.sum().backward()
        assert counted.calls == 0
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(layer.weight.grad, expected_grad)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), expected.detach(), atol=1e-6, rtol=1e-5)
            assert counted.calls == 1
            with pytest.raises(RuntimeError, match="dtype"):
                layer(x.double())
            assert counted.calls == 1
            # more rows than a decoding step's (the prompts' pass): F.linear
            many = torch.randn(packed_weights.MAX_ROWS + 1, 16)
            torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias))
            assert counted.calls == 1


@pytest.mark.parametrize("rows", [1, 5, 8, 13, 64])
def test_rows_padded_to_a_multiple_give_each_row_its_own_product(rows):
    """A decoding step's rows are padded to a multiple of `ROW_MULTIPLE` for oneDNN: the padding
    rows are cut off again, and each row's output is `F.linear`'s up to rounding, in any shape."""
    layer = torch.nn.Linear(24, 40)
    x = torch.randn(rows, 1, 24)
    with torch.no_grad(), packed_linear_weights(torch.nn.Sequential(layer)) as count:
        out = layer(x)
    assert count == 1
    assert out.shape == (rows, 1, 40)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-6, rtol=1e-5)


def test_small_layers_keep_f_linear_by_default(monkeypatch):
    monkeypatch.undo()
    model, _ = lora_model()
    assert all(m.weight.numel() < packed_weights.MIN_WEIGHTS for m in linear_layers(model))
    with packed_linear_weights(model) as count:
        assert count == 0
    big = torch.nn.Linear(1024, packed_weights.MIN_WEIGHTS // 1024)
    with packed_linear_weights(torch.nn.Sequential(big)) as count:
        assert count == 1


def test_other_dtypes_and_replaced_forwards_are_left_as_they_are():
    # bfloat16 base layers stay as they are (PEFT keeps the adapters' A and B in float32)
    model, _ = lora_model(dtype=torch.bfloat16)
    with packed_linear_weights(model) as count:
        float32 = [m for m in linear_layers(model) if m.weight.dtype == torch.float32]
        assert 0 < count == len(float32) < len(linear_layers(model))
        assert all(("forward" in m.__dict__) == (m in float32) for m in linear_layers(model))
    model, _ = lora_model()
    with packed_linear_weights(model, enabled=False) as count:
        assert count == 0
    # the head's forward replaced by `float32_head`: that layer keeps it
    head = model.get_output_embeddings()
    with float32_head(model):
        replaced = head.forward
        with packed_linear_weights(model) as count:
            assert count == len(linear_layers(model)) - 1
            assert head.forward is replaced
        assert head.forward is replaced
    assert "forward" not in head.__dict__


def test_merged_adapters_are_laid_out_without_a_dense_merged_copy():
    """`merged_lora(lay_out=True)`: each base layer computes decoding steps with `W + s B A` laid
    out, its weight stays `W` (no dense merged copy), and the prompts' pass (more rows) and any
    pass autograd records compute as the unmerged layer does."""
    model, tokenizer = lora_model()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    weight = layer.base_layer.weight.data
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    step, prompts = torch.randn(3, weight.shape[1]), torch.randn(80, weight.shape[1])
    with torch.no_grad():
        expected_step, expected_prompts = layer(step), layer(prompts)
    with merged_lora(model, lay_out=True) as merged:
        assert merged and layer.merged
        assert layer.base_layer.weight.data_ptr() == weight.data_ptr()
        with torch.no_grad():
            torch.testing.assert_close(layer(step), expected_step, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer(prompts), expected_prompts, atol=1e-5, rtol=1e-5)
        out = layer(step)
        torch.testing.assert_close(out, expected_step, atol=1e-5, rtol=1e-5)
        out.sum().backward()
        assert layer.lora_B["default"].weight.grad.abs().sum() > 0
    ids, logps, calls = sample(model, tokenizer, pack=False)
    with merged_lora(model, lay_out=True):
        laid_out_ids, laid_out_logps, laid_out_calls = sample(model, tokenizer, pack=True)
    assert calls == 0 < laid_out_calls
    assert torch.equal(laid_out_ids, ids)
    torch.testing.assert_close(laid_out_logps, logps, atol=1e-5, rtol=1e-5)
    after = model.state_dict()
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert not any(getattr(m, "merged", False) for m in model.modules())
