"""Reward models in `reward_funcs`: a sequence-classification model, or its folder, scores
prompt + completion with its first logit, loaded and called as TRL 1.16 does."""

import os

import pytest
import torch
from trainer_helpers import digit_sums, logged, make_trainer, odd_first_byte
from transformers import (
    AutoModelForSequenceClassification,
    Qwen3Config,
    Qwen3ForSequenceClassification,
)
from trl_reference import matches_trl

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.rewards.model import RewardModel
from trl_grpo_ext.tiny import build_tiny_tokenizer

PROMPTS = ["1+2=", "a much longer prompt, to pad the others: 2+2="]
COMPLETIONS = ["3", "four, I think"]


def tiny_reward_model(tokenizer, seed=0, num_hidden_layers=2, pad_token_id=None):
    """A random `Qwen3ForSequenceClassification` (one label) on the tiny tokenizer's vocabulary.
    `pad_token_id=None` leaves it to the trainer, as for a checkpoint that has none."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.2,
        num_labels=1,
        pad_token_id=pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForSequenceClassification(config).eval()


def odd_last_character_model(tokenizer):
    """A reward model whose score is +1 when the text's last character is ASCII with an odd
    code point and -1 otherwise. Its blocks add nothing to the residual stream (their output
    projections are zero), so the last hidden state is the last token's embedding, s * ones,
    and the head reads it back: score = s / sqrt(1 + rms_norm_eps)."""
    model = tiny_reward_model(tokenizer, num_hidden_layers=1)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        signs = torch.full((len(tokenizer),), -1.0)
        for token_id in range(len(tokenizer)):
            text = tokenizer.decode([token_id])
            if len(text) == 1 and ord(text) < 128 and ord(text) % 2 == 1:
                signs[token_id] = 1.0
        model.model.embed_tokens.weight.copy_(signs[:, None].expand(-1, hidden))
        model.model.norm.weight.fill_(1.0)
        model.score.weight.fill_(1.0 / hidden)
    return model


def save_reward_model(model, tokenizer, folder):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def config(tmp_path, **kwargs):
    defaults = dict(num_generations=4, per_device_train_batch_size=8, report_to="none")
    return GroupRelativeConfig(str(tmp_path), **{**defaults, **kwargs})


def by_hand(model, tokenizer, text):
    """The first logit, computed from the last hidden state of the unpadded text."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, -1]  # (H,)
        return (hidden @ model.score.weight[0]).item()


# ---------------------------------------------------------------------- scores


def test_scores_are_the_first_logit_on_prompt_plus_completion(tmp_path, tiny_model_dir):
    tokenizer = build_tiny_tokenizer()  # left padding: the reward model pads right anyway
    reward_model = tiny_reward_model(tokenizer)
    trainer = GroupRelativeTrainer(
        tiny_model_dir, [reward_model, odd_first_byte], args=config(tmp_path), train_dataset=digit_sums(),
        reward_processing_classes=[tokenizer, None],
    )  # fmt: skip
    reward = trainer.reward_funcs[0]
    assert isinstance(reward, RewardModel) and reward.processing_class is tokenizer
    assert trainer.reward_processing_classes == [tokenizer, None]
    scores = reward(prompts=PROMPTS, completions=COMPLETIONS, trainer_state=trainer.state)
    expected = [by_hand(reward_model, tokenizer, p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == 2
    assert reward(prompts=[], completions=[]) == []
    # The trainer learnt the pad token that a right-padded batch is pooled by.
    assert reward_model.config.pad_token_id == tokenizer.pad_token_id
    assert not reward_model.training
    assert not any(p.requires_grad for p in reward_model.parameters())


def test_a_hand_built_reward_model_scores_the_last_character(tiny_model_dir, tmp_path):
    tokenizer = build_tiny_tokenizer()
    folder = save_reward_model(odd_last_character_model(tokenizer), tokenizer, tmp_path / "rm")
    trainer = GroupRelativeTrainer(
        tiny_model_dir, folder, args=config(tmp_path), train_dataset=digit_sums()
    )
    completions = ["a", "ab", "no", "yes!", "x" * 9 + "y"]  # a, b, o, !, y: 97, 98, 111, 33, 121
    scores = trainer.reward_funcs[0](prompts=["q"] * 5, completions=completions)
    assert scores == pytest.approx([1, -1, 1, 1, 1], abs=1e-5)
    assert trainer.reward_names == ["rm"]  # TRL's name: the last part of the model's path


def test_conversational_prompts_are_scored_through_the_reward_models_chat_template(
    tmp_path, tiny_model_dir
):
    tokenizer = build_tiny_tokenizer()
    reward_model = tiny_reward_model(tokenizer)
    trainer = GroupRelativeTrainer(
        tiny_model_dir,
        reward_model,
        args=config(tmp_path),
        train_dataset=digit_sums(),
        reward_processing_classes=tokenizer,
    )
    prompts = [[{"role": "user", "content": "2+2="}], [{"role": "user", "content": "1+1="}]]
    completions = [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "2"}]]
    reward = trainer.reward_funcs[0]
    texts = reward.texts(prompts, completions)
    assert texts[0] == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    scores = reward(prompts=prompts, completions=completions)
    assert scores == pytest.approx([by_hand(reward_model, tokenizer, t) for t in texts], abs=1e-5)


