"""Everything between dataset rows and sampled token ids: prompt rendering and tokenisation,
and the sampling settings of `generate`, each built in one place."""

from .prompts import PromptEncoder, check_chat_template, check_prompt_dataset, is_conversational
from .sampling import isolated_from_checkpoint, sampling_config, sampling_config_from_args

__all__ = [
    "PromptEncoder",
    "check_chat_template",
    "check_prompt_dataset",
    "is_conversational",
    "isolated_from_checkpoint",
    "sampling_config",
    "sampling_config_from_args",
]
