"""Full fine-tunes of models saved under converted weight names (a LLaVA-style vision-language
model here) resume from their checkpoint's weights and load their best checkpoint at the end,
where `transformers.Trainer` alone would match none of the saved weights and go on from the
weights it had."""

import pytest
import torch
from datasets import Dataset
from PIL import Image
from safetensors.torch import load_file, save_file
from trainer_helpers import make_trainer

from trl_grpo_ext.resume_weights import load_full_weights, saved_weight_names
from trl_grpo_ext.tiny_vlm import tiny_vlm_and_processor
from trl_grpo_ext.tiny_vlm_task import COLORS


def first_character_is_odd(completions, **kwargs):
    texts = [completion[-1]["content"] for completion in completions]
    return [float(ord(text[0]) % 2) if text else 0.0 for text in texts]


def vlm_full_fine_tune(output_dir, evaluate=False, **config):
    model, processor = tiny_vlm_and_processor(seed=0, initializer_range=0.2)
    rows = [
        {
            "prompt": [{"role": "user", "content": "Which color?"}],
            "image": Image.new("RGB", (20, 30), color),
        }
        for color in COLORS.values()
    ] * 2
    dataset = Dataset.from_list(rows)
    return make_trainer(
        output_dir,
        model=model,
        tokenizer=processor,
        reward_funcs=first_character_is_odd,
        dataset=dataset,
        eval_dataset=dataset if evaluate else None,
        peft=False,
        num_generations=4,
        max_completion_length=4,
        per_device_train_batch_size=4,
        **config,
    )


def weights(trainer):
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


def test_the_checkpoint_holds_converted_names_that_load_state_dict_would_miss(tmp_path):
    trainer = vlm_full_fine_tune(tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    saved = saved_weight_names(str(tmp_path / "checkpoint-1"))
    assert saved and not saved & set(trainer.model.state_dict())  # none under the model's names


def test_a_full_fine_tune_resumes_from_its_checkpoints_weights(tmp_path):
    # A second iteration on the first step's samples: the resumed step compares the restored
    # weights with the sampling policy, so from the initial weights its loss would be 0.
    run = dict(max_steps=3, num_iterations=2, save_strategy="steps", save_steps=1)
    straight = vlm_full_fine_tune(tmp_path / "straight", **run)
    straight.train()
    resumed = vlm_full_fine_tune(tmp_path / "resumed", **run)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-1"))

    def losses(trainer):
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    # the first step's entry comes back with the checkpoint's trainer state
    assert losses(resumed) == losses(straight) and losses(straight)[1] != 0.0
    after, again = weights(straight), weights(resumed)
    assert all(torch.equal(after[name], again[name]) for name in after)


def test_the_best_checkpoint_of_a_full_fine_tune_is_loaded_at_the_end(tmp_path):
    trainer = vlm_full_fine_tune(
        tmp_path,
        max_steps=3,
        save_strategy="steps",
        save_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_reward",
        greater_is_better=False,  # any checkpoint will do: the test compares weights
        evaluate=True,
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    reference = type(trainer.model).from_pretrained(best, dtype=torch.float32).state_dict()
    now = weights(trainer)
    assert all(torch.equal(now[name], reference[name]) for name in now)


def test_weights_that_do_not_fit_are_an_error_and_change_nothing(tmp_path):
    trainer = vlm_full_fine_tune(tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    folder = tmp_path / "checkpoint-1"
    state = load_file(folder / "model.safetensors")
    dropped = sorted(state)[0]
    del state[dropped]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    before = weights(trainer)
    with pytest.raises(ValueError, match="do not fit LlavaForConditionalGeneration"):
        load_full_weights(trainer.model, str(folder))
    now = weights(trainer)
    assert all(torch.equal(now[name], before[name]) for name in now)


def test_models_saved_under_their_own_names_are_left_to_the_trainer(tmp_path):
    from trl_grpo_ext.tiny import tiny_model_and_tokenizer

    model, _ = tiny_model_and_tokenizer(seed=0)
    model.save_pretrained(tmp_path)
    assert not load_full_weights(model, str(tmp_path))  # the names match: nothing to convert
    assert not load_full_weights(model, str(tmp_path / "nothing"))  # no weights there


def test_a_mixture_of_experts_checkpoint_loads_into_fused_experts(tmp_path):
    # Qwen3-MoE keeps its experts fused in memory and saves them one by one, as on the Hub.
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=16,
        moe_intermediate_size=8,
        num_experts=2,
        num_experts_per_tok=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    trained = Qwen3MoeForCausalLM(config)
    torch.manual_seed(1)
    model = Qwen3MoeForCausalLM(config)
    trained.save_pretrained(tmp_path)
    assert not saved_weight_names(str(tmp_path)) <= set(model.state_dict())  # per expert
    assert load_full_weights(model, str(tmp_path))
    expected = trained.state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())
