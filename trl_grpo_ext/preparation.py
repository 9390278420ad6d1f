"""What `GroupRelativeTrainer.__init__` prepares around `transformers.Trainer.__init__`.

Before it: the configuration (a default one, or a check that it is a `GroupRelativeConfig`), the
reward functions with their names and weights, and the folder a colocated vLLM engine loads the
base model from. After it, once the trainer has an `Accelerator`: the reward and reference models
placed on its device, the `RolloutProducer` that is the trainer's one generation path, and the
teardown of the process group at exit. Each step is a function, so the constructor reads as the
list of them.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import weakref

import datasets
import torch

from .config import GroupRelativeConfig
from .generation.engines import engine_model_folder, policy_for_generation
from .generation.engines import lora_rank as max_lora_rank
from .generation.images import (
    ROLLOUT_FUNC_WITH_IMAGES,
    dataset_has_images,
    images_unsupported,
    is_processor,
    prompt_with_images,
    text_tokenizer,
)
from .generation.producer import RolloutProducer
from .generation.settings import GenerationSettings
from .hub import is_peft_model
from .rewards.model import RewardModel, resolve_reward_models
from .scoring import resolve_reward_funcs, reward_func_list, reward_name, reward_weights

logger = logging.getLogger(__name__)

# Loss types that sum per-token terms (TRL's list for its sequence-level warning).
TOKEN_SUMMED_LOSS_TYPES = ("bnpo", "dr_grpo", "dapo", "cispo")


def trainer_config(model, args: GroupRelativeConfig | None) -> GroupRelativeConfig:
    """`args`, checked to be a [`GroupRelativeConfig`]; when None, the default one, with
    `output_dir` `"<model name>-GRPO"`."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        args = GroupRelativeConfig(output_dir=f"{os.path.basename(str(name)) or 'model'}-GRPO")
    if not isinstance(args, GroupRelativeConfig):
        raise TypeError(
            f"args must be a GroupRelativeConfig, got {type(args).__name__}; build one with "
            "GroupRelativeConfig(**your_args.to_dict()) or the same fields."
        )
    return args


def agent(tools, environment_factory, rollout_func, args: GroupRelativeConfig):
    """The run's `tools.Agent` when it has tools or environments, else None. Checks what they
    cannot be combined with."""
    if rollout_func is not None and args.max_staleness:
        raise ValueError(
            "rollout_func samples in the training process: unset max_staleness (or set it to 0), "
            "whose rollout worker would sample without it."
        )
    if not tools and environment_factory is None:
        return None
    if rollout_func is not None:
        raise ValueError(
            "rollout_func samples whole rollouts itself, so the trainer's tools and environments "
            "would not be used: call your tools inside rollout_func, or drop rollout_func."
        )
    from .tools import Agent

    built = Agent(
        tools, environment_factory, timeout=args.tool_call_timeout, workers=args.tool_call_workers
    )
    weakref.finalize(built, built.runner.close)
    return built


def named_eval_sets(eval_dataset) -> dict:
    """`eval_dataset` as the sets `evaluate()` reads, each named as the checks' messages name it:
    one set, or each set of a dict of datasets or a `DatasetDict` (whose metrics are
    `eval_<name>_...`, as `transformers.Trainer` names them)."""
    if isinstance(eval_dataset, dict):  # a DatasetDict is a dict
        return {f"eval_dataset[{name!r}]": dataset for name, dataset in eval_dataset.items()}
    return {"eval_dataset": eval_dataset}


def eval_set_by_name(eval_dataset, name: str):
    """The set `name` of a trainer's several evaluation sets (`evaluate(eval_dataset=name)`)."""
    if not isinstance(eval_dataset, dict) or name not in eval_dataset:
        names = sorted(eval_dataset) if isinstance(eval_dataset, dict) else None
        raise ValueError(
            f"evaluate(eval_dataset={name!r}) names one of the trainer's evaluation sets, but its "
            f"eval_dataset has {'the sets ' + str(names) if names else 'no named sets'}: pass one "
            "of those names, a dataset, or eval_dataset={name: dataset, ...} to the trainer."
        )
    return eval_dataset[name]


