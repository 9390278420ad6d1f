"""TRL's own tests of `tools`, `environment_factory` and `rollout_func`, run on our trainer.

Ported from huggingface/trl `tests/test_grpo_trainer.py` at commit f2cd577 (version
1.10.0.dev0, the newest stored snapshot of the repository; the installed trl 1.16.0 ships no
tests, and its `GRPOTrainer` has the same contract for these arguments). Each test names the TRL
test it comes from and keeps its assertions. What changed, everywhere:

- `GRPOTrainer`/`GRPOConfig` -> `GroupRelativeTrainer`/`GroupRelativeConfig`, on the CPU.
- The Hub models are built in code: the policy is the tiny Qwen3 model on the byte-level tiny
  tokenizer with TRL's Qwen3 chat template (`agent_helpers.qwen3_tokenizer`), and the reward model
  `tiny-Qwen2ForSequenceClassification-2.5` is a random tiny `Qwen3ForSequenceClassification`
  (`test_reward_models.tiny_reward_model`). The `trl-internal-testing/zen` prompts are a few
  conversational prompts written here.
- TRL patches `model.generate` with hard-coded Qwen token ids; here the engine is replaced by
  `agent_helpers.ScriptedEngine` writing the same texts in the tiny tokenizer. Its k-th entry is
  the k-th engine call's turns, one per rollout, so `[first, second] * steps` replays TRL's
  `fake_generate` (first call: every rollout; second: those whose tool call got a result).
- The byte-level tokenizer spends one token per byte, so where TRL's lengths would cut a tool
  result off, `max_completion_length` is larger (`max_prompt_length` keeps its default: the
  tools' schemas do not count toward it); fewer steps than TRL's default three epochs keep the
  CPU time short.
- TRL's `@patch.dict(os.environ, {"TRL_EXPERIMENTAL_SILENCE": "1"})` is dropped: ours does not
  warn that these arguments are experimental.

Not ported, with the reason:
- `test_train_with_tools_multimodal_response`: a VLM (Qwen3.5) whose tool returns an image; it
  needs a VLM and its processor, so it is ported to tests/test_vlm_tools.py (the tiny VLM).
- `tests/experimental/test_async_grpo_trainer.py`, `test_harbor.py`, `test_openreward.py` (their
  `environment_factory`/`rollout_func` cases): TRL's experimental async trainer and its
  integrations, whose design differs from `max_staleness` (tests/test_agents_async.py covers
  tools and environments with ours).
- `tests/test_data_utils.py` and `tests/test_vllm_client_server.py` pass `tools=` to
  `apply_chat_template` and to vLLM's chat client, not to the trainer.
- No TRL test sets `max_tool_calling_iterations` (tests/test_multi_turn.py covers ours).

Assertions on TRL-private attributes are adapted to what they check, each with a comment:
`trainer._generate` -> `generate_rollouts`, `_env_tools`/`_environment_pool` -> the environments'
tools and the number of instances made, `vllm_generation.sync_weights` -> the producer's weight
publisher. `reward_func_names` is our `reward_names` (tests/test_reward_models.py compares them).
"""

from __future__ import annotations

from unittest.mock import MagicMock

import pytest
import torch
from agent_helpers import ScriptedEngine, call, encode, needs_trl_1_16, qwen3_tokenizer
from datasets import Dataset
from test_reward_models import tiny_reward_model

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny import build_tiny_model, build_tiny_tokenizer

pytestmark = needs_trl_1_16


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_multiply_tool(a: int, b: int) -> int:
    """
    Asynchronously multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def zen(rows: int = 3, **columns) -> Dataset:
    """Conversational prompts in the place of `trl-internal-testing/zen`
    (`conversational_prompt_only`), with `columns` added to every row."""
    lines = ["Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is"]
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": lines[i % 3]}], **columns} for i in range(rows)]
    )


def config(tmp_path, **kwargs) -> GroupRelativeConfig:
    """TRL's test config on the CPU: `kwargs` as in the TRL test, plus our offline settings."""
    return GroupRelativeConfig(
        **{
            "output_dir": str(tmp_path),
            "use_cpu": True,
            "report_to": "none",
            "save_strategy": "no",
            "disable_tqdm": True,
            "seed": 0,
            **kwargs,
        }
    )


