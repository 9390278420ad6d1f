"""Offline stand-ins for the Hugging Face Hub repositories that TRL's GRPO tests load.

Models: each `trl-internal-testing/tiny-<Architecture>` is a tiny model of that architecture
(random weights, two layers) on the project's byte-level tokenizer (`trl_grpo_ext.tiny`), saved in
the layout of the Hub cache (`models--<org>--<name>/snapshots/<commit>`), so that every way of
loading a model by its id (`from_pretrained`, the trainer given a string, `AutoProcessor`) finds
it with `HF_HUB_OFFLINE=1` and `HF_HUB_CACHE` pointing there. Qwen3 and Qwen3-MoE get Qwen3's chat
template (TRL's `chat_templates/qwen3.jinja`), whose tool calls TRL parses; the others the tiny
tokenizer's ChatML template.

Datasets: `zen(name, config, split, streaming)` answers `load_dataset("trl-internal-testing/zen",
...)` with the same columns as the Hub's "Zen of Python" dataset (prompt-only configurations:
`prompt`, a string or one user message), 17 train and 2 test rows.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import trl
from datasets import Dataset, DatasetDict, IterableDatasetDict
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from trl_grpo_ext.tiny import build_tiny_tokenizer
from trl_grpo_ext.tiny_vlm import save_tiny_vlm

ORG = "trl-internal-testing"
COMMIT = "0" * 40
QWEN3_TEMPLATE = Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja"

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# Hub name -> (model_type, head, extra config). The name's suffix (-2.5, -3.2, -0.2) is kept.
TEXT_MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal", {}),
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "classification", {}),
    "tiny-Qwen3ForCausalLM": ("qwen3", "causal", {}),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", "classification", {}),
    "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "causal", MOE),
    "tiny-LlamaForCausalLM-3.2": ("llama", "causal", {}),
    "tiny-LlamaForSequenceClassification-3.2": ("llama", "classification", {}),
    "tiny-MistralForCausalLM-0.2": ("mistral", "causal", {}),
    "tiny-Gemma2ForCausalLM": ("gemma2", "causal", {}),
    "tiny-Cohere2ForCausalLM": ("cohere2", "causal", {}),
    "tiny-GptOssForCausalLM": (
        "gpt_oss",
        "causal",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "tiny-Glm4MoeForCausalLM": (
        "glm4_moe",
        "causal",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
}
VLM_MODELS = {"tiny-LlavaForConditionalGeneration"}  # the project's tiny Llava


def snapshot(cache: Path, name: str) -> Path:
    repo = cache / f"models--{ORG}--{name}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return repo / "snapshots" / COMMIT


def build_text_model(name: str, folder: Path) -> None:
    model_type, head, extra = TEXT_MODELS[name]
    tokenizer = build_tiny_tokenizer()
    if model_type.startswith("qwen3"):
        tokenizer.chat_template = QWEN3_TEMPLATE.read_text()
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **{**SMALL, **extra},
    )
    if head == "classification":
        config.num_labels = 1
    auto = AutoModelForCausalLM if head == "causal" else AutoModelForSequenceClassification
    torch.manual_seed(0)
    model = auto.from_config(config)
    if head == "causal":
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.bos_token_id = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_hub_cache(cache: str | os.PathLike) -> Path:
    """Writes every stand-in missing from the Hub cache folder `cache`; returns it."""
    cache = Path(cache)
    for name in [*TEXT_MODELS, *VLM_MODELS]:
        folder = snapshot(cache, name)
        if (folder / "config.json").exists():
            continue
        if name in TEXT_MODELS:
            build_text_model(name, folder)
        else:
            save_tiny_vlm(folder)
    return cache


ZEN = [
    "Beautiful is better than ugly.",
    "Explicit is better than implicit.",
    "Simple is better than complex.",
    "Complex is better than complicated.",
    "Flat is better than nested.",
    "Sparse is better than dense.",
    "Readability counts.",
    "Special cases aren't special enough to break the rules.",
    "Although practicality beats purity.",
    "Errors should never pass silently.",
    "Unless explicitly silenced.",
    "In the face of ambiguity, refuse the temptation to guess.",
    "There should be one-- and preferably only one --obvious way to do it.",
    "Although that way may not be obvious at first unless you're Dutch.",
    "Now is better than never.",
    "Although never is often better than *right* now.",
    "If the implementation is hard to explain, it's a bad idea.",
    "If the implementation is easy to explain, it may be a good idea.",
    "Namespaces are one honking great idea -- let's do more of those!",
]


def zen_rows(config: str, lines: list[str]) -> list[dict]:
    prompts = [line.rsplit(" ", 1)[0] for line in lines]  # the line without its last word
    if config == "standard_prompt_only":
        return [{"prompt": prompt} for prompt in prompts]
    if config == "conversational_prompt_only":
        return [{"prompt": [{"role": "user", "content": f"Complete: {p}"}]} for p in prompts]
    raise ValueError(f"no stand-in for the zen configuration {config!r}")


def zen(config: str, split: str | None = None, streaming: bool = False):
    splits = {"train": ZEN[:17], "test": ZEN[17:]}
    built = {name: Dataset.from_list(zen_rows(config, lines)) for name, lines in splits.items()}
    if streaming:
        built = {name: data.to_iterable_dataset() for name, data in built.items()}
        whole = IterableDatasetDict(built)
    else:
        whole = DatasetDict(built)
    return whole if split is None else whole[split]