def check_images(
    processing_class, datasets: dict, first_rows: dict, args: GroupRelativeConfig, rollout_func
):
    """Fails at construction when a dataset has images (`image`/`images` columns, or image parts
    in its prompts) that the run would drop, training on the text alone: with a tokenizer as
    `processing_class`, or with a path that does not carry images yet (`images_unsupported`).
    `first_rows`: each split's first row, as `check_prompt_dataset` read it (None if none)."""
    for split, dataset in datasets.items():
        first = first_rows.get(split)
        if dataset is None or not dataset_has_images(dataset, first):
            continue
        if not is_processor(processing_class):
            raise ValueError(
                f"{split} has images, but processing_class is a tokenizer "
                f"({type(processing_class).__name__}), which would train on the text alone. "
                "Pass the model's processor instead: "
                "processing_class=AutoProcessor.from_pretrained(model_id)."
            )
        if rollout_func is not None:
            raise ValueError(ROLLOUT_FUNC_WITH_IMAGES)
        if first is not None and "prompt" in first:
            prompt_with_images(first)  # conversational, each image part with its image
        unsupported = images_unsupported(args.use_vllm)
        if unsupported:
            raise ValueError(f"{split}: {unsupported}")


def streams(dataset) -> bool:
    """Whether `dataset` (a dataset, or a dict of evaluation sets) is or holds a stream."""
    if isinstance(dataset, dict):
        return any(streams(one) for one in dataset.values())
    return isinstance(dataset, datasets.IterableDataset)


def check_as_trl(
    args: GroupRelativeConfig, train_dataset, environment_factory, eval_dataset=None
) -> None:
    """What `trl.GRPOTrainer` says and sets at construction: a warning for sequence-level
    importance sampling with a loss type that sums per-token terms; a streamed dataset sets
    `accelerator_config.dispatch_batches` to False (each process reads the stream and takes its
    own slice, `sampler.StreamBatches`) and refuses True; a streamed train dataset with data
    loader workers sets them to 0, with a warning; neither a train dataset nor an environment
    is an error."""
    level, loss_type = args.importance_sampling_level, args.loss_type
    if level == "sequence" and loss_type in TOKEN_SUMMED_LOSS_TYPES:
        logger.warning(
            f"When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums "
            "per-token contributions, which effectively weights each sequence by its completion "
            "length instead of optimizing the per-sequence objective. To reproduce the GSPO "
            "paper's setup, set `loss_type='grpo'`."
        )
    if streams(train_dataset) or streams(eval_dataset):
        if args.accelerator_config.dispatch_batches:
            raise ValueError(
                "Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                "`accelerator_config`. Please set it to `False`."
            )
        args.accelerator_config.dispatch_batches = False
    if isinstance(train_dataset, datasets.IterableDataset) and args.dataloader_num_workers:
        logger.warning(
            "Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; "
            f"overriding the provided value ({args.dataloader_num_workers})."
        )
        args.dataloader_num_workers = 0
    if train_dataset is None and environment_factory is None:
        raise ValueError(
            "`train_dataset` is required unless an `environment_factory` is provided (whose "
            "reset() supplies the prompts): pass train_dataset to GroupRelativeTrainer."
        )


def environment_dataset(train_dataset, environment_factory, args: GroupRelativeConfig):
    """`train_dataset`, or, without one, rows of an empty user message for the environments'
    `reset()` to fill in: one generation batch of them, repeated for `max_steps` steps. A dict
    `environment_factory` needs a dataset, whose `environment` column picks each row's."""
    if train_dataset is not None:
        return train_dataset
    if isinstance(environment_factory, dict):
        raise ValueError(
            "A dict `environment_factory` (several environments) requires a `train_dataset` with "
            "an `environment` column naming each row's environment. Give a dataset, or pass a "
            "single environment factory."
        )
    if args.max_steps <= 0:
        raise ValueError(
            "Without a train_dataset the environments' reset() supplies the prompts, and "
            "max_steps sets how long to train: set max_steps to a positive number of steps."
        )
    from datasets import Dataset

    rows = args.prompts_per_generation * args.world_size
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})