def trainer_with(tmp_path, *, reward_funcs="reward_model", args=None, **kwargs):
    """A trainer on the tiny Qwen3 model. `reward_funcs="reward_model"` stands for TRL's
    `"trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5"`."""
    tokenizer = qwen3_tokenizer()
    model = build_tiny_model(tokenizer, seed=0, initializer_range=0.2)
    extra = {}
    if reward_funcs == "reward_model":
        reward_funcs = tiny_reward_model(build_tiny_tokenizer())
        extra["reward_processing_classes"] = qwen3_tokenizer()  # renders tool calls
    return GroupRelativeTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        processing_class=tokenizer,
        **extra,
        **kwargs,
    )


def turns(trainer, *texts) -> list[list[int]]:
    """One scripted turn per rollout: each text, then eos."""
    return [encode(trainer.processing_class, text) for text in texts]


def parameters(trainer) -> dict[str, torch.Tensor]:
    return {n: param.clone() for n, param in trainer.model.named_parameters()}


def assert_all_changed(trainer, previous):
    for n, param in previous.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


# ------------------------------------------------------------------------------- rollout_func


def rollout_func_trainer(tmp_path, rollout_func):
    """For TRL's `TestGRPORolloutDispatch`, which builds a bare `GRPOTrainer` by
    `object.__new__`: a real trainer with two completions per prompt (our least), so the
    rollout function returns two of each field where TRL's returns one."""
    return trainer_with(
        tmp_path,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=config(tmp_path, num_generations=2, per_device_train_batch_size=2),
        train_dataset=Dataset.from_list([{"prompt": "prompt"}] * 2),
        rollout_func=rollout_func,
    )


def test_generate_prefers_rollout_func(tmp_path):
    """TRL: TestGRPORolloutDispatch.test_generate_prefers_rollout_func (TRL calls the private
    `trainer._generate(prompts)`; ours is `generate_rollouts(rows)`)."""
    trainer = rollout_func_trainer(tmp_path, None)
    trainer.rollout_func = MagicMock(
        return_value={
            "prompt_ids": [[1]] * 2,
            "completion_ids": [[2]] * 2,
            "logprobs": [[-0.1]] * 2,
            "env_mask": [[1]] * 2,
        }
    )

    rollout = trainer.generate_rollouts([{"prompt": "prompt"}])

    assert rollout.prompt_ids[rollout.prompt_mask.bool()].tolist() == [1, 1]  # prompt_ids
    assert rollout.completion_id_lists() == [[2], [2]]  # completion_ids
    assert rollout.tool_mask.tolist() == [[1], [1]]  # tool_mask (from env_mask)
    trainer.rollout_func.assert_called_once_with(["prompt", "prompt"], trainer)


def test_generate_rollout_func_syncs_weights_when_needed(tmp_path):
    """TRL: TestGRPORolloutDispatch.test_generate_rollout_func_syncs_vllm_weights_when_needed.
    TRL checks `vllm_generation.sync_weights` and `_last_loaded_step`; ours asks the engine to
    publish the weights of the current step (`Engine.publish`: a vLLM engine loads the adapter,
    the transformers engine has nothing to do) before the rollout function samples."""
    trainer = rollout_func_trainer(tmp_path, None)
    order = MagicMock()
    trainer.rollouts.engine = order.engine
    order.rollout_func.return_value = {
        "prompt_ids": [[1]] * 2,
        "completion_ids": [[2]] * 2,
        "logprobs": [[0.0]] * 2,
    }
    trainer.rollout_func = order.rollout_func
    trainer.state.global_step = 2

    trainer.generate_rollouts([{"prompt": "prompt"}])

    order.engine.publish.assert_called_once_with(trainer.state.global_step)
    trainer.rollout_func.assert_called_once_with(["prompt", "prompt"], trainer)
    assert [c[0] for c in order.mock_calls] == ["engine.publish", "rollout_func"]


