"""Model card and adapter-only push to the Hugging Face Hub.

`push_folder` uploads a staging folder that holds exactly what a user loads back: the
adapter (or the full model without LoRA), the tokenizer and the model card. Checkpoints, logs and
`training_args.bin` stay local.

A pushed adapter is only loadable by others when its `adapter_config.json` names the base model
by Hub id. `base_model_hub_id` finds that id (given explicitly, the name the model was loaded
under, or the Hub cache folder it was loaded from); `point_adapter_at` writes it into the staged
copy only, so the adapter in `output_dir` keeps the local path and still loads locally.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings

from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers.trainer import TRAINING_ARGS_NAME

try:
    from peft import PeftModel
except ImportError:  # peft is a dependency; this keeps the import error where it is used
    PeftModel = ()


def is_peft_model(model) -> bool:
    return bool(PeftModel) and isinstance(model, PeftModel)


# A snapshot in the Hub cache: .../models--{owner}--{name}/snapshots/{commit}. Hub names never
# hold "--", so the split is unambiguous.
_CACHE_SNAPSHOT = re.compile(r"models--(?P<owner>[^/\\]+?)--(?P<name>[^/\\]+)[/\\]snapshots[/\\]")

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

This model was trained from {base_model} with Group Relative Policy Optimization (GRPO) using
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


def base_model_hub_id(name_or_path: str | None, given: str | None = None) -> str | None:
    """The Hub id of a base model, or None when it has none that we know of.

    Args:
        name_or_path (`str`, *optional*): what the model was loaded from (`config._name_or_path`):
            a Hub id, a folder of the Hub cache (`.../models--owner--name/snapshots/<commit>`,
            whose id is read from the path), another local folder (no id), or empty (a model
            built in code).
        given (`str`, *optional*): the id the user named explicitly; it wins.
    """
    if given:
        return given
    if not name_or_path:
        return None
    snapshot = _CACHE_SNAPSHOT.search(os.path.abspath(name_or_path))
    if snapshot and os.path.isdir(name_or_path):
        return f"{snapshot['owner']}/{snapshot['name']}"
    if os.path.exists(name_or_path):
        return None  # a local folder means nothing on the Hub
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        return None  # an absolute or relative path that is gone
    return name_or_path


def point_adapter_at(folder: str | os.PathLike, base_model: str) -> bool:
    """Rewrites `base_model_name_or_path` in `folder/adapter_config.json` to `base_model`.

    Returns whether there was an adapter config to rewrite (a full model has none).
    """
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.exists(path):
        return False
    with open(path) as handle:
        adapter_config = json.load(handle)
    adapter_config["base_model_name_or_path"] = base_model
    with open(path, "w") as handle:
        json.dump(adapter_config, handle, indent=2, sort_keys=True)
        handle.write("\n")
    return True


def _loading_snippet(model_name: str, is_adapter: bool, base_model: str | None, local_base):
    if not is_adapter:
        return (
            "from transformers import AutoModelForCausalLM\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{model_name}")'
        )
    if base_model:  # adapter_config.json names the base model on the Hub
        return (
            "from peft import AutoPeftModelForCausalLM\n\n"
            f'model = AutoPeftModelForCausalLM.from_pretrained("{model_name}")'
        )
    where = f"the local folder `{local_base}`" if local_base else "a model built in code"
    return (
        "from peft import PeftModel\n"
        "from transformers import AutoModelForCausalLM\n\n"
        f"# The base model was {where}, not a Hub model: load the same weights.\n"
        'base = AutoModelForCausalLM.from_pretrained("path/to/the/base/model")\n'
        f'model = PeftModel.from_pretrained(base, "{model_name}")'
    )


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
    local_base_model: str | None = None,
) -> ModelCard:
    """A model card with Hub metadata (base model, library, tags) and the training setup.

    Args:
        base_model (`str`, *optional*): the base model's Hub id; None when it has none.
        local_base_model (`str`, *optional*): the local folder the base model was loaded from,
            named in the card (never in its metadata) when `base_model` is None.
    """
    card_data = ModelCardData(
        base_model=base_model,
        library_name="peft" if is_adapter else "transformers",
        tags=sorted({"grpo", "trl_grpo_ext", "reinforcement-learning", *(tags or [])}),
        datasets=datasets or None,
        pipeline_tag="text-generation",
    )
    if base_model:
        base_text = f"[`{base_model}`](https://huggingface.co/{base_model})"
    elif local_base_model:
        base_text = (
            f"a base model in a local folder (`{local_base_model}`), not a Hub id: the adapter "
            "loads onto those same base weights, as below"
        )
    else:
        base_text = "a model built in code"
    config_rows = "\n".join(
        f"| `{name}` | {getattr(config, name)} |" for name in CARD_FIELDS if hasattr(config, name)
    )
    extras = "".join(
        f"\n## {title}\n\n{body.strip()}\n" for title, body in (extra_sections or {}).items()
    )
    content = CARD_TEMPLATE.format(
        card_data=card_data.to_yaml(),
        model_name=model_name,
        base_model=base_text,
        adapter_note=" as a LoRA adapter (PEFT)" if is_adapter else "",
        rewards="\n".join(f"- `{name}`" for name in reward_names),
        config_rows=config_rows,
        extra_sections=extras,
        loading=_loading_snippet(model_name, is_adapter, base_model, local_base_model),
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


def push_staged(
    save,
    *,
    repo_id: str,
    base_model: str | None,
    local_base_model: str | None,
    is_adapter: bool,
    extra_files: list[str] | None = None,
    **push_kwargs,
):
    """Saves afresh into a temporary folder with `save(folder)`, makes that copy loadable from
    the Hub, and uploads it (`push_folder`): checkpoints, logs and metrics stay local.

    The pickled training arguments are left out. The staged `adapter_config.json` names the base
    model by its Hub id (`point_adapter_at`); the adapter in the output folder keeps its path.
    """
    with tempfile.TemporaryDirectory(prefix="trl_grpo_ext-save-") as staging:
        save(staging)
        args_file = os.path.join(staging, TRAINING_ARGS_NAME)  # a pickle of the arguments
        if os.path.exists(args_file):
            os.remove(args_file)
        if base_model:
            point_adapter_at(staging, base_model)
        elif local_base_model and is_adapter:
            warnings.warn(
                f"The base model was loaded from the local folder {local_base_model!r}, so "
                f"the adapter pushed to {repo_id!r} names no Hub model to load it onto. Set "
                "trainer.base_model_id to the base model's Hub id (the recipe's "
                "--base_model) to make it loadable with AutoPeftModelForCausalLM.",
                stacklevel=3,
            )
        for path in extra_files or []:
            shutil.copy2(path, os.path.join(staging, os.path.basename(path)))
        return push_folder(staging, repo_id=repo_id, **push_kwargs)


class HubMixin:
    """The saving and pushing of a `transformers.Trainer` subclass: the adapter (under LoRA) or
    model, the tokenizer and a model card; only those reach the Hub, checkpoints stay local."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Saves the adapter under LoRA (the full model otherwise), the tokenizer and a model card."""
        super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            self.create_model_card(output_dir=output_dir)

    # The base model's Hub id, for a model loaded from a local folder (a downloaded or converted
    # copy): the pushed adapter_config.json and the card name it. None: the id the model was
    # loaded under, or the Hub cache folder it was loaded from; else the card says it has none.
    base_model_id: str | None = None

    def _base_model(self) -> tuple[str | None, str | None]:
        """(Hub id of the base model or None, the local folder it was loaded from or None)."""
        model = self.accelerator.unwrap_model(self.model)
        base = model.get_base_model() if is_peft_model(model) else model
        name_or_path = getattr(base.config, "_name_or_path", None) or None
        hub_id = base_model_hub_id(name_or_path, given=self.base_model_id)
        local = name_or_path if name_or_path and os.path.exists(name_or_path) else None
        return hub_id, local

    def create_model_card(
        self, model_name=None, dataset_name=None, tags=None, output_dir=None, **_
    ):
        """Writes `README.md` with Hub metadata, the reward functions and the configuration.

        Sections in `trainer.model_card_sections` (title -> markdown) are appended, which is
        how the recipe adds its before/after table. The base model is named by its Hub id
        (`trainer.base_model_id` when set); a local folder is never presented as one.
        """
        model = self.accelerator.unwrap_model(self.model)
        base_model, local_base_model = self._base_model()
        card = build_model_card(
            base_model=base_model,
            is_adapter=is_peft_model(model),
            reward_names=self.reward_names,
            config=self.args,
            model_name=model_name
            or self.args.hub_model_id
            or os.path.basename(self.args.output_dir),
            datasets=[dataset_name]
            if isinstance(dataset_name, str)
            else dataset_name or self.model_card_datasets,
            extra_sections=self.model_card_sections,
            tags=tags,
            local_base_model=local_base_model,
        )
        card.save(os.path.join(output_dir or self.args.output_dir, "README.md"))

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking=True,
        token=None,
        revision=None,
        extra_files: list[str] | None = None,
        **_,
    ):
        """Uploads the adapter (or model), tokenizer and model card, and nothing else.

        The files are saved afresh into a temporary folder and that folder is uploaded, so
        checkpoints, logs and metrics in `output_dir` stay local. The repository is
        `args.hub_model_id` (default: the output folder's name), private when
        `args.hub_private_repo` is set. The uploaded `adapter_config.json` names the base
        model by its Hub id (`trainer.base_model_id` when set, for a model loaded from a local
        copy), so `AutoPeftModelForCausalLM.from_pretrained(repo)` works anywhere; the adapter in
        `output_dir` keeps the local path.

        Args:
            extra_files (`list[str]`, *optional*): more files to upload beside them (for
                example a reward-curve image the model card shows).
        """
        self.save_model(self.args.output_dir, _internal_call=True)
        # Sharded weights (DeepSpeed ZeRO-3, FSDP) are gathered by every process together; the
        # main process alone then saves them again into the folder it uploads.
        state_dict = None
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            engine = self.deepspeed if self.is_deepspeed_enabled else self.model
            state_dict = self.accelerator.get_state_dict(engine)
        if not self.args.should_save:
            return None
        repo_id = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        base_model, local_base_model = self._base_model()

        def save(folder):
            if state_dict is None:
                return self.save_model(folder, _internal_call=True)
            self._save(folder, state_dict=state_dict)
            self.create_model_card(output_dir=folder)

        return push_staged(
            save,
            repo_id=repo_id,
            base_model=base_model,
            local_base_model=local_base_model,
            is_adapter=is_peft_model(self.accelerator.unwrap_model(self.model)),
            extra_files=extra_files,
            private=self.args.hub_private_repo,
            token=token or self.args.hub_token,
            revision=revision or self.args.hub_revision,
            commit_message=commit_message or "End of training",
        )

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Checkpoints are not pushed: they hold optimizer states and, without LoRA, full
        weights. `push_to_hub()` uploads the adapter, tokenizer and card at the end."""

    def _save(self, output_dir: str | None = None, state_dict=None):
        # `training_args.bin` pickles the arguments: keep the Hub token out of it.
        token, self.args.hub_token = self.args.hub_token, None
        try:
            super()._save(output_dir, state_dict=state_dict)
        finally:
            self.args.hub_token = token
