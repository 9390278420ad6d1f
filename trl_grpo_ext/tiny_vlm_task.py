"""A synthetic visual task that the tiny VLM (`tiny_vlm.py`) cannot solve from the text alone.

Every prompt is the same question, "Color?", about a picture that is either red or blue (each
channel jittered, so no two pictures are alike); the answer is the color's name. The text never
says which: a model that does not look at the picture is right half the time at best.

`warm_up_format` teaches the answer's format only: supervised steps on the same prompts whose
target is a color drawn independently of the picture, so the model learns to answer `red` or
`blue` and then stop, but nothing about which. After it, greedy held-out accuracy
(`heldout_accuracy`) is at chance; GRPO with `says_the_color` as the reward must then raise it,
which it can only do by reading the image features.
"""

from __future__ import annotations

import random

import torch
from PIL import Image

COLORS = {"red": (220, 30, 30), "blue": (30, 30, 220)}
PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}]
JITTER = 30  # per channel, in 0..255


def color_picture(name: str, rng: random.Random, size: int = 16) -> Image.Image:
    """A plain picture of the color `name`, each channel moved by up to `JITTER`."""
    rgb = tuple(min(255, max(0, v + rng.randint(-JITTER, JITTER))) for v in COLORS[name])
    return Image.new("RGB", (size, size), rgb)


def color_rows(count: int, seed: int = 0, balanced: bool = False) -> list[dict]:
    """`count` dataset rows in TRL's format: the prompt, an `image` and its `answer`.

    `balanced=True` alternates the colors (red, blue, red, ...): read in order
    (`shuffle_dataset=False`), every generation batch of an even number of prompts asks for
    both colors equally, so no step rewards one answer whatever the picture, a step that can
    collapse a run onto always giving that answer."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        name = list(COLORS)[index % len(COLORS)] if balanced else rng.choice(list(COLORS))
        rows.append({"prompt": PROMPT, "image": color_picture(name, rng), "answer": name})
    return rows


def says_the_color(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion is exactly the picture's color."""
    return [float(c[0]["content"].strip() == target) for c, target in zip(completions, answer)]


def _prompt_text(processor) -> str:
    return processor.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)


def warm_up_format(
    model, processor, steps: int = 40, batch_size: int = 16, learning_rate: float = 3e-3, seed=0
) -> float:
    """Supervised steps on `<prompt> <color><eos>` with the color drawn independently of the
    picture (cross-entropy on the answer only): the format, not the skill. Returns the last
    loss; the model is left in eval mode."""
    tokenizer = processor.tokenizer
    text = _prompt_text(processor)
    rng = random.Random(seed + 1000)  # pictures and targets apart from the GRPO rows
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    loss = torch.tensor(float("nan"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            pictures = [[color_picture(rng.choice(list(COLORS)), rng)] for _ in range(batch_size)]
            targets = [rng.choice(list(COLORS)) + tokenizer.eos_token for _ in range(batch_size)]
            batch = processor(
                text=[text + target for target in targets],
                images=pictures,
                return_tensors="pt",
                padding=True,
                padding_side="left",
            )
            labels = batch["input_ids"].clone()  # (B, L), left-padded: answers at the end
            for row, target in enumerate(targets):
                length = len(tokenizer(target, add_special_tokens=False)["input_ids"])
                labels[row, :-length] = -100
            loss = model(**batch, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    model.eval()
    return loss.item()


@torch.no_grad()
def heldout_accuracy(model, processor, count: int = 64, seed: int = 0) -> float:
    """Greedy accuracy on `count` held-out pictures (their own seed stream)."""
    rows = color_rows(count, seed=seed + 2000)
    text = _prompt_text(processor)
    batch = processor(
        text=[text] * count,
        images=[[row["image"]] for row in rows],
        return_tensors="pt",
        padding=True,
        padding_side="left",
    )
    was_training = model.training
    model.eval()
    output = model.generate(**batch, max_new_tokens=6, do_sample=False)
    model.train(was_training)
    prompt_length = batch["input_ids"].shape[1]
    answers = processor.tokenizer.batch_decode(output[:, prompt_length:], skip_special_tokens=True)
    return sum(a.strip() == row["answer"] for a, row in zip(answers, rows)) / count


def color_dataset(
    num_rows: int, split: str = "train", seed: int = 0, system_prompt: str | None = None
):
    """The task as a `datasets.Dataset` with `prompt`, `image` and `answer` columns (the
    vision-language recipe's `dataset_name: tiny_colors`). `split="train"` alternates the colors
    (`color_rows(balanced=True)`); any other split draws its own pictures from the held-out
    stream that `heldout_accuracy` reads. A `system_prompt` goes before the question."""
    from datasets import Dataset

    if split == "train":
        rows = color_rows(num_rows, seed=seed, balanced=True)
    else:
        rows = color_rows(num_rows, seed=seed + 2000)
    if system_prompt:
        for row in rows:
            system = {"role": "system", "content": [{"type": "text", "text": system_prompt}]}
            row["prompt"] = [system, *row["prompt"]]
    return Dataset.from_list(rows)


def save_warmed_up_tiny_vlm(folder: str, seed: int = 0, steps: int = 40) -> str:
    """The tiny VLM after `warm_up_format` (the answer's format, not the skill), saved with its
    processor to `folder` unless a finished save is there already; returns `folder`. The
    initialisation (`initializer_range=0.2`) is the one the learning test measured."""
    import os

    from .tiny_vlm import tiny_vlm_and_processor

    done = os.path.join(folder, "warmed_up")
    if os.path.exists(done):
        return folder
    model, processor = tiny_vlm_and_processor(seed=seed, initializer_range=0.2)
    if steps:
        warm_up_format(model, processor, steps=steps, seed=seed)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    with open(done, "w") as handle:  # written last: a folder without it is an interrupted save
        handle.write(f"seed={seed} steps={steps}\n")
    return folder
