"""A tiny vision-language model and its processor built in code, for tests and offline runs.

The LLaVA architecture, which transformers loads through `AutoModelForImageTextToText`: a CLIP
vision tower, a two-layer projector and a Llama language model, each a few thousand parameters,
initialised deterministically from a seed. The processor is a `LlavaProcessor` made of the PIL
`CLIPImageProcessorPil` (no torchvision needed) and the byte-level tokenizer of `tiny.py` with
one more special token, `<image>`; it expands each `<image>` of the text into one token per
image patch. The chat template renders the content parts of a message, `{"type": "image"}` as
`<image>` and `{"type": "text", "text": ...}` as its text, and plain string contents as they are.
`save_tiny_vlm` writes model and processor to a folder that `AutoProcessor.from_pretrained` and
`AutoModelForImageTextToText.from_pretrained` load, as a user loads a Hub model.
"""

from __future__ import annotations

import os

import torch
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from .tiny import build_tiny_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 16  # pixels per side after resizing and cropping
PATCH_SIZE = 8  # so (16 / 8)^2 = 4 image tokens per image

VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_processor() -> LlavaProcessor:
    """The tiny tokenizer with `<image>` added, and a PIL image processor that resizes and crops
    every image to `IMAGE_SIZE` pixels square."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        chat_template=VLM_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # CLIP's class token, which "default" drops again
    )


def build_tiny_vlm(
    processor: LlavaProcessor | None = None,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vision_hidden_size: int = 32,
    initializer_range: float = 0.02,
) -> LlavaForConditionalGeneration:
    """A `LlavaForConditionalGeneration` of the given (small) shape, identical for identical
    arguments."""
    processor = processor or build_tiny_processor()
    tokenizer = processor.tokenizer
    vision_config = CLIPVisionConfig(
        hidden_size=vision_hidden_size,
        intermediate_size=2 * vision_hidden_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=vision_hidden_size,
        initializer_range=initializer_range,
    )
    text_config = LlamaConfig(
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
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=processor.image_token_id,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model


def tiny_vlm_and_processor(seed: int = 0, **model_kwargs):
    """`(model, processor)`, built in memory."""
    processor = build_tiny_processor()
    return build_tiny_vlm(processor, seed=seed, **model_kwargs), processor


def save_tiny_vlm(path: str | os.PathLike, seed: int = 0, **model_kwargs) -> str:
    """Builds the tiny VLM and its processor and saves both to `path`; returns the path."""
    model, processor = tiny_vlm_and_processor(seed=seed, **model_kwargs)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)
