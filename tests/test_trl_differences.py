"""Behaviour of trl.GRPOTrainer 1.16 that its own test file checks, run side by side with ours
on the same tiny stand-ins: batch layouts TRL accepts, its warnings and errors, the public
methods its users call in subclasses, entropy regularisation and the MoE router loss."""

from __future__ import annotations

import logging

import pytest
import torch
from datasets import Dataset
from trainer_helpers import make_trainer
from trl_reference import matches_trl

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny import tiny_model_and_tokenizer


def numbered_prompts(count: int) -> Dataset:
    return Dataset.from_list([{"prompt": f"Count to {i}:", "row": i} for i in range(count)])


class GenerationBatches:
    """A reward function that records the dataset rows of each generation batch it scores."""

    __name__ = "generation_batches"

    def __init__(self):
        self.batches: list[list[int]] = []

    def __call__(self, completions, row, **kwargs):
        self.batches.append(list(row))
        return [float(len(completion) % 2) for completion in completions]


STRADDLING = dict(
    per_device_train_batch_size=2,
    num_generations=2,
    steps_per_generation=4,
    gradient_accumulation_steps=3,
    max_completion_length=2,
    max_steps=4,  # 8 micro-batches an epoch (3 steps: 3 + 3 + 2), then one step of epoch two
    learning_rate=1e-2,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
)


@matches_trl
def test_steps_per_generation_not_a_multiple_of_accumulation_samples_as_trl(
    tmp_path, tiny_model_dir
):
    """TRL 1.16 accepts steps_per_generation=4 with gradient_accumulation_steps=3: a generation
    batch every 4 micro-batches, which optimizer steps straddle, and a new one at each epoch."""
    import trl

    theirs_reward, ours_reward = GenerationBatches(), GenerationBatches()
    trl.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=theirs_reward,
        args=trl.GRPOConfig(
            output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, **STRADDLING
        ),
        train_dataset=numbered_prompts(8),
    ).train()
    ours = make_trainer(
        tmp_path / "ours", reward_funcs=ours_reward, dataset=numbered_prompts(8), **STRADDLING
    )
    ours.train()
    # 12 micro-batches: generation batches at 0 and 4 of epoch one, then 0 of epoch two.
    assert (
        [len(rows) for rows in ours_reward.batches]
        == [len(rows) for rows in theirs_reward.batches]
        == [8, 8, 8]
    )
    for batches in (ours_reward.batches, theirs_reward.batches):
        assert sorted(set(batches[0] + batches[1])) == list(range(8))  # one epoch, each once
    losses = [entry["loss"] for entry in ours.state.log_history if "loss" in entry]
    assert len(losses) == 4


def test_a_step_across_two_generation_batches_divides_dapo_by_its_own_tokens(tmp_path):
    """With loss_type='dapo' the second step trains on the last micro-batch of one generation
    batch and the first two of the next: its denominator is the token count of those three."""
    seen = []
    ours = make_trainer(
        tmp_path, dataset=numbered_prompts(8), loss_type="dapo", **{**STRADDLING, "max_steps": 2}
    )
    original = ours.compute_objective

    def recording(model, batch):
        seen.append((int(batch["completion_mask"].sum()), float(batch["num_items_in_batch"])))
        return original(model, batch)

    ours.compute_objective = recording
    ours.train()
    assert len(seen) == 6
    for step in (seen[:3], seen[3:]):
        assert {items for _, items in step} == {float(sum(tokens for tokens, _ in step))}


# ------------------------------------------------------------------ what TRL says, said here too


def trl_trainer(tmp_path, model, reward_funcs, train_dataset, **config):
    import trl

    tokenizer = None if isinstance(model, str) else tiny_model_and_tokenizer()[1]
    settings = dict(
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=2,
        max_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
    )
    return trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), **{**settings, **config}),
        train_dataset=train_dataset,
        processing_class=tokenizer,
    )


def none_for_even_rows(completions, row, **kwargs):
    return [None if r % 2 == 0 else 1.0 for r in row]


def logged_dict(records, start: str) -> dict:
    import ast

    message = next(r.getMessage() for r in records if start in r.getMessage())
    return ast.literal_eval(message.splitlines()[1])


@matches_trl
def test_a_sample_no_reward_function_scores_is_warned_about_with_its_kwargs(
    tmp_path, tiny_model_dir, caplog
):
    start = "All reward functions returned None for the following kwargs:"
    with caplog.at_level(logging.WARNING):
        trl_trainer(tmp_path, tiny_model_dir, none_for_even_rows, numbered_prompts(4)).train()
    theirs = logged_dict(caplog.records, start)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        make_trainer(
            tmp_path / "ours",
            reward_funcs=none_for_even_rows,
            dataset=numbered_prompts(4),
            per_device_train_batch_size=4,
            num_generations=2,
            max_steps=1,
        ).train()
    ours = logged_dict(caplog.records, start)
    assert list(ours) == list(theirs) == ["row", "prompt", "completion"]
    assert ours["row"] % 2 == 0 and ours["prompt"] == f"Count to {ours['row']}:"


