"""Log-probs from the hidden states in chunks of tokens (`trl_grpo_ext.logprobs`), against the
plain formula on full logits: `log_softmax(head(h) / tau)[o]`, values and gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from trl_grpo_ext.logprobs import (
    _shared_prompt_logits,
    capture_head_inputs,
    completion_logprobs,
    head_token_logprobs,
    output_head,
    token_logprobs,
)
from trl_grpo_ext.tiny import tiny_model_and_tokenizer


def reference(hidden, weight, token_ids, bias=None, temperature=1.0, softcap=None, scale=1.0):
    """The full `(..., V)` logits, then log_softmax, gather and entropy, by autograd."""
    logits = F.linear(hidden, weight, bias)  # (..., V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    logps = log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy


def random_inputs(batch=2, length=5, hidden=6, vocab=11, dtype=torch.float64, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, length, hidden, generator=generator, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=generator, dtype=dtype).requires_grad_()
    b = torch.randn(vocab, generator=generator, dtype=dtype).requires_grad_() if bias else None
    ids = torch.randint(vocab, (batch, length), generator=generator)
    return h, w, b, ids


def gradients(outputs, upstream, inputs):
    loss = sum((out * up).sum() for out, up in zip(outputs, upstream))
    return torch.autograd.grad(loss, [x for x in inputs if x is not None])


@pytest.mark.parametrize("chunk_tokens", [1, 3, 4, 10, None])  # 10 tokens: 3 and 4 don't divide
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"temperature": 0.7},
        {"temperature": 0.7, "softcap": 2.0},  # Gemma's final_logit_softcapping
        {"scale": 0.5, "bias": False},  # Cohere's logit_scale, a head without bias
    ],
)
def test_values_and_gradients_match_full_logits(chunk_tokens, options):
    options = dict(options)
    h, w, b, ids = random_inputs(bias=options.pop("bias", True))
    temperature = options.get("temperature", 1.0)
    softcap, scale = options.get("softcap"), options.get("scale", 1.0)
    logps, entropy = head_token_logprobs(
        h, w, ids, b, temperature, chunk_tokens, True, softcap, scale
    )
    ref_logps, ref_entropy = reference(h, w, ids, b, temperature, softcap, scale)
    torch.testing.assert_close(logps, ref_logps)
    torch.testing.assert_close(entropy, ref_entropy)
    assert logps.dtype == torch.float64 and logps.shape == ids.shape

    upstream = [torch.randn_like(logps), torch.randn_like(entropy)]
    got = gradients([logps, entropy], upstream, [h, w, b])
    want = gradients([ref_logps, ref_entropy], upstream, [h, w, b])
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


# 3 tokens: the backward pass recomputes each chunk's logits; None: one chunk holds all 10
# positions and the backward pass of the log-probs uses the probabilities the forward kept.
@pytest.mark.parametrize("chunk_tokens", [3, None])
@pytest.mark.parametrize("which", ["logps", "entropy"])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_gradient_of_one_output_alone(which, chunk_tokens, softcap):
    h, w, b, ids = random_inputs(seed=1)
    logps, entropy = head_token_logprobs(
        h, w, ids, b, 0.8, chunk_tokens, return_entropy=True, final_logit_softcapping=softcap
    )
    ref_logps, ref_entropy = reference(h, w, ids, b, 0.8, softcap)
    got = torch.autograd.grad((logps if which == "logps" else entropy).sum(), [h, w, b])
    want = torch.autograd.grad((ref_logps if which == "logps" else ref_entropy).sum(), [h, w, b])
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("with_grad", [False, True])  # True: one chunk keeps its probabilities
def test_float32_entropy_over_a_real_vocabulary(with_grad):
    """Float32 over SmolLM2's 49,152 entries with logits near 20, as a language model's are:
    the entropy `lse - sum_v p_v z_v` within 1e-4 of float64. The sum is a plain reduction; a
    matmul's dot product of the same terms was 2.8e-3 off here (7e-3 on SmolLM2's outputs)."""
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(64, 64, generator=generator).requires_grad_(with_grad)
    w = torch.randn(49152, 64, generator=generator) * 0.4
    b = torch.full((49152,), 20.0)
    ids = torch.randint(49152, (64,), generator=generator)
    logps, entropy = head_token_logprobs(h, w, ids, b, return_entropy=True)
    ref_logps, ref_entropy = reference(h.detach().double(), w.double(), ids, b.double())
    torch.testing.assert_close(entropy.detach().double(), ref_entropy, atol=1e-4, rtol=0)
    torch.testing.assert_close(logps.detach().double(), ref_logps, atol=1e-4, rtol=0)


def test_without_entropy_only_the_logps_and_no_gradient_for_frozen_inputs():
    h, w, b, ids = random_inputs(seed=2)
    w.requires_grad_(False)
    logps = head_token_logprobs(h, w, ids, b, chunk_tokens=4)
    torch.testing.assert_close(logps, reference(h, w, ids, b)[0])
    (grad_h,) = torch.autograd.grad(logps.sum(), [h])
    (ref_grad_h,) = torch.autograd.grad(reference(h, w, ids, b)[0].sum(), [h])
    torch.testing.assert_close(grad_h, ref_grad_h)


class HeadMatmuls(TorchDispatchMode):
    """Counts the matrix products with the head's `(V, H)` weight (or its transpose)."""

    def __init__(self, vocab, hidden=6):
        super().__init__()
        self.weight_shapes, self.count = {(vocab, hidden), (hidden, vocab)}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            self.count += any(shape in self.weight_shapes for shape in shapes)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk_tokens, recomputed", [(None, 0), (4, 3)])
