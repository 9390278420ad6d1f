"""Quickstart: train the tiny offline model with GRPO and LoRA, save the adapter, load it back.

Runs in seconds on a CPU. For a real model, replace `save_tiny(...)` with a hub id such as
"Qwen/Qwen2.5-0.5B-Instruct" and raise `max_steps`, `max_completion_length` and the batch.
"""

from datasets import Dataset
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny import save_tiny

# 1. A model (a folder or a hub id) and a dataset with a "prompt" column. Every other column,
#    here "answer", is passed to the reward functions.
model_dir = save_tiny("runs/tiny-model", initializer_range=0.2)
dataset = Dataset.from_list(
    [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
)


# 2. A reward function in TRL's convention: keyword arguments, one float (or None) per completion.
def exact_answer(completions, answer, **kwargs):
    return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]


# 3. The configuration: per_device_train_batch_size counts completions, so each step here
#    samples 8 // 4 = 2 prompts with num_generations=4 completions each.
args = GroupRelativeConfig(
    output_dir="runs/quickstart",
    num_generations=4,
    max_completion_length=4,
    per_device_train_batch_size=8,
    learning_rate=1e-2,
    max_steps=2,
    logging_steps=1,
    report_to="none",
)

# 4. Train: only the LoRA adapter is updated.
trainer = GroupRelativeTrainer(
    model=model_dir,
    reward_funcs=exact_answer,
    args=args,
    train_dataset=dataset,
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
)
trainer.train()
print([log["reward"] for log in trainer.state.log_history if "reward" in log])

# 5. Save the adapter (and tokenizer and model card), then load it back on the base model.
trainer.save_model("runs/quickstart/final")
base = AutoModelForCausalLM.from_pretrained(model_dir)
model = PeftModel.from_pretrained(base, "runs/quickstart/final")
