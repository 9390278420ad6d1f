"""Asynchronous rollouts (`max_staleness`) with tools and environments: every turn of a rollout
is sampled with one weight version, the one recorded; batches in flight together never share an
environment; tool results stay masked; checkpoints leave multi-turn batches in flight out.

The rollout worker here is the scripted engine with its own (stub) weights, as a vLLM engine has
(the worker then samples with the producer's engine), so the versions each generate call sees are
the ones the worker loaded."""

import re
import sqlite3

import pytest
from agent_helpers import ScriptedEngine, add, call, encode, needs_trl_1_16
from datasets import Dataset
from test_agents import Counter, Recording, chat, rewards_by_length, tool_trainer

from trl_grpo_ext.checkpoints import load_rollout_state
from trl_grpo_ext.generation.weights import OwnWeights

pytestmark = needs_trl_1_16


class StubPublisher:
    """A publisher (`weights.WeightPublisher`'s interface) that only records the version."""

    def __init__(self):
        self.version, self.loaded = None, []

    def snapshot(self, version):
        return version

    def load(self, snapshot, version):
        self.version = version
        self.loaded.append(version)

    def publish(self, version):
        self.load(version, version)

    def close(self):
        pass


class VersionedEngine(OwnWeights, ScriptedEngine):
    """A scripted engine with its own weights (`StubPublisher`) that records, for each `generate`
    call, the weight version loaded then and the contexts it continued (`ScriptedEngine.prompts`)."""

    def __init__(self, script):
        super().__init__(script, logps=True)
        self.publisher, self.versions = StubPublisher(), []

    def generate(self, prompt_ids, prompt_mask, generation_config, seed=None):
        self.versions.append(self.version)
        return super().generate(prompt_ids, prompt_mask, generation_config, seed)


def reach_the_target(tokenizer):
    """Each rollout calls `increment(step=target)` with the target its environment's `reset`
    appended to the prompt (" Reach N."), then answers once a tool result is in its context."""
    response = tokenizer("<tool_response>", add_special_tokens=False)["input_ids"]

    def turn(context):
        n = len(response)
        if any(context[i : i + n] == response for i in range(len(context) - n + 1)):
            return encode(tokenizer, "Done.")
        target = int(re.findall(r"Reach (\d+)\.", tokenizer.decode(context))[-1])
        return encode(tokenizer, call("increment", step=target))

    return turn


def async_counter_trainer(tmp_path, signal=True, environment=Counter, **overrides):
    """Counter environments, targets 1..8 (two rows per batch, so consecutive batches have
    different targets), the scripted worker with its stub publisher. The reward alternates 0, 1
    (every group has a signal), or is 0 everywhere without `signal`."""
    rows = [{"prompt": chat("Count."), "target": t} for t in range(1, 9)]
    checked = []

    def environments_match_rows(completions, environments, target, **kwargs):
        """Scored with the batch's own environments: each was reset with its rollout's row and
        holds the value its own call reached."""
        checked.append([(e.target, e.value) for e in environments] == [(t, t) for t in target])
        return [float(signal and i % 2) for i in range(len(completions))]

    trainer = tool_trainer(
        tmp_path,
        environment_factory=environment,
        reward_funcs=environments_match_rows,
        dataset=Dataset.from_list(rows),
        shuffle_dataset=False,
        per_device_train_batch_size=4,
        num_generations=2,
        **{"max_staleness": 1, "max_steps": 4, **overrides},
    )
    trainer.rollouts.engine = VersionedEngine(reach_the_target(trainer.processing_class))
    return trainer, checked


def consumed_rollouts(trainer):
    """Records every rollout the trainer scores."""
    rollouts, score = [], trainer.score_rollouts

    def recording(rollout):
        rollouts.append(rollout)
        return score(rollout)

    trainer.score_rollouts = recording
    return rollouts


def test_every_turn_of_a_rollout_uses_the_version_it_records(tmp_path):
    trainer, checked = async_counter_trainer(tmp_path)
    rollouts = consumed_rollouts(trainer)
    recording = Recording(trainer)
    pipeline = trainer.rollouts._pipeline()  # the one `train` uses (closed at its end)
    trainer.train()
    engine, tokenizer = trainer.rollouts.engine, trainer.processing_class

    assert trainer.state.global_step == 4 and len(rollouts) == 4
    assert engine.publisher.loaded == [0, 1, 2, 3]
    for step, rollout in enumerate(rollouts):
        prompts = [
            ids[mask.bool()].tolist() for ids, mask in zip(rollout.prompt_ids, rollout.prompt_mask)
        ]
        # the generate calls of this batch: those whose contexts continue its prompts
        versions = [
            version
            for version, contexts in zip(engine.versions, engine.prompts)
            if any(c[: len(p)] == p for c in contexts for p in prompts)
        ]
        assert len(versions) == 2  # the call turn and the answer turn
        assert versions == [rollout.policy_version] * 2
        assert step - rollout.policy_version in (0, 1)
    # the batch of step 0 came from version 0; later ones were sampled a step ahead
    assert [r.policy_version for r in rollouts] == [0, 0, 1, 2]
    staleness = [e["async/staleness"] for e in trainer.state.log_history if "async/staleness" in e]
    assert staleness == [step - r.policy_version for step, r in enumerate(rollouts)]

    # each batch was scored with its own environments, untouched by the batch sampled ahead
    assert checked == [True] * 4
    assert [sorted(set(rollout.columns["target"])) for rollout in rollouts] == [
        [1, 2],
        [3, 4],
        [5, 6],
        [7, 8],
    ]
    for earlier, later in zip(rollouts, rollouts[1:]):
        assert not {id(e) for e in earlier.environments} & {id(e) for e in later.environments}
    assert len({id(e) for r in rollouts for e in r.environments}) == 4 * 3  # 3 slots of 4

    # the worker renders tool results with a tokenizer of its own (not thread-safe to share)
    worker_format = pipeline.worker.worker.tool_loop.format
    assert worker_format.tokenizer is not tokenizer
    assert worker_format.tokenizer.chat_template == tokenizer.chat_template
    # tool results are trained on as masked tokens
    for batch, rollout in zip(recording.batches, rollouts):
        for row, target in enumerate(rollout.columns["target"]):
            call_ids = encode(tokenizer, call("increment", step=target))
            suffix = trainer.rollouts.tool_loop.format.result_ids(
                [{"role": "tool", "name": "increment", "content": str(target)}]
            )
            sampled = call_ids + suffix + encode(tokenizer, "Done.")
            mask = batch["completion_mask"][row]
            assert batch["completion_ids"][row, : len(sampled)].tolist() == sampled
            assert mask[: len(call_ids)].eq(1).all()
            assert mask[len(call_ids) : len(call_ids) + len(suffix)].eq(0).all()
            assert mask[len(call_ids) + len(suffix) : len(sampled)].eq(1).all()
            assert "behaviour_logps" in batch  # the worker's log-probs, for the correction
    assert all(calls == 1 for r in rollouts for calls in r.tool_calls.tolist())