def test_generate_rollout_func_raises_when_required_keys_are_missing(tmp_path):
    """TRL: TestGRPORolloutDispatch.test_generate_rollout_func_raises_when_required_keys_are_missing."""
    trainer = rollout_func_trainer(tmp_path, None)
    trainer.rollout_func = MagicMock(
        return_value={"prompt_ids": [[1]] * 2, "completion_ids": [[2]] * 2}
    )

    with pytest.raises(ValueError, match="rollout_func must return keys"):
        trainer.generate_rollouts([{"prompt": "prompt"}])


# -------------------------------------------------------------------------------------- tools


@pytest.mark.parametrize("tools", [[multiply_tool], [async_multiply_tool]])
def test_train_with_tools(tmp_path, tools):
    """TRL: TestGRPOTrainer.test_train_with_tools. The model makes 3 completions, 2 of which are
    tool calls; one succeeds and the other fails (wrong argument name)."""
    steps = 3
    trainer = trainer_with(
        tmp_path,
        args=config(
            tmp_path,
            learning_rate=0.1,
            per_device_train_batch_size=3,
            num_generations=3,
            max_completion_length=256,  # TRL: 128 Qwen tokens; ours are bytes
            max_steps=steps,
        ),
        train_dataset=zen(),
        tools=tools,
    )
    previous_trainable_params = parameters(trainer)
    tool_name = tools[0].__name__
    first = turns(
        trainer,
        call(tool_name, a=3, b=4),
        call(tool_name, a=3, c=4),  # an invalid tool call with wrong argument name
        "I don't know any tool",
    )
    second = turns(trainer, "Done!", "Done!")  # only the two rollouts that called a tool
    trainer.rollouts.engine = engine = ScriptedEngine([first, second] * steps)

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert trainer.state.log_history[-1]["tools/call_frequency"] is not None
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] is not None
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)
    # TRL's `fake_generate` asserts this layout by the batch sizes it answers to.
    assert [len(contexts) for contexts in engine.prompts] == [3, 2] * steps
    assert_all_changed(trainer, previous_trainable_params)


def test_train_with_malformed_tool_calls(tmp_path):
    """TRL: TestGRPOTrainer.test_train_with_malformed_tool_calls. None of the 3 completions is a
    well-formed call, so the engine is never called a second time."""
    steps = 3
    trainer = trainer_with(
        tmp_path,
        args=config(
            tmp_path,
            learning_rate=0.1,
            per_device_train_batch_size=3,
            num_generations=3,
            max_completion_length=128,
            max_steps=steps,
        ),
        train_dataset=zen(),
        tools=[multiply_tool],
    )
    previous_trainable_params = parameters(trainer)
    first = turns(
        trainer,
        '<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call>',
        '<toolcall>\n{"arguments": {"a": 3, "b": 4}}\n</toolcall>',
        '<tool_call>\n{"arguments": {a: 3, b: 4}}\n</tool_call>',
    )
    trainer.rollouts.engine = engine = ScriptedEngine([first] * steps)

    trainer.train()

    # TRL's `fake_generate` asserts that every call has the 3 rollouts (no second call).
    assert [len(contexts) for contexts in engine.prompts] == [3] * steps
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)


# ------------------------------------------------------------------------ environment_factory


