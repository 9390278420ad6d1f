"""Vision-language GRPO (issue 28): the tiny VLM built in code, the errors that keep a dataset
with images from training on its text alone, and images through the transformers engine."""

import json

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.checkpoints import rollout_state_paths
from trl_grpo_ext.generation.images import (
    concat_rows,
    images_unsupported,
    model_inputs,
    per_sample,
    select_rows,
)
from trl_grpo_ext.tiny_vlm import (
    IMAGE_TOKEN,
    build_tiny_vlm,
    save_tiny_vlm,
    tiny_vlm_and_processor,
)

RED, BLUE = (255, 0, 0), (0, 0, 255)


def image(color, size=(20, 30)):
    return Image.new("RGB", size, color)


def image_prompt(text="Which color?"):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def test_tiny_vlm_round_trips_through_auto_classes(tmp_path):
    """Saved to a folder, model and processor load as a user loads a Hub VLM, and compute the
    same logits as the objects built in memory."""
    model, processor = tiny_vlm_and_processor(seed=0)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded_processor = AutoProcessor.from_pretrained(tmp_path)
    loaded_model = AutoModelForImageTextToText.from_pretrained(tmp_path)
    assert type(loaded_processor).__name__ == "LlavaProcessor"
    assert type(loaded_model).__name__ == "LlavaForConditionalGeneration"
    text = loaded_processor.apply_chat_template(
        image_prompt(), tokenize=False, add_generation_prompt=True
    )
    assert text == f"<|im_start|>user\n{IMAGE_TOKEN}Which color?<|im_end|>\n<|im_start|>assistant\n"
    inputs = loaded_processor(text=[text], images=[[image(RED)]], return_tensors="pt")
    # One `<image>` becomes one token per 8x8 patch of the 16x16 crop.
    assert (inputs["input_ids"] == loaded_processor.image_token_id).sum() == 4
    assert inputs["pixel_values"].shape == (1, 3, 16, 16)
    with torch.no_grad():
        expected = model(**processor(text=[text], images=[[image(RED)]], return_tensors="pt"))
        assert torch.equal(loaded_model(**inputs).logits, expected.logits)
    assert loaded_model.config.image_token_id == loaded_processor.image_token_id


def test_tiny_vlm_sees_the_image_and_is_deterministic():
    """Two colors give two different next-token distributions (the vision tower feeds the
    language model), and the same seed builds the same weights."""
    model, processor = tiny_vlm_and_processor(seed=0)
    text = processor.apply_chat_template(image_prompt(), tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text, text], images=[[image(RED)], [image(BLUE)]], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1]
    assert not torch.allclose(logits[0], logits[1])
    same = build_tiny_vlm(processor, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] <= inputs["input_ids"].shape[1] + 3


# ------------------------------------------------------------------ the trainer with images

COLORS = {"red": RED, "blue": BLUE}


def color_rows(prompt_text="Which color?", column="image", repeat=2):
    """Conversational prompts with one image each, TRL's format: the image in a column."""
    rows = []
    for name, color in COLORS.items():
        value = image(color) if column == "image" else [image(color)]
        rows.append({"prompt": [{"role": "user", "content": prompt_text}], column: value})
        rows[-1]["answer"] = name
    return Dataset.from_list(rows * repeat)


def vlm_trainer(output_dir, dataset=None, processing_class="processor", **config):
    model, processor = tiny_vlm_and_processor(seed=0, initializer_range=0.2)
    if processing_class == "processor":
        processing_class = processor
    elif processing_class == "tokenizer":
        processing_class = processor.tokenizer
    reward_funcs = config.pop("reward_funcs", odd_first_byte_of_message)
    trainer_kwargs = {k: config.pop(k) for k in ("tools", "rollout_func") if k in config}
    defaults = dict(
        output_dir=str(output_dir),
        num_generations=4,
        max_completion_length=3,
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return GroupRelativeTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=GroupRelativeConfig(**{**defaults, **config}),
        train_dataset=color_rows() if dataset is None else dataset,
        processing_class=processing_class,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        **trainer_kwargs,
    )


def odd_first_byte_of_message(completions, **kwargs):
    """1.0 when the completion's first character has an odd code point: a signal in most
    groups of a random model."""
    texts = [completion[0]["content"] for completion in completions]
    return [float(ord(text[0]) % 2) if text else 0.0 for text in texts]