def test_one_chunk_is_not_recomputed_in_the_backward_pass(chunk_tokens, recomputed):
    # The backward pass of the log-probs needs one product per chunk for the hidden states'
    # gradient, and one more to recompute the chunk's logits unless one chunk held every row.
    h, w, b, ids = random_inputs(vocab=37, seed=4)
    w.requires_grad_(False)
    logps = head_token_logprobs(h, w, ids, b, 0.9, chunk_tokens)
    with HeadMatmuls(vocab=37) as matmuls:
        (grad,) = torch.autograd.grad(logps.sum(), [h])
    chunks = 1 if chunk_tokens is None else 3
    assert matmuls.count == chunks + recomputed
    (want,) = torch.autograd.grad(reference(h, w, ids, b, 0.9)[0].sum(), [h])
    torch.testing.assert_close(grad, want)


def test_bf16_softmax_in_float32_and_upcast_matmul():
    h, w, b, ids = random_inputs(batch=3, length=4, hidden=16, vocab=50, dtype=torch.float32)
    h16, w16, b16 = (x.detach().bfloat16().requires_grad_() for x in (h, w, b))
    # As the model's own bf16 head, then a float32 softmax: the bf16 logits, upcast.
    logps = head_token_logprobs(h16, w16, ids, b16, 0.7, chunk_tokens=5)
    assert logps.dtype == torch.float32
    torch.testing.assert_close(logps, reference(h16, w16, ids, b16, 0.7)[0])
    grads = torch.autograd.grad(logps.sum(), [h16, w16, b16])
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    ref_grads = torch.autograd.grad(reference(h16, w16, ids, b16, 0.7)[0].sum(), [h16, w16, b16])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=2e-2, rtol=2e-2)
    # upcast (cast_lm_head_to_fp32): logits from float32 copies of the bf16 values, which differ
    # from the bf16 matmul by more than the float32 rounding.
    upcast = head_token_logprobs(h16, w16, ids, b16, 0.7, chunk_tokens=5, upcast=True)
    exact = reference(h16.float(), w16.float(), ids, b16.float(), 0.7)[0]
    torch.testing.assert_close(upcast, exact, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logps, exact, atol=1e-5, rtol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the number of elements of the largest tensor any operator returns."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_more_than_chunk_tokens_logits_exist_at_once():
    vocab, chunk = 300, 4
    h, w, b, ids = random_inputs(batch=4, length=8, hidden=3, vocab=vocab, dtype=torch.float32)
    with LargestTensor() as mode:
        logps, entropy = head_token_logprobs(h, w, ids, b, chunk_tokens=chunk, return_entropy=True)
        (logps.sum() + entropy.sum()).backward()
    assert mode.largest == chunk * vocab  # 1,200 values, where the full logits have 9,600
    with LargestTensor() as full:
        reference(h, w, ids, b)[0].sum().backward()
    assert full.largest == 32 * vocab


def test_by_default_a_chunk_of_logits_is_one_float32_buffer_of_128_mib():
    # Qwen2.5's vocabulary: 220 positions a chunk, so 500 positions never have more than
    # 220 x V logits at once (1,024 positions a chunk held 594 MiB per buffer).
    vocab = 151_936
    h, w, b, ids = random_inputs(batch=2, length=250, hidden=3, vocab=vocab, dtype=torch.float32)
    w.requires_grad_(False)
    with LargestTensor() as mode:
        head_token_logprobs(h, w, ids, b).sum().backward()
    assert mode.largest == 220 * vocab
    assert 220 * vocab * 4 <= 128 * 2**20 < 221 * vocab * 4


def test_validation():
    h, w, b, ids = random_inputs()
    with pytest.raises(ValueError, match="chunk_tokens"):
        head_token_logprobs(h, w, ids, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        head_token_logprobs(h, w, ids, temperature=0)
    with pytest.raises(ValueError, match="weight"):
        head_token_logprobs(h, w.t(), ids)
    with pytest.raises(ValueError, match="token_ids"):
        head_token_logprobs(h, w, ids[:, 1:])


# ----------------------------------------------------------------------------------------------
# completion_logprobs on a model: the same log-probs and gradients as the full-logits pass
# ----------------------------------------------------------------------------------------------


def batch(vocab, groups, group_size, prompt_length=10, completion_length=4, seed=0):
    """Left-padded prompts repeated per group, right-padded random completions."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (groups, prompt_length), generator=generator)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[0, :3] = 0  # the first prompt is shorter
    completion_ids = torch.randint(
        3, vocab, (groups * group_size, completion_length), generator=generator
    )
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 2:] = 0
    input_ids = torch.cat([prompts.repeat_interleave(group_size, 0), completion_ids], 1)
    attention_mask = torch.cat([prompt_mask.repeat_interleave(group_size, 0), completion_mask], 1)
    return input_ids, attention_mask, completion_ids, completion_mask


def full_logits_logprobs(model, input_ids, attention_mask, completion_ids, temperature):
    """Every row's full logits through the model's own head, then `token_logprobs`."""
    length = completion_ids.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, P + T, V)
    aligned = logits[:, -length - 1 : -1]  # (B, T, V)
    return token_logprobs(aligned, completion_ids, temperature, return_entropy=True)


def logprobs_and_gradients(compute, model, mask):
    logps, entropy = compute()
    upstream = torch.linspace(-1, 1, logps.numel()).view_as(logps)
    ((logps * upstream * mask).sum() + (entropy * mask).sum()).backward()
    trainable = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return logps * mask, entropy * mask, trainable


def assert_matches_full_logits(model, inputs, temperature=0.7, **kwargs):
    input_ids, attention_mask, completion_ids, mask = inputs
    got = logprobs_and_gradients(
        lambda: completion_logprobs(
            model, input_ids, attention_mask, completion_ids, temperature, True, **kwargs
        ),
        model,
        mask,
    )
    want = logprobs_and_gradients(
        lambda: full_logits_logprobs(model, input_ids, attention_mask, completion_ids, temperature),
        model,
        mask,
    )
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=1e-5)
    assert got[2].keys() == want[2].keys() and got[2]
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.fixture
def tiny():
    model, _ = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    return model


@pytest.mark.parametrize("packed", [True, False])
def test_completion_logprobs_match_full_logits(tiny, packed):
    # Three groups of four completions share prompts (packed), or twelve distinct prompts.
    inputs = batch(tiny.config.vocab_size, *((3, 4) if packed else (12, 1)))
    assert (_shared_prompt_logits(tiny, *inputs[:2], inputs[2].shape[1]) is not None) == packed
    assert output_head(tiny) is tiny.lm_head
    assert_matches_full_logits(tiny, inputs, logprob_chunk_tokens=5)  # 48 tokens, 10 chunks


def ragged_batch(vocab, groups, group_size, lengths, completion_length=9):
    """`batch` with the completions ending after `lengths` tokens (0: the row is masked out,
    as `mask_truncated_completions` masks a truncated one)."""
    input_ids, attention_mask, completion_ids, _ = batch(
        vocab, groups, group_size, completion_length=completion_length
    )
    mask = (torch.arange(completion_length) < torch.tensor(lengths).unsqueeze(1)).long()
    attention_mask[:, -completion_length:] = mask
    return input_ids, attention_mask, completion_ids, mask


class RowLengths:
    """Records the length of every sequence the model's embedding layer reads."""

    def __init__(self, model):
        self.lengths = []
        model.get_input_embeddings().register_forward_hook(
            lambda module, args, output: self.lengths.append(args[0].shape[-1])
        )


@pytest.mark.parametrize(
    "attention, groups, group_size",
    [("sdpa", 3, 4), ("eager", 3, 4), ("sdpa", 12, 1)],
    ids=["packed, by blocks", "packed, whole-row mask", "unpacked"],
)
def test_positions_after_each_completion_end_are_not_run(attention, groups, group_size):
    """Completions of 9 to 0 tokens: each packed block stops at its completion's end, the
    columns after every row's end are cut, and what is computed equals the full rows' log-probs,
    entropies and gradients; after each end both are 0."""
    from peft import LoraConfig, get_peft_model

    tiny, _ = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    tiny.config._attn_implementation = attention
    model = get_peft_model(
        tiny, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    )
    lengths = [9, 3, 1, 0, 2, 2, 5, 1, 7, 7, 7, 7]  # group 1 has 2 + 2 + 5 + 1 = 10 tokens
    if group_size == 1:
        lengths = [min(length, 7) for length in lengths]  # none reaches the end
    inputs = ragged_batch(tiny.config.vocab_size, groups, group_size, lengths)
    rows = RowLengths(tiny)
    logps, entropy = completion_logprobs(model, *inputs[:3], 0.7, return_entropy=True)
    if group_size == 1:  # 10 prompt tokens and the 7 columns up to the longest row's end
        assert rows.lengths == [10 + 7]
    else:  # the prompt but its last token, and the blocks of group 2 (4 x 7 tokens)
        assert rows.lengths == [9 + 28]
    beyond = torch.arange(9) >= torch.tensor(lengths).clamp(min=1).unsqueeze(1)
    assert (logps[beyond] == 0).all() and (entropy[beyond] == 0).all()
    assert (logps[~beyond] != 0).all()
    assert_matches_full_logits(model, inputs, logprob_chunk_tokens=5)


@pytest.mark.parametrize("target_modules", ["all-linear", ["q_proj", "v_proj", "lm_head"]])
def test_completion_logprobs_with_lora(tiny, target_modules):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False)
    model = get_peft_model(tiny, config)
    # "all-linear" leaves the output layer out: the chunked path; LoRA on lm_head: the model's
    # own head computes the logits.
    assert (output_head(model) is None) == ("lm_head" in target_modules)
    assert_matches_full_logits(model, batch(tiny.config.vocab_size, 3, 4), logprob_chunk_tokens=7)


@pytest.mark.parametrize("find_unused_parameters", [False, True])
def test_completion_logprobs_through_ddp(tiny, find_unused_parameters, tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(tiny, find_unused_parameters=find_unused_parameters)
        assert output_head(model) is tiny.lm_head
        input_ids, attention_mask, completion_ids, mask = batch(tiny.config.vocab_size, 3, 4)
        for _ in range(2):  # DDP complains on the second step if the first went wrong
            logps = completion_logprobs(model, input_ids, attention_mask, completion_ids)
            (logps * mask).sum().backward()
        got = {n: p.grad.clone() for n, p in tiny.named_parameters()}
        tiny.zero_grad()
    finally:
        dist.destroy_process_group()
    for _ in range(2):
        want_logps, _ = full_logits_logprobs(tiny, input_ids, attention_mask, completion_ids, 1.0)
        (want_logps * mask).sum().backward()
    for name, param in tiny.named_parameters():
        torch.testing.assert_close(got[name], param.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_cast_lm_head_to_fp32(tiny):
    model = tiny.to(torch.bfloat16)
    input_ids, attention_mask, completion_ids, mask = batch(tiny.config.vocab_size, 3, 4)
    hidden = _shared_prompt_logits(
        model, input_ids, attention_mask, completion_ids.shape[1], head=model.lm_head
    )  # (B, T, H) in bf16, from the same packed pass as completion_logprobs
    weight = model.lm_head.weight
    exact = reference(hidden.float(), weight.float(), completion_ids, temperature=0.7)[0]
    bf16_head = reference(hidden, weight, completion_ids, temperature=0.7)[0]
    upcast = completion_logprobs(
        model, input_ids, attention_mask, completion_ids, 0.7, cast_lm_head_to_fp32=True
    )
    plain = completion_logprobs(model, input_ids, attention_mask, completion_ids, 0.7)
    # (after a completion's end both are 0: not computed)
    torch.testing.assert_close(upcast, exact * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, bf16_head * mask, atol=1e-5, rtol=1e-5)
    assert (plain - exact * mask).abs().max() > 1e-3  # bf16 logits round visibly
    assert weight.dtype == torch.bfloat16  # the model itself is unchanged
    # Gradients reach the bf16 weights.
    (upcast * mask).sum().backward()
    assert weight.grad.dtype == torch.bfloat16 and weight.grad.abs().sum() > 0


def test_cast_lm_head_to_fp32_in_generation(tiny):
    """Generation with transformers computes every step's logits in float32, as TRL's
    `cast_lm_head_to_fp32` does; the model keeps its bf16 head."""
    from trl_grpo_ext.generation import sampling_config
    from trl_grpo_ext.generation.engines import in_eval_mode
    from trl_grpo_ext.generation.transformers_engine import TransformersEngine

    model = tiny.to(torch.bfloat16)
    head = model.lm_head
    calls = []
    hook = head.register_forward_hook(
        lambda module, inputs, output: calls.append((inputs[0], output))
    )
    prompt_ids = torch.randint(3, tiny.config.vocab_size, (2, 4))
    config = sampling_config(
        max_new_tokens=3, num_return_sequences=2, eos_token_id=[0], pad_token_id=0
    )
    try:
        for cast in (True, False):
            calls.clear()
            engine = TransformersEngine(lambda: in_eval_mode(model), cast_lm_head_to_fp32=cast)
            engine.generate(prompt_ids, torch.ones_like(prompt_ids), config, seed=0)
            assert calls
            for hidden, logits in calls:
                assert logits.dtype == (torch.float32 if cast else torch.bfloat16)
                if cast:
                    want = F.linear(hidden.float(), head.weight.float())
                    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    finally:
        hook.remove()
    assert head.weight.dtype == torch.bfloat16 and "forward" not in head.__dict__


def _last_hidden_states(model, input_ids, attention_mask, completion_length):
    with capture_head_inputs(model.lm_head) as captured:
        model(input_ids=input_ids, attention_mask=attention_mask)
    return captured[0][:, -completion_length - 1 : -1]  # (B, T, H)


def test_cast_lm_head_to_fp32_refuses_lora_on_the_head(tiny):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny, LoraConfig(r=2, target_modules=["lm_head"]))
    input_ids, attention_mask, completion_ids, _ = batch(tiny.config.vocab_size, 1, 2)
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32"):
        completion_logprobs(
            model, input_ids, attention_mask, completion_ids, cast_lm_head_to_fp32=True
        )


def test_gemma2_final_logit_softcapping():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=1.5,  # low, so that the cap changes the log-probs a lot
        initializer_range=0.5,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    inputs = batch(config.vocab_size, 3, 4)
    assert_matches_full_logits(model, inputs, logprob_chunk_tokens=5)
    # Without the cap the numbers would differ: the test sees the softcapping.
    hidden = _last_hidden_states(model, *inputs[:2], inputs[2].shape[1])
    uncapped = reference(hidden, model.lm_head.weight, inputs[2], temperature=0.7)[0]
    capped = completion_logprobs(model, *inputs[:3], 0.7)
    assert (uncapped - capped).abs().max() > 0.1


# ----------------------------------------------------------------------------------------------
# token_logprobs: the same selective log-softmax on logits
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 8])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_log_softmax_gather(chunk_size, temperature):
    generator = torch.Generator().manual_seed(chunk_size)
    logits = 3 * torch.randn(3, 5, 11, generator=generator)
    token_ids = torch.randint(11, (3, 5), generator=generator)
    logps, entropy = token_logprobs(logits, token_ids, temperature, chunk_size, return_entropy=True)
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    torch.testing.assert_close(logps, log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1))
    ref_logps, ref_entropy = reference_token_logprobs(logits, token_ids, temperature)
    torch.testing.assert_close(logps, ref_logps)
    torch.testing.assert_close(entropy, ref_entropy)
    torch.testing.assert_close(token_logprobs(logits, token_ids, temperature, chunk_size), logps)