def test_train_with_multiple_environments(tmp_path):
    """TRL: TestGRPOTrainer.test_train_with_multiple_environments. With a dict
    `environment_factory`, each rollout uses the environment its `environment` field names, with
    that environment's tools only. With `shuffle_dataset=False` and `num_generations=2`, every
    generation batch is [counter, counter, echo, echo]."""
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 8})

    reset_kwargs_seen = {"counter": [], "echo": []}
    tool_calls_made = {"increment": [], "shout": []}
    made = []  # the environments built, in order (stands for TRL's `_environment_pool`)

    class CounterEnvironment:
        def __init__(self):
            made.append("counter")

        def reset(self, **kwargs):
            reset_kwargs_seen["counter"].append(kwargs)
            return "Count."

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            tool_calls_made["increment"].append(step)
            return step

    class EchoEnvironment:
        def __init__(self):
            made.append("echo")

        def reset(self, **kwargs):
            reset_kwargs_seen["echo"].append(kwargs)
            return "Echo."

        def shout(self, text: str) -> str:
            """
            Shout the given text.

            Args:
                text: Text to shout.

            Returns:
                The text in upper case.
            """
            tool_calls_made["shout"].append(text)
            return text.upper()

    steps = 2  # TRL trains 3 epochs of the 16 rows; two batches show the same
    trainer = trainer_with(
        tmp_path,
        args=config(
            tmp_path,
            learning_rate=0.1,
            per_device_train_batch_size=4,  # 2 prompts x 2 generations: a batch mixes both
            num_generations=2,
            shuffle_dataset=False,  # keep the [counter, counter, echo, echo] layout
            max_completion_length=256,
            max_steps=steps,
        ),
        train_dataset=dataset,
        environment_factory={"counter": CounterEnvironment, "echo": EchoEnvironment},
    )

    # Each environment exposes only its own tool (TRL reads its private `_env_tools`).
    environments = trainer.agent.environments
    assert environments.tools_for("counter").names == ["increment"]
    assert environments.tools_for("echo").names == ["shout"]
    # The probe instances seed the reuse pool, so they are not wasted (TRL: one instance in each
    # of `_environment_pool`'s lists): one of each was built at construction...
    assert made == ["counter", "echo"]

    previous_trainable_params = parameters(trainer)
    first = turns(
        trainer,
        call("increment", step=1),  # counter: valid, only CounterEnvironment has it
        "I won't",  # counter: no call (reward variance within the group)
        call("shout", text="hi"),  # echo: valid, only EchoEnvironment has it
        "Done!",  # echo: no call
    )
    second = turns(trainer, "Done!", "Done!")
    trainer.rollouts.engine = ScriptedEngine([first, second] * steps)

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    # Each rollout dispatched to its own environment's tools.
    assert tool_calls_made["increment"]
    assert tool_calls_made["shout"]
    # 2 of the 4 rollouts issued a tool call, and both calls succeeded.
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 4)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(0.0)
    # Both environments were selected and reset, and `environment` is not forwarded to `reset`.
    assert reset_kwargs_seen["counter"] and reset_kwargs_seen["echo"]
    assert all(
        "environment" not in kwargs
        for kwargs in reset_kwargs_seen["counter"] + reset_kwargs_seen["echo"]
    )
    # ...and a batch of two rollouts per environment needed only one more of each, ever.
    assert sorted(made) == ["counter", "counter", "echo", "echo"]
    assert_all_changed(trainer, previous_trainable_params)


def test_train_with_unknown_environment_raises(tmp_path):
    """TRL: TestGRPOTrainer.test_train_with_unknown_environment_raises."""
    dataset = zen().map(lambda example: {"environment": "unknown"})

    class CounterEnvironment:
        def reset(self, **kwargs): ...

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            return step

    trainer = trainer_with(
        tmp_path,
        args=config(tmp_path, per_device_train_batch_size=3, num_generations=3),
        train_dataset=dataset,
        environment_factory={"counter": CounterEnvironment},
    )

    with pytest.raises(ValueError, match="not among the environments"):
        trainer.train()


class DummyEnvironment:
    """TRL's `DummyEnvironment` of `test_train_with_environment_factory`."""

    def reset(self, **kwargs):
        self._counter = 0

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self._counter += step
        return self._counter


class RewardedDummyEnvironment(DummyEnvironment):
    """TRL's `DummyEnvironment` of `test_train_with_environment_owned_reward`: it owns the reward."""

    def get_reward(self) -> float:
        return float(self._counter)


def counter_script(trainer, steps: int) -> ScriptedEngine:
    """TRL's `fake_generate` of the counter tests: a call that succeeds, one to a tool that does
    not exist, and no call; then 'Done!' for the two that called."""
    first = turns(
        trainer,
        call("increment", step=1),
        call("decrement", step=2),  # an invalid tool call with wrong tool name
        "I won't increment",
    )
    return ScriptedEngine([first, turns(trainer, "Done!", "Done!")] * steps)


