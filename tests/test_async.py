"""Dynamic sampling and asynchronous rollouts: staleness bound, off-policy weights, learning."""

import math
import threading
import time

import pytest
import torch
from datasets import Dataset
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_helpers import logged, make_trainer, right_digit

from trl_grpo_ext import GroupRelativeTrainer
from trl_grpo_ext.generation import process_worker
from trl_grpo_ext.generation.async_rollout import GeneratedBatch, RolloutPipeline

# ----------------------------------------------------------------------------- staleness bound


class ThreadWorker:
    """A worker thread with random delays that handles messages in order, like the process."""

    def __init__(self, delays):
        self.messages, self.done, self.version = [], {}, 0
        self.condition = threading.Condition()
        self.delays = delays
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while True:
            with self.condition:
                while not self.messages:
                    self.condition.wait()
                message = self.messages.pop(0)
            if message[0] == "stop":
                return
            if message[0] == "weights":
                self.version = message[1]
                continue
            time.sleep(self.delays.pop(0) if self.delays else 0)
            with self.condition:
                self.done[message[1]] = self.version
                self.condition.notify_all()

    def _put(self, message):
        with self.condition:
            self.messages.append(message)
            self.condition.notify_all()

    def update_weights(self, version):
        self._put(("weights", version))

    def submit(self, index, prompt_texts, seed):
        self._put(("generate", index))

    def result(self, index):
        with self.condition:
            while index not in self.done:
                self.condition.wait()
            version = self.done.pop(index)
        empty = torch.zeros(1, 1)
        return GeneratedBatch(index, version, empty, empty, empty, empty)

    def close(self):
        self._put(("stop",))
        self.thread.join()


@settings(max_examples=25, deadline=None)
@given(
    max_staleness=st.integers(0, 3),
    steps=st.integers(1, 12),
    worker_delays=st.lists(st.sampled_from([0.0, 0.0005, 0.002]), min_size=12, max_size=12),
    trainer_delays=st.lists(st.sampled_from([0.0, 0.0005, 0.002]), min_size=12, max_size=12),
)
def test_staleness_bound_holds_for_every_consumed_batch(
    max_staleness, steps, worker_delays, trainer_delays
):
    pipeline = RolloutPipeline(ThreadWorker(list(worker_delays)), max_staleness)
    try:
        for step in range(steps):
            upcoming = {i: ([f"prompt {i}"], i) for i in range(step, steps)}
            batch, staleness = pipeline.consume(step, upcoming)
            assert batch.index == step
            assert 0 <= step - batch.version == staleness <= max_staleness
            time.sleep(trainer_delays[step])  # the optimizer step
    finally:
        pipeline.close()


# ----------------------------------------------------------------------------- the trainer


def run_trainer(tmp_path, **config):
    trainer = make_trainer(tmp_path, max_steps=5, max_completion_length=4, **config)
    trainer.train()
    weights = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad
    }
    return trainer, weights


class Recording(GroupRelativeTrainer):
    """Keeps every rollout `generate_rollouts` returns."""

    def generate_rollouts(self, rows):
        rollout = super().generate_rollouts(rows)
        self.recorded = [*getattr(self, "recorded", []), rollout]
        return rollout


def test_staleness_zero_is_the_synchronous_trainer_exactly(tmp_path):
    """max_staleness 0 waits for each batch right after publishing the weights: it is the
    synchronous trainer's own path, the same tokens, no behaviour log-probs in either (so no
    importance weights), the same losses and weights bit for bit; only the staleness is
    logged."""
    sync, sync_weights = run_trainer(tmp_path / "sync", trainer_class=Recording)
    worker, worker_weights = run_trainer(tmp_path / "k0", trainer_class=Recording, max_staleness=0)
    assert len(worker.recorded) == len(sync.recorded) == 5
    for got, want in zip(worker.recorded, sync.recorded):
        assert torch.equal(got.completion_ids, want.completion_ids)  # the same tokens
        assert got.behaviour_logps is None and want.behaviour_logps is None
    assert logged(worker, "reward") == logged(sync, "reward")
    assert logged(worker, "loss") == logged(sync, "loss")
    for name, value in sync_weights.items():
        assert torch.equal(worker_weights[name], value), name
    for trainer in (sync, worker):
        assert not logged(trainer, "sampling/importance_sampling_ratio/mean")
        assert trainer.rollouts.pipeline is None  # no rollout worker, no copy of the model
    assert logged(worker, "async/staleness") == [0.0] * 5


