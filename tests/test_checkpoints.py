"""Checkpoints, resume, saving and the Hub push."""

import json
import os

import pytest
import torch
import yaml
from trainer_helpers import make_trainer
from transformers import TrainerCallback

from trl_grpo_ext.checkpoints import last_complete_checkpoint
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

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
