"""A streaming dataset (`load_dataset(..., streaming=True)`, a `datasets.IterableDataset`) as
`train_dataset` or `eval_dataset`, as `trl.GRPOTrainer` takes it: the same generation batches
as the same rows in a `Dataset` and as TRL's when unshuffled, a seeded shuffle reseeded each
epoch, exact resumes, asynchronous rollouts, dynamic sampling, evaluation, and a clear error
where a stream cannot serve."""

import pytest
import torch
import trl
from datasets import Dataset, IterableDataset
from packaging.version import Version
from PIL import Image
from trainer_helpers import digit_sums, make_trainer

from trl_grpo_ext.tiny import save_tiny


def recording(store: list):
    """A reward that records each generation batch's prompts, one per group."""

    def record(completions, prompts, **kwargs):
        store.append(list(prompts[::4]))  # num_generations=4: a group's prompts are one
        return [float(len(completion) % 2) for completion in completions]

    return record


def trained(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def run(output_dir, dataset, **config):
    prompts = []
    trainer = make_trainer(output_dir, dataset=dataset, reward_funcs=recording(prompts), **config)
    return trainer, prompts


def test_an_unshuffled_stream_trains_as_the_same_rows_in_a_dataset(tmp_path):
    # 9 prompts, 2 per generation batch: 4 batches an epoch (the ninth prompt is dropped, as
    # an incomplete batch is), and the fifth step starts the second epoch.
    config = dict(shuffle_dataset=False, max_steps=5)
    rows, rows_prompts = run(tmp_path / "rows", digit_sums(), **config)
    rows.train()
    stream, stream_prompts = run(tmp_path / "stream", digit_sums().to_iterable_dataset(), **config)
    stream.train()
    assert stream_prompts == rows_prompts
    assert stream_prompts[0] == stream_prompts[4] == ["0+0=", "0+1="]
    first, second = trained(rows), trained(stream)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_a_shuffled_stream_is_seeded_and_reshuffled_each_epoch(tmp_path):
    config = dict(max_steps=8, seed=3)
    orders = []
    for attempt in range(2):
        trainer, prompts = run(
            tmp_path / str(attempt), digit_sums().to_iterable_dataset(), **config
        )
        trainer.train()
        orders.append(prompts)
    assert orders[0] == orders[1]  # the seed decides
    first_epoch = [p for batch in orders[0][:4] for p in batch]
    second_epoch = [p for batch in orders[0][4:] for p in batch]
    assert len(set(first_epoch)) == len(set(second_epoch)) == 8  # no prompt twice in an epoch
    assert first_epoch != second_epoch  # another order in the next epoch
    assert first_epoch != sorted(first_epoch)


def test_a_stream_resumes_as_it_ran(tmp_path):
    config = dict(max_steps=6, save_strategy="steps", save_steps=2, seed=1)
    straight, straight_prompts = run(
        tmp_path / "straight", digit_sums().to_iterable_dataset(), **config
    )
    straight.train()
    resumed, resumed_prompts = run(
        tmp_path / "resumed", digit_sums().to_iterable_dataset(), **config
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    assert resumed_prompts == straight_prompts[2:]  # the stream read on from step 3
    first, second = trained(straight), trained(resumed)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_asynchronous_rollouts_read_the_stream_in_the_same_order(tmp_path):
    config = dict(max_steps=4, seed=2)
    synchronous, sync_prompts = run(tmp_path / "sync", digit_sums().to_iterable_dataset(), **config)
    synchronous.train()
    ahead, async_prompts = run(
        tmp_path / "async", digit_sums().to_iterable_dataset(), max_staleness=1, **config
    )
    ahead.train()
    assert ahead.state.global_step == 4 and async_prompts == sync_prompts


def test_a_streaming_eval_dataset_evaluates_as_the_same_rows_in_a_dataset(tmp_path):
    rows = Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(3) for b in range(3)])
    results = []
    for eval_dataset in (rows, rows.to_iterable_dataset()):
        trainer = make_trainer(tmp_path, eval_dataset=eval_dataset, num_generations_eval=4)
        results.append(trainer.evaluate())
    assert results[0] == results[1] and "eval_reward" in results[0]