def test_a_spawned_worker_samples_a_full_fine_tune_with_gradient_checkpointing(tmp_path):
    """`rollout_worker_threads: 2` spawns the worker (as a trainer on CUDA does), which gets the
    model pickled: gradient checkpointing's hooks on it failed to pickle. The spawned worker
    samples the tokens a forked one samples."""
    options = dict(peft=False, gradient_checkpointing=True, max_staleness=1)
    forked, _ = run_trainer(tmp_path / "forked", **options)
    spawned, _ = run_trainer(tmp_path / "spawned", rollout_worker_threads=2, **options)
    assert logged(spawned, "reward") == logged(forked, "reward")
    assert spawned.model.get_input_embeddings()._forward_hooks  # the trained model's, kept


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_async_runs_with_bounded_staleness_and_logs_it(tmp_path, max_staleness):
    trainer, _ = run_trainer(tmp_path, max_staleness=max_staleness, dataset=big_dataset())
    staleness = logged(trainer, "async/staleness")
    assert max(staleness) == max_staleness and min(staleness) >= 0
    hist = [key for entry in trainer.state.log_history for key in entry if "staleness_hist" in key]
    assert hist
    assert all(weight > 0 for weight in logged(trainer, "sampling/importance_sampling_ratio/max"))


class ShiftedBehaviour(GroupRelativeTrainer):
    """Makes the worker's log-probs of the first completion token lower by log 2 in even rows
    and by log 4 in odd ones, so that at staleness 0 (the first batch of max_staleness 1:
    pi_old = mu up to rounding) the sequence ratios pi_old / mu are 2 and 4."""

    def score_rollouts(self, rollout):
        assert rollout.behaviour_logps is not None  # sampled by the worker, which scores them
        shifts = torch.tensor([math.log(2), math.log(4)]).repeat(len(rollout) // 2)  # (N,)
        rollout.behaviour_logps[:, 0] -= shifts
        return super().score_rollouts(rollout)


def test_worker_rollouts_get_trls_correction_and_metrics(tmp_path, monkeypatch):
    import trl_grpo_ext.trainer as trainer_module

    calls = []
    original = trainer_module.policy_loss

    def recording(*args, **kwargs):
        calls.append(kwargs["importance_weights"])
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "policy_loss", recording)
    trainer = make_trainer(
        tmp_path, trainer_class=ShiftedBehaviour, max_staleness=1, max_steps=1, seed=1
    )
    assert not trainer.args.use_vllm
    trainer.train()
    # TRL's default, sequence_mask with clip_max 3: ratio 2 kept, ratio 4 masked to 0.
    assert calls
    for weights in calls:
        assert weights.shape == (8, 1)
        expected = torch.tensor([[2.0], [0.0]]).repeat(4, 1)
        torch.testing.assert_close(weights, expected, atol=1e-4, rtol=0)
    for key, value in (
        ("sampling/importance_sampling_ratio/min", 0.0),
        ("sampling/importance_sampling_ratio/mean", 1.0),
        ("sampling/importance_sampling_ratio/max", 2.0),
        ("sampling/sampling_logp_difference/max", math.log(4)),
    ):
        values = logged(trainer, key)
        assert len(values) == len(calls) and values == pytest.approx(
            [value] * len(values), abs=1e-4
        )
    assert not [key for entry in trainer.state.log_history for key in entry if "off_policy" in key]