@pytest.mark.parametrize("chunk_size", [2, 3])  # 3: one chunk, its probabilities kept
@pytest.mark.parametrize("return_entropy", [False, True])
def test_token_logprobs_gradient(return_entropy, chunk_size):
    # The backward pass is hand-written (chunked); check it against finite differences and
    # against autograd through the naive formula.
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 2, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    token_ids = torch.randint(5, (3, 2), generator=generator)

    def fn(x):
        return token_logprobs(x, token_ids, 0.7, chunk_size, return_entropy=return_entropy)

    assert torch.autograd.gradcheck(fn, (logits,))

    weights = torch.randn(3, 2, generator=generator, dtype=torch.float64)
    out = fn(logits)
    outs = out if return_entropy else (out,)
    (grad,) = torch.autograd.grad(sum((o * weights).sum() for o in outs), logits)
    log_probs = torch.log_softmax(logits / 0.7, dim=-1)
    naive = [log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)]
    if return_entropy:
        naive.append(-(log_probs.exp() * log_probs).sum(-1))
    (naive_grad,) = torch.autograd.grad(sum((o * weights).sum() for o in naive), logits)
    torch.testing.assert_close(grad, naive_grad)


def test_token_logprobs_bf16_is_computed_in_float32():
    generator = torch.Generator().manual_seed(4)
    logits = (4 * torch.randn(2, 3, 50, generator=generator)).bfloat16().requires_grad_()
    token_ids = torch.randint(50, (2, 3), generator=generator)
    logps = token_logprobs(logits, token_ids, temperature=0.9, chunk_size=1)
    assert logps.dtype == torch.float32
    exact = torch.log_softmax(logits.detach().float() / 0.9, dim=-1)
    torch.testing.assert_close(logps, exact.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1))
    logps.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad).all()


