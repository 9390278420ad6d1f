"""Checkpoints, resume, saving and the Hub push."""

import json
import os
import shutil
import warnings

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from trainer_helpers import digit_sums, logged, make_trainer
from transformers import TrainerCallback

from trl_grpo_ext.checkpoints import (
    RolloutState,
    last_complete_checkpoint,
    load_rollout_state,
    save_rollout_state,
)
from trl_grpo_ext.generation.async_rollout import GeneratedBatch, InFlightBatch
from trl_grpo_ext.generation.transformers_engine import generation_seed
from trl_grpo_ext.tiny import build_tiny_tokenizer, tiny_model_and_tokenizer

RUN = dict(max_steps=4, save_strategy="steps", save_steps=2, learning_rate=1e-2)


def trained_weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def assert_same_weights(first, second):
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    trainer = make_trainer(tmp_path_factory.mktemp("straight"), **RUN)
    trainer.train()
    return trainer, trained_weights(trainer)


class StopAfter(TrainerCallback):
    """Ends training after `step` optimizer steps, as a killed job would (after its save)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def test_resume_continues_the_same_run(tmp_path, straight_run):
    _, straight = straight_run
    first = make_trainer(tmp_path, **RUN)
    first.add_callback(StopAfter(2))
    first.train()
    assert first.state.global_step == 2
    second = make_trainer(tmp_path, **RUN)
    second.train(resume_from_checkpoint=os.path.join(tmp_path, "checkpoint-2"))
    assert second.state.global_step == 4
    assert_same_weights(straight, trained_weights(second))


def test_a_checkpoint_killed_while_writing_leaves_the_previous_one_usable(tmp_path, straight_run):
    _, straight = straight_run
    trainer = make_trainer(tmp_path, **RUN)
    original = trainer._save_rng_state

    def killed_at_step_4(output_dir):
        if trainer.state.global_step == 4:
            raise KeyboardInterrupt("killed while writing the checkpoint")
        original(output_dir)

    trainer._save_rng_state = killed_at_step_4
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    partial = tmp_path / "checkpoint-4"
    assert partial.is_dir() and not (partial / "trainer_state.json").exists()
    with pytest.warns(UserWarning, match="interrupted"):
        assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        make_trainer(tmp_path, **RUN).train(resume_from_checkpoint=str(partial))
    resumed = make_trainer(tmp_path, **RUN)
    with pytest.warns(UserWarning, match="interrupted"):
        resumed.train(resume_from_checkpoint=True)
    assert_same_weights(straight, trained_weights(resumed))
    assert partial.is_dir()  # the user's files are never deleted


def test_save_model_writes_the_adapter_tokenizer_and_card(tmp_path, straight_run):
    trainer, _ = straight_run
    trainer.save_model(str(tmp_path / "final"))
    files = set(os.listdir(tmp_path / "final"))
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "README.md",
    } <= files
    assert not any(name.startswith("model") for name in files)  # no full weights under LoRA
    card = (tmp_path / "final" / "README.md").read_text()
    metadata = yaml.safe_load(card.split("---")[1])
    assert metadata["library_name"] == "peft"
    assert {"grpo", "trl_grpo_ext"} <= set(metadata["tags"])
    assert "odd_first_byte" in card and "| `loss_type` | dapo |" in card

    with open(tmp_path / "final" / "adapter_config.json") as handle:
        assert json.load(handle)["peft_type"] == "LORA"

    from peft import PeftModel  # the adapter loads back onto a fresh base with PEFT

    base, _ = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "final"))
    trained = dict(trainer.model.named_parameters())
    for name, param in loaded.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(param, trained[name])


def test_push_to_hub_uploads_exactly_adapter_tokenizer_and_card(tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    calls = {}

    def fake_create_repo(self, repo_id, private=None, **kwargs):
        calls["create"] = (repo_id, private)

    def fake_upload_folder(self, repo_id, folder_path, **kwargs):
        calls["files"] = sorted(os.listdir(folder_path))
        calls["card"] = open(os.path.join(folder_path, "README.md")).read()
        calls["repo_id"] = repo_id

    monkeypatch.setattr(HfApi, "create_repo", fake_create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", fake_upload_folder)
    trainer = make_trainer(
        tmp_path, max_steps=2, save_strategy="steps", save_steps=1,
        hub_model_id="someone/tiny-grpo", hub_private_repo=True,
    )  # fmt: skip
    trainer.train()
    trainer.model_card_sections["Before and after"] = "| model | accuracy |\n|---|---|"
    trainer.push_to_hub()
    assert calls["create"] == ("someone/tiny-grpo", True)
    assert calls["files"] == sorted(
        ["README.md", "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja",
         "tokenizer.json", "tokenizer_config.json"]
    )  # fmt: skip
    assert "## Before and after" in calls["card"]
    metadata = yaml.safe_load(calls["card"].split("---")[1])
    assert metadata["library_name"] == "peft" and "grpo" in metadata["tags"]


def test_checkpoints_are_not_pushed_and_the_token_is_not_saved(tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    uploads = []
    from huggingface_hub import RepoUrl

    def create_repo(self, repo_id=None, *args, **kwargs):
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kwargs: uploads.append(kwargs))
    trainer = make_trainer(
        tmp_path, max_steps=2, save_strategy="steps", save_steps=1, push_to_hub=True,
        hub_model_id="someone/tiny", hub_token="hf_secret_value",
    )  # fmt: skip
    trainer.train()
    assert uploads == []  # the base Trainer would push every checkpoint
    for folder, _, names in os.walk(tmp_path):
        for name in names:
            assert b"hf_secret_value" not in open(os.path.join(folder, name), "rb").read(), name
    trainer.model_card_datasets = ["openai/gsm8k"]
    trainer.push_to_hub()
    (pushed,) = uploads
    assert pushed["repo_id"] == "someone/tiny"


# ----------------------------------------------------------------------------- rollout state

# Generation windows of 4 optimizer steps (4 micro-batches, each trained on twice) over 4 prompts:
# one window per epoch, so the 6 steps also cross an epoch (checkpoint 4).
WINDOW = dict(
    max_steps=6,
    gradient_accumulation_steps=2,
    steps_per_generation=4,
    num_iterations=2,
    learning_rate=3e-3,  # small enough that the second pass over a micro-batch is not all clipped
    per_device_train_batch_size=4,
    num_generations=4,
    save_strategy="steps",
    save_steps=1,
)


def first_byte(completions, **kwargs):
    """The first character's code point / 100: groups rarely tie, so every step trains."""
    return [ord(completion[0]) / 100 if completion else 0.0 for completion in completions]


