"""Override `compute_objective`: add an entropy bonus to the clipped surrogate."""

import torch
from toy_task import closeness, digit_sum_dataset, lora_config, tiny_policy

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.logprobs import token_logprobs
from trl_grpo_ext.objective import policy_loss


# --8<-- [start:subclass]
class EntropyBonusTrainer(GroupRelativeTrainer):
    """loss = policy_loss - entropy_coef * (mean entropy of the completion tokens).

    A sketch for loss_type="dapo": both terms are sums over tokens divided by the token count of
    the optimizer step, so gradient accumulation and several processes stay exact.
    """

    entropy_coef = 0.01

    def compute_objective(self, model, batch):
        completion_ids, mask = batch["completion_ids"], batch["completion_mask"]  # (B, T) each
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            logits_to_keep=completion_ids.shape[1] + 1,
        ).logits[:, :-1]  # (B, T, V): the logits at position t predict completion token t
        logps, entropy = token_logprobs(
            logits, completion_ids, temperature=self.args.temperature, return_entropy=True
        )  # (B, T) each
        tokens = batch["num_items_in_batch"] / self.args.world_size
        loss, stats = policy_loss(
            logps, batch.get("old_logps"), batch["advantages"], mask,
            self.loss_settings,  # loss_type, clip range, beta, ... read from self.args once
            ref_logps=batch.get("ref_logps"), num_items_in_batch=tokens,
        )  # fmt: skip
        entropy_bonus = (entropy * mask).sum() / tokens
        metrics = {key: value.item() for key, value in stats.items()}
        metrics["entropy"] = ((entropy * mask).sum() / mask.sum().clamp(min=1)).item()
        return loss - self.entropy_coef * entropy_bonus, metrics

    # --8<-- [end:subclass]


model, tokenizer = tiny_policy()
args = GroupRelativeConfig(
    output_dir="runs/entropy-bonus",
    num_generations=4,
    max_completion_length=2,
    per_device_train_batch_size=16,
    loss_type="dapo",
    max_steps=1,
    logging_steps=1,
    report_to="none",
)
trainer = EntropyBonusTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=closeness,
    args=args,
    train_dataset=digit_sum_dataset(),
    peft_config=lora_config(),
)
trainer.train()
assert all(torch.isfinite(torch.tensor(log["loss"])) for log in trainer.state.log_history[:-1])
