"""The recipe's tiny model with heads vLLM's CPU build runs (`--tiny_num_attention_heads 2`),
while the default keeps the model (and the cache key of its warm-up) it always had."""

from transformers import HfArgumentParser
from trl import ModelConfig

import trl_grpo_ext.script_args as script_args_module
from trl_grpo_ext import GroupRelativeConfig
from trl_grpo_ext.models import TinyWarmup
from trl_grpo_ext.script_args import MathScriptArguments, resolve_model_path


def warm_up_settings(monkeypatch, tmp_path, *overrides):
    seen = []
    monkeypatch.setattr(
        script_args_module, "warm_tiny_model", lambda cache, settings: seen.append(settings)
    )
    parser = HfArgumentParser((MathScriptArguments, GroupRelativeConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--model_name_or_path", "tiny", *overrides]
    )
    resolve_model_path(script_args, model_args, training_args)
    return seen[0]


def test_the_default_tiny_model_keeps_its_heads_and_its_cache_key(monkeypatch, tmp_path):
    settings = warm_up_settings(monkeypatch, tmp_path)
    # TinyWarmup's own defaults: the cache key of the warm-up is the one it always was
    defaults = TinyWarmup()
    assert (settings.num_attention_heads, settings.num_key_value_heads) == (
        defaults.num_attention_heads,
        defaults.num_key_value_heads,
    )


def test_two_heads_give_the_head_size_vllms_cpu_build_runs(monkeypatch, tmp_path):
    settings = warm_up_settings(monkeypatch, tmp_path, "--tiny_num_attention_heads", "2")
    assert (settings.num_attention_heads, settings.num_key_value_heads) == (2, 1)
    assert settings.hidden_size // settings.num_attention_heads == 32