# Asynchronous rollouts one step ahead: 2 prompts per step, 4 steps per epoch over 9 prompts.
ASYNC = dict(
    max_steps=6,
    max_staleness=1,
    reward_funcs=first_byte,
    per_device_train_batch_size=8,
    num_generations=4,
    save_strategy="steps",
    save_steps=1,
)


def step_logs(trainer):
    """The per-step log entries (loss and metrics), without the run summary and `step_time`,
    a wall-clock time."""
    return [
        {key: value for key, value in entry.items() if key != "step_time"}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]


def straight(folder, config, dataset):
    trainer = make_trainer(folder, dataset=dataset, **config)
    trainer.train()
    return trainer, trained_weights(trainer), folder


def resumed(folder, checkpoint, config, dataset, **overrides):
    trainer = make_trainer(
        folder, dataset=dataset, **{**config, "save_strategy": "no", **overrides}
    )
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return trainer


def assert_identical_runs(step, straight_run, resumed_trainer, ignore=()):
    trainer, weights, _ = straight_run
    resumed_weights = trained_weights(resumed_trainer)
    different = [name for name in weights if not torch.equal(weights[name], resumed_weights[name])]
    assert not different, f"resumed from step {step}: {len(different)} tensors differ"

    def logs(run):
        return [{k: v for k, v in entry.items() if k not in ignore} for entry in step_logs(run)]

    assert logs(resumed_trainer) == logs(trainer), f"resumed from step {step}"


@pytest.fixture(scope="module")
def window_run(tmp_path_factory):
    return straight(tmp_path_factory.mktemp("window"), WINDOW, digit_sums(2))


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    return straight(tmp_path_factory.mktemp("async"), ASYNC, digit_sums(3))


def test_resume_inside_a_generation_window_is_bit_identical(tmp_path, window_run):
    """Checkpoints 1-3 and 5 fall inside a window: the buffered rollouts, not new ones, are
    trained on after the resume. (Before the fix, steps 1, 2, 3, 5 differed by up to 1e-2.)"""
    trainer, _, folder = window_run
    assert all(norm > 0 for norm in logged(trainer, "grad_norm"))  # every step trains
    for step in range(1, 6):
        run = resumed(tmp_path / str(step), folder / f"checkpoint-{step}", WINDOW, digit_sums(2))
        assert_identical_runs(step, window_run, run)


