"""Options that trl.GRPOTrainer 1.16 takes and that its own test file uses, run side by side with
ours on the same tiny model: `dataloader_num_workers`, beam search in `generation_kwargs`, and a
prompt-learning `peft_config`."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from datasets import Dataset
from test_trl_differences import GenerationBatches, numbered_prompts
from trainer_helpers import digit_sums, make_trainer
from trl_reference import matches_trl

from trl_grpo_ext.logprobs import completion_logprobs
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

TINY = dict(
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=3,
    max_steps=1,
    learning_rate=0.1,
    save_strategy="no",
    report_to="none",
    seed=0,
)


def alternating(completions, **kwargs):
    """1, 0, 1, 0, ...: every group has a non-zero advantage, whatever was sampled."""
    return [float(i % 2 == 0) for i in range(len(completions))]


def trl_trainer(tmp_path, peft_config=None, train_dataset=None, eval_dataset=None, **config):
    import trl

    model, tokenizer = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    return trl.GRPOTrainer(
        model=model,
        reward_funcs=alternating,
        args=trl.GRPOConfig(
            output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, **{**TINY, **config}
        ),
        train_dataset=digit_sums() if train_dataset is None else train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )


# ---------------------------------------------------------------- prompt learning (PEFT)


def prompt_tuning():
    from peft import PromptTuningConfig, TaskType

    return PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)


def trains_only_the_virtual_tokens(trainer):
    """Trains one step; asserts the prompt embeddings moved and every base weight did not."""
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {
        name for name, p in trainer.model.named_parameters() if not torch.equal(before[name], p)
    }
    assert changed == {"prompt_encoder.default.embedding.weight"}


@matches_trl
def test_a_prompt_learning_peft_config_trains_the_virtual_tokens_as_trl(tmp_path):
    """TRL 1.16 builds and trains with a PromptTuningConfig; so do we, the base model frozen."""
    trains_only_the_virtual_tokens(trl_trainer(tmp_path, peft_config=prompt_tuning()))
    trains_only_the_virtual_tokens(
        make_trainer(
            tmp_path / "ours", reward_funcs=alternating, peft_config=prompt_tuning(), **TINY
        )
    )


def test_prompt_learning_log_probs_include_the_virtual_tokens(tmp_path):
    """The trained log-probs are those of PEFT's forward pass, virtual tokens before the inputs
    (rows sharing a prompt are not packed, which PEFT's 2D mask could not take)."""
    trainer = make_trainer(tmp_path, peft_config=prompt_tuning(), **TINY)
    model = trainer.model.eval()
    torch.manual_seed(1)
    with torch.no_grad():  # virtual tokens far from their initial values
        model.prompt_encoder.default.embedding.weight.normal_(0, 1)
    prompt = torch.tensor([[5, 6, 7, 8]]).repeat(4, 1)  # (4, P): one group of 4
    completion = torch.randint(10, 40, (4, 3))  # (4, T)
    input_ids = torch.cat([prompt, completion], 1)
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        ours = completion_logprobs(model, input_ids, mask, completion)
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, -4:-1]  # (4, T, V)
        expected = logits.log_softmax(-1).gather(2, completion.unsqueeze(2)).squeeze(2)
        with model.disable_adapter():  # the base model alone gives other numbers
            plain = completion_logprobs(model, input_ids, mask, completion)
    torch.testing.assert_close(ours, expected)
    assert not torch.allclose(ours, plain, atol=1e-3)


def test_prompt_learning_with_vllm_is_an_error_that_says_what_to_change(tmp_path):
    with pytest.raises(ValueError, match="use_vllm=False"):
        make_trainer(tmp_path, peft_config=prompt_tuning(), use_vllm=True, **TINY)


# ---------------------------------------------------------------- beam search in generation_kwargs