def test_train_with_environment_factory(tmp_path):
    """TRL: TestGRPOTrainer.test_train_with_environment_factory."""
    steps = 5
    trainer = trainer_with(
        tmp_path,
        args=config(
            tmp_path,
            learning_rate=0.1,
            per_device_train_batch_size=3,
            num_generations=3,
            max_steps=steps,  # required with environment_factory
            max_completion_length=256,
        ),
        environment_factory=DummyEnvironment,
    )
    previous_trainable_params = parameters(trainer)
    trainer.rollouts.engine = counter_script(trainer, steps)

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert trainer.state.log_history[-1]["tools/call_frequency"] is not None
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] is not None
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)

    # Check the states of the environment
    assert trainer.environments[0]._counter == 1  # should have been incremented once
    assert trainer.environments[1]._counter == 0  # the tool call failed
    assert trainer.environments[2]._counter == 0  # no tool call was made
    assert_all_changed(trainer, previous_trainable_params)


def test_train_with_environment_owned_reward(tmp_path):
    """TRL: TestGRPOTrainer.test_train_with_environment_owned_reward. No `reward_funcs`: the
    reward is the final counter, so the 3 generations (counters 1, 0, 0) get 1.0, 0.0, 0.0."""
    steps = 5
    trainer = trainer_with(
        tmp_path,
        reward_funcs=None,
        args=config(
            tmp_path,
            learning_rate=0.1,
            per_device_train_batch_size=3,
            num_generations=3,
            max_steps=steps,  # required with environment_factory
            max_completion_length=256,
        ),
        environment_factory=RewardedDummyEnvironment,
    )

    # The env-owned reward is the sole reward source (named after the env class), weight 1, and
    # `get_reward` is not exposed as a tool.
    assert trainer.reward_names == ["RewardedDummyEnvironment"]  # TRL: reward_func_names
    assert trainer.reward_weights.tolist() == [1.0]
    tool_names = [tool.__name__ for tool in trainer.tools]
    assert "increment" in tool_names
    assert "get_reward" not in tool_names
    assert "reset" not in tool_names

    previous_trainable_params = parameters(trainer)
    trainer.rollouts.engine = counter_script(trainer, steps)

    trainer.train()

    # Logged like any reward func, under the env class name. Counters 1, 0, 0 -> 1/3.
    assert trainer.state.log_history[-1]["rewards/RewardedDummyEnvironment/mean"] == (
        pytest.approx(1 / 3)
    )
    assert_all_changed(trainer, previous_trainable_params)


def test_environment_owned_reward_coexists_with_reward_funcs(tmp_path):
    """TRL: TestGRPOTrainer.test_environment_owned_reward_coexists_with_reward_funcs."""

    class DummyEnvironment:
        def reset(self, **kwargs):
            self._solved = False

        def guess(self, word: str) -> str:
            """
            Submit a guess.

            Args:
                word: The guessed word.

            Returns:
                Feedback about the guess.
            """
            return "nope"

        def get_reward(self) -> float:
            return 1.0 if self._solved else 0.0

    def format_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    trainer = trainer_with(
        tmp_path,
        reward_funcs=format_reward,
        args=config(
            tmp_path,
            per_device_train_batch_size=3,
            num_generations=3,
            max_steps=5,  # required with environment_factory
            reward_weights=[0.5],  # weight only applies to the trainer-owned reward func
        ),
        environment_factory=DummyEnvironment,
    )

    # Appended after the trainer-owned reward func, under the env class name, weight 1.
    assert trainer.reward_names == ["format_reward", "DummyEnvironment"]  # TRL: reward_func_names
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    assert len(trainer.reward_funcs) == 2
    # `get_reward` is not exposed as a tool; `guess` is.
    tool_names = [tool.__name__ for tool in trainer.tools]
    assert "guess" in tool_names
    assert "get_reward" not in tool_names


