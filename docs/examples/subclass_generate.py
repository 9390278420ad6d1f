"""Override `generate_rollouts`: change what the model sees before it samples."""

from toy_task import closeness, digit_sum_dataset, lora_config, tiny_policy

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer, Rollout


# --8<-- [start:subclass]
class InstructedTrainer(GroupRelativeTrainer):
    """Prefixes every prompt with an instruction before sampling. The reward functions receive
    the prompts as sampled (with the instruction) and the other dataset columns unchanged."""

    instruction = "Answer with one digit. "

    def generate_rollouts(self, rows: list[dict]) -> Rollout:
        rows = [{**row, "prompt": self.instruction + row["prompt"]} for row in rows]
        return super().generate_rollouts(rows)

    # --8<-- [end:subclass]


model, tokenizer = tiny_policy()
args = GroupRelativeConfig(
    output_dir="runs/instructed",
    num_generations=4,
    max_completion_length=2,
    per_device_train_batch_size=16,
    max_steps=1,
    report_to="none",
)
trainer = InstructedTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=closeness,
    args=args,
    train_dataset=digit_sum_dataset(),
    peft_config=lora_config(),
)
rollout = trainer.generate_rollouts([{"prompt": "2+3=", "answer": "5"}])
assert len(rollout) == 4 and rollout.prompts[0] == "Answer with one digit. 2+3="
assert rollout.columns["answer"] == ["5"] * 4
trainer.train()
