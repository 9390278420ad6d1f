"""Per-token log-probabilities of completions: the forward pass and one selective log-softmax.

Step 4 of `DESIGN.md`, `log pi(o_t | q, o_<t) = log_softmax(z_t / tau)[o_t]`, where the logits
are the model's output head applied to the last hidden state h_t:

    z_t = c * tanh(s * (W h_t + b) / c)        (c: `final_logit_softcapping`, s: logit scale)

Running the head over all B*T completion positions at once holds the full logits (B*T*V values,
2.5 GB in float32 for 8 x 512 tokens at Qwen's V = 151,936), and autograd keeps them, and a
softmax of the same size, alive until the backward pass. `head_token_logprobs` instead takes the
hidden states and the head's weight and computes the logits of `chunk_tokens` positions at a time,
keeping only two numbers per position (the log-normaliser and the entropy); the backward pass
recomputes each chunk's logits. So the extra memory is a few buffers of `chunk_tokens * V` values,
however many completion tokens there are, for the price of one more head matmul per chunk. When
one chunk holds every position, the forward pass keeps its probabilities instead (a buffer the
recomputation would allocate anyway), and the backward pass of the log-probs needs no second
head matmul.

`token_logprobs` does the same for logits that already exist, a few batch rows at a time; both
run one autograd function, `_SelectiveLogSoftmax`.

`completion_logprobs` is the trainer's forward pass: `capture_head_inputs` and `output_head` let
it run a (PEFT-, DDP- or autocast-wrapped) model through its own forward while its output head
only records the hidden states it receives, so every wrapper still sees its forward pass.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .packed_attention import (
    ATTENTION,
    attends_by_blocks,
    block_slots,
    layer_kinds,
    register_packed_mask,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "capture_head_inputs",
    "completion_logprobs",
    "default_chunk_tokens",
    "float32_head",
    "head_token_logprobs",
    "logit_transform",
    "no_grad_logprobs",
    "output_head",
    "packing_pays",
    "token_logprobs",
    "transformers_model",
]

# The size of one float32 buffer of a chunk's logits: the pass holds about two or three (682
# tokens a chunk at SmolLM2's V = 49,152, 220 at Qwen's V = 151,936). On a GPU a smaller chunk
# costs only more, smaller matmuls; on a CPU the softmax's work is the same per token.
DEFAULT_CHUNK_BYTES = 128 * 2**20


def default_chunk_tokens(vocab_size: int) -> int:
    """Positions per chunk by default: as many as one float32 buffer of `DEFAULT_CHUNK_BYTES`
    holds (at least one)."""
    return max(1, DEFAULT_CHUNK_BYTES // (4 * vocab_size))


class _SelectiveLogSoftmax(torch.autograd.Function):
    """`log_softmax(z / tau)[o]` and the entropy, one chunk of the leading dimension at a time.

    The logits `z` are either given (`weight` is None: `inputs` are logits `(..., V)`), or
    computed from the last hidden states, `z = transform(h W^T + b)` (`inputs` are `(N, H)`, the
    head's `weight` `(V, H)`). Autograd on the plain formula would keep the full logits (or a
    full-size copy of `z / tau`, and for bf16 its float32 upcast) and a softmax of the same size
    alive until backward. Here forward keeps the log-normaliser and the entropy of each position;
    backward recomputes one chunk's `z` at a time and turns it into gradients for the inputs (and
    W, b); with a single chunk, forward keeps its probabilities and backward starts from them.
    Each chunk's logits become its probabilities in place (`_softmax_in_place`), and the
    backward pass from kept probabilities needs no buffer of their size
    (`_gradients_from_probs`): on a CPU a fresh buffer costs a page fault per page. Only
    chunk-sized buffers of V values exist at once, apart from the gradient of given logits,
    which is as large as they are. The softmax runs in float32 (float64 for float64 inputs);
    the head's matmul runs in the inputs' dtype, or in float32 with `upcast` (TRL's
    `cast_lm_head_to_fp32`).
    """

    @staticmethod
    def forward(
        ctx,
        inputs,  # (N, H) hidden states, or (..., V) logits when weight is None
        weight,  # (V, H) or None
        bias,  # (V,) or None
        token_ids,  # inputs.shape[:-1]
        temperature,
        chunk_rows,
        softcap,
        scale,
        upcast,
        with_entropy,
    ):
        if weight is None:
            matmul_dtype = inputs.dtype  # no matmul: the dtype the logits come in
        elif upcast:
            matmul_dtype = torch.float32
        else:
            matmul_dtype = torch.promote_types(inputs.dtype, weight.dtype)
        compute_dtype = torch.promote_types(matmul_dtype, torch.float32)
        transform = (temperature, softcap, scale, matmul_dtype, compute_dtype)
        matmul_weight = None if weight is None else weight.to(matmul_dtype)  # a copy with upcast
        logps = inputs.new_empty(inputs.shape[:-1], dtype=compute_dtype)  # (N,) or (B, T)
        logsumexp = torch.empty_like(logps)
        entropy = torch.empty_like(logps) if with_entropy else logps.new_empty(0)
        # When one chunk holds every row, its probabilities are kept for the backward pass,
        # which then needs neither the head's matmul nor the exponentials again; its buffers
        # are no larger than those the recomputation would allocate there.
        keep_probs = (
            inputs.shape[0] <= chunk_rows and softcap is None and any(ctx.needs_input_grad[:3])
        )
        probs = None
        for start in range(0, inputs.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            z = _chunk_logits(inputs[rows], matmul_weight, bias, *transform)  # (c, [T,] V)
            chosen = z.gather(-1, token_ids[rows].unsqueeze(-1)).squeeze(-1)  # (c, [T])
            # z becomes its softmax in place: the logits' one buffer, kept or freed
            chunk_lse, chunk_entropy = _softmax_in_place(z, with_entropy)
            logps[rows] = chosen - chunk_lse
            logsumexp[rows] = chunk_lse
            if with_entropy:
                entropy[rows] = chunk_entropy
            probs = z if keep_probs else None
            del z  # before the next chunk's logits exist
        ctx.save_for_backward(inputs, weight, bias, token_ids, logsumexp, entropy, probs)
        ctx.transform = transform
        ctx.chunk_rows = chunk_rows
        ctx.with_entropy = with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        inputs, weight, bias, token_ids, logsumexp, entropy, kept_probs = ctx.saved_tensors
        if not ctx.with_entropy:
            grad_entropy = None
        needs_inputs, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        if (grad_logps is None and grad_entropy is None) or not (
            needs_inputs or needs_weight or needs_bias
        ):
            return (None,) * 10
        temperature, softcap, scale, matmul_dtype, compute_dtype = ctx.transform
        from_kept = kept_probs is not None and grad_entropy is None  # one chunk, no softcap
        matmul_weight = None if weight is None else weight.to(matmul_dtype)  # (V, H)
        grad_inputs = (  # (N, H) or (..., V)
            torch.empty_like(inputs, memory_format=torch.contiguous_format)
            if needs_inputs
            else None
        )
        # Accumulated over the chunks in (at least) float32, cast to the parameter's dtype at the end.
        accumulate = None if weight is None else torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=accumulate) if needs_weight else None
        grad_bias = torch.zeros_like(bias, dtype=accumulate) if needs_bias else None
        for start in range(0, inputs.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            chunk_inputs = inputs[rows] if weight is None else inputs[rows].to(matmul_dtype)
            if from_kept:
                # d log p_k / dz_v = g (1[v = k] - p_v), and back through z = s * logits / tau:
                # products with the kept probabilities, which stay as they are (a retained graph
                # may run backward again), and no gradient of the logits' size
                chunk_grad = grad_logps[rows].to(compute_dtype) * (scale / temperature)
                _gradients_from_probs(
                    kept_probs,
                    token_ids[rows],
                    chunk_grad,
                    chunk_inputs,
                    matmul_weight,
                    None if grad_inputs is None else grad_inputs[rows],
                    grad_weight,
                    grad_bias,
                )
                continue
            z = _chunk_logits(chunk_inputs, matmul_weight, bias, *ctx.transform)  # (c, [T,] V)
            grad = _logits_gradient_in_place(
                z,
                token_ids[rows],
                logsumexp[rows],
                entropy[rows] if grad_entropy is not None else None,
                grad_logps[rows] if grad_logps is not None else None,
                grad_entropy[rows] if grad_entropy is not None else None,
                temperature / softcap if softcap is not None else None,
            )
            grad.mul_(scale / temperature)  # back through z = s * logits / tau
            # grad is now the gradient wrt the given logits, or the head's output
            if grad_inputs is not None:
                if weight is None:
                    grad_inputs[rows] = grad
                else:
                    grad_inputs[rows] = grad.to(matmul_dtype) @ matmul_weight  # (c, H)
            if grad_weight is not None:
                # In float32 (not the bf16 matmul): rounding each chunk's product to bf16 before
                # the sum would bias the weight's gradient.
                grad_weight.addmm_(grad.t().to(accumulate), chunk_inputs.to(accumulate))  # (V, H)
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0)  # (V,)
            del grad  # freed before the next chunk's logits exist
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return (grad_inputs, grad_weight, grad_bias) + (None,) * 7


# Values per block of rows of the softmax's temporaries. On a CPU, 8 MiB in float32, which the
# allocator reuses from block to block (a fresh chunk-sized buffer costs a page fault per page);
# on an accelerator, whose allocator caches its buffers, 64 MiB: fewer, larger kernels.
BLOCK_VALUES = 2**21
ACCELERATOR_BLOCK_VALUES = 2**24


def _row_blocks(values: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
    """`values` `(..., V)` as blocks of its rows: each block's rows of the flattened `(N, V)`
    values, and the block `(n, V)`, a view of them."""
    flat = values.view(-1, values.shape[-1])
    block = BLOCK_VALUES if values.device.type == "cpu" else ACCELERATOR_BLOCK_VALUES
    size = max(1, block // max(1, values.shape[-1]))
    starts = range(0, flat.shape[0], size)
    return [(slice(start, start + size), flat[start : start + size]) for start in starts]


def _softmax_in_place(z: torch.Tensor, with_entropy: bool):
    """Turns the logits `z` `(..., V)` into `softmax(z)` in place; returns the log-normaliser
    `lse = m + log s` and, `with_entropy`, the entropy `H = log s - sum_v e_v y_v / s`, where
    `y = z - max(z)`, `e = exp(y)`, `s = sum_v e_v` (else None), both `z.shape[:-1]`.

    Block by block of rows, so the temporaries are blocks (`BLOCK_VALUES`). The entropy's sum is
    a plain float32 reduction of terms `<= 0` (a matmul's dot product was 7e-3 off on SmolLM2).
    """
    lse = z.new_empty(z.shape[:-1])
    entropy = z.new_empty(z.shape[:-1]) if with_entropy else None
    for rows, block in _row_blocks(z):
        top = block.amax(dim=-1, keepdim=True)  # (n, 1)
        # a row of -inf logits: no NaN from -inf - -inf
        top = torch.where(top.isfinite(), top, torch.zeros_like(top))
        if with_entropy:
            shifted = block - top  # (n, V), y
            torch.exp(shifted, out=block)  # e
            total = block.sum(dim=-1, keepdim=True)  # s
            weighted = shifted.mul_(block).sum(dim=-1, keepdim=True)  # sum e y
            entropy.view(-1)[rows] = (total.log() - weighted / total).squeeze(-1)
        else:
            block.sub_(top).exp_()
            total = block.sum(dim=-1, keepdim=True)
        block.div_(total)
        lse.view(-1)[rows] = (top + total.log()).squeeze(-1)
    return lse, entropy


def _gradients_from_probs(
    probs, token_ids, coefficient, inputs, weight, grad_inputs, grad_weight, grad_bias
) -> None:
    """Adds the gradients of `sum coefficient * log p[token]` (the logits' gradient is
    `coefficient * (1[v = token] - p_v)`) to `grad_inputs` (written), `grad_weight` and
    `grad_bias` (accumulated), from kept probabilities `(..., V)`, without a buffer of their
    size: with a head, `grad h = c (W[token] - p W)`, `grad W = sum c h (1[token] - p)` and
    `grad b = sum c (1[token] - p)`; given logits, `grad_inputs` is written block by block."""
    vocab = probs.shape[-1]
    probs = probs.view(-1, vocab)  # (N, V)
    token_ids = token_ids.reshape(-1)  # (N,)
    coefficient = coefficient.reshape(-1, 1)  # (N, 1)
    if weight is None:  # the given logits' gradient
        if grad_inputs is None:
            return
        for (rows, block), (_, out) in zip(_row_blocks(probs), _row_blocks(grad_inputs)):
            grad = block * -coefficient[rows]  # (n, V)
            grad.scatter_add_(-1, token_ids[rows].unsqueeze(-1), coefficient[rows])
            out.copy_(grad)
        return
    if grad_inputs is not None:  # (N, H)
        expected = probs.to(weight.dtype) @ weight  # sum_v p_v W_v
        chosen = weight[token_ids].to(coefficient.dtype)
        grad_inputs.copy_((chosen - expected.to(coefficient.dtype)) * coefficient)
    if grad_weight is not None or grad_bias is not None:
        accumulate = (grad_weight if grad_weight is not None else grad_bias).dtype
        coefficient = coefficient.to(accumulate)
    if grad_weight is not None:  # (V, H), in float32 at least
        scaled = inputs.reshape(-1, inputs.shape[-1]).to(accumulate) * coefficient  # (N, H)
        grad_weight.index_add_(0, token_ids, scaled)
        grad_weight.addmm_(probs.t().to(accumulate), scaled, alpha=-1)
    if grad_bias is not None:  # (V,)
        grad_bias.index_add_(0, token_ids, coefficient.squeeze(-1))
        grad_bias.sub_(coefficient.squeeze(-1) @ probs.to(accumulate))


def _logits_gradient_in_place(
    z, token_ids, logsumexp, entropy, grad_logps, grad_entropy, tanh_per_logit
) -> torch.Tensor:
    """The gradient wrt the recomputed logits `z` `(..., V)` of `sum g_logp log p[token] +
    sum g_H H` (before the `s / tau` of the logits' transform), built in place of `z`, block by
    block. `tanh_per_logit` (`tau / c` under a softcap, else None) also takes it back through
    the cap: `d(c tanh(u / c)) / du = 1 - tanh^2`, with `tanh = z tau / c`."""
    token_ids = token_ids.reshape(-1, 1)
    logsumexp = logsumexp.reshape(-1, 1)
    if entropy is not None:
        entropy, grad_entropy = entropy.reshape(-1, 1), grad_entropy.reshape(-1, 1)
    if grad_logps is not None:
        grad_logps = grad_logps.reshape(-1, 1).to(z.dtype)
    for rows, block in _row_blocks(z):
        slope = None
        if tanh_per_logit is not None:
            slope = (block * tanh_per_logit).square_().neg_().add_(1)  # (n, V)
        log_probs = block.sub_(logsumexp[rows])  # in place of z
        probs = log_probs.exp()  # (n, V)
        grad = log_probs  # built in place of log_probs
        if entropy is not None:
            # dH / dz_v = -p_v (log p_v + H)
            grad.add_(entropy[rows]).mul_(probs).mul_(-grad_entropy[rows])
        else:
            grad.zero_()
        if grad_logps is not None:
            # d log p_k / dz_v = 1[v = k] - p_v
            grad.addcmul_(probs, grad_logps[rows], value=-1)
            grad.scatter_add_(-1, token_ids[rows], grad_logps[rows])
        if slope is not None:
            grad.mul_(slope)
    return z


def _chunk_logits(inputs, weight, bias, temperature, softcap, scale, matmul_dtype, compute_dtype):
    """`c * tanh(s * (h W^T + b) / c) / tau` of one chunk, in compute_dtype; with `weight` None,
    `inputs` are the logits and this is a copy of them divided by tau."""
    if weight is None:
        # (c, [T,] V), never the caller's logits; contiguous, to be viewed as rows of V
        z = inputs.to(compute_dtype, copy=True, memory_format=torch.contiguous_format)
    else:
        bias = None if bias is None else bias.to(matmul_dtype)
        z = F.linear(inputs.to(matmul_dtype), weight, bias).to(compute_dtype)  # (c, V)
    if scale != 1.0:
        z.mul_(scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z.div_(temperature)


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 4,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each chosen token at the sampling temperature, `log softmax(z/tau)[o_t]`.

    A selective log-softmax: the log-normaliser is computed per chunk of `chunk_size` batch rows
    and the chosen logit is gathered, so no second vocabulary-sized tensor is built for the whole
    batch, in the forward or the backward pass (`_SelectiveLogSoftmax`, the function
    `head_token_logprobs` runs on the head's output). bf16/fp16 logits are upcast to float32 one
    chunk at a time; the results are float32 (float64 for float64 logits).

    Args:
        logits (`torch.Tensor`):
            Logits of shape `(B, T, V)`, already aligned with `token_ids` (the logits at position
            t predict token t).
        token_ids (`torch.Tensor`):
            Chosen token ids of shape `(B, T)`.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature; the logits are divided by it, so that the log-probabilities are
            those of the distribution the completions were sampled from.
        chunk_size (`int`, *optional*, defaults to `4`):
            Number of batch rows processed at once. Peak extra memory is a few float32
            buffers of `chunk_size * T * V` values each.
        return_entropy (`bool`, *optional*, defaults to `False`):
            Also return the entropy (in nats) of the tempered distribution at each position.

    Returns:
        `torch.Tensor` of shape `(B, T)`, or a tuple `(logps, entropy)` of two such tensors when
        `return_entropy=True`. Both are differentiable with respect to `logits`.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, T, V), got {tuple(logits.shape)}")
    if token_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"token_ids must have shape {tuple(logits.shape[:2])} to match logits, "
            f"got {tuple(token_ids.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    logps, entropy = _SelectiveLogSoftmax.apply(
        logits,
        None,  # the logits are given: no head
        None,
        token_ids.long(),
        float(temperature),
        int(chunk_size),  # batch rows of T positions each
        None,  # no softcap
        1.0,  # no scale
        False,
        return_entropy,
    )
    return (logps, entropy) if return_entropy else logps


def head_token_logprobs(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    return_entropy: bool = False,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    upcast: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each chosen token, `log softmax(z / tau)[o_t]`, from the hidden states.

    The same numbers as `token_logprobs(head(hidden_states), token_ids, temperature)`,
    with `head(h) = c * tanh(s * (h W^T + b) / c)`, but the logits exist only `chunk_tokens`
    positions at a time, in the forward and in the backward pass.

    Args:
        hidden_states (`torch.Tensor`):
            Last hidden states of shape `(..., H)`, aligned with `token_ids` (the state at
            position t predicts token t).
        weight (`torch.Tensor`):
            The output head's weight, shape `(V, H)`.
        token_ids (`torch.Tensor`):
            Chosen token ids, the shape of `hidden_states` without its last dimension.
        bias (`torch.Tensor`, *optional*):
            The output head's bias, shape `(V,)`.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature tau; the logits are divided by it.
        chunk_tokens (`int`, *optional*):
            Positions whose logits are computed at once; None for as many as one float32 buffer
            of `DEFAULT_CHUNK_BYTES` (128 MiB) holds (`default_chunk_tokens`). Peak extra memory
            is about three float32 buffers of `chunk_tokens * V` values (plus, when the head is trained, a
            float32 gradient accumulator of the weight's size).
        return_entropy (`bool`, *optional*, defaults to `False`):
            Also return the entropy (in nats) of the tempered distribution at each position.
        final_logit_softcapping (`float`, *optional*):
            The cap c of models that squash their logits (Gemma 2 and 3); None for none.
        logit_scale (`float`, *optional*, defaults to `1.0`):
            The factor s of models that scale their logits (Cohere, Granite).
        upcast (`bool`, *optional*, defaults to `False`):
            Compute the logits in float32 from float32 copies of the hidden states and the weight
            (TRL's `cast_lm_head_to_fp32`). Otherwise the matmul runs in the inputs' dtype; the
            softmax is in float32 either way.

    Returns:
        `torch.Tensor` of the shape of `token_ids`, in float32 (float64 for float64 inputs), or a
        tuple `(logps, entropy)` of two such tensors when `return_entropy=True`. Both are
        differentiable with respect to `hidden_states`, `weight` and `bias`.
    """
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0])
    chunk_tokens = int(chunk_tokens)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if weight.dim() != 2 or hidden_states.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must have shape (V, {hidden_states.shape[-1]}), got {tuple(weight.shape)}"
        )
    if token_ids.shape != hidden_states.shape[:-1]:
        raise ValueError(
            f"token_ids must have shape {tuple(hidden_states.shape[:-1])} to match the hidden "
            f"states, got {tuple(token_ids.shape)}"
        )
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # (N, H)
    logps, entropy = _SelectiveLogSoftmax.apply(
        hidden,
        weight,
        bias,
        token_ids.reshape(-1).long(),
        float(temperature),
        chunk_tokens,
        None if final_logit_softcapping is None else float(final_logit_softcapping),
        float(logit_scale),
        bool(upcast),
        return_entropy,
    )
    logps = logps.view(token_ids.shape)
    return (logps, entropy.view(token_ids.shape)) if return_entropy else logps


