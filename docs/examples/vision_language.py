"""Vision-language GRPO with the tiny offline VLM: TRL's dataset format (an `image` column and
conversational prompts), the model's processor as `processing_class`, LoRA on the language
model. Runs in seconds on a CPU; the model is random, so this shows the wiring, not learning.
"""

from datasets import Dataset
from peft import LoraConfig
from PIL import Image

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny_vlm import save_tiny_vlm

folder = save_tiny_vlm("runs/tiny-vlm")  # stands in for a Hub id such as a Qwen2.5-VL

# --8<-- [start:vlm]
# TRL's format: conversational prompts, the images in an "image" (or "images") column; the
# trainer puts each row's images into its first user message as {"type": "image"} parts.
colors = {"red": (255, 0, 0), "blue": (0, 0, 255)}
dataset = Dataset.from_list(
    [
        {
            "prompt": [{"role": "user", "content": "Which color is the picture?"}],
            "image": Image.new("RGB", (32, 32), rgb),
            "answer": name,
        }
        for name, rgb in colors.items()
    ]
)


def says_the_color(completions, answer, image, **kwargs):
    """Rewards get the same arguments as for text, the image column among them."""
    return [float(target in c[0]["content"]) for c, target in zip(completions, answer)]


trainer = GroupRelativeTrainer(
    model=folder,  # loaded with AutoModelForImageTextToText, its processor with AutoProcessor
    reward_funcs=says_the_color,
    args=GroupRelativeConfig(
        output_dir="runs/vlm-grpo",
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=8,
        max_steps=2,
        report_to="none",
    ),
    train_dataset=dataset,
    # "all-linear" becomes the language model's linear layers: the vision tower stays frozen.
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
)
trainer.train()
# --8<-- [end:vlm]

trainable = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
assert trainable and all("language_model" in name for name in trainable)
assert trainer.state.global_step == 2
