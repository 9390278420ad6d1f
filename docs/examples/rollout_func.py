"""A `rollout_func` (TRL's contract): the function samples the rollouts, the trainer trains on them.

Here it samples each completion with the policy's own `generate`, then appends a note from a
checker that the model did not write: `env_mask` marks it 0, so it gets no gradient, and the
checker's verdict goes to the reward function as an extra field. Runs with the tiny model.
"""

import torch
from toy_task import digit_sum_dataset

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

model, tokenizer = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
seen = []


# --8<-- [start:rollout_func]
def rollout_func(prompts, trainer):
    """One completion per entry of `prompts`, which holds each prompt num_generations times."""
    seen.append(prompts)
    tokenizer = trainer.processing_class
    policy = trainer.accelerator.unwrap_model(trainer.model)
    eos = tokenizer.eos_token_id
    output = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "env_mask": [], "digit": []}
    for prompt in prompts:
        prompt_ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            sequence = policy.generate(torch.tensor([prompt_ids]), do_sample=True, max_new_tokens=3)
        sampled = sequence[0, len(prompt_ids) :].tolist()
        sampled = sampled[: sampled.index(eos)] if eos in sampled else sampled
        is_digit = tokenizer.decode(sampled)[:1].isdigit()
        note = tokenizer(" [checked]", add_special_tokens=False)["input_ids"] + [eos]
        output["prompt_ids"].append(prompt_ids)
        output["completion_ids"].append(sampled + note)
        output["env_mask"].append([1] * len(sampled) + [0] * len(note))  # 0: not the model's
        output["digit"].append(is_digit)  # any other key reaches the reward functions
    return output  # "logprobs": None, as sampled in process by the current policy


def starts_with_a_digit(completions, digit, **kwargs):
    return [1.0 if d else 0.0 for d in digit]


args = GroupRelativeConfig(
    output_dir="runs/rollout-func",
    num_generations=4,
    per_device_train_batch_size=8,
    max_completion_length=16,
    max_steps=1,
    logging_steps=1,
    report_to="none",
)
trainer = GroupRelativeTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=starts_with_a_digit,
    args=args,
    train_dataset=digit_sum_dataset(),
    rollout_func=rollout_func,
)
trainer.train()
print(trainer.state.log_history[0]["rewards/starts_with_a_digit/mean"])
# --8<-- [end:rollout_func]

prompts = seen[0]
assert len(prompts) == 8 and all(p == prompts[i - i % 4] for i, p in enumerate(prompts))
assert len(set(prompts)) == 2  # 2 prompts, each 4 times in a row
log = trainer.state.log_history[0]
assert log["completions/max_length"] <= 3  # the model's tokens only, not the checker's note
assert log["completions/clipped_ratio"] == 0.0  # each completion ends with the note's eos
