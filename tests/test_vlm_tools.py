"""Images in tool results (issue 28): a tool returns content parts with an image; the processor
renders and tokenises the result (image placeholders expanded), the model sees the image in the
turns that follow and in every training forward pass, and the result's tokens stay out of the
loss."""

import pytest
import torch
from agent_helpers import needs_trl_1_16
from datasets import Dataset
from test_vlm import RED, image, vlm_trainer

from trl_grpo_ext.generation.images import COMPLETION, concat_rows, model_inputs

pytestmark = needs_trl_1_16

GREEN = (0, 255, 0)
CALL = '<tool_call>\n{"name": "screenshot", "arguments": {}}\n</tool_call>'
RESULT_TEXT = "Here is the screenshot"


def screenshot() -> list:
    """
    Takes a screenshot and returns it.

    Returns:
        A list of content blocks with the screenshot image.
    """
    return [{"type": "image", "image": image(GREEN)}, {"type": "text", "text": RESULT_TEXT}]


def text_rows(repeat=1):
    return Dataset.from_list([{"prompt": [{"role": "user", "content": "Look."}]}] * repeat)


def tool_trainer(tmp_path, dataset=None, **config):
    defaults = dict(
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=200,
        max_steps=1,
        tools=[screenshot],
    )
    return vlm_trainer(
        tmp_path, text_rows() if dataset is None else dataset, **{**defaults, **config}
    )


def turn(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def script_turns(trainer, second=None):
    """The engine writes the first turn of each rollout: the even ones call `screenshot`, the
    odd ones answer "No." (as TRL's test of tools returning images). Later turns (after a tool
    result) are `second`'s text, or, without it, sampled by the model. Records each call's
    contexts and image fields."""
    engine = trainer.rollouts.engine
    tokenizer = trainer.processing_class.tokenizer
    generate, calls = engine.generate, []

    def scripted(prompt_ids, prompt_mask, config, seed=None, image_inputs=None):
        contexts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        calls.append({"contexts": contexts, "image_inputs": image_inputs})
        first = all("<tool_response>" not in tokenizer.decode(c) for c in contexts)
        if not first and second is None:
            output = generate(prompt_ids, prompt_mask, config, seed, image_inputs)
            calls[-1]["sampled"] = output[2]
            return output
        group = config.num_return_sequences or 1
        rows = [
            turn(tokenizer, (CALL if i % 2 == 0 else "No.") if first else second)
            for i in range(len(contexts) * group)
        ]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        repeat = prompt_ids.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
        return *repeat, ids, None

    engine.generate = scripted
    return calls


def record_vision_tower(trainer):
    """`(training, pixel_values)` of each call of the vision tower."""
    calls = []

    def record(module, args, kwargs, output):
        pixel_values = kwargs.get("pixel_values", args[0] if args else None)
        calls.append((module.training, pixel_values.detach().clone()))

    vision = trainer.model.get_base_model().model.vision_tower
    vision.register_forward_hook(record, with_kwargs=True)
    return calls


def pixels(trainer, *images):
    return trainer.processing_class.image_processor(images=list(images), return_tensors="pt")[
        "pixel_values"
    ]


def test_the_tool_image_reaches_generation_and_every_training_forward_pass(tmp_path):
    """The model samples its turn after the result with the tool's image (the vision tower
    runs on its pixel values), and each training forward pass of a micro-batch runs it on its
    rows' tool images."""
    trainer = tool_trainer(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=1)
    calls = script_turns(trainer)
    vision = record_vision_tower(trainer)
    trainer.train()
    green = pixels(trainer, image(GREEN))
    # generation: the first turn scripted, the second sampled by the model with the image
    assert len(calls) == 2 and calls[1]["image_inputs"] is not None
    assert torch.equal(calls[1]["image_inputs"]["pixel_values"], green)
    assert len(calls[1]["contexts"]) == 1  # the rollout that called the tool
    generation = [values for training, values in vision if not training]
    assert generation and all(torch.equal(values, green) for values in generation)
    # training: micro-batches of one row; only the rollout that called the tool has an image
    training = [values for training, values in vision if training]
    assert len(training) == 1 and torch.equal(training[0], green)
    step = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
    assert step[0]["tools/call_frequency"] == pytest.approx(0.5)
    assert step[0]["tools/failure_frequency"] == 0.0


def full_conversation_ids(trainer, prompt, tools, result):
    """What the processor's chat template and the processor make of the whole conversation:
    prompt, the assistant's call, the tool's result, and the next assistant header."""
    messages = [
        *prompt,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "screenshot", "arguments": {}}}
            ],
        },
        {"role": "tool", "name": "screenshot", "content": result},
    ]
    return trainer.processing_class.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )[0]