def test_token_logprobs_validation():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="token_ids"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


def reference_token_logprobs(logits, token_ids, temperature):
    batch_size, seq_len, _ = logits.shape
    logps = torch.zeros(batch_size, seq_len, dtype=logits.dtype)
    entropy = torch.zeros(batch_size, seq_len, dtype=logits.dtype)
    for b in range(batch_size):
        for t in range(seq_len):
            log_p = torch.log_softmax(logits[b, t] / temperature, dim=-1)
            logps[b, t] = log_p[token_ids[b, t]]
            entropy[b, t] = -(log_p.exp() * log_p).sum()
    return logps, entropy


class FullSizeTensors(TorchDispatchMode):
    """Counts the tensors any operator returns with at least `size` elements."""

    def __init__(self, size):
        super().__init__()
        self.size, self.count = size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.numel() >= self.size:
                self.count += 1
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_builds_no_full_size_tensor_but_the_gradient(dtype):
    """Given `(B, T, V)` logits, the only logits-sized tensor built is their gradient: forward
    and backward work on `chunk_size` rows at a time, and the caller's logits are not touched."""
    generator = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(6, 4, 40, generator=generator)).to(dtype).requires_grad_()
    token_ids = torch.randint(40, (6, 4), generator=generator)
    before = logits.detach().clone()
    with FullSizeTensors(logits.numel()) as forward:
        logps, entropy = token_logprobs(logits, token_ids, 0.7, chunk_size=2, return_entropy=True)
    assert forward.count == 0
    with FullSizeTensors(logits.numel()) as backward:
        (grad,) = torch.autograd.grad(logps.sum() + entropy.sum(), logits)
    assert backward.count == 1 and grad.dtype == dtype
    assert torch.equal(logits.detach(), before)


