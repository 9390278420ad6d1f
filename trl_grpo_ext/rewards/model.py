"""Reward models: a sequence-classification model used as a reward function, as in TRL.

`reward_funcs` may hold, besides functions and registry names, a reward model: a
`PreTrainedModel` for sequence classification, or its local folder or Hub id (loaded with
`AutoModelForSequenceClassification.from_pretrained(id, num_labels=1, **model_init_kwargs)`).
The score of a completion is the model's first logit, `logits[:, 0]`, on the prompt and the
completion joined as TRL joins them:

- standard prompts: the strings concatenated, `prompt + completion`;
- conversational prompts: the messages `prompt + completion` rendered by the reward model's own
  chat template (no generation prompt), with the run's `chat_template_kwargs`;

tokenised by the reward model's own tokenizer, right-padded, with no special tokens added (the
text already holds what the template put there). The pad token id is written into the model's
config, because a sequence-classification head reads the logit at the last non-pad token.

`RewardModel` wraps such a model as a plain reward function in TRL's convention, so the
trainer's scoring, dynamic sampling and evaluation treat it like any other; its `__name__` (the
metric name) is the last part of the model's `config._name_or_path`, as in TRL.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def is_model_id(spec) -> bool:
    """Whether a string in `reward_funcs` names a reward model rather than a reward function.

    A registered reward name always wins. Otherwise a local folder, or a string with a `/` and no
    `:` (a Hub id such as `"org/name"`, or a path), is a model; everything else (bare names,
    dotted import paths like `"my_pkg.rewards:score"`) is left to the reward registry.
    """
    from .registry import _REGISTRY

    if not isinstance(spec, str) or spec in _REGISTRY:
        return False
    return os.path.isdir(spec) or ("/" in spec and ":" not in spec)


def reward_model_name(model) -> str:
    """The metric name of a reward model, as TRL names it: the last part of the model's
    `config._name_or_path` (its class name when that is empty, e.g. a model built in code)."""
    name_or_path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return name_or_path.rstrip("/").split("/")[-1] or type(model).__name__


def load_reward_model(model_id: str, model_init_kwargs: dict | None = None):
    """`AutoModelForSequenceClassification.from_pretrained(model_id, num_labels=1, ...)`, with an
    error that says what a string in `reward_funcs` may be when nothing can be loaded."""
    from transformers import AutoModelForSequenceClassification

    try:
        return AutoModelForSequenceClassification.from_pretrained(
            model_id, num_labels=1, **(model_init_kwargs or {})
        )
    except (OSError, ValueError) as error:
        raise ValueError(
            f"reward_funcs entry {model_id!r} is not a registered reward and no reward model could "
            f"be loaded from it ({type(error).__name__}: {error}). A string in reward_funcs is a "
            "registered reward name (see trl_grpo_ext.rewards.list_rewards()), an import path "
            "('my_pkg.rewards:my_reward'), or the local folder or Hub id of a sequence-"
            "classification model; check the path, or that the Hub is reachable (HF_HUB_OFFLINE)."
        ) from error


class RewardModel:
    """A sequence-classification model as a reward function in TRL's convention.

    Args:
        model (`PreTrainedModel`):
            A model whose output has `logits` of shape `(batch, num_labels)`; the reward is
            `logits[:, 0]`. Put in eval mode and frozen here.
        processing_class (`PreTrainedTokenizerBase`):
            The reward model's own tokenizer; a missing pad token is set to the eos token.
        chat_template_kwargs (`dict`, *optional*):
            Extra arguments of `apply_chat_template` for conversational prompts.

    Example:
        >>> reward = RewardModel(model, tokenizer)  # doctest: +SKIP
        >>> reward(prompts=["2+2="], completions=["4"])  # doctest: +SKIP
        [0.73]
    """

    def __init__(self, model, processing_class, chat_template_kwargs: dict | None = None):
        num_labels = getattr(model.config, "num_labels", 1)
        if num_labels != 1:
            logger.warning(
                "Reward model %s has num_labels=%d; its first logit is the reward, as in TRL. To "
                "score with another label, wrap the model in a reward function of your own.",
                reward_model_name(model),
                num_labels,
            )
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        # The classification head reads the logit at the last token that is not padding.
        text_config = (
            model.config.get_text_config()
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        text_config.pad_token_id = processing_class.pad_token_id
        self.model = model.eval().requires_grad_(False)
        self.processing_class = processing_class
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.device: torch.device | None = None  # the trainer's device, once prepared
        self.__name__ = reward_model_name(model)

    def prepare(self, accelerator, is_deepspeed_enabled: bool = False) -> None:
        """Places the model for inference as TRL does: a DeepSpeed inference engine under
        DeepSpeed (ZeRO-3 shards it), else `accelerator.prepare_model(evaluation_mode=True)`."""
        if is_deepspeed_enabled:
            from trl.models.utils import prepare_deepspeed

            self.model = prepare_deepspeed(self.model, accelerator)
        else:
            self.model = accelerator.prepare_model(
                self.model, evaluation_mode=True, device_placement=True
            )
        self.device = accelerator.device

    def texts(self, prompts: list, completions: list) -> list[str]:
        """The texts the model scores: each prompt joined with its completion."""
        from trl.data_utils import apply_chat_template, is_conversational

        if prompts and is_conversational({"prompt": prompts[0]}):
            return [
                apply_chat_template(
                    {"messages": prompt + completion},
                    self.processing_class,
                    **self.chat_template_kwargs,
                )["text"]
                for prompt, completion in zip(prompts, completions, strict=True)
            ]
        return [
            prompt + completion for prompt, completion in zip(prompts, completions, strict=True)
        ]

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        if not completions:
            return []
        inputs = self.processing_class(
            text=self.texts(prompts, completions),
            return_tensors="pt",
            padding=True,
            padding_side="right",
            add_special_tokens=False,
        )
        device = self.device
        if device is None:
            device = next(self.model.parameters()).device
        inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
        with torch.inference_mode():
            logits = self.model(**inputs).logits  # (N, num_labels)
        return logits[:, 0].float().tolist()

    def __repr__(self) -> str:
        return f"RewardModel({self.__name__!r})"


def resolve_reward_models(reward_funcs: list, reward_processing_classes, args) -> tuple[list, list]:
    """Loads the reward models named in `reward_funcs` and wraps every reward model in a
    [`RewardModel`]; other entries are returned unchanged.

    Args:
        reward_funcs (`list`): functions, registry names, model ids, or models.
        reward_processing_classes (tokenizer, `list`, or `None`):
            TRL's meaning: one per reward function (ignored for functions), or a single one when
            there is one reward function; `None` (or a `None` entry) loads the reward model's
            tokenizer with `AutoTokenizer.from_pretrained`.
        args ([`GroupRelativeConfig`]): for `model_init_kwargs`, `trust_remote_code` and
            `chat_template_kwargs`.

    Returns:
        `(reward_funcs, reward_processing_classes)`: two lists of the same length, the processing
        class of each reward model (`None` for functions).
    """
    from transformers import AutoTokenizer

    if reward_processing_classes is None:
        reward_processing_classes = [None] * len(reward_funcs)
    elif not isinstance(reward_processing_classes, (list, tuple)):
        reward_processing_classes = [reward_processing_classes]
    if len(reward_processing_classes) != len(reward_funcs):
        raise ValueError(
            f"The number of reward_processing_classes ({len(reward_processing_classes)}) must match "
            f"the number of reward functions ({len(reward_funcs)}): give one per reward function "
            "(None for functions and for models whose own tokenizer should be loaded)."
        )
    init_kwargs = {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        init_kwargs["device_map"] = None  # as TRL: "auto" fails under data parallelism
    funcs, processing_classes = [], []
    for func, processing_class in zip(reward_funcs, reward_processing_classes):
        revision = None
        if is_model_id(func):
            revision = init_kwargs.get("revision")
            func = load_reward_model(func, init_kwargs)
        if isinstance(func, torch.nn.Module):
            if not hasattr(func, "config"):
                raise TypeError(
                    f"reward_funcs holds a {type(func).__name__} without a config; a reward model "
                    "is a PreTrainedModel for sequence classification."
                )
            if processing_class is None:
                if not func.config._name_or_path:
                    raise ValueError(
                        f"reward model {type(func).__name__} was not loaded from a folder or the "
                        "Hub, so its tokenizer cannot be found; pass it as "
                        "reward_processing_classes (one per reward function, None for functions)."
                    )
                processing_class = AutoTokenizer.from_pretrained(
                    func.config._name_or_path,
                    revision=revision,
                    trust_remote_code=args.trust_remote_code,
                )
            func = RewardModel(func, processing_class, args.chat_template_kwargs)
            processing_class = func.processing_class
        # A processing class given for a function is kept and ignored, as in TRL.
        funcs.append(func)
        processing_classes.append(processing_class)
    return funcs, processing_classes