@pytest.mark.parametrize(
    "dataset",
    [
        pytest.param(lambda: color_rows(), id="image-column"),
        pytest.param(lambda: color_rows(column="images"), id="images-column"),
        pytest.param(
            lambda: Dataset.from_list(
                [
                    {
                        "prompt": [
                            {"role": "user", "content": [{"type": "image", "image": image(RED)}]}
                        ]
                    }
                ]
            ),
            id="image-parts",
        ),
    ],
)
def test_images_with_a_tokenizer_are_an_error_not_text_only_training(tmp_path, dataset):
    """Given the processor's tokenizer, the trainer would train on the text alone: it says to
    pass the processor instead."""
    with pytest.raises(ValueError, match=r"train on the text alone.*AutoProcessor"):
        vlm_trainer(tmp_path, dataset(), processing_class="tokenizer")


def test_rollout_func_with_images_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="rollout_func does not receive images"):
        vlm_trainer(tmp_path, rollout_func=lambda prompts, trainer: {})


def test_use_vllm_with_images_is_an_error():
    """vLLM is not installed here: the check itself, as the constructor runs it."""
    assert "use_vllm=True" in images_unsupported(use_vllm=True)
    assert images_unsupported(use_vllm=False) is None


def test_image_prompts_must_be_conversational(tmp_path):
    dataset = Dataset.from_list([{"prompt": "Which color?", "image": image(RED)}])
    with pytest.raises(ValueError, match="must be conversational"):
        vlm_trainer(tmp_path, dataset)


def test_a_processor_no_longer_fails_at_construction_and_trains_on_text(tmp_path):
    """TRL's error case: a `LlavaProcessor` as processing_class, with a text-only dataset."""
    text = Dataset.from_list([{"prompt": [{"role": "user", "content": "Hi"}]}] * 2)
    trainer = vlm_trainer(tmp_path, text, max_steps=1)
    trainer.train()
    assert trainer.state.global_step == 1


def test_images_ride_along_per_completion(tmp_path):
    """Each completion's prompt ids hold its image's expanded tokens; its pixel values are its
    own image's; the image token is suppressed and never sampled; rewards receive the image
    column and the prompts with their image parts."""
    seen = {}

    def reward(prompts, completions, image, answer, **kwargs):
        seen.update(prompts=prompts, image=image, answer=answer)
        return [0.0] * len(completions)

    trainer = vlm_trainer(tmp_path, reward_funcs=reward)
    processor = trainer.processing_class
    rows = [trainer.train_dataset[0], trainer.train_dataset[1]]  # red, blue
    rollout = trainer.generate_rollouts(rows)
    assert trainer.rollouts.generation_config.suppress_tokens == [processor.image_token_id]
    assert not (rollout.completion_ids == processor.image_token_id).any()
    assert ((rollout.prompt_ids == processor.image_token_id).sum(1) == 4).all()
    pixel_values = rollout.image_inputs["pixel_values"]  # (N, 1, 3, 16, 16)
    assert pixel_values.shape == (8, 1, 3, 16, 16)
    assert rollout.image_inputs["pixel_values:count"].tolist() == [1] * 8
    for row, color in zip((0, 4), ("red", "blue")):
        expected = processor.image_processor(images=[image(COLORS[color])], return_tensors="pt")
        assert torch.equal(
            pixel_values[row : row + 4, 0], expected["pixel_values"].expand(4, -1, -1, -1)
        )
    trainer.score_rollouts(rollout)
    assert seen["answer"] == ["red"] * 4 + ["blue"] * 4
    assert all(isinstance(value, Image.Image) for value in seen["image"])
    assert seen["prompts"][0][0]["content"][0]["type"] == "image"


def test_the_vision_tower_runs_in_generation_and_in_every_training_forward_pass(tmp_path):
    """2 steps, each one generation batch (2 prompts x 4 completions) in 2 micro-batches of 4:
    the vision tower runs once per generation (the prompts' pass, in eval mode) and in each of
    the 4 training forward passes, each time on exactly its rows' images."""
    trainer = vlm_trainer(tmp_path, gradient_accumulation_steps=2, max_steps=2)
    calls = []

    def record(module, args, kwargs, output):
        pixel_values = kwargs.get("pixel_values", args[0] if args else None)
        calls.append((module.training, pixel_values.shape[0]))

    vision = trainer.model.get_base_model().model.vision_tower
    vision.register_forward_hook(record, with_kwargs=True)
    before = {n: p.detach().clone() for n, p in vision.named_parameters()}
    trainer.train()
    # generation: 2 prompts, one image each; training: 4 completions per micro-batch
    assert calls == [(False, 2), (True, 4), (True, 4)] * 2
    assert not any(p.requires_grad for p in vision.parameters())
    assert all(torch.equal(before[n], p) for n, p in vision.named_parameters())