@pytest.mark.parametrize("prompt_image", [False, True], ids=["text-prompt", "image-prompt"])
def test_rollout_tokens_are_the_processors_across_turns_and_tool_tokens_are_masked(
    tmp_path, prompt_image
):
    """Token-in, token-out across turns: prompt + call + result is exactly what the processor
    makes of the conversation (the result's `<image>` expanded into 4 image tokens), then the
    next turn; the tool mask is 0 on the result (image tokens included), which the micro-batches
    keep out of the loss; each rollout's image fields are its prompt's image, then its tool's."""
    dataset = text_rows()
    if prompt_image:
        dataset = Dataset.from_list(
            [{"prompt": [{"role": "user", "content": "Look."}], "image": image(RED)}]
        )
    trainer = tool_trainer(tmp_path, dataset)
    calls = script_turns(trainer, second="Done!")
    processor = trainer.processing_class
    tokenizer, token = processor.tokenizer, processor.image_token_id
    rollout = trainer.generate_rollouts([dataset[0]])
    prompt = rollout.prompts[0]
    result = [{"type": "image", "image": image(GREEN)}, {"type": "text", "text": RESULT_TEXT}]
    expected = full_conversation_ids(trainer, prompt, [screenshot], result)
    expected += turn(tokenizer, "Done!")
    length = int(rollout.completion_mask[0].sum())
    prompt_ids = rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()
    ids = prompt_ids + rollout.completion_ids[0, :length].tolist()
    assert ids == expected
    completion = rollout.completion_ids[0, :length]
    assert int((completion == token).sum()) == 4  # the tool's <image>, expanded
    assert int((rollout.prompt_ids[0] == token).sum()) == (4 if prompt_image else 0)
    # the tool mask: the call and the answer are the model's, the result (from the eos of the
    # call to the next assistant header) is not
    call, done = turn(tokenizer, CALL), turn(tokenizer, "Done!")
    suffix = length - len(call) - len(done)
    mask = [1] * len(call) + [0] * suffix + [1] * len(done)
    assert rollout.tool_mask[0, :length].tolist() == mask
    assert rollout.tool_mask[0][completion == token].eq(0).all()
    assert rollout.tool_mask[1].eq(1).all()  # "No.": no tool call
    # the second turn was sampled with the rollout's images: the prompt's, then the tool's
    images = [image(RED), image(GREEN)] if prompt_image else [image(GREEN)]
    assert torch.equal(calls[1]["image_inputs"]["pixel_values"], pixels(trainer, *images))
    assert calls[1]["contexts"][0] == expected[: -len(done)]
    counts = rollout.image_inputs["pixel_values:count"].tolist()
    assert counts == ([2, 1] if prompt_image else [1, 0])
    assert torch.equal(
        rollout.image_inputs["pixel_values"][0, : counts[0]], pixels(trainer, *images)
    )
    # training tensors: the result's tokens, image tokens included, get no gradient
    batch = trainer._make_generation_batch([dataset[0]])[0]
    width = batch["completion_ids"].shape[1]
    trained = batch["completion_mask"][0].bool()
    assert not trained[batch["completion_ids"][0] == token].any()
    assert batch["attention_mask"][0, -width:][:length].eq(1).all()  # but they are read
    assert int(trained.sum()) == len(call) + len(done)


def test_a_tool_image_with_a_tokenizer_is_a_clear_error(tmp_path):
    """With the tokenizer as processing_class the image could only reach the model as text:
    the error says to pass the processor."""
    trainer = tool_trainer(tmp_path, processing_class="tokenizer")
    engine = trainer.rollouts.engine
    tokenizer = trainer.processing_class

    def scripted(prompt_ids, prompt_mask, config, seed=None, image_inputs=None):
        ids = torch.tensor([turn(tokenizer, CALL)] * len(prompt_ids) * config.num_return_sequences)
        group = config.num_return_sequences
        return (
            prompt_ids.repeat_interleave(group, 0),
            prompt_mask.repeat_interleave(group, 0),
            ids,
            None,
        )

    engine.generate = scripted
    with pytest.raises(
        ValueError, match="returned an image.*processing_class is a tokenizer.*AutoProcessor"
    ):
        trainer.generate_rollouts([trainer.train_dataset[0]])