def test_dynamic_sampling_rounds_take_environments_of_their_own(tmp_path):
    """An extra round is sampled while the next step's batch is in flight: its environments
    are a slot of their own."""
    trainer, checked = async_counter_trainer(
        tmp_path, signal=False, dynamic_sampling=True, max_resample_rounds=1, max_steps=2
    )
    rollouts = consumed_rollouts(trainer)
    trainer.train()
    # per step: the scheduled batch, then one extra round (no group has a signal)
    assert len(rollouts) == 4
    scheduled, extra = rollouts[0], rollouts[1]
    assert not {id(e) for e in scheduled.environments} & {id(e) for e in extra.environments}
    assert not {id(e) for e in extra.environments} & {id(e) for e in rollouts[2].environments}
    assert extra.policy_version == 0 and rollouts[3].policy_version == 1
    assert checked == [True] * 4  # every round scored with its own environments


def test_checkpoints_leave_multi_turn_batches_in_flight_out_and_say_so(tmp_path):
    trainer, _ = async_counter_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    with pytest.warns(UserWarning, match=r"multi-turn batches in flight \(steps \[1\]\)"):
        state = load_rollout_state(str(checkpoint))
    assert state.in_flight == {} and state.not_kept == [1]

    resumed, checked = async_counter_trainer(tmp_path / "resumed", max_steps=2)
    with pytest.warns(UserWarning, match="sampled again with the restored weights"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2 and checked == [True]


def test_the_local_process_worker_runs_the_tool_loop(tmp_path):
    """Without vLLM the worker is a transformers process with its own copy of the model: the
    tool loop drives it like any engine, and its log-probs come back per rollout."""
    trainer = tool_trainer(
        tmp_path,
        tools=[add],
        reward_funcs=rewards_by_length,
        max_staleness=1,
        max_steps=2,
        max_completion_length=8,
    )
    rollouts = consumed_rollouts(trainer)
    trainer.train()
    assert trainer.state.global_step == 2
    assert [r.policy_version for r in rollouts] == [0, 0]
    for rollout in rollouts:
        mask = rollout.completion_mask.bool()
        assert rollout.behaviour_logps[mask].lt(0).all()  # the process's own log-probs
        assert rollout.behaviour_logps[~mask].eq(0).all()


class LedgerCounter(Counter):
    """A Counter that keeps its steps in an SQLite connection opened in `__init__`, usable only on
    the thread that opened it."""

    def __init__(self):
        super().__init__()
        self.db = sqlite3.connect(":memory:")
        self.db.execute("CREATE TABLE steps (step INTEGER)")

    def reset(self, **row):
        self.db.execute("DELETE FROM steps")
        return super().reset(**row)

    def increment(self, step: int) -> int:
        """Adds `step` to the counter.

        Args:
            step: How much to add.

        Returns:
            The new value.
        """
        self.db.execute("INSERT INTO steps VALUES (?)", (step,))
        self.value = self.db.execute("SELECT SUM(step) FROM steps").fetchone()[0]
        return self.value


def failure_frequencies(trainer) -> list[float]:
    return [e["tools/failure_frequency"] for e in trainer.state.log_history if "loss" in e]


def test_with_threads_an_environment_bound_to_its_thread_works_with_async_rollouts(tmp_path):
    """The worker thread runs the tool loop while the trainer's thread resets the environments:
    with `tool_call_workers` > 1 each environment is made, reset and called on one tool thread."""
    trainer, checked = async_counter_trainer(
        tmp_path, environment=LedgerCounter, tool_call_workers=2
    )
    trainer.train()
    assert checked == [True] * 4
    assert failure_frequencies(trainer) == [0.0] * 4


def test_by_default_a_thread_bound_environment_fails_loudly_with_async_rollouts(tmp_path):
    """By default sync tools run on the rollout worker's thread, not on the trainer's, where the
    environments were made: each call fails, and a warning says why, once."""
    trainer, _ = async_counter_trainer(tmp_path, environment=LedgerCounter)
    with pytest.warns(RuntimeWarning) as warned:
        trainer.train()
    messages = [str(w.message) for w in warned if "Tool increment failed" in str(w.message)]
    assert len(messages) == 1
    assert "SQLite objects created in a thread" in messages[0]
    assert failure_frequencies(trainer) == [1.0] * 4