class NewBuffers(TorchDispatchMode):
    """Counts the new storages of at least `size` elements that operators return: not views of
    their inputs, nor their inputs written in place."""

    def __init__(self, size):
        super().__init__()
        self.size, self.count = size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*args, *(kwargs or {}).values()]
        given = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.numel() >= self.size:
                self.count += tensor.untyped_storage().data_ptr() not in given
        return out


@pytest.mark.parametrize("with_entropy", [False, True])
def test_one_chunk_builds_one_logits_sized_buffer(with_entropy, monkeypatch):
    """A fresh buffer of the logits' size costs a page fault per page (on a CPU, a third of the
    head's time at SmolLM2's shape). One chunk of logits is turned into its probabilities in
    place, block by block of rows, and the backward pass of the log-probs works from them
    without another: one buffer of that size in all, and still the reference's values."""
    monkeypatch.setattr("trl_grpo_ext.logprobs.BLOCK_VALUES", 3 * 37)  # blocks of 3 rows
    h, w, b, ids = random_inputs(batch=2, length=5, vocab=37, seed=6)
    w.requires_grad_(False)
    b.requires_grad_(False)
    logits_size = 10 * 37
    with NewBuffers(logits_size) as forward:
        out = head_token_logprobs(h, w, ids, b, 0.9, return_entropy=with_entropy)
    logps = out[0] if with_entropy else out
    with NewBuffers(logits_size) as backward:
        (grad,) = torch.autograd.grad(logps.sum(), [h])
    assert (forward.count, backward.count) == (1, 0)
    ref_logps, ref_entropy = reference(h, w, ids, b, 0.9)
    torch.testing.assert_close(logps, ref_logps)
    if with_entropy:
        torch.testing.assert_close(out[1], ref_entropy)
    torch.testing.assert_close(grad, torch.autograd.grad(ref_logps.sum(), [h])[0])