def test_asynchronous_resume_is_bit_identical(tmp_path, async_run):
    """The batch in flight at each checkpoint (sampled by weights one step older) comes back from
    the checkpoint; the batches after it are sampled by the same weights versions as before."""
    trainer, _, folder = async_run
    assert all(norm > 0 for norm in logged(trainer, "grad_norm"))
    # Step 4 starts an epoch: its batch was not known one step ahead, so it is fresh.
    assert logged(trainer, "async/staleness") == [0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    for step in range(1, 6):
        run = resumed(tmp_path / str(step), folder / f"checkpoint-{step}", ASYNC, digit_sums(3))
        assert_identical_runs(step, async_run, run)


def test_resume_between_logging_steps_keeps_the_metrics_gathered_since_the_last_log(tmp_path):
    """Checkpoint 3 falls between logs: the metrics of step 3 (its rewards and loss terms) are
    saved and logged at step 4 with those of step 4. Only the Trainer's own `loss`, which it
    does not checkpoint, averages over step 4 alone."""
    config = {**WINDOW, "logging_steps": 2}
    run = straight(tmp_path / "straight", config, digit_sums(2))
    again = resumed(
        tmp_path / "resumed", tmp_path / "straight" / "checkpoint-3", config, digit_sums(2)
    )
    assert_identical_runs(3, run, again, ignore=("loss",))


def test_checkpoint_files_hold_the_buffered_micro_batches_and_in_flight_prompts(
    window_run, async_run
):
    _, _, folder = window_run
    with open(folder / "checkpoint-1" / "rollout_buffer.json") as handle:
        manifest = json.load(handle)
    keys = ["input_ids", "attention_mask", "completion_ids", "completion_mask", "advantages"]
    keys += ["old_logps", "num_items_in_batch"]
    assert [entry["keys"] for entry in manifest["micro_batches"]] == [keys] * 4
    assert all(entry["values"] == {} for entry in manifest["micro_batches"])  # all tensors
    tensors = load_file(folder / "checkpoint-1" / "rollout_buffer.safetensors")
    assert set(tensors) == {f"micro_batch.{i}.{key}" for i in range(4) for key in keys}
    assert tensors["micro_batch.0.input_ids"].shape == (
        4,
        tensors["micro_batch.0.input_ids"].shape[1],
    )
    for step in range(2):  # each micro-batch carries the completion tokens of its optimizer step
        masks = [tensors[f"micro_batch.{i}.completion_mask"] for i in (2 * step, 2 * step + 1)]
        for i in (2 * step, 2 * step + 1):
            assert tensors[f"micro_batch.{i}.num_items_in_batch"].shape == ()
            assert tensors[f"micro_batch.{i}.num_items_in_batch"] == sum(m.sum() for m in masks)
    # Checkpoint 4 ends the window: the next step samples afresh, nothing is buffered.
    with open(folder / "checkpoint-4" / "rollout_buffer.json") as handle:
        assert json.load(handle)["micro_batches"] is None

    _, _, folder = async_run
    with open(folder / "checkpoint-2" / "rollout_buffer.json") as handle:
        (in_flight,) = json.load(handle)["in_flight"]
    assert in_flight["index"] == 2 and in_flight["version"] == 1  # sampled after step 1
    assert in_flight["seed"] == generation_seed(0, 0, 2)
    prompts = set(digit_sums(3)["prompt"])
    tokenizer = build_tiny_tokenizer()
    texts = {tokenizer.decode(tokens) for tokens in in_flight["prompt_tokens"]}
    assert len(in_flight["prompt_tokens"]) == 2 and texts <= prompts
    tensors = load_file(folder / "checkpoint-2" / "rollout_buffer.safetensors")
    assert set(tensors) == {
        f"in_flight.2.{name}"
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "behaviour_logps")
    }
    assert tensors["in_flight.2.completion_ids"].shape[0] == 8  # 2 prompts x 4 completions