def test_per_token_fields_take_the_tool_results_values_over_the_completion():
    """A per-token field (`token_type_ids` of Gemma-3-like processors) is the prompt's, then the
    tool results' values over the completion (`:completion`), zeros elsewhere; rollouts joined
    with others without images get zeros."""
    rows = {
        "pixel_values": torch.ones(1, 1, 3, 2, 2),
        "pixel_values:count": torch.tensor([1]),
        "token_type_ids": torch.tensor([[0, 1]]),
        "token_type_ids" + COMPLETION: torch.tensor([[0, 1, 1]]),
    }
    inputs = model_inputs(rows, completion_length=4)
    assert inputs["token_type_ids"].tolist() == [[0, 1, 0, 1, 1, 0]]
    joined = concat_rows([rows, None], [2, 3], 3, sizes=[1, 2])
    assert joined["pixel_values:count"].tolist() == [1, 0, 0]
    assert joined["token_type_ids"].tolist() == [[0, 0, 1], [0, 0, 0], [0, 0, 0]]
    assert joined["token_type_ids" + COMPLETION].tolist() == [[0, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert model_inputs(joined, 3)["pixel_values"].shape == (1, 3, 2, 2)


class FirstTurnScripted:
    """The rollout worker's engine (a `ProcessEngine`, the model in a process of its own) with
    the first turn of each rollout scripted as in `script_turns`; later turns, with their image
    fields, are sampled by the process."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer, self.image_calls = engine, tokenizer, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt_ids, prompt_mask, config, seed=None, image_inputs=None):
        contexts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        if any("<tool_response>" in self.tokenizer.decode(c) for c in contexts):
            self.image_calls.append(image_inputs)
            return self.engine.generate(prompt_ids, prompt_mask, config, seed, image_inputs)
        group = config.num_return_sequences or 1
        rows = [
            turn(self.tokenizer, CALL if i % 2 == 0 else "No.")
            for i in range(len(contexts) * group)
        ]
        ids = torch.full((len(rows), max(map(len, rows))), self.tokenizer.pad_token_id)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        return (
            prompt_ids.repeat_interleave(group, 0),
            prompt_mask.repeat_interleave(group, 0),
            ids,
            None,
        )


def test_with_max_staleness_the_rollout_worker_carries_the_tool_images(tmp_path, monkeypatch):
    """Asynchronous mode: the tool loop runs on the rollout worker's thread, the worker's
    process samples the turn after the result with the tool's image, and the rollouts reach
    training with it."""
    from trl_grpo_ext.generation import ahead

    build = ahead.build_rollout_engine
    scripted = []

    def build_scripted(args, engine, model):
        built, owned = build(args, engine, model)
        scripted.append(FirstTurnScripted(built, trainer.processing_class.tokenizer))
        return scripted[-1], owned

    monkeypatch.setattr(ahead, "build_rollout_engine", build_scripted)
    trainer = tool_trainer(tmp_path, text_rows(2), max_staleness=1, max_steps=2)
    rollouts = []
    generate_rollouts = trainer.generate_rollouts

    def recording(rows):
        rollouts.append(generate_rollouts(rows))
        return rollouts[-1]

    trainer.generate_rollouts = recording
    vision = record_vision_tower(trainer)
    trainer.train()
    green = pixels(trainer, image(GREEN))
    assert scripted and scripted[0].image_calls
    assert all(torch.equal(call["pixel_values"], green) for call in scripted[0].image_calls)
    assert len(rollouts) == 2
    for rollout in rollouts:
        assert rollout.image_inputs["pixel_values:count"].tolist() == [1, 0]
        assert torch.equal(rollout.image_inputs["pixel_values"][0], green)
    training = [values for training, values in vision if training]
    assert len(training) == 2 and all(torch.equal(values, green) for values in training)


def test_train_with_tools_multimodal_response(tmp_path):
    """TRL's `test_train_with_tools_multimodal_response` (tests/test_grpo_trainer.py), on the
    tiny VLM: a tool returns a list of content blocks with an image; one rollout of two calls
    it, with no failure, and the adapters train (two steps: LoRA's A matrices move from the
    second on). TRL's reward model is a reward that prefers the rollout that looked (more
    messages); TRL's scripted "Done!" is the second turn."""

    def message_count(completions, **kwargs):
        return [float(len(messages)) for messages in completions]

    trainer = tool_trainer(
        tmp_path, text_rows(2), learning_rate=0.1, reward_funcs=message_count, max_steps=2
    )
    script_turns(trainer, second="Done!")
    before = {n: p.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    step = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry][-1]
    assert step["tools/call_frequency"] == pytest.approx(1 / 2)
    assert step["tools/failure_frequency"] == pytest.approx(0.0)
    for name, param in before.items():
        assert not torch.equal(param, trainer.model.get_parameter(name)), f"{name} unchanged"


def test_the_same_as_trl_on_scripted_turns(tmp_path):
    """`trl.GRPOTrainer` and ours on the saved tiny VLM, the same scripted turns (one rollout
    calls `screenshot`, then writes "Done!"; the other answers "No."): the same prompt ids,
    completion ids (the result with its expanded image tokens), tool mask, image fields of the
    turn after the result, and pixel values in the training forward pass."""
    import trl
    from transformers import AutoProcessor

    from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
    from trl_grpo_ext.tiny_vlm import save_tiny_vlm

    folder = save_tiny_vlm(tmp_path / "tiny-vlm")
    tokenizer = AutoProcessor.from_pretrained(folder).tokenizer
    common = dict(
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=200,
        save_strategy="no",
        report_to="none",
        seed=0,
    )

    def message_count(completions, **kwargs):
        return [float(len(messages)) for messages in completions]

    def record_training(model, store):
        def record(module, args, kwargs, output):
            if module.training:
                store.append(kwargs.get("pixel_values", args[0] if args else None).clone())

        model.model.vision_tower.register_forward_hook(record, with_kwargs=True)

    reference = trl.GRPOTrainer(
        model=folder,
        reward_funcs=message_count,
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, **common),
        train_dataset=text_rows(),
        tools=[screenshot],
    )
    trl_fields, trl_pixels, generated = [], [], {}

    def single_turn(ids, images, fields, num_generations, **kwargs):
        if num_generations == 2:  # the first turns
            turns = [turn(tokenizer, CALL), turn(tokenizer, "No.")]
        else:
            trl_fields.append(fields)
            turns = [turn(tokenizer, "Done!")] * len(ids)
        return turns, [[0.0] * len(ids) for ids in turns]

    reference._generate_single_turn = single_turn
    generate = reference._generate

    def recording(prompts):
        generated["output"] = generate(prompts)
        return generated["output"]

    reference._generate = recording
    record_training(reference.model, trl_pixels)
    reference.train()
    trl_prompt_ids, trl_completion_ids, trl_tool_mask = generated["output"][:3]

    ours = GroupRelativeTrainer(
        model=folder,
        reward_funcs=message_count,
        args=GroupRelativeConfig(output_dir=str(tmp_path / "ours"), **common),
        train_dataset=text_rows(),
        tools=[screenshot],
    )
    calls = script_turns(ours, second="Done!")
    rollouts, pixels_ours = [], []
    generate_rollouts = ours.generate_rollouts
    ours.generate_rollouts = lambda rows: rollouts.append(generate_rollouts(rows)) or rollouts[-1]
    record_training(ours.model, pixels_ours)
    ours.train()

    rollout = rollouts[0]
    lengths = rollout.completion_mask.sum(1).tolist()
    assert [ids[m.bool()].tolist() for ids, m in zip(rollout.prompt_ids, rollout.prompt_mask)] == [
        list(ids) for ids in trl_prompt_ids
    ]
    assert [ids[:n] for ids, n in zip(rollout.completion_ids.tolist(), lengths)] == [
        list(ids) for ids in trl_completion_ids
    ]
    assert [mask[:n] for mask, n in zip(rollout.tool_mask.tolist(), lengths)] == trl_tool_mask
    assert torch.equal(calls[1]["image_inputs"]["pixel_values"], trl_fields[0]["pixel_values"])
    assert len(pixels_ours) == len(trl_pixels) == 1
    assert torch.equal(pixels_ours[0], trl_pixels[0])