def test_dynamic_sampling_draws_from_the_stream_and_resumes_as_it_ran(tmp_path):
    """Only the groups of prompts that start with 0 have rewards that differ: the others are
    dropped and more prompts are drawn from the stream (a seeded shuffle of it, read again for
    each draw), and a resumed run draws the same ones."""
    drawn = {"straight": [], "resumed": []}

    def informative_if_zero_first(name):
        def reward(completions, prompts, **kwargs):
            drawn[name].append(list(prompts[::4]))
            return [
                float(len(c) % 2) if p.startswith("0") else 0.0
                for c, p in zip(completions, prompts)
            ]

        return reward

    config = dict(max_steps=4, save_strategy="steps", save_steps=2, seed=3, dynamic_sampling=True)
    runs = {}
    for name in drawn:
        runs[name] = make_trainer(
            tmp_path / name,
            dataset=digit_sums().to_iterable_dataset(),
            reward_funcs=informative_if_zero_first(name),
            **config,
        )
    runs["straight"].train()
    rounds = [entry["dynamic_sampling/rounds"] for entry in runs["straight"].state.log_history
              if "dynamic_sampling/rounds" in entry]  # fmt: skip
    assert len(rounds) == 4 and sum(rounds) > 0  # prompts were drawn beyond the batches
    assert len(drawn["straight"]) == 4 + sum(rounds)
    assert {p for batch in drawn["straight"] for p in batch} <= set(digit_sums()["prompt"])
    runs["resumed"].train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    assert drawn["resumed"] == drawn["straight"][-len(drawn["resumed"]) :]
    first, second = trained(runs["straight"]), trained(runs["resumed"])
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_a_stream_is_read_once_at_construction_and_judged_by_its_first_row(tmp_path):
    """`map` on a stream leaves its columns unknown: the checks read its first row, once (a
    stream from the Hub is a request each time), and judge the columns by it."""
    reads = []

    def rows(prompt_key="prompt", image=False):
        reads.append(prompt_key)
        for a in range(3):
            row = {prompt_key: [{"role": "user", "content": f"{a}+1="}]}
            yield {**row, "image": Image.new("RGB", (8, 8))} if image else row

    stream = IterableDataset.from_generator(rows).map(lambda row: row)
    assert stream.column_names is None
    make_trainer(tmp_path, dataset=stream, max_steps=1)
    assert reads == ["prompt"]
    renamed = IterableDataset.from_generator(rows, gen_kwargs={"prompt_key": "question"})
    with pytest.raises(ValueError, match=r"no 'prompt' column; it has \['question'\]"):
        make_trainer(tmp_path, dataset=renamed.map(lambda row: row))
    with_images = IterableDataset.from_generator(rows, gen_kwargs={"image": True})
    with pytest.raises(ValueError, match="has images, but processing_class is a tokenizer"):
        make_trainer(tmp_path, dataset=with_images.map(lambda row: row))


def test_where_a_stream_cannot_serve_the_error_says_what_to_do(tmp_path):
    stream = Dataset.from_list([{"prompt": "1+1="}] * 8).to_iterable_dataset()
    with pytest.raises(ValueError, match="max_steps"):  # a stream has no length
        make_trainer(tmp_path, dataset=stream, max_steps=-1).train()
    short = Dataset.from_list([{"prompt": "1+1="}]).to_iterable_dataset()
    with pytest.raises(ValueError, match="streamed 1 prompts but one generation batch needs 2"):
        make_trainer(tmp_path, dataset=short).train()  # rather than 0 steps and a warning


@pytest.mark.skipif(
    Version(trl.__version__) < Version("1.16"), reason="trl.GRPOTrainer takes streams from 1.16"
)
def test_an_unshuffled_stream_gives_the_generation_batches_trl_gives(tmp_path):
    trl_prompts = []
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        max_steps=5,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=2,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
    )
    trl.GRPOTrainer(
        model=save_tiny(tmp_path / "model"),
        reward_funcs=recording(trl_prompts),
        args=args,
        train_dataset=digit_sums().to_iterable_dataset(),
    ).train()
    ours, our_prompts = run(
        tmp_path / "ours", digit_sums().to_iterable_dataset(), shuffle_dataset=False, max_steps=5
    )
    ours.train()
    assert our_prompts == trl_prompts and len(trl_prompts) == 5  # the fifth: a second epoch
