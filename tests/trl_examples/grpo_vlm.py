"""GRPO on a vision-language model, written as a TRL user writes it: TRL's classes and calling
conventions only (`TrlParser`, `GRPOConfig`, `GRPOTrainer`, `get_peft_config`), on the math
problems with a picture of `lmms-lab/multimodal-open-r1-8k-verified` (columns `image`,
`problem`, `solution`), or another dataset of those columns (`--dataset_name`).

    accelerate launch tests/trl_examples/grpo_vlm.py \
        --model_name_or_path Qwen/Qwen2.5-VL-3B-Instruct --output_dir grpo-qwen2.5-vl-3b \
        --learning_rate 1e-5 --dtype bfloat16 --max_completion_length 1024 \
        --use_peft --lora_target_modules q_proj v_proj --log_completions

GSPO is the same script with sequence-level importance sampling, e.g.
`--importance_sampling_level sequence --epsilon 3e-4 --epsilon_high 4e-4 --beta 0.0
--loss_type grpo`. `tests/test_trl_vlm_examples.py` runs it on `trl_grpo_ext`'s trainer by
rebinding `GRPOConfig` and `GRPOTrainer` before the `__main__` block.
"""

from __future__ import annotations

import re

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config

DATASET = "lmms-lab/multimodal-open-r1-8k-verified"
MAX_IMAGE_SIDE = 512  # pixels: larger pictures are scaled down, their image tokens add up
NUM_HELD_OUT = 100  # problems kept for evaluation when `eval_strategy` is set

INSTRUCTIONS = (
    "Solve the problem about the picture. Reason step by step inside <think> and </think>, "
    "then write only the final answer after </think>."
)

# A completion in the format the instructions ask for: reasoning in one think block, then an
# answer that is not empty.
THINK_THEN_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*\S.*$", re.DOTALL)
ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def completion_text(completion) -> str:
    """The text of a completion: a string, or (conversational) its assistant messages."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content") or "" for message in completion)


def final_answer(text: str) -> str:
    """What follows the last `</think>` (or the whole text), inside `<answer>` tags if any."""
    answer = text.rsplit("</think>", 1)[-1]
    tagged = ANSWER_TAGS.findall(answer)
    return tagged[-1] if tagged else answer


def normalized(answer: str) -> str:
    """Case, spaces, a trailing full stop, `$` signs and a `\\boxed{}` do not count."""
    answer = answer.strip().strip("$").strip()
    boxed = re.fullmatch(r"\\boxed\{(.*)\}", answer, re.DOTALL)
    if boxed:
        answer = boxed.group(1)
    return " ".join(answer.lower().rstrip(".").split())


def same_answer(predicted: str, expected: str) -> bool:
    if predicted == expected:
        return True
    try:  # "0.50" and "0.5", "2" and "2.0"
        return float(predicted) == float(expected)
    except ValueError:
        return False


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 for a completion that reasons inside `<think>` ... `</think>` and then answers."""
    return [float(bool(THINK_THEN_ANSWER.match(completion_text(c)))) for c in completions]


def accuracy_reward(completions, solution, **kwargs) -> list[float]:
    """1.0 for a completion whose final answer is the row's `solution` (whose `<answer>` tags,
    if any, are dropped), compared after `normalized`."""
    return [
        float(
            same_answer(
                normalized(final_answer(completion_text(completion))),
                normalized(final_answer(expected)),
            )
        )
        for completion, expected in zip(completions, solution)
    ]


def with_prompt(row: dict) -> dict:
    """The row as a conversational prompt: the user message holds the picture (an image part
    that the trainer fills from the `image` column) and the problem; its picture in RGB, at
    most MAX_IMAGE_SIDE pixels on a side."""
    image = row["image"].convert("RGB")
    image.thumbnail((MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))
    user_content = [{"type": "image"}, {"type": "text", "text": row["problem"]}]
    prompt = [
        {"role": "system", "content": [{"type": "text", "text": INSTRUCTIONS}]},
        {"role": "user", "content": user_content},
    ]
    return {"prompt": prompt, "image": image}


def main(script_args, training_args, model_args) -> None:
    # The model is loaded by the trainer from its name or folder, with these arguments.
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }

    # The problems with their pictures (another dataset of the same columns: --dataset_name).
    dataset_name = script_args.dataset_name or DATASET
    dataset = load_dataset(
        dataset_name, script_args.dataset_config, split=script_args.dataset_train_split
    )
    dataset = dataset.map(with_prompt, remove_columns=["problem"])
    eval_dataset = None
    if training_args.eval_strategy != "no":
        split = dataset.train_test_split(test_size=NUM_HELD_OUT, seed=training_args.seed)
        dataset, eval_dataset = split["train"], split["test"]

    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        reward_funcs=[format_reward, accuracy_reward],
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    trainer.train()

    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())
