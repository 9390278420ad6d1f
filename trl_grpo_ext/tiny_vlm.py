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

# Qwen3-VL's chat format with `<image>` for each image: the tools' schemas in a system turn, calls
# as `<tool_call>` JSON in the assistant's turn, and tool results (text or image parts) as
# `<tool_response>` blocks of a user turn.
_CONTENT = (
    "{% if content is string %}{{ content }}"
    "{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
VLM_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{% set content = messages[0]['content'] %}"
    + _CONTENT
    + "{{ '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' }}" + _CONTENT + "{{ '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    + _CONTENT
    + "{% for call in message.get('tool_calls') or [] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first or content %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{ call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{ '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# transformers' response parsing for that format: `<tool_call>` JSON blocks become `tool_calls`.
VLM_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def build_tiny_processor() -> LlavaProcessor:
    """The tiny tokenizer with `<image>` added, and a PIL image processor that resizes and crops
    every image to `IMAGE_SIZE` pixels square."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    tokenizer.response_template = VLM_RESPONSE_TEMPLATE
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