# ----------------------------------------------------------------------------------------------
# The model's output head
# ----------------------------------------------------------------------------------------------


def output_head(model) -> torch.nn.Linear | None:
    """The output head of a (DDP-, PEFT- or otherwise wrapped) transformers causal LM, when
    `head_token_logprobs` can use its weight as it is; else None.

    None when the head is not a plain `nn.Linear` (a LoRA layer or a trained copy from PEFT's
    `modules_to_save`, a quantized layer) or its weight is sharded outside the forward pass
    (FSDP, DeepSpeed ZeRO-3): then only the model's own head computes the right logits.
    """
    causal_lm = transformers_model(model)
    if causal_lm is None or _is_sharded(model):
        return None
    head = causal_lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return None
    weight = head.weight
    if weight.dim() != 2 or weight.numel() == 0 or hasattr(weight, "ds_id"):
        return None
    return head


def transformers_model(model):
    """The outermost transformers model inside DDP / PEFT wrappers (`model` itself if it is
    one), or None."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def adds_virtual_tokens(model) -> bool:
    """Whether a (DDP-wrapped) PEFT model has prompt-learning adapters (prompt tuning, prefix
    tuning, P-tuning): its forward pass puts virtual tokens before the inputs, so it takes a
    2D attention mask only and its cache holds positions that are no row's tokens."""
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict):
            return any(getattr(config, "is_prompt_learning", False) for config in configs.values())
    return False


