"""The same VLM script through `trl.GRPOTrainer` and ours, on scripted completions: the prompt
ids (image tokens expanded as TRL expands them), the pixel values each completion is trained
with, and the reward functions' keyword arguments are the same (issue 28)."""

import pytest
import torch
from test_vlm import color_rows
from transformers import AutoProcessor

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny_vlm import save_tiny_vlm

COMMON = dict(
    max_steps=1,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=4,
    save_strategy="no",
    report_to="none",
    logging_steps=1,
    seed=0,
)
COMPLETION = "ab"


def recording_reward(store):
    def reward(prompts, completions, completion_ids, **kwargs):
        for i, answer in enumerate(kwargs["answer"]):
            store.setdefault(answer, []).append(
                {"prompt": prompts[i], "completion": completions[i], "image": kwargs["image"][i]}
            )
        store["keys"] = sorted(kwargs)
        return [0.0] * len(completions)

    return reward


def recording_vision_tower(model, store):
    def record(module, args, kwargs, output):
        if module.training:  # training forward passes only
            store.append(kwargs.get("pixel_values", args[0] if args else None).detach().clone())

    model.model.vision_tower.register_forward_hook(record, with_kwargs=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


def run_trl(folder, output_dir):
    import trl

    tokenizer = AutoProcessor.from_pretrained(folder).tokenizer
    completion = tokenizer(COMPLETION, add_special_tokens=False)["input_ids"]
    completion = completion + [tokenizer.eos_token_id]
    rewards, prompt_ids, pixel_values = {}, [], []
    trainer = trl.GRPOTrainer(
        model=folder,
        reward_funcs=recording_reward(rewards),
        args=trl.GRPOConfig(output_dir=str(output_dir), use_cpu=True, bf16=False, **COMMON),
        train_dataset=color_rows(repeat=1),
    )

    def single_turn(ids, images, multimodal_fields, num_generations, **kwargs):
        prompt_ids.extend(list(map(list, ids)))
        return [completion] * len(ids), [[0.0] * len(completion)] * len(ids)

    trainer._generate_single_turn = single_turn
    recording_vision_tower(trainer.model, pixel_values)
    trainer.train()
    return prompt_ids, torch.cat(pixel_values), rewards


def run_ours(folder, output_dir):
    rewards, prompt_ids, pixel_values = {}, [], []
    trainer = GroupRelativeTrainer(
        model=folder,
        reward_funcs=recording_reward(rewards),
        args=GroupRelativeConfig(output_dir=str(output_dir), **COMMON),
        train_dataset=color_rows(repeat=1),
    )
    tokenizer = trainer.processing_class.tokenizer
    completion = tokenizer(COMPLETION, add_special_tokens=False)["input_ids"]
    completion = torch.tensor(completion + [tokenizer.eos_token_id])

    def scripted(ids, mask, generation_config, seed=None, image_inputs=None):
        group = generation_config.num_return_sequences
        prompt_ids.extend(row[m.bool()].tolist() for row, m in zip(ids, mask))
        ids, mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
        return ids, mask, completion.expand(len(ids), -1).clone(), None

    trainer.rollouts.engine.generate = scripted
    recording_vision_tower(trainer.model, pixel_values)
    trainer.train()
    return (
        [ids for ids in prompt_ids for _ in range(COMMON["num_generations"])],
        torch.cat(pixel_values),
        rewards,
    )


def test_trl_and_ours_see_the_same_prompts_images_and_reward_arguments(folder, tmp_path):
    their_ids, their_pixels, theirs = run_trl(folder, tmp_path / "trl")
    our_ids, our_pixels, ours = run_ours(folder, tmp_path / "ours")
    # Both draw the 2 prompts in their own order: compare them per prompt (its answer).
    for answer in ("red", "blue"):
        assert len(ours[answer]) == len(theirs[answer]) == 2
        for our_call, their_call in zip(ours[answer], theirs[answer]):
            assert our_call["prompt"] == their_call["prompt"]  # image parts injected alike
            assert our_call["completion"] == their_call["completion"]
            assert our_call["image"] == their_call["image"]
    assert ours["keys"] == theirs["keys"]
    image_token = AutoProcessor.from_pretrained(folder).image_token_id
    assert all(ids.count(image_token) == 4 for ids in their_ids)  # one per 8x8 patch
    assert sorted(our_ids) == sorted(their_ids)
    assert our_pixels.shape == their_pixels.shape == (4, 3, 16, 16)
    order = lambda pixels: sorted(pixels.unbind(), key=lambda p: p.sum().item())  # noqa: E731
    for our_row, their_row in zip(order(our_pixels), order(their_pixels)):
        assert torch.equal(our_row, their_row)