def test_rollout_state_round_trips_tensors_exactly_and_other_values_as_json(tmp_path):
    micro_batches = [
        {
            "input_ids": torch.tensor([[3, 1, 4]]),
            "logps": torch.randn(1, 3, dtype=torch.bfloat16),
            "mask": torch.tensor([[True, False, True]]),
            "num_items_in_batch": torch.tensor(5.0),
            "prompts": ["1+2="],
            "note": {"round": 2, "scale": 0.5, "extra": None},
        },
        {"input_ids": torch.arange(6).view(2, 3)[1:], "prompts": ["2+2=", "π"]},  # a view
    ]
    generated = GeneratedBatch(7, 5, *(torch.randn(2, 3) for _ in range(4)))
    state = RolloutState(
        global_step=6,
        micro_batches=micro_batches,
        in_flight={7: InFlightBatch([[1, 2], [3]], 11, generated)},
        metrics={"reward": [0.5, float("nan")]},
        staleness_counts={1: 3},
    )
    save_rollout_state(str(tmp_path), state)
    with safe_open(tmp_path / "rollout_buffer.safetensors", "pt") as handle:
        assert sorted(handle.keys()) == sorted(
            [f"micro_batch.0.{k}" for k in ("input_ids", "logps", "mask", "num_items_in_batch")]
            + ["micro_batch.1.input_ids"]
            + [f"in_flight.7.{k}" for k in ("prompt_ids", "prompt_mask", "completion_ids")]
            + ["in_flight.7.behaviour_logps"]
        )
    with open(tmp_path / "rollout_buffer.json") as handle:
        stored = json.load(handle)["micro_batches"]
    assert stored[0]["values"] == {
        "prompts": ["1+2="],
        "note": {"round": 2, "scale": 0.5, "extra": None},
    }
    assert stored[1] == {"keys": ["input_ids", "prompts"], "values": {"prompts": ["2+2=", "π"]}}
    loaded = load_rollout_state(str(tmp_path))
    assert loaded.global_step == 6 and loaded.staleness_counts == {1: 3}
    assert loaded.metrics["reward"][0] == 0.5 and loaded.metrics["reward"][1] != 0.5
    for original, restored in zip(micro_batches, loaded.micro_batches):
        assert list(restored) == list(original)
        for key, value in original.items():
            if isinstance(value, torch.Tensor):
                assert restored[key].dtype == value.dtype and torch.equal(restored[key], value)
            else:
                assert restored[key] == value
    batch = loaded.in_flight[7]
    assert (batch.prompt_tokens, batch.seed, batch.batch.index, batch.batch.version) == (
        [[1, 2], [3]], 11, 7, 5,
    )  # fmt: skip
    assert torch.equal(batch.batch.behaviour_logps, generated.behaviour_logps)

    with pytest.raises(TypeError, match=r"micro-batch 0, key 'rows'.*set"):
        save_rollout_state(str(tmp_path), RolloutState(1, [{"rows": {1, 2}}]))
    assert load_rollout_state(str(tmp_path / "elsewhere")) is None


def without_rollout_state(checkpoint, copy_to):
    """A copy of `checkpoint` as an older version wrote it: no rollout files."""
    shutil.copytree(checkpoint, copy_to)
    for name in ("rollout_buffer.json", "rollout_buffer.safetensors"):
        os.remove(copy_to / name)
    return copy_to


def test_a_checkpoint_without_rollout_state_resumes_with_a_warning(tmp_path, window_run):
    _, _, folder = window_run
    inside = without_rollout_state(folder / "checkpoint-2", tmp_path / "checkpoint-2")
    with pytest.warns(UserWarning, match="holds no rollout buffer"):
        run = resumed(tmp_path / "inside", inside, WINDOW, digit_sums(2))
    assert run.state.global_step == 6
    boundary = without_rollout_state(folder / "checkpoint-4", tmp_path / "checkpoint-4")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing is lost at a window's end
        run = resumed(tmp_path / "boundary", boundary, WINDOW, digit_sums(2))
    assert_identical_runs(4, window_run, run)


def test_in_flight_batches_for_other_prompts_are_sampled_again(tmp_path, async_run):
    """Without the data skip, the loader restarts the epoch: the saved batch of step 2 belongs to
    other prompts, so it is not trained on with these."""
    _, _, folder = async_run
    with pytest.warns(UserWarning, match="sampled for other prompts"):
        resumed(tmp_path, folder / "checkpoint-2", ASYNC, digit_sums(3), ignore_data_skip=True)


# ---------------------------------------------------------------- the pushed adapter's base model