def big_dataset():
    return Dataset.from_list(
        [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    )


LEARN = dict(
    reward_funcs=right_digit,
    num_generations=8,
    per_device_train_batch_size=32,
    max_completion_length=1,
    max_steps=100,
)


@pytest.fixture(scope="module")
def sync_curve(tmp_path_factory):
    """The reward curve of the synchronous run, trained once for every staleness compared."""
    sync = make_trainer(tmp_path_factory.mktemp("sync"), **LEARN)
    sync.train()
    return logged(sync, "reward")


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_async_learns_like_the_synchronous_run(tmp_path, max_staleness, sync_curve):
    stale = make_trainer(tmp_path / "async", max_staleness=max_staleness, **LEARN)
    stale.train()
    async_curve = logged(stale, "reward")
    sync_final, async_final = sum(sync_curve[-10:]) / 10, sum(async_curve[-10:]) / 10
    assert async_final >= sum(async_curve[:10]) / 10 + 0.15
    assert async_final >= sync_final - 0.1, (sync_final, async_final)


# ----------------------------------------------------------------------------- dynamic sampling


def decided_by_prompt(prompts, completions, **kwargs):
    """Prompts starting with 0 or 1 are always right, 2 or 3 always wrong: no signal there.
    Only prompts starting with 4 depend on the completion."""
    scores = []
    for prompt, completion in zip(prompts, completions):
        first = int(prompt[0])
        varied = float(ord(completion[0]) % 2) if completion else 0.0
        scores.append(1.0 if first < 2 else 0.0 if first < 4 else varied)
    return scores


def test_dynamic_sampling_trains_only_on_groups_with_signal(tmp_path):
    seen = []

    class Recording(GroupRelativeTrainer):
        def compute_advantages(self, rewards):
            advantages = super().compute_advantages(rewards)
            seen.append(rewards.view(-1, self.args.num_generations).std(dim=1))
            return advantages

    trainer = make_trainer(
        tmp_path,
        trainer_class=Recording,
        reward_funcs=decided_by_prompt,
        dataset=big_dataset(),
        dynamic_sampling=True,
        max_resample_rounds=20,
        max_steps=4,
    )
    trainer.train()
    assert len(seen) == 4
    for group_std in seen:
        assert (group_std > 0).all()  # every trained group has rewards that differ
    assert 0 < logged(trainer, "dynamic_sampling/filtered_fraction")[0] < 1
    assert logged(trainer, "dynamic_sampling/rounds")[0] >= 1


def test_dynamic_sampling_terminates_when_no_group_has_signal(tmp_path):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = make_trainer(
        tmp_path, reward_funcs=constant, dynamic_sampling=True, max_resample_rounds=3, max_steps=2
    )
    trainer.train()
    assert logged(trainer, "dynamic_sampling/rounds") == [3.0, 3.0]
    assert logged(trainer, "dynamic_sampling/filtered_fraction") == [1.0, 1.0]
    assert logged(trainer, "loss") == [0.0, 0.0]  # nothing to learn from, nothing trained


def test_async_options_are_validated(tmp_path):
    with pytest.raises(ValueError, match="one generation batch per optimizer step") as error:
        make_trainer(tmp_path, max_staleness=1, num_iterations=2)
    assert "num_iterations=1" in str(error.value)
    assert "steps_per_generation" not in str(error.value)  # only what to change
    with pytest.raises(ValueError, match=r"steps_per_generation.*\(1; got 2\)\.$") as error:
        make_trainer(tmp_path, max_staleness=1, steps_per_generation=2)
    assert "num_iterations" not in str(error.value)
    with pytest.raises(ValueError, match="off_policy_correction"):
        make_trainer(tmp_path, off_policy_correction="ppo")


def test_with_staleness_a_model_on_an_accelerator_is_never_copied_to_the_cpu(tmp_path, monkeypatch):
    """Without a vLLM engine the rollout worker would sample with a copy of the model on the
    CPU: for a model on a GPU that is an error naming the settings that work, before any copy
    (the rollout worker's process is never started)."""
    trainer = make_trainer(tmp_path, max_staleness=1, max_steps=1)
    model_class = type(trainer.accelerator.unwrap_model(trainer.model))
    cuda = property(lambda self: torch.device("cuda", 0))
    monkeypatch.setattr(model_class, "device", cuda, raising=False)
    started = []
    monkeypatch.setattr(process_worker, "ProcessEngine", lambda *a, **k: started.append(a))
    try:
        with pytest.raises(ValueError, match="on cuda:0.*use_vllm=True.*max_staleness=0"):
            trainer.rollouts._pipeline()
        assert not started
    finally:
        monkeypatch.undo()
        trainer.rollouts.close()


def test_async_encodes_each_generation_batch_once(tmp_path):
    """The prompts of a batch are tokenised when it enters the lookahead, not again at each
    step it waits there: with k=2, as many encodings as generation batches, and a prompt cut
    by `max_prompt_length` is counted once."""
    prompts = [f"{a}+{b}=" for a in range(5) for b in range(5)]
    trainer = make_trainer(
        tmp_path,
        max_staleness=2,
        max_steps=4,
        dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        per_device_train_batch_size=4,
        num_generations=2,
        max_prompt_length=3,
    )
    encoded = []
    encode = trainer.rollouts.encoder.encode
    trainer.rollouts.encoder.encode = lambda batch: encoded.append(list(batch)) or encode(batch)
    with pytest.warns(UserWarning, match="longer than max_prompt_length=3"):
        trainer.train()
    # Batches of steps 0-3 were consumed; those of steps 4 and 5 were in the lookahead.
    assert len(encoded) == 6
    assert len({tuple(batch) for batch in encoded}) == 6
    assert trainer.rollouts.encoder.num_truncated == 6 * 2  # every prompt is 4 tokens long