TRLS_BEAMS = {"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1}  # its test's


def trains(trainer):
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    return any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@matches_trl
def test_beam_search_generation_kwargs_train_as_in_trl(tmp_path):
    """TRL's own test's settings: three completions per prompt from two beams (transformers
    refuses more returned sequences than beams; TRL runs each prompt three times)."""
    beams = dict(num_generations=3, per_device_train_batch_size=3, generation_kwargs=TRLS_BEAMS)
    assert trains(trl_trainer(tmp_path, **{**TINY, **beams}))
    assert trains(make_trainer(tmp_path / "ours", reward_funcs=alternating, **{**TINY, **beams}))


def test_beam_search_runs_each_prompt_once_per_completion(tmp_path):
    """Without sampling, every completion of a group is the prompt's best beam, as with TRL's G
    repeats of the prompt; the trainer's own log-probs are the old ones (no behaviour ones)."""
    trainer = make_trainer(
        tmp_path,
        **{**TINY, "num_generations": 3, "per_device_train_batch_size": 3},
        generation_kwargs={"do_sample": False, "num_beams": 3},
    )
    rows = [{"prompt": "0+1="}, {"prompt": "1+2="}]  # whose best beam is not the greedy path
    rollout = trainer.generate_rollouts(rows)
    assert rollout.behaviour_logps is None
    model, tokenizer = trainer.model, trainer.processing_class
    for index, row in enumerate(rows):
        encoded = tokenizer(row["prompt"], return_tensors="pt")
        best, greedy = (
            model.generate(
                **encoded, num_beams=beams, do_sample=False, max_new_tokens=3,
                eos_token_id=trainer.eos_token_ids, pad_token_id=tokenizer.pad_token_id,
            )[0, encoded["input_ids"].shape[1] :].tolist()
            for beams in (3, 1)
        )  # fmt: skip
        assert best != greedy
        group = rollout.completion_ids[3 * index : 3 * index + 3]  # (3, T)
        mask = rollout.completion_mask[3 * index : 3 * index + 3].bool()
        for completion, kept in zip(group, mask):
            assert completion[kept].tolist() == best[: int(kept.sum())]


@pytest.mark.parametrize("setting", [dict(use_vllm=True), dict(max_staleness=1)])
def test_beam_search_off_the_trainers_generate_is_an_error_naming_the_setting(tmp_path, setting):
    with pytest.raises(ValueError, match="num_beams=2 asks for beam search"):
        make_trainer(tmp_path, **TINY, generation_kwargs={"num_beams": 2}, **setting)


# ---------------------------------------------------------------- dataloader_num_workers

WORKERS = dict(dataloader_num_workers=2)


def streamed(dataset: Dataset):
    return dataset.to_iterable_dataset()


@matches_trl
def test_a_map_style_train_set_keeps_its_workers_beside_an_iterable_eval_set_as_trl(tmp_path):
    """TRL's training loader has `dataloader_num_workers` workers, an iterable eval set or not."""
    eval_dataset = streamed(digit_sums())
    theirs = trl_trainer(tmp_path, eval_dataset=eval_dataset, **WORKERS)
    ours = make_trainer(tmp_path / "ours", eval_dataset=eval_dataset, **{**TINY, **WORKERS})
    for trainer in (theirs, ours):
        assert trainer.get_train_dataloader().num_workers == 2
        assert trainer.get_eval_dataloader().num_workers == 0  # the stream's, for this loader
        assert trainer.args.dataloader_num_workers == 2
    # by name, among several sets: the stream's without workers; an unknown name says the names
    named = make_trainer(
        tmp_path / "named",
        eval_dataset={"stream": eval_dataset, "rows": digit_sums()},
        **{**TINY, **WORKERS},
    )
    assert named.get_eval_dataloader("stream").num_workers == 0
    assert named.get_eval_dataloader("rows").num_workers == 2
    with pytest.raises(ValueError, match=r"the sets \['rows', 'stream'\]"):
        named.get_eval_dataloader("missing")


@matches_trl
def test_a_streamed_train_set_is_read_without_workers_as_trl(tmp_path, caplog):
    """TRL sets dataloader_num_workers to 0 for a stream, with a warning: workers would each
    read the stream and interleave their generation batches."""
    theirs = trl_trainer(tmp_path, train_dataset=streamed(digit_sums()), **WORKERS)
    with caplog.at_level("WARNING"):
        ours = make_trainer(
            tmp_path / "ours", dataset=streamed(digit_sums()), **{**TINY, **WORKERS}
        )
    assert "require `dataloader_num_workers=0`" in caplog.text
    for trainer in (theirs, ours):
        assert trainer.args.dataloader_num_workers == 0
        assert trainer.get_train_dataloader().num_workers == 0


@matches_trl
@pytest.mark.parametrize("where", ["train", "eval", "eval set of a dict"])
def test_a_stream_sets_dispatch_batches_false_and_refuses_true_as_trl(tmp_path, where):
    """Each process reads a stream and takes its own slice: TRL sets accelerate's
    `dispatch_batches` to False for it, and refuses True, with the same words here."""
    stream = streamed(digit_sums())
    kinds = {
        "train": dict(train_dataset=stream),
        "eval": dict(eval_dataset=stream),
        "eval set of a dict": dict(eval_dataset={"plain": digit_sums(), "streamed": stream}),
    }[where]
    ours_kinds = {("dataset" if k == "train_dataset" else k): v for k, v in kinds.items()}
    theirs = trl_trainer(tmp_path, **kinds)
    ours = make_trainer(tmp_path / "ours", **ours_kinds, **TINY)
    for trainer in (theirs, ours):
        assert trainer.args.accelerator_config.dispatch_batches is False
    refused = "Iterable datasets require `dispatch_batches=False`"
    with pytest.raises(ValueError, match=refused):
        trl_trainer(tmp_path, **kinds, accelerator_config={"dispatch_batches": True})
    with pytest.raises(ValueError, match=refused):
        make_trainer(
            tmp_path / "ours", **ours_kinds, **TINY, accelerator_config={"dispatch_batches": True}
        )


def trained_batches(tmp_path, **workers) -> list[list[int]]:
    """The rows of each generation batch of a run over an epoch boundary, two generation
    batches an epoch, each reused over two micro-batches."""
    reward = GenerationBatches()
    trainer = make_trainer(
        tmp_path,
        reward_funcs=reward,
        dataset=numbered_prompts(8),
        **{**TINY, "steps_per_generation": 2, "max_steps": 6, "logging_steps": 1},
        **workers,
    )
    assert trainer.get_train_dataloader().num_workers == workers.get("dataloader_num_workers", 0)
    trainer.train()
    return reward.batches


@pytest.fixture(scope="module")
def batches_without_workers(tmp_path_factory):
    batches = trained_batches(tmp_path_factory.mktemp("without-workers"))
    assert len(batches) == 3 and sorted(set(batches[0] + batches[1])) == list(range(8))
    return batches


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_give_the_batches_of_a_loader_without_workers(
    tmp_path, persistent, batches_without_workers
):
    before = set(multiprocessing.active_children())
    with_workers = trained_batches(
        tmp_path / "with", dataloader_persistent_workers=persistent, **WORKERS
    )
    assert with_workers == batches_without_workers
    assert set(multiprocessing.active_children()) <= before  # ended with train(), persistent too