def _trainer_on_base_folder(tmp_path, folder, monkeypatch):
    """A trainer whose base model is loaded from `folder` (as the recipe loads a local copy),
    and a fake `hub.push_folder` that copies the staged folder to `tmp_path / "pushed"`."""
    import shutil

    from transformers import AutoModelForCausalLM

    from trl_grpo_ext import hub

    built, tokenizer = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    built.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    pushed = tmp_path / "pushed"
    monkeypatch.setattr(
        hub, "push_folder", lambda staging, **kwargs: shutil.copytree(staging, pushed)
    )
    trainer = make_trainer(
        tmp_path / "run", model=model, tokenizer=tokenizer, hub_model_id="someone/tiny-grpo"
    )
    return trainer, pushed


def _adapter_base(folder):
    with open(os.path.join(folder, "adapter_config.json")) as handle:
        return json.load(handle)["base_model_name_or_path"]


def _card(folder):
    card = (folder / "README.md").read_text()
    return card, yaml.safe_load(card.split("---")[1])


def test_pushed_adapter_names_the_hub_id_of_a_hub_cache_folder_and_loads_from_it(
    tmp_path, monkeypatch
):
    # The base model was loaded from the Hub cache's folder of `someone/tiny-base`.
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--someone--tiny-base"
    snapshot = repo / "snapshots" / commit
    trainer, pushed = _trainer_on_base_folder(tmp_path, snapshot, monkeypatch)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    trainer.push_to_hub()

    assert _adapter_base(pushed) == "someone/tiny-base"
    card, metadata = _card(pushed)
    assert metadata["base_model"] == "someone/tiny-base"
    assert 'AutoPeftModelForCausalLM.from_pretrained("someone/tiny-grpo")' in card
    assert str(snapshot) not in card
    # The adapter saved locally keeps the folder it was trained from, so it loads here as before.
    assert _adapter_base(tmp_path / "run") == str(snapshot)

    # Anyone with `someone/tiny-base` (here: offline, from that cache) loads the pushed adapter
    # with the card's one line, and gets the trained weights.
    from peft import AutoPeftModelForCausalLM

    loaded = AutoPeftModelForCausalLM.from_pretrained(str(pushed), cache_dir=str(cache))
    trained = dict(trainer.model.named_parameters())
    lora = [(name, param) for name, param in loaded.named_parameters() if "lora_" in name]
    assert lora
    for name, param in lora:
        torch.testing.assert_close(param, trained[name])


def test_base_model_id_names_the_hub_model_of_a_local_copy(tmp_path, monkeypatch):
    trainer, pushed = _trainer_on_base_folder(tmp_path, tmp_path / "my-copy", monkeypatch)
    trainer.base_model_id = "someone/tiny-base"
    trainer.push_to_hub()
    assert _adapter_base(pushed) == "someone/tiny-base"
    card, metadata = _card(pushed)
    assert metadata["base_model"] == "someone/tiny-base"
    assert "[`someone/tiny-base`](https://huggingface.co/someone/tiny-base)" in card
    assert _adapter_base(tmp_path / "run") == str(tmp_path / "my-copy")
    assert _card(tmp_path / "run")[1]["base_model"] == "someone/tiny-base"


def test_a_local_base_model_is_never_presented_as_a_hub_id(tmp_path, monkeypatch):
    folder = tmp_path / "my-copy"
    trainer, pushed = _trainer_on_base_folder(tmp_path, folder, monkeypatch)
    with pytest.warns(UserWarning, match=r"local folder .*trainer.base_model_id"):
        trainer.push_to_hub()
    card, metadata = _card(pushed)
    assert "base_model" not in metadata
    assert f"a base model in a local folder (`{folder}`), not a Hub id" in card
    # The card does not offer the one-line load that would look for the folder on the Hub ...
    assert "AutoPeftModelForCausalLM" not in card
    # ... but loading onto the same base weights, which works.
    assert 'PeftModel.from_pretrained(base, "someone/tiny-grpo")' in card


def test_base_model_hub_id():
    from trl_grpo_ext.hub import base_model_hub_id

    assert base_model_hub_id("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert base_model_hub_id("gpt2") == "gpt2"
    assert base_model_hub_id("/gone/models--a--b/snapshots/c") is None  # no such folder
    assert base_model_hub_id("../gone") is None
    assert base_model_hub_id(None) is None and base_model_hub_id("") is None
    assert base_model_hub_id(".", given="owner/name") == "owner/name"
    assert base_model_hub_id(".") is None  # an existing folder is never a Hub id