def test_environment_owned_reward_mixed_environments(tmp_path):
    """TRL: TestGRPOTrainer.test_environment_owned_reward_mixed_environments. Only some
    environments own their reward; one reward column per class that does, deduplicated when two
    names map to the same class; other environments' rollouts get None."""

    class ScoredEnvironment:  # owns its reward
        def reset(self, **kwargs): ...

        def act(self, x: int) -> int:
            """
            Act.

            Args:
                x: A value.

            Returns:
                The value.
            """
            return x

        def get_reward(self) -> float:
            return 1.0

    class PlainEnvironment:  # no `get_reward`; scored by `reward_funcs`
        def reset(self, **kwargs): ...

        def play(self, x: int) -> int:
            """
            Play.

            Args:
                x: A value.

            Returns:
                The value.
            """
            return x

    def format_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    dataset = Dataset.from_dict({"environment": ["scored", "scored2", "plain"]})
    trainer = trainer_with(
        tmp_path,
        reward_funcs=format_reward,
        args=config(tmp_path, per_device_train_batch_size=3, num_generations=3),
        train_dataset=dataset,
        environment_factory={
            "scored": ScoredEnvironment,
            "scored2": ScoredEnvironment,
            "plain": PlainEnvironment,
        },
    )

    assert trainer.reward_names == ["format_reward", "ScoredEnvironment"]  # TRL: reward_func_names
    assert trainer.reward_weights.tolist() == [1.0, 1.0]
    env_reward_func = trainer.reward_funcs[-1]
    rewards = env_reward_func(environments=[ScoredEnvironment(), PlainEnvironment()])
    assert rewards == [1.0, None]


def test_no_reward_source_raises(tmp_path):
    """TRL: TestGRPOTrainer.test_no_reward_source_raises. Neither `reward_funcs` nor an
    environment's `get_reward`: construction fails."""
    with pytest.raises(ValueError, match="No reward source provided"):
        trainer_with(tmp_path, reward_funcs=None, args=config(tmp_path), train_dataset=zen())


def test_dataset_required_without_environment(tmp_path):
    """TRL: TestGRPOTrainer.test_dataset_required_without_environment. Construction fails."""
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        trainer_with(tmp_path, args=config(tmp_path, max_steps=1))


def test_environment_owned_data_requires_max_steps(tmp_path):
    """TRL: TestGRPOTrainer.test_environment_owned_data_requires_max_steps."""

    class DummyEnvironment:
        def reset(self, **kwargs):
            return "Guess the 5-letter word."

    with pytest.raises(ValueError, match="max_steps"):
        trainer_with(
            tmp_path, args=config(tmp_path), environment_factory=DummyEnvironment
        )  # max_steps unset


def test_multiple_environments_without_dataset_raises(tmp_path):
    """TRL: TestGRPOTrainer.test_multiple_environments_without_dataset_raises."""

    class EnvA:
        def reset(self, **kwargs): ...

    class EnvB:
        def reset(self, **kwargs): ...

    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        trainer_with(
            tmp_path,
            args=config(tmp_path, max_steps=1),
            environment_factory={"a": EnvA, "b": EnvB},
        )


def test_train_with_environment_owned_data(tmp_path):
    """TRL: TestGRPOTrainer.test_train_with_environment_owned_data. No `train_dataset`: `reset()`
    returns the prompt and `max_steps` drives the loop."""

    class GuessTheWordEnvironment:
        def reset(self, **kwargs):
            return "Guess the 5-letter word."

    def reward_len(completions, **kwargs):
        return [float(len(completion[-1]["content"])) for completion in completions]

    steps = 5
    trainer = trainer_with(
        tmp_path,
        reward_funcs=reward_len,
        args=config(
            tmp_path,
            learning_rate=0.1,
            per_device_train_batch_size=3,
            num_generations=3,
            max_steps=steps,
            max_completion_length=8,
        ),
        environment_factory=GuessTheWordEnvironment,
    )
    previous_trainable_params = parameters(trainer)
    # Distinct-length completions within the group give reward variance (TRL: 'Done!',
    # 'DoneDone!', 'DoneDoneDone!', 3 to 5 Qwen tokens; in bytes they would pass 8).
    trainer.rollouts.engine = ScriptedEngine([turns(trainer, "D!", "DD!", "DDD!")] * steps)

    trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, previous_trainable_params)