def _is_sharded(model) -> bool:
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__name__ in ("FullyShardedDataParallel", "FSDPModule"):
                return True
    return False


def logit_transform(model) -> tuple[float | None, float]:
    """`(final_logit_softcapping, logit_scale)` the model applies to its head's output.

    Read from the (text) config as TRL 1.16's fused head reads it: Gemma's softcap; Cohere's
    `logit_scale`, `output_multiplier`, Falcon-H1's `lm_head_multiplier`, and Granite's
    `logits_scaling` (a divisor; a factor for HyperCLOVA X).
    """
    causal_lm = transformers_model(model)
    if causal_lm is None:
        return None, 1.0
    config = causal_lm.config.get_text_config()
    softcap = getattr(config, "final_logit_softcapping", None)
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        scale = getattr(config, name, None)
        if scale is not None:
            return softcap, float(scale)
    divisor = getattr(config, "logits_scaling", None)
    if divisor is not None:
        hyperclova = getattr(config, "model_type", None) == "hyperclovax"
        return softcap, float(divisor) if hyperclova else 1.0 / float(divisor)
    return softcap, 1.0


@contextlib.contextmanager
def float32_head(model):
    """While active, `model`'s output head computes its logits in float32 from float32 hidden
    states, weight and bias (TRL's `cast_lm_head_to_fp32`, for generation), without changing the
    model's parameters: a float32 copy of a lower-precision weight lives for the block."""
    head = output_head(model)
    if head is None:
        raise ValueError(FLOAT32_HEAD_NEEDS_A_PLAIN_HEAD)
    weight = head.weight.float()
    bias = None if head.bias is None else head.bias.float()
    previous = head.__dict__.get("forward")
    head.forward = lambda hidden_states: F.linear(hidden_states.float(), weight, bias)
    try:
        yield head
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous


def cast_output_head_to_float32(model) -> None:
    """TRL's `cast_lm_head_to_fp32` on the model itself: the output head's weight and bias
    become float32 parameters (trained and stored in float32) and it computes its logits from
    float32 hidden states. With tied embeddings the input embeddings share that weight, and
    their outputs are cast back to the model's dtype, as TRL does."""
    head = output_head(model)
    if head is None:
        raise ValueError(FLOAT32_HEAD_NEEDS_A_PLAIN_HEAD)
    dtype = head.weight.dtype
    if dtype == torch.float32:
        return
    head.float()  # in place: a tied input embedding shares the same parameter
    head.register_forward_pre_hook(lambda module, inputs: (inputs[0].float(), *inputs[1:]))
    causal_lm = transformers_model(model)
    embeddings = causal_lm.get_input_embeddings()
    if embeddings is not None and embeddings.weight is head.weight:
        embeddings.register_forward_hook(lambda module, inputs, output: output.to(dtype))


FLOAT32_HEAD_NEEDS_A_PLAIN_HEAD = (
    "cast_lm_head_to_fp32=True needs the model's output head to be a plain nn.Linear whose "
    "weight is not sharded: remove lm_head from the adapter's target modules (and "
    "modules_to_save), or set cast_lm_head_to_fp32=False."
)