def test_lora_goes_on_the_language_model_only(tmp_path):
    trainer = vlm_trainer(tmp_path)
    trainable = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("language_model" in name for name in trainable)
    assert any("language_model.layers.0.mlp.down_proj.lora_A" in name for name in trainable)


def test_training_with_images_updates_the_adapters_and_evaluates(tmp_path):
    trainer = vlm_trainer(tmp_path, max_steps=3)
    trainer.train()
    assert any(entry.get("grad_norm", 0) > 0 for entry in trainer.state.log_history)
    metrics = trainer.evaluate(color_rows(repeat=1))
    assert "eval_reward" in metrics


def test_resume_inside_a_generation_window_with_images_is_bit_identical(tmp_path):
    """The buffered micro-batches, pixel values included, go into the checkpoint: resumed from
    step 1 (inside a window of 2 steps), the run ends with the same weights and logs."""
    window = dict(
        max_steps=2,
        steps_per_generation=2,
        num_iterations=1,
        save_strategy="steps",
        save_steps=1,
        learning_rate=3e-3,
    )
    straight = vlm_trainer(tmp_path / "straight", **window)
    straight.train()
    stored, _ = rollout_state_paths(str(tmp_path / "straight" / "checkpoint-1"))
    assert load_file(stored)["micro_batch.0.image_inputs.pixel_values"].shape == (4, 1, 3, 16, 16)
    resumed = vlm_trainer(tmp_path / "resumed", **{**window, "save_strategy": "no"})
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-1"))

    def weights(trainer):
        return {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}

    first, second = weights(straight), weights(resumed)
    assert all(torch.equal(first[name], second[name]) for name in first)

    def logs(trainer):
        return [
            {k: v for k, v in entry.items() if k != "step_time"}
            for entry in trainer.state.log_history
            if "loss" in entry
        ]

    assert logs(resumed) == logs(straight)  # step 1 comes back with the trainer state


# ------------------------------------------------------------ the asynchronous worker


def expected_pixel_values(processor, rows):
    """Each row's own image through the processor: `(rows, 3, 16, 16)`."""
    values = [processor.image_processor(images=[row["image"]], return_tensors="pt") for row in rows]
    return torch.cat([value["pixel_values"] for value in values])


def test_the_process_worker_samples_with_the_images():
    """The rollout worker's process gets the processor's fields: it samples what the model
    samples in this process with the same images and seed, and other images give other
    log-probs."""
    from transformers import GenerationConfig

    from trl_grpo_ext.generation.process_worker import ProcessEngine, sample_batch

    model, processor = tiny_vlm_and_processor(seed=0, initializer_range=0.2)
    text = processor.apply_chat_template(image_prompt(), tokenize=False, add_generation_prompt=True)
    config = GenerationConfig(
        do_sample=True, temperature=1.0, max_new_tokens=4, num_return_sequences=3, pad_token_id=0
    )

    def inputs(colors):
        images = [[image(color)] for color in colors]
        encoded = processor(text=[text] * len(colors), images=images, return_tensors="pt")
        prompt_ids, prompt_mask = encoded.pop("input_ids"), encoded.pop("attention_mask")
        return prompt_ids, prompt_mask, dict(encoded)

    engine = ProcessEngine(model)
    try:
        ids, mask, fields = inputs([RED, BLUE])
        *_, completion_ids, logps = engine.generate(ids, mask, config, 7, image_inputs=fields)
        *_, other_ids, other_logps = engine.generate(ids, mask, config, 7, *inputs([BLUE, RED])[2:])
    finally:
        engine.close()
    *_, local_ids, local_logps = sample_batch(model.eval(), (ids, mask), config, 7, fields)
    assert torch.equal(completion_ids, local_ids)  # 1 CPU thread there: log-probs round apart
    torch.testing.assert_close(logps, local_logps, rtol=1e-5, atol=1e-5)
    assert (logps - other_logps).abs().max() > 1e-2


class Recording(GroupRelativeTrainer):
    """Keeps the rollouts `generate_rollouts` returns (in every mode, the asynchronous one
    included), with the rows they were asked for."""

    def generate_rollouts(self, rows):
        rollout = super().generate_rollouts(rows)
        self.recorded = [*getattr(self, "recorded", []), (rows, rollout)]
        return rollout


