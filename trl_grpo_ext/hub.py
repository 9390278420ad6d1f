"""Model card and adapter-only push to the Hugging Face Hub.

`push_folder` uploads a staging folder that holds exactly what a user loads back: the
adapter (or the full model without LoRA), the tokenizer and the model card. Checkpoints, logs and
`training_args.bin` stay local.
"""

from __future__ import annotations

import os

from huggingface_hub import HfApi, ModelCard, ModelCardData

# Fields of the config worth a reader's attention, in the card's training-configuration table.
CARD_FIELDS = (
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_generations",
    "max_completion_length",
    "temperature",
    "loss_type",
    "beta",
    "epsilon",
    "epsilon_high",
    "scale_rewards",
    "num_iterations",
    "importance_sampling_level",
    "seed",
)

CARD_TEMPLATE = """---
{card_data}
---

# {model_name}

This model was trained from `{base_model}` with Group Relative Policy Optimization (GRPO) using
[trl_grpo_ext](https://github.com/trl-grpo-ext/trl_grpo_ext){adapter_note}.

## Reward functions

{rewards}

## Training configuration

| field | value |
|---|---|
{config_rows}
{extra_sections}
## Loading

```python
{loading}
```
"""


def build_model_card(
    *,
    base_model: str | None,
    is_adapter: bool,
    reward_names: list[str],
    config,
    model_name: str,
    datasets: list[str] | None = None,
    extra_sections: dict[str, str] | None = None,
    tags: list[str] | None = None,
) -> ModelCard:
    """A model card with Hub metadata (base model, library, tags) and the training setup."""
    card_data = ModelCardData(
        base_model=base_model,
        library_name="peft" if is_adapter else "transformers",
        tags=sorted({"grpo", "trl_grpo_ext", "reinforcement-learning", *(tags or [])}),
        datasets=datasets or None,
        pipeline_tag="text-generation",
    )
    if is_adapter:
        loading = (
            "from peft import AutoPeftModelForCausalLM\n\n"
            f'model = AutoPeftModelForCausalLM.from_pretrained("{model_name}")'
        )
    else:
        loading = (
            "from transformers import AutoModelForCausalLM\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{model_name}")'
        )
    config_rows = "\n".join(
        f"| `{name}` | {getattr(config, name)} |" for name in CARD_FIELDS if hasattr(config, name)
    )
    extras = "".join(
        f"\n## {title}\n\n{body.strip()}\n" for title, body in (extra_sections or {}).items()
    )
    content = CARD_TEMPLATE.format(
        card_data=card_data.to_yaml(),
        model_name=model_name,
        base_model=base_model or "a model built in code",
        adapter_note=" as a LoRA adapter (PEFT)" if is_adapter else "",
        rewards="\n".join(f"- `{name}`" for name in reward_names),
        config_rows=config_rows,
        extra_sections=extras,
        loading=loading,
    )
    return ModelCard(content)


def push_folder(
    folder: str | os.PathLike,
    *,
    repo_id: str,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str = "Upload GRPO-trained model",
):
    """Creates `repo_id` if needed and uploads every file of `folder`; returns the commit info.

    The caller stages the folder, so that what is uploaded is exactly what it holds.
    """
    api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        commit_message=commit_message,
        revision=revision,
        repo_type="model",
    )