@contextlib.contextmanager
def capture_head_inputs(head: torch.nn.Linear):
    """While active, `head` records the hidden states it receives and returns zero-width logits.

    Yields the list the inputs are appended to. The zero-width output `(..., 0)` still depends on
    the inputs, the weight and the bias, so wrappers that trace the graph from the model's
    outputs (DDP with `find_unused_parameters`) see every parameter as used.
    """
    captured = []
    previous = head.__dict__.get("forward")  # an instance-level patch to restore, if any

    def record(hidden_states):
        captured.append(hidden_states)
        bias = None if head.bias is None else head.bias[:0]
        return F.linear(hidden_states, head.weight[:0], bias)  # (..., 0)

    head.forward = record
    try:
        yield captured
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous


def _unwrapped_config(model):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def completion_logprobs(
    model,
    input_ids,
    attention_mask,
    completion_ids,
    temperature=1.0,
    return_entropy=False,
    logprob_chunk_tokens=None,
    cast_lm_head_to_fp32=False,
    model_inputs=None,
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

    Positions after a row's last attended completion token (its end-of-sequence token, in
    the completion part of `attention_mask`) are not computed: the columns after every row's
    end are cut, and a packed row holds each completion's block up to its own end. Their
    log-probs and entropies are 0 (every user of them masks them out). Rows with
    `model_inputs` keep their columns.

    Args:
        logprob_chunk_tokens (`int`, *optional*):
            Completion positions whose logits exist at once; None for as many as one float32
            buffer of 128 MiB holds (`logprobs.default_chunk_tokens`). Peak extra memory is a
            few float32 buffers of `logprob_chunk_tokens * V` values.
        cast_lm_head_to_fp32 (`bool`, *optional*, defaults to `False`):
            Compute the logits in float32 from float32 hidden states and head weight, as TRL's
            `cast_lm_head_to_fp32`, which also makes the head's parameters float32
            (`cast_output_head_to_float32`).
        model_inputs (`dict`, *optional*):
            More keyword arguments of the forward pass, for these rows: a vision-language
            model's `pixel_values` and the like. Rows are then not packed (each row's image
            features must meet its own image tokens).
    """
    full_length = completion_ids.shape[1]
    lengths = attended_lengths(attention_mask[:, -full_length:])  # (B,)
    completion_length = full_length if model_inputs else int(lengths.max())
    if completion_length < full_length:  # columns after every row's end: not run at all
        input_ids = input_ids[:, : completion_length - full_length]
        attention_mask = attention_mask[:, : completion_length - full_length]
        completion_ids = completion_ids[:, :completion_length]
    head = output_head(model)
    if head is None and cast_lm_head_to_fp32:
        raise ValueError(FLOAT32_HEAD_NEEDS_A_PLAIN_HEAD)
    outputs = _completion_outputs(
        model, head, input_ids, attention_mask, completion_length, model_inputs
    )  # (B, T, H) hidden states with a usable head, else (B, T, V) logits
    computed = torch.arange(completion_length, device=lengths.device) < lengths.unsqueeze(1)
    values = _outputs_logprobs(
        model,
        head,
        outputs,
        completion_ids,
        computed,
        temperature=temperature,
        return_entropy=return_entropy,
        chunk_tokens=logprob_chunk_tokens,
        upcast=cast_lm_head_to_fp32,
    )  # (B, T') each
    values = tuple(F.pad(v, (0, full_length - completion_length)) for v in values)  # (B, T)
    return values if return_entropy else values[0]


def _completion_outputs(model, head, input_ids, attention_mask, completion_length, model_inputs):
    """The forward pass of `completion_logprobs`: at each of the last `completion_length`
    positions, the head's input `(B, T, H)` with a usable `head`, else the logits `(B, T, V)`;
    rows sharing their prompt are packed (`_shared_prompt_logits`) where that pays."""
    outputs = None
    if not model_inputs:
        outputs = _shared_prompt_logits(
            model, input_ids, attention_mask, completion_length, head=head
        )
    if outputs is None:
        outputs = _head_outputs(
            model,
            head,
            input_ids=input_ids,
            attention_mask=attention_mask,
            logits_to_keep=completion_length + 1,
            use_cache=False,
            **(model_inputs or {}),
        )[:, :-1]  # position t predicts completion token t
    return outputs


def _outputs_logprobs(
    model,
    head,
    outputs,
    completion_ids,
    computed,
    *,
    temperature,
    return_entropy,
    chunk_tokens,
    upcast,
):
    """The log-probs (and entropies) `(B, T)` of the completion tokens from the outputs of
    `_completion_outputs`, computed where `computed` is True and 0 elsewhere; a tuple."""
    if head is None:  # the model's logits (B, T, V)
        values = token_logprobs(
            outputs, completion_ids, temperature=temperature, return_entropy=return_entropy
        )
        return tuple(v * computed for v in (values if return_entropy else (values,)))
    # the head runs on the positions up to each row's end only
    softcap, scale = logit_transform(model)
    values = head_token_logprobs(
        outputs[computed],
        head.weight,
        completion_ids[computed],
        bias=head.bias,
        temperature=temperature,
        return_entropy=return_entropy,
        final_logit_softcapping=softcap,
        logit_scale=scale,
        chunk_tokens=chunk_tokens,
        upcast=upcast,
    )  # (N,) each
    return tuple(
        v.new_zeros(computed.shape).masked_scatter(computed, v)
        for v in (values if return_entropy else (values,))
    )


def attended_lengths(completion_attention: torch.Tensor) -> torch.Tensor:
    """`(B,)`: each row's completion positions up to its last attended one (at least 1), from
    the completion part `(B, T)` of the rows' attention mask."""
    positions = torch.arange(
        1, completion_attention.shape[1] + 1, device=completion_attention.device
    )
    return (completion_attention.bool() * positions).amax(1).clamp(min=1)