@matches_trl
def test_scores_equal_trl_grpo_trainers(tmp_path, tiny_model_dir):
    import trl

    tokenizer = build_tiny_tokenizer()
    folder = save_reward_model(tiny_reward_model(tokenizer), tokenizer, tmp_path / "rm")
    theirs = trl.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=folder,
        args=trl.GRPOConfig(
            str(tmp_path / "trl"), use_cpu=True, bf16=False, num_generations=4,
            per_device_train_batch_size=8, report_to="none",
        ),
        train_dataset=digit_sums(),
    )  # fmt: skip
    ours = GroupRelativeTrainer(
        tiny_model_dir, folder, args=config(tmp_path / "ours"), train_dataset=digit_sums()
    )
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    replies = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    for prompts, completions in ((PROMPTS, COMPLETIONS), (chats, replies)):
        rows = [{"prompt": prompt} for prompt in prompts]
        expected = theirs._calculate_rewards(rows, prompts, completions, None)[:, 0].tolist()
        assert ours.reward_funcs[0](prompts=prompts, completions=completions) == pytest.approx(
            expected, abs=1e-6
        )
    assert ours.reward_names == theirs.reward_func_names


# ---------------------------------------------------------------------- arguments and errors


def test_registry_names_still_resolve_next_to_a_reward_model_folder(tmp_path, tiny_model_dir):
    tokenizer = build_tiny_tokenizer()
    folder = save_reward_model(tiny_reward_model(tokenizer), tokenizer, tmp_path / "my-rm")
    trainer = GroupRelativeTrainer(
        tiny_model_dir, ["format", folder, "trl_grpo_ext.rewards.length:length_reward"],
        args=config(tmp_path), train_dataset=digit_sums(),
    )  # fmt: skip
    assert trainer.reward_names == ["format", "my-rm", "length_reward"]
    assert [type(f) is RewardModel for f in trainer.reward_funcs] == [False, True, False]
    # Loaded as TRL loads it: one label, the tokenizer of its own folder.
    assert trainer.reward_funcs[1].model.config.num_labels == 1
    assert trainer.reward_processing_classes[1].name_or_path == folder


def test_a_relative_folder_without_a_slash_is_a_reward_model(tmp_path, tiny_model_dir, monkeypatch):
    tokenizer = build_tiny_tokenizer()
    save_reward_model(tiny_reward_model(tokenizer), tokenizer, tmp_path / "my_judge")
    monkeypatch.chdir(tmp_path)
    trainer = GroupRelativeTrainer(
        tiny_model_dir, "my_judge", args=config(tmp_path), train_dataset=digit_sums()
    )
    assert trainer.reward_names == ["my_judge"]


def test_a_model_id_that_is_neither_a_folder_nor_on_the_hub_is_a_clear_error(
    tmp_path, tiny_model_dir
):
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(ValueError, match="not a registered reward and no reward model") as error:
        GroupRelativeTrainer(
            tiny_model_dir,
            "nobody/no-such-reward-model",
            args=config(tmp_path),
            train_dataset=digit_sums(),
        )
    assert "list_rewards" in str(error.value)
    with pytest.raises(ValueError, match="unknown reward 'no_such_reward'.*Hub id"):
        GroupRelativeTrainer(
            tiny_model_dir, "no_such_reward", args=config(tmp_path), train_dataset=digit_sums()
        )


def test_reward_processing_classes_must_match_the_reward_functions(tmp_path, tiny_model_dir):
    tokenizer = build_tiny_tokenizer()
    # TRL's words ("must match"), which its own test checks, with the two numbers
    match = r"reward_processing_classes \(1\) must match the number of reward functions \(2\)"
    with pytest.raises(ValueError, match=match):
        GroupRelativeTrainer(
            tiny_model_dir, [tiny_reward_model(tokenizer), odd_first_byte], args=config(tmp_path), train_dataset=digit_sums(),
            reward_processing_classes=tokenizer,
        )  # fmt: skip
    # A model built in code has no folder to load a tokenizer from.
    with pytest.raises(ValueError, match="pass it as reward_processing_classes"):
        GroupRelativeTrainer(
            tiny_model_dir,
            tiny_reward_model(tokenizer),
            args=config(tmp_path),
            train_dataset=digit_sums(),
        )


def test_a_tokenizer_without_pad_token_gets_its_eos(tmp_path, tiny_model_dir):
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    reward_model = tiny_reward_model(tokenizer, pad_token_id=0)
    trainer = GroupRelativeTrainer(
        tiny_model_dir,
        reward_model,
        args=config(tmp_path),
        train_dataset=digit_sums(),
        reward_processing_classes=tokenizer,
    )
    assert tokenizer.pad_token == tokenizer.eos_token
    assert reward_model.config.pad_token_id == tokenizer.eos_token_id
    scores = trainer.reward_funcs[0](prompts=PROMPTS, completions=COMPLETIONS)
    expected = [by_hand(reward_model, tokenizer, p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert scores == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------------- training


def test_training_with_a_reward_model_raises_its_reward_and_leaves_it_unchanged(tmp_path):
    tokenizer = build_tiny_tokenizer()
    folder = save_reward_model(odd_last_character_model(tokenizer), tokenizer, tmp_path / "rm")
    before = {
        name: tensor.clone()
        for name, tensor in AutoModelForSequenceClassification.from_pretrained(folder)
        .state_dict()
        .items()
    }
    # One-token completions: the last character is the completion's (or the prompt's "=",
    # odd, when the model stops at once), so a random policy scores about 0 on average.
    trainer = make_trainer(
        tmp_path,
        reward_funcs=folder,
        num_generations=8,
        per_device_train_batch_size=32,
        max_completion_length=1,
        max_steps=30,
    )
    trainer.train()
    rewards = logged(trainer, "reward")
    assert logged(trainer, "rewards/rm/mean") == rewards
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= first + 0.8, (first, last)  # rewards are +-1; measured: -0.23 -> 0.97
    after = trainer.reward_funcs[0].model.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
