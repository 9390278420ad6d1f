"""A tiny causal language model and tokenizer built in code, for tests and the offline default.

Nothing here touches the network: the tokenizer is byte-level (every byte is one token, so any
text round-trips and undecodable bytes come back as replacement characters, as with real BPE
tokenizers), wrapped in `PreTrainedTokenizerFast` with a ChatML chat template, distinct pad and
eos tokens and left padding. The model is a `Qwen3ForCausalLM` with a few thousand parameters,
initialised deterministically from a seed. `save_tiny` writes both to a folder so that every
loader that takes a path (`AutoModelForCausalLM`, `AutoTokenizer`, `AutoProcessor`, the recipe,
TRL) works on it.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens, then `<|endoftext|>` (pad), `<|im_start|>`,
    `<|im_end|>` (eos). Deterministic; no training, no files."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
        model_max_length=2048,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    initializer_range: float = 0.02,
) -> Qwen3ForCausalLM:
    """A `Qwen3ForCausalLM` of the given (small) shape, identical for identical arguments.

    Args:
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the initial weights. With the default, logits are nearly
            uniform; a larger value such as 0.2 gives a random model with sharper preferences,
            which LoRA can move much faster on toy tasks.
    """
    tokenizer = tokenizer or build_tiny_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=2048,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model


def tiny_model_and_tokenizer(seed: int = 0, **model_kwargs):
    """`(model, tokenizer)`, built in memory."""
    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(tokenizer, seed=seed, **model_kwargs), tokenizer


def save_tiny(path: str | os.PathLike, seed: int = 0, **model_kwargs) -> str:
    """Builds the tiny model and tokenizer and saves both to `path`; returns the path."""
    model, tokenizer = tiny_model_and_tokenizer(seed=seed, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