@torch.no_grad()
def no_grad_logprobs(logprobs, model, tensors: dict, chunk_size: int) -> torch.Tensor:
    """Log-probs `(B, T)` of the sampling (or reference) policy: `logprobs(model, rows)` on
    `chunk_size` rows of `tensors` at a time, without gradient and with dropout off (a dropout
    mask here would make the first ratio differ from 1 and clip for nothing). The model is
    handed back in the mode it came in.

    Args:
        logprobs (`Callable`): `(model, tensors) -> (B, T)` log-probs, e.g. the trainer's
            `completion_logprobs` of its batch with its temperature and head options.
        tensors (`dict[str, torch.Tensor]`): tensors of `B` rows each, sliced together.
    """
    rows = tensors["input_ids"].shape[0]
    was_training = model.training
    model.eval()
    try:
        chunks = [
            logprobs(model, {k: v[i : i + chunk_size] for k, v in tensors.items()})
            for i in range(0, rows, chunk_size)
        ]
    finally:
        model.train(was_training)
    return torch.cat(chunks)


def _head_outputs(model, head, **inputs):
    """The logits of a forward pass, or with `head` (the model's output head) its inputs."""
    if head is None:
        return model(**inputs).logits
    with capture_head_inputs(head) as captured:
        model(**inputs)
    if len(captured) != 1:
        raise RuntimeError(f"expected the output head to run once, it ran {len(captured)} times")
    return captured[0]