@matches_trl
@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo", "cispo", "grpo"])
def test_sequence_level_ratios_with_a_token_summed_loss_are_warned_about(
    tmp_path, tiny_model_dir, caplog, loss_type
):
    start = "When using `importance_sampling_level='sequence'`"
    settings = dict(importance_sampling_level="sequence", loss_type=loss_type)
    with caplog.at_level(logging.WARNING):
        trl_trainer(tmp_path, tiny_model_dir, none_for_even_rows, numbered_prompts(4), **settings)
    theirs = [message(r) for r in caplog.records if start in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        make_trainer(tmp_path / "ours", dataset=numbered_prompts(4), **settings)
    ours = [message(r) for r in caplog.records if start in r.getMessage()]
    assert len(ours) == len(theirs) == (loss_type != "grpo")
    assert ours == theirs


def message(record) -> str:
    """A warning's text without accelerate's rank prefix and TRL's link to its docs."""
    text = record.getMessage().removeprefix("[RANK 0] ")
    return text.split(" (see https")[0].rstrip(".")


@matches_trl
def test_no_train_dataset_nor_environment_is_refused_at_construction(tmp_path):
    """As TRL refuses it, with the same words."""
    model, tokenizer = tiny_model_and_tokenizer()
    expected = "`train_dataset` is required unless an `environment_factory` is provided"
    with pytest.raises(ValueError, match=expected):
        trl_trainer(tmp_path, model, none_for_even_rows, None, report_to=[])
    with pytest.raises(ValueError, match=expected):
        GroupRelativeTrainer(
            model=model,
            reward_funcs=none_for_even_rows,
            args=GroupRelativeConfig(str(tmp_path / "ours"), report_to="none"),
            processing_class=tokenizer,
        )


def half_precision_model(folder, tied: bool) -> str:
    """The tiny model, its output head tied to its input embeddings or not, saved in bfloat16."""
    model, tokenizer = tiny_model_and_tokenizer()
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@matches_trl
@pytest.mark.parametrize("tied", [False, True])
def test_cast_lm_head_to_fp32_casts_the_heads_weights_as_trl(tmp_path, tied):
    folder = half_precision_model(tmp_path / "model", tied)
    settings = dict(
        cast_lm_head_to_fp32=True,
        beta=0.1,  # a reference model, cast too
        model_init_kwargs={"dtype": torch.bfloat16},
    )
    theirs = trl_trainer(tmp_path, folder, none_for_even_rows, numbered_prompts(4), **settings)
    ours = make_trainer(
        tmp_path / "ours",
        model=folder,
        peft=False,
        dataset=numbered_prompts(4),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        **settings,
    )
    ids = torch.tensor([[3, 4, 5]])
    for trainer in (theirs, ours):
        for model in (trainer.model, trainer.ref_model):
            assert model.lm_head.weight.dtype == torch.float32
            assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
            assert model.model.embed_tokens(ids).dtype == torch.bfloat16
            assert model.model.norm.weight.dtype == torch.bfloat16
            assert model(ids).logits.dtype == torch.float32
    ours.train()
    assert ours.model.lm_head.weight.dtype == torch.float32


# ------------------------------------------------------- TRL's public names, for subclasses


def first_char_odd(completions, **kwargs):
    return [float(ord(c[0]) % 2) if c else 0.0 for c in completions]


@matches_trl
def test_trls_public_helpers_give_trls_results(tmp_path, tiny_model_dir):
    import trl

    reward_funcs = [none_for_even_rows, first_char_odd]
    theirs = trl_trainer(tmp_path, tiny_model_dir, reward_funcs, numbered_prompts(4))
    ours = make_trainer(tmp_path / "ours", reward_funcs=reward_funcs, dataset=numbered_prompts(4))
    assert (
        ours.reward_func_names
        == theirs.reward_func_names
        == [
            "none_for_even_rows",
            "first_char_odd",
        ]
    )
    generator = torch.Generator().manual_seed(0)
    entropies = torch.rand(4, 6, generator=generator) * 3  # (B, T)
    mask = (torch.rand(4, 6, generator=generator) > 0.3).long()
    for threshold in (0.0, 0.2, 0.5, 0.8, 1.0):
        assert torch.equal(
            ours.get_high_entropy_mask(entropies, mask, threshold),
            theirs.get_high_entropy_mask(entropies, mask, threshold),
        ), threshold
    advantages = torch.tensor([[1.0], [-0.5], [-1.0], [0.0]])  # (B, 1)
    logps = -torch.rand(4, 6, generator=generator)
    sampling = logps - torch.rand(4, 6, generator=generator) * 0.4
    sampling[2, 1] = float("nan")  # a token the engine could not score
    for threshold in (0.0, 0.1, 0.3):
        args = (advantages, logps, sampling, mask.float(), threshold)
        expected = trl.GRPOTrainer.get_off_policy_mask(*args)
        assert torch.equal(type(ours).get_off_policy_mask(*args), expected)
        assert torch.equal(ours.get_off_policy_mask(*args), expected)


def test_overriding_trls_mask_helpers_changes_the_loss(tmp_path):
    """A subclass that overrides `get_high_entropy_mask` or `get_off_policy_mask`, as TRL users
    do, is what the loss uses: masks that drop every token leave a loss of exactly 0."""
    calls = []

    class DropEverything(GroupRelativeTrainer):
        def get_high_entropy_mask(self, entropies, mask, threshold):
            calls.append(("entropy", threshold))
            return torch.zeros_like(mask, dtype=torch.bool)

        @staticmethod
        def get_off_policy_mask(advantages, per_token_logps, sampling, mask, threshold):
            calls.append(("off_policy", threshold))
            return torch.zeros(len(advantages), 1)

    trainer = make_trainer(
        tmp_path,
        trainer_class=DropEverything,
        max_steps=1,
        top_entropy_quantile=0.2,
        off_policy_mask_threshold=0.3,
    )
    trainer.train()
    assert ("entropy", pytest.approx(0.8)) in calls and ("off_policy", 0.3) in calls
    assert trainer.state.log_history[0]["loss"] == 0.0


# ------------------------------------------------------------------ entropy regularisation


def entropy_runs(tmp_path, tiny_model_dir, **settings):
    """TRL's and our logs of the same short run: one micro-batch per step, so a step's logged
    loss is its micro-batch's."""
    settings = dict(
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        logging_steps=1,
        learning_rate=1e-2,
        **settings,
    )
    theirs = trl_trainer(tmp_path, tiny_model_dir, first_char_odd, numbered_prompts(8), **settings)
    theirs.train()
    ours = make_trainer(
        tmp_path / "ours", reward_funcs=first_char_odd, dataset=numbered_prompts(8), **settings
    )
    ours.train()
    logs = lambda t: [e for e in t.state.log_history if "loss" in e]  # noqa: E731
    return logs(theirs), logs(ours)


@matches_trl
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_a_static_entropy_bonus_logs_trls_policy_loss_at_trls_scale(
    tmp_path, tiny_model_dir, loss_type
):
    """loss = policy_loss - entropy_coef * entropy for every loss type (the bonus is a plain mean
    entropy, never rescaled to a loss type's normalisation), in TRL's logs and ours."""
    theirs, ours = entropy_runs(
        tmp_path, tiny_model_dir, loss_type=loss_type, entropy_coef=0.1, max_steps=1
    )
    for logs in (theirs, ours):
        (log,) = logs
        assert log["entropy_coef"] == pytest.approx(0.1)
        assert log["entropy"] > 1.0  # so that the bonus is visible
        assert log["loss"] == pytest.approx(log["policy_loss"] - 0.1 * log["entropy"], abs=1e-3)


@matches_trl
@pytest.mark.parametrize("target", [100.0, 0.01])
def test_adaptive_entropy_moves_and_applies_the_coefficient_as_trl(
    tmp_path, tiny_model_dir, target
):
    """use_adaptive_entropy: the coefficient rises by entropy_coef_delta each step while the
    entropy is at or below entropy_target (applied from the next step on), and falls to
    entropy_coef_min otherwise (never applied)."""
    theirs, ours = entropy_runs(
        tmp_path,
        tiny_model_dir,
        use_adaptive_entropy=True,
        entropy_coef=0.02,
        entropy_coef_delta=0.05,
        entropy_coef_max=0.2,
        entropy_target=target,
        max_steps=3,
    )
    coefs = [log["entropy_coef"] for log in ours]
    assert coefs == pytest.approx([log["entropy_coef"] for log in theirs])
    if target > 1:
        assert coefs == pytest.approx([0.07, 0.12, 0.17])
    else:
        assert coefs == [0.0, 0.0, 0.0]
    for logs in (theirs, ours):
        applied = [0.0] + ([log["entropy_coef"] for log in logs[:-1]] if target > 1 else [0.0] * 2)
        for log, coef in zip(logs, applied):
            expected = log["policy_loss"] - coef * log["entropy"]
            assert log["loss"] == pytest.approx(expected, abs=1e-3)


def test_adaptive_entropy_state_resumes_from_a_checkpoint(tmp_path):
    """The coefficient moves once per optimizer step (two micro-batches each here), is read as
    TRL's `trainer.entropy_coef`, and a resumed run continues from the checkpoint's
    coefficient."""
    settings = dict(
        gradient_accumulation_steps=2,
        use_adaptive_entropy=True,
        entropy_coef_delta=0.05,
        entropy_target=100.0,
        save_strategy="steps",
        save_steps=2,
        max_steps=2,
    )
    first = make_trainer(tmp_path, **settings)
    first.train()
    assert first.entropy_coef == pytest.approx(0.1)  # TRL's public `trainer.entropy_coef`
    resumed = make_trainer(tmp_path, **{**settings, "max_steps": 3})
    resumed.train(resume_from_checkpoint=True)
    assert [e["entropy_coef"] for e in resumed.state.log_history if "loss" in e][-1] == (
        pytest.approx(0.15)
    )
    assert resumed.entropy_coef == pytest.approx(0.15)


# ------------------------------------------------------------------ MoE router auxiliary loss


def tiny_moe(tmp_path) -> str:
    """A two-layer Qwen3-MoE (4 experts, 2 per token) built from its config, saved with the
    tiny tokenizer; its config declares router_aux_loss_coef 0.001, as Qwen3-MoE's does."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    _, tokenizer = tiny_model_and_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    folder = tmp_path / "moe"
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@matches_trl
@pytest.mark.parametrize(
    ("coef", "expected"), [(None, (0.001, True)), (0.0, (0.0, False)), (0.05, (0.05, True))]
)
def test_router_aux_loss_is_enabled_and_weighted_as_trl(tmp_path, coef, expected):
    folder = tiny_moe(tmp_path)
    settings = dict(router_aux_loss_coef=coef, max_steps=1)
    theirs = trl_trainer(tmp_path, folder, first_char_odd, numbered_prompts(4), **settings)
    ours = make_trainer(
        tmp_path / "ours",
        model=folder,
        peft=False,
        reward_funcs=first_char_odd,
        dataset=numbered_prompts(4),
        per_device_train_batch_size=4,
        num_generations=2,
        **settings,
    )
    for trainer in (theirs, ours):
        assert (trainer.router_aux_loss_coef, trainer.aux_loss_enabled) == expected
    theirs.train()
    ours.train()
    for trainer in (theirs, ours):
        assert ("aux_loss" in trainer.state.log_history[0]) == expected[1]


@matches_trl
def test_router_aux_loss_coef_on_a_dense_model_is_an_error_as_in_trl(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        trl_trainer(
            tmp_path, tiny_model_dir, first_char_odd, numbered_prompts(4), router_aux_loss_coef=0.1
        )
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model.*leave router_aux_loss"):
        make_trainer(tmp_path / "ours", router_aux_loss_coef=0.1)


def test_the_router_aux_loss_is_the_models_own_over_every_row_weighted(tmp_path):
    """The loss of a micro-batch is the policy loss plus router_aux_loss_coef times the aux
    loss that the model itself returns for the micro-batch's rows in full (TRL's definition),
    divided by the accumulation steps; `aux_loss` logs it."""
    from transformers import AutoModelForCausalLM

    folder = tiny_moe(tmp_path)
    checks = []

    class Recording(GroupRelativeTrainer):
        def compute_objective(self, model, batch):
            with torch.no_grad():
                expected = model(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    output_router_logits=True,
                ).aux_loss
            loss, metrics = super().compute_objective(model, batch)
            self.aux_loss_enabled = False
            policy_only, _ = super().compute_objective(model, batch)
            self.aux_loss_enabled = True
            scale = 0.5 / self.current_gradient_accumulation_steps
            checks.append(
                ((loss - policy_only).detach(), scale * expected, metrics["aux_loss"], expected)
            )
            return loss, metrics

    model = AutoModelForCausalLM.from_pretrained(folder)
    trainer = make_trainer(
        tmp_path / "ours",
        model=model,
        tokenizer=tiny_model_and_tokenizer()[1],
        peft=False,
        trainer_class=Recording,
        router_aux_loss_coef=0.5,
        per_device_train_batch_size=4,
        num_generations=2,
        gradient_accumulation_steps=2,
        max_steps=1,
    )
    trainer.train()
    assert len(checks) == 2
    for difference, weighted, logged, expected in checks:
        assert float(expected) > 0
        assert float(difference) == pytest.approx(float(weighted), rel=1e-4)
        assert logged == pytest.approx(float(expected), rel=1e-5)
