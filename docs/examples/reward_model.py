"""A reward model next to a reward function: its folder (or Hub id) goes in `reward_funcs`."""

import torch
from toy_task import digit_sum_dataset, exact, lora_config, tiny_policy
from transformers import Qwen3Config, Qwen3ForSequenceClassification

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer

model, tokenizer = tiny_policy()

# A stand-in for a trained reward model such as "Skywork/Skywork-Reward-V2-Qwen3-0.6B": a tiny
# sequence-classification model with one label, saved with its tokenizer (here the policy's).
config = Qwen3Config(
    vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_labels=1,
)  # fmt: skip
Qwen3ForSequenceClassification(config).save_pretrained("tiny-judge")
tokenizer.save_pretrained("tiny-judge")

# --8<-- [start:reward_model]
args = GroupRelativeConfig(
    output_dir="runs/reward-model",
    num_generations=4,
    max_completion_length=3,
    per_device_train_batch_size=16,
    max_steps=2,
    reward_weights=[1.0, 0.5],
    logging_steps=1,
    report_to="none",
)
trainer = GroupRelativeTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=[exact, "tiny-judge"],  # a function and a reward model's folder or Hub id
    args=args,
    train_dataset=digit_sum_dataset(),
    peft_config=lora_config(),
)
trainer.train()
print(trainer.state.log_history[0]["rewards/tiny-judge/mean"])  # named after the folder
# --8<-- [end:reward_model]

# The reward is the model's first logit on prompt + completion, in its own tokens.
judge = trainer.reward_funcs[1]
ids = judge.processing_class("2+3=5", add_special_tokens=False, return_tensors="pt")["input_ids"]
with torch.no_grad():
    by_hand = judge.model(input_ids=ids).logits[0, 0].item()
assert abs(judge(prompts=["2+3="], completions=["5"])[0] - by_hand) < 1e-5