def packing_pays(
    model, prompt_length: int, completion_length: int, group_size: int, by_blocks: bool = False
) -> bool:
    """Whether one packed row of `P + G*T` tokens costs fewer FLOPs than `G` rows of `P + T`.

    Per layer, a token costs `2 * (4 d^2 + 3 d m)` in its linear layers (hidden size d, MLP
    width m) and `4 d K` in attention over K keys. Over the whole packed row (`by_blocks` False)
    the mask hides most keys, but the attention kernel still computes all `P + G*T` of them, so
    packing pays when the prompt is long next to the completions, and loses when the completions
    are long. Measured on SmolLM2-135M (float32, CPU, forward and backward, G = 8): P = 57,
    T = 64: 0.60x the time of the rows (predicted 0.66x); P = 57, T = 256: 1.40x (predicted
    1.24x, so not packed). Block by block (`packed_attention`), a completion's queries see
    `P + T` keys, as in its own row, and packing always saves the prompt's repeats.
    """
    config = _unwrapped_config(model)
    hidden = getattr(config, "hidden_size", None)
    if not hidden:
        return True
    width = getattr(config, "intermediate_size", None) or 4 * hidden
    linear = 2 * (4 * hidden * hidden + 3 * hidden * width)
    packed = prompt_length + group_size * completion_length
    row = prompt_length + completion_length
    if by_blocks:
        packed_keys = prompt_length * prompt_length + group_size * completion_length * row
    else:
        packed_keys = packed * packed
    packed_cost = packed * linear + 4 * hidden * packed_keys
    rows_cost = group_size * row * (linear + 4 * hidden * row)
    return packed_cost < rows_cost


def _layers_attend_as_masked(config, row_length: int, by_blocks: bool) -> bool:
    """Whether every layer of a (text) `config` computes under a packed row's 4D mask what it
    computes in each completion's own row of `row_length` tokens.

    transformers hands a 4D mask to every layer as it is. Full attention then attends as the
    mask says, and layers that mix no tokens (MLP, MoE) are unaffected. A sliding-window layer
    would attend past its window where the row is longer than it: attention by blocks
    (`by_blocks`, `packed_attention`) narrows the mask to each layer's window, other
    implementations pack only rows inside every window. A chunked layer likewise needs the row
    inside one chunk, and a recurrent layer (linear attention, state-space, convolution) would
    carry its state from one completion's block into the next.
    """
    window = getattr(config, "sliding_window", None)
    for kind in set(layer_kinds(config)):
        if kind == "sliding_attention":
            if not by_blocks and window is not None and window < row_length:
                return False
        elif kind == "chunked_attention":
            if config.attention_chunk_size < row_length:
                return False
        elif kind not in ("full_attention", "mlp", "moe"):
            return False
    return True