def prepare_rewards(reward_funcs, reward_processing_classes, args: GroupRelativeConfig, agent=None):
    """The trainer's reward functions: reward models loaded and wrapped
    (`rewards.model.resolve_reward_models`), registry names and import paths resolved, then the
    `get_reward` of each environment class (weight 1, named after the class), as TRL adds it;
    with those, `reward_funcs` may be None.

    Returns:
        `(reward_funcs, reward_names, reward_weights, reward_processing_classes)`: the callables,
        their metric names, the `(F,)` weights of `args.reward_weights`, and the processing class
        of each reward model (`None` for functions).
    """
    extra = agent.reward_functions() if agent is not None else []
    if extra and (reward_funcs is None or reward_funcs == []):
        funcs, processing_classes = [], []
    else:
        funcs, processing_classes = resolve_reward_models(
            reward_func_list(reward_funcs), reward_processing_classes, args
        )
        funcs = resolve_reward_funcs(funcs)
    names = [reward_name(func) for func in funcs]
    weights = reward_weights(args.reward_weights, names)
    funcs += [func for _, func in extra]
    names += [name for name, _ in extra]
    weights = torch.cat([weights, torch.ones(len(extra))])
    return funcs, names, weights, processing_classes + [None] * len(extra)


def colocated_engine_folder(model, processing_class, args: GroupRelativeConfig) -> str | None:
    """The folder a colocated vLLM engine loads the base model from (without adapters); None
    for the other engines. Taken before `models.prepare_policy` wraps the model."""
    if not (args.use_vllm and args.vllm_mode == "colocate"):
        return None
    base = model.get_base_model() if is_peft_model(model) else model
    return engine_model_folder(base, processing_class)


def place_reward_and_reference_models(trainer) -> None:
    """Puts the reward models and the reference model on the trainer's device (wrapped for
    DeepSpeed where it runs), and adds TRL's `SyncRefModelCallback` with `sync_ref_model`."""
    for func in trainer.reward_funcs:
        if isinstance(func, RewardModel):
            func.prepare(trainer.accelerator, trainer.is_deepspeed_enabled)
    if trainer.ref_model is None:
        return
    trainer.ref_model = trainer.accelerator.prepare_model(trainer.ref_model, evaluation_mode=True)
    if trainer.args.sync_ref_model:
        from trl.trainer.callbacks import SyncRefModelCallback

        trainer.add_callback(SyncRefModelCallback(trainer.ref_model, trainer.accelerator))


def rollout_producer(trainer, model, engine_folder: str | None) -> RolloutProducer:
    """The trainer's `RolloutProducer`. It asks the trainer for the policy each time it samples,
    so it sees the current (wrapped) model and weights; `model` (the policy as prepared by
    `models.prepare_policy`) gives the LoRA rank a vLLM engine is started with."""
    args = trainer.args
    processing_class = trainer.processing_class
    return RolloutProducer(
        GenerationSettings.from_config(args),
        text_tokenizer(processing_class),
        trainer.eos_token_ids,
        policy=lambda: policy_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            args.ds3_gather_for_generation,
            args.gradient_checkpointing_kwargs,
        ),
        model=lambda: trainer.accelerator.unwrap_model(trainer.model),
        engine_folder=engine_folder,
        lora_rank=max_lora_rank(model) if is_peft_model(model) else None,
        agent=trainer.agent,
        processor=processing_class if is_processor(processing_class) else None,
    )


def end_distributed_at_exit(trainer) -> None:
    """With several processes, tears down the process group at exit while the interpreter is
    still whole (`_end_distributed`); holds the trainer only weakly."""
    if trainer.args.world_size > 1:
        atexit.register(_end_distributed, weakref.ref(trainer))


def _end_distributed(trainer_ref) -> None:
    """Left to interpreter shutdown, gloo's worker threads free finished collectives (and their
    tensors) while Python is being torn down, which aborts the process now and then after a
    finished run (exit code -6). The data-parallel wrapper holds the process group, so it is
    released first."""
    trainer = trainer_ref()
    if trainer is None or not torch.distributed.is_initialized():
        return
    trainer.accelerator.free_memory()
    trainer.model_wrapped = trainer.model
    gc.collect()
    trainer.accelerator.end_training()