def test_with_max_staleness_each_completion_carries_its_own_image(tmp_path):
    """Rollouts sampled ahead by the rollout worker (a process of its own) carry each prompt's
    own pixel values into training, as synchronous ones do; the adapters train."""
    trainer = vlm_trainer(tmp_path, max_steps=3, max_staleness=1)
    trainer.__class__ = Recording
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "async/staleness" in entry]
    assert [entry["async/staleness"] for entry in steps] == [0.0, 1.0, 1.0]
    # Sampled by the same weights, the worker's log-probs are the trainer's, which see the images,
    # but for the image token, never sampled: the worker's distribution is renormalised without
    # it (about 1/V of the mass, -log(1 - 1/V) ~ 0.003 here), the trainer's is not
    assert steps[0]["sampling/sampling_logp_difference/max"] < 1e-2
    assert any(entry["grad_norm"] > 0 for entry in steps)
    processor = trainer.processing_class
    assert len(trainer.recorded) == 3
    for rows, rollout in trainer.recorded:
        expected = expected_pixel_values(processor, rows).repeat_interleave(4, dim=0)
        assert torch.equal(rollout.image_inputs["pixel_values"][:, 0], expected)
        assert ((rollout.prompt_ids == processor.image_token_id).sum(1) == 4).all()
        assert not (rollout.completion_ids == processor.image_token_id).any()


def test_asynchronous_resume_with_images_is_bit_identical(tmp_path):
    """The batch in flight at a checkpoint comes back from it, identified by its prompt tokens
    and its images; resumed, the run ends with the same weights and logs. The same prompts with
    other images are sampled again, with a warning."""
    run = dict(max_steps=3, max_staleness=1, save_strategy="steps", save_steps=1)
    straight = vlm_trainer(tmp_path / "straight", **run)
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-1"
    _, manifest = rollout_state_paths(str(checkpoint))
    with open(manifest) as handle:
        in_flight = json.load(handle)["in_flight"]
    assert in_flight and all(entry["images"] for entry in in_flight)

    def weights(trainer):
        return {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}

    def logs(trainer):
        return [
            {k: v for k, v in entry.items() if k != "step_time"}
            for entry in trainer.state.log_history
            if "loss" in entry
        ]

    resumed = vlm_trainer(tmp_path / "resumed", **{**run, "save_strategy": "no"})
    resumed.train(resume_from_checkpoint=str(checkpoint))
    first, second = weights(straight), weights(resumed)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert logs(resumed) == logs(straight)

    swapped = color_rows().map(
        lambda row: {"image": image(BLUE if row["answer"] == "red" else RED)}
    )
    other = vlm_trainer(tmp_path / "other", swapped, **{**run, "save_strategy": "no"})
    with pytest.warns(UserWarning, match="sampled for other prompts"):
        other.train(resume_from_checkpoint=str(checkpoint))


# ------------------------------------------------------------------ per-sample fields


def test_per_sample_fields_slice_to_each_rows_own_images():
    """Prompts with 1 and 2 images, 2 completions each: any slice of rows gives the model
    exactly the images of those rows, in order; per-token fields extend over the completion."""
    pixel_values = torch.arange(3.0).reshape(3, 1, 1, 1).expand(3, 3, 2, 2)  # images 0, 1, 2
    token_type_ids = torch.tensor([[0, 0, 1], [1, 1, 0]])
    fields = {"pixel_values": pixel_values, "token_type_ids": token_type_ids}
    rows = per_sample(fields, [1, 2], prompt_length=3, group_size=2)
    assert rows["pixel_values"].shape == (4, 2, 3, 2, 2)
    assert rows["pixel_values:count"].tolist() == [1, 1, 2, 2]
    inputs = model_inputs({k: v[1:3] for k, v in rows.items()}, completion_length=2)
    assert inputs["pixel_values"][:, 0, 0, 0].tolist() == [0.0, 1.0, 2.0]
    assert inputs["token_type_ids"].tolist() == [[0, 0, 1, 0, 0], [1, 1, 0, 0, 0]]


def test_a_vlm_folder_loads_with_its_processor(tmp_path):
    """A model given by folder (or Hub id) loads as TRL loads it: `AutoModelForImageTextToText`
    and, without a processing_class, `AutoProcessor`."""
    folder = save_tiny_vlm(tmp_path / "tiny-vlm")
    trainer = GroupRelativeTrainer(
        model=folder,
        reward_funcs=odd_first_byte_of_message,
        args=GroupRelativeConfig(output_dir=str(tmp_path / "out"), report_to="none"),
        train_dataset=color_rows(),
    )
    assert type(trainer.model).__name__ == "LlavaForConditionalGeneration"
    assert type(trainer.processing_class).__name__ == "LlavaProcessor"