def _shared_prompt_logits(model, input_ids, attention_mask, completion_length: int, head=None):
    """Logits `(B, T, V)` predicting the `T` completion tokens, with each distinct prompt run
    once, in one forward pass; None when it does not apply (no two consecutive rows share a
    prompt, groups of unequal size, or an attention implementation that ignores custom masks)
    or does not pay (`packing_pays`), or where a layer would not attend as the mask says
    (`_layers_attend_as_masked`: recurrent layers, windows shorter than the rows outside
    attention by blocks). With `head` (the model's output head), the hidden states `(B, T, H)`
    that enter it instead of the logits.

    Each run of `n` consecutive rows with the same prompt becomes one packed row: the prompt
    but its last token, then for every completion a block of `T` tokens (the last prompt token
    and the completion but its last token). A 4D mask lets each block attend to the prompt and
    causally to itself only, and position ids restart at the prompt's end in every block, so
    each block computes exactly what its full row would; gradients of all the blocks add up in
    the one copy of the prompt. A block ends at its completion's last attended token
    (`_PackedLayout`): the padding after a completion is not in the packed row at all.
    """
    rows, total_length = input_ids.shape
    prompt_length = total_length - completion_length
    if prompt_length < 2 or rows < 2 or completion_length < 1:
        return None
    if adds_virtual_tokens(model):  # PEFT prepends them to a 2D mask; a 4D one is refused
        return None
    config = _unwrapped_config(model)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager", ATTENTION):
        return None
    by_blocks = attends_by_blocks(config)  # each block over the prompt and itself only
    if not _layers_attend_as_masked(config, total_length, by_blocks):
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
    if not packing_pays(model, prompt_length - padded, completion_length, group_size, by_blocks):
        return None
    first_rows = torch.arange(0, rows, group_size, device=input_ids.device)  # (U,)
    prefix_ids = prompt_ids[first_rows, padded:-1]  # (U, Q)
    prefix_mask = prompt_mask[first_rows, padded:-1].bool()  # (U, Q)
    prefix_length = prefix_ids.shape[1]
    if prefix_length == 0:
        return None
    layout = _PackedLayout.build(
        attention_mask[:, prompt_length:], num_prompts, group_size, prefix_length
    )
    packed_ids = layout.scatter(
        prefix_ids, input_ids[:, prompt_length - 1 : -1]
    )  # (U, L): the prompt, each completion's block, padding after the shorter rows' blocks
    allowed = layout.allowed(prefix_mask)  # (U, L, L)
    if implementation == "eager":  # eager attention adds the mask to the scores
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        mask = torch.zeros(allowed.shape, dtype=dtype, device=input_ids.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    else:
        mask = allowed  # boolean, True where attention is allowed
    mask = mask.unsqueeze(1)  # (U, 1, L, L)
    if by_blocks:
        register_packed_mask(config, mask, prefix_length, group_size, layout.lengths)
    outputs = _head_outputs(
        model,
        head,
        input_ids=packed_ids,
        attention_mask=mask,
        position_ids=layout.position_ids + padded,
        use_cache=False,
        logits_to_keep=layout.length - prefix_length,
    )  # (U, L - Q, V), or (U, L - Q, H) with `head`
    return layout.gather(outputs, completion_length)  # (B, T, V) or (B, T, H)


class _PackedLayout:
    """Where each token of a group's packed row sits: the prompt's `Q` tokens, then each
    completion's block (the last prompt token and the completion but its last token) cut to
    the completion's length, then padding up to the longest packed row of the batch.

    A block holds the positions that predict the completion's real tokens (up to the last
    attended one, at least one), so the tokens after a completion's end cost nothing in the
    linear layers, the attention or the output head."""

    def __init__(self, lengths: torch.Tensor, prefix_length: int, completion_length: int):
        units, size = lengths.shape
        device = lengths.device
        self.lengths = lengths  # (U, G), each in 1..T
        self.ragged = bool((lengths < completion_length).any())
        self.prefix_length = prefix_length
        # (U, G, T): whether slot t of a block is a token, and its packed position
        self.valid, self.where = block_slots(prefix_length, lengths, completion_length)
        offsets = torch.arange(completion_length, device=device)  # (T,)
        self.length = int((prefix_length + lengths.sum(1)).max())  # L
        # per packed position: the block (-1 the prompt, -2 padding) and the offset in it
        self.block = torch.full((units, self.length), -2, dtype=torch.long, device=device)
        self.block[:, :prefix_length] = -1
        position = torch.arange(self.length, device=device)
        self.position_ids = position.clamp(max=prefix_length).expand(units, -1).clone()  # (U, L)
        rows = torch.arange(units, device=device).view(units, 1, 1).expand_as(self.where)
        self._flat = (rows * self.length + self.where)[self.valid]  # real block tokens
        blocks = torch.arange(size, device=device).view(1, size, 1).expand_as(self.where)
        self.block.view(-1)[self._flat] = blocks[self.valid]
        self.position_ids.view(-1)[self._flat] = (prefix_length + offsets).expand_as(self.where)[
            self.valid
        ]

    @classmethod
    def build(cls, completion_attention, units: int, size: int, prefix_length: int):
        """From the completion part `(B, T)` of the rows' attention mask."""
        lengths = attended_lengths(completion_attention).view(units, size)
        return cls(lengths, prefix_length, completion_attention.shape[1])

    def scatter(self, prefix_ids: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The packed rows `(U, L)` from the prompts `(U, Q)` and the blocks `(B, T)`."""
        units = prefix_ids.shape[0]
        packed = prefix_ids.new_zeros(units, self.length)
        packed[:, : self.prefix_length] = prefix_ids
        packed.view(-1)[self._flat] = block_ids.view(self.valid.shape)[self.valid]
        return packed

    def allowed(self, prefix_mask: torch.Tensor) -> torch.Tensor:
        """`(U, L, L)`: causal, a block sees the prompt's real tokens and itself; every
        position sees itself (so no row of the softmax is empty), and a padding position after
        a shorter packed row's blocks the prompt too (its output is never read)."""
        position = torch.arange(self.length, device=prefix_mask.device)
        causal = position[None, :] <= position[:, None]  # (L, L)
        query, key = self.block.unsqueeze(2), self.block.unsqueeze(1)  # (U, L, 1), (U, 1, L)
        key_is_real = torch.cat(
            [prefix_mask, prefix_mask.new_ones(len(prefix_mask), self.length - self.prefix_length)],
            1,
        ).unsqueeze(1)  # (U, 1, L)
        seen = ((key == -1) | ((key == query) & (query >= 0))) & key_is_real
        return (causal & seen) | torch.eye(self.length, dtype=torch.bool, device=position.device)

    def gather(self, outputs: torch.Tensor, completion_length: int) -> torch.Tensor:
        """`(B, T, ...)` from the packed rows' outputs `(U, L - Q, ...)` of the block tokens:
        each completion's positions; after its block, copies of other positions' outputs that
        nothing reads (`completion_logprobs` gives those positions 0)."""
        if not self.ragged:  # the blocks in order, each T long
            return outputs.reshape(-1, completion_length, outputs.shape[-1])
        units = outputs.shape[0]
        index = self.where - self.prefix_length  # (U, G, T)
        picked = outputs[torch.arange(units, device=outputs.device).view(units, 1, 1), index]
        return picked.reshape(-1, completion_length, outputs.shape[-1])  # from (U, G, T, ...)
