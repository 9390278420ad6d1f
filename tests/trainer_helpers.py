"""Builders shared by the trainer tests: a toy task and a trainer on the tiny model."""

from datasets import Dataset

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny import tiny_model_and_tokenizer


def digit_sums(size: int = 3) -> Dataset:
    """Prompts `a+b=` for one-digit a, b < size; the answer column holds the sum."""
    return Dataset.from_list(
        [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(size) for b in range(size)]
    )


def default_dataset(agent: dict) -> Dataset | None:
    """`make_trainer`'s prompts for its `agent` arguments: none for an environment (its reset()
    gives them), `digit_sums` as user messages for tools, else `digit_sums`."""
    if "environment_factory" in agent:
        return None
    if "tools" in agent:
        return digit_sums().map(
            lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]}
        )
    return digit_sums()


def right_digit(completions, answer, **kwargs):
    """1.0 when the completion starts with the right digit."""
    return [
        1.0 if completion[:1] == target else 0.0 for completion, target in zip(completions, answer)
    ]


def odd_first_byte(completions, **kwargs):
    """1.0 when the completion's first character has an odd code point: random completions
    score 0 and 1 about equally often, so every batch has a learning signal."""
    return [float(ord(completion[0]) % 2) if completion else 0.0 for completion in completions]


def lora_config(r: int = 8, dropout: float = 0.0):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules="all-linear")


def make_trainer(
    output_dir,
    *,
    reward_funcs=odd_first_byte,
    dataset=None,
    peft: bool = True,
    peft_config=None,
    model=None,
    tokenizer=None,
    trainer_class=GroupRelativeTrainer,
    eval_dataset=None,
    **config,
):
    """A trainer on the tiny model with fast defaults; `config` overrides GroupRelativeConfig,
    but `tools`, `environment_factory` and `rollout_func`, which go to the trainer (and with an
    `environment_factory`, `dataset=None` means no dataset; with `tools`, the prompts are
    `digit_sums` as user messages)."""
    agent = {
        k: config.pop(k) for k in ("tools", "environment_factory", "rollout_func") if k in config
    }
    if model is None:
        model, built_tokenizer = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
        tokenizer = tokenizer or built_tokenizer
    defaults = dict(
        output_dir=str(output_dir),
        num_generations=4,
        max_completion_length=2,
        per_device_train_batch_size=8,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    args = GroupRelativeConfig(**{**defaults, **config})
    return trainer_class(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=default_dataset(agent) if dataset is None else dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=(peft_config or lora_config()) if peft and model is not None else None,
        **agent,
    )


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]