def test_old_and_reference_logprobs_see_the_images(tmp_path):
    """With num_iterations=2 (old log-probs) and beta > 0 under LoRA (reference log-probs with
    the adapters disabled), each no-gradient pass runs the vision tower on its chunk's images:
    per step, generation (2 prompts), old and reference passes (4 rows each), then 2 training
    micro-batches of 4 rows, each trained on twice (num_iterations)."""
    trainer = vlm_trainer(
        tmp_path, num_iterations=2, beta=0.1, gradient_accumulation_steps=2, max_steps=2
    )
    calls = []

    def record(module, args, kwargs, output):
        pixel_values = kwargs.get("pixel_values", args[0] if args else None)
        calls.append((module.training, pixel_values.shape[0]))

    trainer.model.get_base_model().model.vision_tower.register_forward_hook(
        record, with_kwargs=True
    )
    trainer.train()
    no_grad = [(False, 2)] + [(False, 4)] * 4  # generation; old: 2 chunks; reference: 2 chunks
    assert calls == no_grad + [(True, 4)] * 2 + [(True, 4)] * 2


def test_mixed_batches_and_dynamic_sampling_keep_each_rows_images(tmp_path):
    """A batch where one prompt has an image and one has none samples both (the text row has
    no pixel values), and dynamic sampling, which joins and selects groups of several sampling
    rounds, trains with each group's own images."""
    mixed = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "Which color?"}], "images": [image(RED)]},
            {"prompt": [{"role": "user", "content": "No image"}], "images": []},
        ]
    )
    trainer = vlm_trainer(tmp_path, mixed)
    rollout = trainer.generate_rollouts([mixed[0], mixed[1]])
    assert rollout.image_inputs["pixel_values:count"].tolist() == [1] * 4 + [0] * 4
    assert (
        (rollout.prompt_ids == trainer.processing_class.image_token_id).sum(1) > 0
    ).tolist() == [True] * 4 + [False] * 4
    dynamic = vlm_trainer(tmp_path / "dynamic", dynamic_sampling=True, max_steps=2)
    dynamic.train()
    assert dynamic.state.global_step == 2


def test_joined_rollouts_keep_each_rows_images():
    """`concat_rows` (dynamic sampling joins rounds): per-image fields padded to the most
    entries, per-token fields left-padded to the wider prompts, each row's own values kept."""
    one = per_sample(
        {"pixel_values": torch.full((1, 3, 2, 2), 1.0), "token_type_ids": torch.tensor([[1, 0]])},
        [1],
        prompt_length=2,
    )
    two = per_sample(
        {
            "pixel_values": torch.stack([torch.full((3, 2, 2), 2.0), torch.full((3, 2, 2), 3.0)]),
            "token_type_ids": torch.tensor([[1, 1, 0]]),
        },
        [2],
        prompt_length=3,
    )
    joined = concat_rows([one, two], [2, 3], 3)
    assert joined["pixel_values"].shape == (2, 2, 3, 2, 2)
    assert joined["token_type_ids"].tolist() == [[0, 1, 0], [1, 1, 0]]
    inputs = model_inputs(select_rows(joined, torch.tensor([1, 0])))
    assert inputs["pixel_values"][:, 0, 0, 0].tolist() == [2.0, 3.0, 1.0]


def test_the_pass_at_k_harness_samples_with_the_images(tmp_path):
    """The harness samples through the trainer's producer: each problem's completions come
    from its own image, the image token is never sampled, and answers are graded per
    problem."""
    from trl_grpo_ext.evaluation import evaluate_on_processes

    trainer = vlm_trainer(tmp_path)
    engine, seen = trainer.rollouts.engine, []
    generate = engine.generate

    def recording(prompt_ids, prompt_mask, generation_config, seed=None, image_inputs=None):
        seen.append((image_inputs["pixel_values"], generation_config.suppress_tokens))
        outputs = generate(prompt_ids, prompt_mask, generation_config, seed, image_inputs)
        assert not (outputs[2] == trainer.processing_class.image_token_id).any()
        return outputs

    engine.generate = recording
    dataset = color_rows(repeat=1)
    report = evaluate_on_processes(trainer, dataset, max_new_tokens=4, num_samples=2)
    assert report.num_problems == 2 and report.num_samples == 2
    assert report.greedy_lenient == 0.0  # "red" and "blue" are not numbers math_accuracy grades
    expected = expected_pixel_values(trainer.processing_class, list(dataset))
    token = trainer.processing_class.image_token_id
    assert [torch.equal(values, expected) for values, _ in seen] == [True, True]  # greedy, pass@k
    assert all(suppressed == [token] for _, suppressed in seen)
    assert 0 < report.mean_completion_tokens <= 4
