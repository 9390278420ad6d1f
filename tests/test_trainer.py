"""GroupRelativeTrainer end to end on the tiny model: data, rollouts, rewards, LoRA, metrics."""

import asyncio
import logging
import math

import pytest
import torch
from datasets import Dataset
from trainer_helpers import digit_sums, logged, make_trainer, right_digit

from trl_grpo_ext import GroupRelativeTrainer
from trl_grpo_ext.generation.rollout import completion_mask_from_ids
from trl_grpo_ext.scoring import RewardFunctionError
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

# ----------------------------------------------------------------------------- completion masks


def test_completion_mask_ends_at_first_eos_inclusive():
    eos, pad = 9, 0
    completion_ids = torch.tensor([[5, 6, eos, pad], [5, eos, 7, eos], [5, 6, 7, 8]])
    mask, truncated = completion_mask_from_ids(completion_ids, [eos])
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


def test_completion_mask_when_pad_equals_eos():
    eos = 9  # padding after the first eos uses the same id and must not count
    completion_ids = torch.tensor([[5, eos, eos, eos], [eos, eos, eos, eos]])
    mask, truncated = completion_mask_from_ids(completion_ids, [eos])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    assert not truncated.any()


def test_rollout_masks_with_a_tokenizer_whose_pad_is_eos(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    tokenizer.pad_token = tokenizer.eos_token
    trainer = make_trainer(tmp_path, model=model, tokenizer=tokenizer, max_completion_length=6)
    rollout = trainer.generate_rollouts([{"prompt": "1+1="}, {"prompt": "2+0="}])
    eos = tokenizer.eos_token_id
    for ids, mask, truncated in zip(
        rollout.completion_ids, rollout.completion_mask, rollout.is_truncated
    ):
        length = int(mask.sum())
        assert mask[:length].all() and not mask[length:].any()
        if truncated:
            assert length == 6 and eos not in ids.tolist()
        else:
            assert ids[length - 1] == eos and eos not in ids[: length - 1].tolist()


def test_mask_truncated_completions_removes_them_from_the_loss(tmp_path):
    trainer = make_trainer(tmp_path, max_completion_length=1, mask_truncated_completions=True)
    batch = trainer._make_generation_batch([{"prompt": "1+1=", "answer": "2"}] * 2)[0]
    # With one token allowed, only completions that emitted eos at once are kept.
    assert batch["completion_mask"].sum() < batch["completion_mask"].numel()


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_steps_where_every_completion_is_cut_say_that_nothing_trains(
    tmp_path, mask_truncated, caplog
):
    """A policy that stops ending within the cap trains on nothing under overlong filtering:
    said once, naming the two settings to change; without the filtering, nothing to say."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    trainer = make_trainer(
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        max_steps=3,
        mask_truncated_completions=mask_truncated,
        generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]},  # nothing ever ends
    )
    with caplog.at_level(logging.WARNING, logger="trl_grpo_ext.metrics"):
        trainer.train()
    assert logged(trainer, "completions/clipped_ratio") == [1.0, 1.0, 1.0]
    said = [r.getMessage() for r in caplog.records if "nothing" in r.getMessage()]
    if not mask_truncated:
        assert said == []
        return
    assert len(said) == 1
    assert "at step 1 reached max_completion_length (2 tokens)" in said[0]
    assert "mask_truncated_completions=False" in said[0]


# ----------------------------------------------------------------------------- datasets


def test_groups_are_consecutive_and_columns_repeated_per_completion(tmp_path):
    seen = {}

    def record(prompts, completions, completion_ids, answer, level, trainer_state, **kwargs):
        seen.update(prompts=prompts, answer=answer, level=level, ids=completion_ids)
        assert trainer_state is not None
        return [0.0] * len(completions)

    dataset = Dataset.from_list(
        [{"prompt": f"{a}+1=", "answer": str(a + 1), "level": a} for a in range(4)]
    )
    trainer = make_trainer(tmp_path, reward_funcs=record, dataset=dataset)
    rollout = trainer.generate_rollouts([dataset[0], dataset[1]])
    trainer.score_rollouts(rollout)
    assert seen["prompts"] == ["0+1="] * 4 + ["1+1="] * 4
    assert seen["answer"] == ["1"] * 4 + ["2"] * 4
    assert seen["level"] == [0] * 4 + [1] * 4
    assert all(len(ids) == int(n) for ids, n in zip(seen["ids"], rollout.completion_lengths))


def test_conversational_prompts_use_the_chat_template(tmp_path):
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1)}
            for a in range(4)
        ]
    )
    captured = {}

    def record(prompts, completions, **kwargs):
        captured.update(prompts=prompts, completions=completions)
        return [1.0] * len(completions)

    trainer = make_trainer(tmp_path, reward_funcs=record, dataset=dataset)
    rollout = trainer.generate_rollouts([dataset[0]])
    trainer.score_rollouts(rollout)
    text = trainer.processing_class.decode(rollout.prompt_ids[0], skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\n0+1=<|im_end|>\n<|im_start|>assistant\n")
    assert captured["completions"][0][0]["role"] == "assistant"
    assert isinstance(captured["completions"][0][0]["content"], str)


def test_dataset_without_prompt_column_lists_its_columns(tmp_path):
    dataset = Dataset.from_list([{"question": "1+1=", "answer": "2"}])
    with pytest.raises(ValueError, match=r"no 'prompt' column.*\['question', 'answer'\]"):
        make_trainer(tmp_path, dataset=dataset)


@pytest.mark.parametrize(
    "first, later, message",
    [
        (5, None, r"A prompt is 5 \(int\)\. A prompt is a string, or a non-empty list of messages"),
        ([{"content": "hi"}], None, r"A prompt is \[\{'content': 'hi'\}\] \(list\).*'role'"),
        ([], None, r"A prompt is \[\] \(list\)"),
        ("1+1=", None, r"A prompt is None \(NoneType\)"),  # a later row: at its batch
        ("", "", r"The prompt '' has no tokens"),  # the tiny tokenizer adds no BOS
    ],
)
def test_a_prompt_that_is_not_one_is_an_error_that_says_what_a_prompt_is(
    tmp_path, first, later, message
):
    """Rather than a tokenizer's or generate's error about its inputs: at construction for the
    first row, at the first batch that holds it for a later one."""
    dataset = Dataset.from_list([{"prompt": first}, {"prompt": later}] * 2)
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, dataset=dataset, shuffle_dataset=False, max_steps=1).train()


def test_a_batch_that_mixes_strings_and_messages_is_an_error():
    # An Arrow dataset cannot hold both in one column; a list of rows or a generator can.
    from trl_grpo_ext.generation.prompts import check_prompts

    with pytest.raises(ValueError, match="mix strings and lists of messages"):
        check_prompts(["1+1=", [{"role": "user", "content": "2+2="}]])


def test_reward_weights_of_wrong_length(tmp_path):
    with pytest.raises(ValueError, match="reward_weights has 2 entries but there are 1"):
        make_trainer(tmp_path, reward_weights=[1.0, 2.0])


# ----------------------------------------------------------------------------- rewards


def _score(tmp_path, reward_funcs, **config):
    trainer = make_trainer(tmp_path, reward_funcs=reward_funcs, **config)
    rollout = trainer.generate_rollouts([{"prompt": "1+1=", "answer": "2"}])
    return trainer, trainer.score_rollouts(rollout)


def test_none_excludes_a_function_for_that_sample_and_weights_apply(tmp_path):
    def first(completions, **kwargs):
        return [1.0, None, 1.0, None]

    def second(completions, **kwargs):
        return [2.0, 2.0, None, None]

    trainer, rewards = _score(tmp_path, [first, second], reward_weights=[1.0, 0.5])
    assert torch.isnan(rewards[1, 0]) and torch.isnan(rewards[2, 1])
    advantages = trainer.compute_advantages(rewards)
    # Totals: 1 + 1, 0.5 * 2, 1, (all None -> excluded); group of the first three.
    totals = torch.tensor([2.0, 1.0, 1.0])
    expected = (totals - totals.mean()) / (totals.std() + 1e-4)
    torch.testing.assert_close(advantages[:3], expected)
    assert advantages[3] == 0


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([1.0, 1.0], r"'broken' returned 2 values for 4 completions"),
        ([1.0, "yes", 1.0, 1.0], r"'broken' returned 'yes' \(str\) for sample 1"),
        ([1.0, 1.0, [1.0], 1.0], r"'broken' returned \[1.0\] \(list\) for sample 2"),
        (0.5, r"'broken' returned float"),
    ],
)
def test_bad_reward_returns_stop_training_with_the_name_and_sample(tmp_path, returned, message):
    def broken(completions, **kwargs):
        return returned

    with pytest.raises(RewardFunctionError, match=message):
        _score(tmp_path, broken)


def test_a_raising_reward_function_is_named(tmp_path):
    def explodes(completions, **kwargs):
        raise KeyError("solution")

    with pytest.raises(RewardFunctionError, match="'explodes' raised KeyError"):
        _score(tmp_path, explodes)


def test_async_reward_functions_run_concurrently(tmp_path):
    # Each function waits for the other to start: run one after the other, they would time out.
    started = {}

    async def make_barrier():
        return asyncio.Event()

    def make(name, other):
        async def reward(completions, **kwargs):
            started.setdefault("events", {})
            loop_events = started["events"]
            loop_events.setdefault(name, asyncio.Event()).set()
            await asyncio.wait_for(loop_events.setdefault(other, asyncio.Event()).wait(), 5)
            return [1.0] * len(completions)

        reward.__name__ = name
        return reward

    _, rewards = _score(tmp_path, [make("left", "right"), make("right", "left")])
    assert rewards.shape == (4, 2) and torch.all(rewards == 1)


def test_trl_rewards_work_unchanged(tmp_path):
    from trl.rewards import accuracy_reward, think_format_reward

    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"{a}+1="}], "solution": str(a + 1)}
            for a in range(4)
        ]
    )
    trainer = make_trainer(
        tmp_path, reward_funcs=[accuracy_reward, think_format_reward], dataset=dataset
    )
    rollout = trainer.generate_rollouts([dataset[0]])
    rewards = trainer.score_rollouts(rollout)
    assert rewards.shape == (4, 2)
    assert trainer.reward_names == ["accuracy_reward", "think_format_reward"]
    # Random completions are neither right nor well formatted.
    assert torch.nan_to_num(rewards).eq(0).all()
    trainer.train()
    assert "rewards/think_format_reward/mean" in trainer.state.log_history[0]


# ----------------------------------------------------------------------------- LoRA and reference


def _base_weights(trainer):
    return {
        name: param.detach().clone()
        for name, param in trainer.model.named_parameters()
        if "lora_" not in name
    }


def test_lora_trains_only_adapters_and_base_stays_bit_identical(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=3, beta=0.1)
    assert trainer.ref_model is None  # the base model with adapters disabled is the reference
    before = _base_weights(trainer)
    lora_before = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n
    }
    trainer.train()
    for name, param in trainer.model.named_parameters():
        if "lora_" in name:
            assert param.requires_grad
        else:
            assert not param.requires_grad
            assert torch.equal(param, before[name]), name
    changed = [
        not torch.equal(p, lora_before[n])
        for n, p in trainer.model.named_parameters()
        if n in lora_before
    ]
    assert any(changed)
    kl = logged(trainer, "kl")
    assert len(kl) == 3 and all(value >= 0 for value in kl) and kl[-1] > 0


def test_gradient_checkpointing_with_lora(tmp_path):
    trainer = make_trainer(tmp_path, gradient_checkpointing=True, max_steps=2)
    lora_before = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n
    }
    trainer.train()
    assert trainer.model.get_base_model().is_gradient_checkpointing
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
    # Gradients reached the adapters through the checkpointed layers.
    assert any(
        not torch.equal(p, lora_before[n])
        for n, p in trainer.model.named_parameters()
        if n in lora_before
    )


def test_full_finetuning_with_kl_keeps_a_frozen_reference_of_an_in_memory_model(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    model.config._name_or_path = "does/not-exist"  # TRL would try to reload the reference from here
    trainer = make_trainer(
        tmp_path, model=model, tokenizer=tokenizer, peft=False, beta=0.1, max_steps=3
    )
    reference = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    for name, param in trainer.ref_model.named_parameters():
        assert not param.requires_grad and torch.equal(param, reference[name])
    moved = [not torch.equal(p, reference[n]) for n, p in trainer.model.named_parameters()]
    assert any(moved)
    assert logged(trainer, "kl")[-1] > 0


def test_model_from_a_local_folder(tmp_path, tiny_model_dir):
    trainer = GroupRelativeTrainer(
        model=tiny_model_dir,
        reward_funcs=right_digit,
        args=make_trainer(tmp_path).args,
        train_dataset=digit_sums(),
    )
    assert trainer.processing_class.padding_side == "left"
    trainer.train()


# ----------------------------------------------------------------------------- old log-probs


class CountingForwards:
    def __init__(self, model):
        self.calls = self.without_gradient = 0
        model.register_forward_pre_hook(self.hook)

    def hook(self, module, args):
        self.calls += 1
        self.without_gradient += not torch.is_grad_enabled()


def test_no_extra_forward_for_old_logps_with_one_iteration(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1, max_completion_length=1)
    counter = CountingForwards(trainer.model.get_base_model())
    batches = trainer._make_generation_batch([{"prompt": "1+1=", "answer": "2"}] * 2)
    generation_calls = counter.calls  # one forward per generated token
    assert "old_logps" not in batches[0]
    trainer.compute_objective(trainer.model, batches[0])
    assert counter.calls == generation_calls + 1


def constant_when_a_is_zero(prompts, completions, **kwargs):
    """Prompts `0+b=` always score 1 (groups without signal); others score the first byte."""
    return [
        1.0 if prompt.startswith("0") else float(ord(completion[0]) % 2) if completion else 0.0
        for prompt, completion in zip(prompts, completions)
    ]


def test_micro_batches_without_signal_skip_the_backward_and_change_nothing(tmp_path, monkeypatch):
    """A micro-batch whose advantages are all zero (here one group of a `0+b=` prompt) has a
    loss and gradient of exactly 0: its forward pass runs without gradient, for the metrics,
    and it skips the backward pass. Training ends with the same losses, weights and metrics
    (entropy and clip ratios included, as TRL logs them) as computing it."""
    config = dict(
        reward_funcs=constant_when_a_is_zero,
        dataset=digit_sums(3),
        per_device_train_batch_size=4,  # one group per micro-batch
        gradient_accumulation_steps=2,
        max_steps=6,
        weight_decay=0.1,
    )

    def run(name):
        trainer = make_trainer(tmp_path / name, **config)
        counter = CountingForwards(trainer.model.get_base_model())
        trainer.train()
        weights = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
        return trainer, counter, weights

    skipping, skipping_calls, skipping_weights = run("skip")
    with monkeypatch.context() as patch:
        patch.setattr(GroupRelativeTrainer, "_carries_no_signal", lambda self, batch: False)
        computing, computing_calls, computing_weights = run("compute")
    assert logged(skipping, "frac_reward_zero_std") == logged(computing, "frac_reward_zero_std")
    skipped = sum(logged(computing, "frac_reward_zero_std")) * 2  # groups = micro-batches
    assert skipped >= 2  # the toy data has groups without signal
    assert skipping_calls.calls == computing_calls.calls  # every micro-batch runs the model
    # ... and those without signal without gradient (sampling runs without gradient too)
    assert skipping_calls.without_gradient - computing_calls.without_gradient == skipped
    for key in ("loss", "entropy", "clip_ratio/region_mean", "clip_ratio/low_min"):
        assert logged(skipping, key) == logged(computing, key), key
    for name, value in computing_weights.items():
        torch.testing.assert_close(skipping_weights[name], value, rtol=0, atol=0)


def test_old_logps_computed_once_per_generation_batch_with_several_iterations(
    tmp_path, monkeypatch
):
    # Every micro-batch runs the model, even one whose advantages are all zero.
    monkeypatch.setattr(GroupRelativeTrainer, "_carries_no_signal", lambda self, batch: False)
    trainer = make_trainer(tmp_path, max_steps=4, num_iterations=2, max_completion_length=1)
    counter = CountingForwards(trainer.model.get_base_model())
    trainer.train()
    # 2 generation batches x (1 generation forward + 1 old-logps forward) + 4 training forwards
    assert counter.calls == 2 * 2 + 4
    assert logged(trainer, "ratio_mean")[0] == pytest.approx(1.0, abs=1e-5)


# ----------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize(
    ("loss_type", "level"),
    [
        ("dapo", "token"),
        ("grpo", "token"),
        ("dr_grpo", "token"),
        ("cispo", "token"),
        ("sapo", "token"),
        ("luspo", "sequence"),
        ("vespo", "token"),
        ("dapo", "sequence"),
        ("grpo", "sequence_token"),
    ],
)
def test_gradient_accumulation_equals_one_large_batch(tmp_path, loss_type, level):
    """2 micro-batches of 8 accumulate the same gradient as one of 16 (SGD, no clipping), for
    every loss type: those aggregated over the whole step's tokens are not divided again."""
    weights = []
    for micro, accumulation in ((16, 1), (8, 2)):
        trainer = make_trainer(
            tmp_path / f"{micro}",
            loss_type=loss_type,
            importance_sampling_level=level,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
            max_completion_length=4,
            max_steps=1,
            optim="sgd",
            learning_rate=1.0,
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
        )
        trainer.train()
        weights.append(
            {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
        )
    assert any(w.abs().sum() > 0 for w in weights[0].values())
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- metrics


def test_metrics_use_trl_names(tmp_path, capsys):
    trainer = make_trainer(tmp_path, log_completions=True, beta=0.05, max_steps=2)
    trainer.train()
    entry = trainer.state.log_history[0]
    expected = [
        "reward", "reward_std", "rewards/odd_first_byte/mean", "rewards/odd_first_byte/std",
        "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
        "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio",
        "num_tokens", "loss", "grad_norm", "learning_rate", "completions/mean_terminated_length",
        "completions/min_terminated_length", "completions/max_terminated_length",
    ]  # fmt: skip
    assert [key for key in expected if key not in entry] == []
    assert entry["num_tokens"] > 0 and 0 <= entry["completions/clipped_ratio"] <= 1
    printed = capsys.readouterr().out
    assert "prompt" in printed and "completion" in printed and "odd_first_byte" in printed


def test_reward_std_is_trls_over_the_batch_and_terminated_lengths_leave_truncated_out():
    from trl.trainer.utils import nanstd

    from trl_grpo_ext.metrics import length_metrics, reward_metrics

    rewards = torch.tensor([[0.0], [1.0], [0.0], [1.0]])  # two groups of 2
    metrics = reward_metrics(rewards, torch.ones(1), group_size=2, names=["r"])
    # Hand computation: batch mean 0.5, unbiased variance 4 * 0.25 / 3; within each group 0.5
    assert metrics["reward_std"] == pytest.approx((1 / 3) ** 0.5)  # 0.5774
    assert metrics["reward_std"] == pytest.approx(nanstd(rewards[:, 0]).item())  # as TRL
    assert metrics["reward_std_in_groups"] == pytest.approx(0.5**0.5)  # 0.7071
    lengths = length_metrics(torch.tensor([3, 5, 8]), torch.tensor([False, True, False]))
    assert lengths["completions/mean_terminated_length"] == 5.5
    assert lengths["completions/min_terminated_length"] == 3.0
    assert lengths["completions/max_terminated_length"] == 8.0
    none_ended = length_metrics(torch.tensor([4, 4]), torch.tensor([True, True]))
    assert none_ended["completions/mean_terminated_length"] == 0.0  # TRL's value when none ended


# ----------------------------------------------------------------------------- inputs


def test_reward_names_and_import_paths_resolve_through_the_registry(tmp_path):
    trainer = make_trainer(tmp_path, reward_funcs=["length", "trainer_helpers:odd_first_byte"])
    assert trainer.reward_names == ["length", "odd_first_byte"]
    rollout = trainer.generate_rollouts([{"prompt": "1+1=", "answer": "2"}])
    assert trainer.score_rollouts(rollout).shape == (4, 2)


def test_a_ready_peft_model_trains_its_adapters(tmp_path):
    from peft import get_peft_model
    from trainer_helpers import lora_config

    model, tokenizer = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    peft_model = get_peft_model(model, lora_config())
    trainer = make_trainer(tmp_path, model=peft_model, tokenizer=tokenizer, peft=False)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    trainer.train()
    with pytest.raises(ValueError, match="already a PeftModel"):
        GroupRelativeTrainer(
            model=peft_model, reward_funcs=right_digit, args=trainer.args,
            train_dataset=digit_sums(), processing_class=tokenizer, peft_config=lora_config(),
        )  # fmt: skip


def test_steps_per_generation_buffers_one_generation_batch_across_steps(tmp_path):
    trainer = make_trainer(tmp_path, steps_per_generation=2, max_steps=4, max_completion_length=1)
    calls = []
    original = trainer.generate_rollouts

    def counting(rows):
        calls.append(len(rows))
        return original(rows)

    trainer.generate_rollouts = counting
    trainer.train()
    # 2 generation batches of 16 completions (4 prompts), each serving 2 optimizer steps.
    assert calls == [4, 4]
    # The second step of a generation batch is off-policy by one update: ratios move from 1.
    ratios = logged(trainer, "ratio_mean")
    assert ratios[0] == pytest.approx(1.0, abs=1e-6) and ratios[1] != pytest.approx(1.0, abs=1e-6)


def test_entropy_bonus_lowers_the_loss_by_coef_times_the_entropy(tmp_path):
    losses, entropies = {}, {}
    for coef in (0.0, 0.1):
        trainer = make_trainer(tmp_path / str(coef), max_steps=1, entropy_coef=coef)
        trainer.train()
        losses[coef], entropies[coef] = logged(trainer, "loss")[0], logged(trainer, "entropy")[0]
    assert entropies[0.0] == pytest.approx(entropies[0.1])  # the same samples
    assert losses[0.0] - losses[0.1] == pytest.approx(0.1 * entropies[0.0], rel=1e-3)


def test_objective_options_reach_policy_loss(tmp_path, monkeypatch):
    import trl_grpo_ext.trainer as trainer_module

    calls = []
    original = trainer_module.policy_loss

    def recording(*args, **kwargs):
        calls.append({**kwargs, "completion_mask": args[3], "settings": args[4]})
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "policy_loss", recording)
    trainer = make_trainer(
        tmp_path,
        max_steps=1,
        max_completion_length=4,
        top_entropy_quantile=0.5,
        use_bias_correction_kl=False,
        off_policy_mask_threshold=0.3,
        sapo_temperature_neg=2.0,
        loss_type="sapo",
    )
    trainer.train()
    (kwargs,) = calls
    mask, completion_mask = kwargs["entropy_mask"], kwargs["completion_mask"].bool()
    kept = (mask & completion_mask).sum() / completion_mask.sum()
    assert 0.4 <= kept <= 0.6  # the upper half of the tokens by entropy
    settings = kwargs["settings"]
    assert settings.use_bias_correction_kl is False
    assert settings.off_policy_mask_threshold == 0.3
    assert settings.sapo_temperature_neg == 2.0 and settings.loss_type == "sapo"
    assert settings.max_completion_length == 4
    assert trainer.loss_settings is settings  # built once, not per micro-batch


def test_normalize_then_sum_normalises_each_reward_in_its_group(tmp_path):
    from trl_grpo_ext.objective import group_advantages

    def first(completions, **kwargs):
        return [0.0] * len(completions)

    def second(completions, **kwargs):
        return [0.0] * len(completions)

    rewards = torch.tensor([[1.0, 10.0], [0.0, 30.0], [1.0, 20.0], [0.0, 0.0]] * 2)  # (8, 2)
    for mode in ("sum_then_normalize", "normalize_then_sum"):
        trainer = make_trainer(
            tmp_path / mode, reward_funcs=[first, second], multi_objective_aggregation=mode
        )
        expected = group_advantages(rewards, 4, multi_objective_aggregation=mode)
        torch.testing.assert_close(trainer.compute_advantages(rewards), expected)
    summed = group_advantages(rewards, 4)
    assert not torch.allclose(summed, expected)  # the two modes differ on this example
