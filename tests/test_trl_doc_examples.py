"""The examples of TRL's documentation for `tools` and `environment_factory`, run on our trainer
with only the import changed.

From huggingface/trl at commit f2cd577 (version 1.10.0.dev0, the newest stored snapshot of the
repository; the installed trl 1.16.0 ships no docs): `docs/source/grpo_trainer.md`, section
"Agent Training" (Tools, Environments, Providing an external dataset, Rewards, Multiple
environments), and `docs/source/openenv.md` (Quick start, Wordle). Each example keeps its code as
written, with `from trl import GRPOTrainer, GRPOConfig` changed to
`from trl_grpo_ext import GroupRelativeTrainer as GRPOTrainer, GroupRelativeConfig as GRPOConfig`.
The substitutions that running offline on a CPU in seconds needs are listed above each test, one
line each. Everywhere:

- `model="Qwen/..."` -> a folder with the tiny model (`trl_grpo_ext.tiny.save_tiny`) whose
  tokenizer has TRL's Qwen3 chat template (`agent_helpers.qwen3_tokenizer`), the tool format of
  the documented Qwen3 models.
- The tiny model is random and writes no tool calls, so the trainer's engine is replaced by
  `agent_helpers.ScriptedEngine`, a model that reads its context and writes the calls a trained
  model would: the examples are about the tool loop.
- Config: `max_steps` of 1 or 2, 2 to 4 completions per step, `use_cpu=True`, `report_to="none"`.
  `max_prompt_length` keeps our default of 512: the tools' schemas, more than 512 tokens in the
  byte-level tiny tokenizer, do not count toward it.

Not ported:
- grpo_trainer.md "Multimodal Tool Responses": a tool returning an image for a VLM; tool results
  with images are not supported (docs/agents.md, "Differences from TRL").
- openenv.md "Multi-environment training" (`MultiEnv`): its tools' bodies are elided (`...`)
  and its clients are OpenEnv servers; `test_multiple_environments` and the Wordle test cover
  its contract (`None` rewards, a dataset column reaching `reset`, an exception as a result).
- openenv.md "Training on harnesses": TRL's experimental `AsyncGRPOTrainer`.
- `rollout_func`: the docs describe it (openenv.md, "environment_factory vs rollout_func") but
  give no code example.
"""

from __future__ import annotations

import re
import sys
import types

import pytest
from agent_helpers import ScriptedEngine, call, encode, needs_trl_1_16, qwen3_tokenizer
from datasets import Dataset

from trl_grpo_ext.tiny import save_tiny

pytestmark = needs_trl_1_16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny model's folder, its tokenizer with Qwen3's chat template (renders tools)."""
    path = save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)
    qwen3_tokenizer().save_pretrained(path)
    return path


def offline(tmp_path, *set_by_example: str, **overrides) -> dict:
    """The config fields that run an example offline on the CPU in a second or two, but for the
    fields named in `set_by_example`, which the example's own arguments set."""
    fields = {
        "output_dir": str(tmp_path),
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "per_device_train_batch_size": 2,
        "num_generations": 2,
        "max_steps": 1,
        "logging_steps": 1,
        "seed": 0,
        **overrides,
    }
    return {name: value for name, value in fields.items() if name not in set_by_example}


def scripted_model(trainer, turn) -> ScriptedEngine:
    """Replaces the trainer's engine by a model that writes `turn(context)` (a string) for the
    rendered context it is given (the prompt and every turn and tool result so far)."""
    tokenizer = trainer.processing_class
    engine = ScriptedEngine(lambda ids: encode(tokenizer, turn(tokenizer.decode(ids))))
    trainer.rollouts.engine = engine
    return engine


def last_user_text(context: str) -> str:
    """The last user message of a Qwen3 rendering (a tool result is a user message there)."""
    return context.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


def schemas(context: str) -> list[str]:
    """The names of the tools whose schemas the chat template rendered into `context`."""
    listed = context.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    return re.findall(r'"function", "function": \{"name": "(\w+)"', listed)


def logged(trainer) -> dict:
    """The metrics of the first training step."""
    return trainer.state.log_history[0]


# --------------------------------------------------------------------------------------- tools

# grpo_trainer.md, "Tools", the second example. Substitutions:
# - `...` in `GRPOTrainer(...)` -> `model`, `args`, `train_dataset` and `reward_funcs`, which the
#   example elides: a conversational dataset and a reward that records the completions.
# - the model writes one turn with a call of each tool, then answers "Done." after the results.


def test_tools(model_dir, tmp_path):
    from trl_grpo_ext import GroupRelativeTrainer as GRPOTrainer

    def multiply(a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        return a * b

    async def async_add(a: int, b: int) -> int:
        """
        Asynchronously adds two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum of the two integers.
        """
        return a + b

    # --- what `...` stands for
    from trl_grpo_ext import GroupRelativeConfig as GRPOConfig

    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "What are 6 * 7 and 2 + 3?"}]] * 4}
    )
    seen = []

    def reward_func(completions, **kwargs):
        seen.extend(completions)
        return [1.0] * len(completions)

    # ---

    trainer = GRPOTrainer(
        tools=[multiply, async_add],
        model=model_dir,
        args=GRPOConfig(**offline(tmp_path)),
        train_dataset=dataset,
        reward_funcs=reward_func,
    )

    def turn(context):
        assert schemas(context) == ["multiply", "async_add"]
        if "<tool_response>" in context:
            return "Done."
        return call("multiply", a=6, b=7) + "\n" + call("async_add", a=2, b=3)

    scripted_model(trainer, turn)
    trainer.train()

    assert len(seen) == 2
    for messages in seen:
        assert [m["role"] for m in messages] == ["assistant", "tool", "tool", "assistant"]
        assert [(m["name"], m["content"]) for m in messages[1:3]] == [
            ("multiply", "42"),
            ("async_add", "5"),
        ]
    assert logged(trainer)["tools/call_frequency"] == 2.0
    assert logged(trainer)["tools/failure_frequency"] == 0.0


# -------------------------------------------------------------------------------- environments


def increment_env_class():
    """grpo_trainer.md, "Environments": the environment that self-samples its target."""
    import random

    class IncrementEnv:
        # Reserved methods
        def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
            self.counter = 0
            self.target = random.randint(1, 6)  # self-sample the task
            return f"Increment the counter by {self.target}."  # returned string becomes the prompt

        def get_reward(self) -> float:  # optional: the environment scores itself from its state
            return float(self.counter == self.target)

        # Public methods (exposed as tools)
        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            self.counter += step
            return self.counter

    return IncrementEnv


def increment_to_target(context: str) -> str:
    """A model that calls `increment` with the number in the task, then stops."""
    if "<tool_response>" in context:
        return "Done."
    (target,) = re.findall(r"Increment the counter (?:by|to) (\d+)\.", last_user_text(context))
    return call("increment", step=int(target))


# grpo_trainer.md, "Environments". Substitutions:
# - `max_steps=1000` -> 2, and the offline config fields.
# - the model reads the target from the prompt `reset()` returned and increments by it, so each
#   rollout's `get_reward()` is 1 only if its own instance got the call.


def test_environment_owns_the_data(model_dir, tmp_path):
    from trl_grpo_ext import GroupRelativeConfig as GRPOConfig
    from trl_grpo_ext import GroupRelativeTrainer as GRPOTrainer

    IncrementEnv = increment_env_class()

    trainer = GRPOTrainer(
        model=model_dir,
        args=GRPOConfig(
            chat_template_kwargs={"enable_thinking": False},
            **offline(tmp_path, max_steps=2, per_device_train_batch_size=4),
        ),
        environment_factory=IncrementEnv,
    )
    engine = scripted_model(trainer, increment_to_target)
    trainer.train()

    assert trainer.state.global_step == 2
    assert [entry["rewards/IncrementEnv/mean"] for entry in trainer.state.log_history[:2]] == [
        1.0,
        1.0,
    ]
    assert logged(trainer)["tools/call_frequency"] == 1.0
    # the prompts are the environments' tasks, and the tool is the only one rendered
    first_turns = [context for contexts in engine.prompts[::2] for context in contexts]
    for ids in first_turns:
        context = trainer.processing_class.decode(ids)
        assert schemas(context) == ["increment"]
        assert re.fullmatch(r"Increment the counter by [1-6]\.", last_user_text(context))


# grpo_trainer.md, "Providing an external dataset (optional)". Substitutions:
# - `increment` gets the docstring the example refers to ("see the full docstring above"): a tool
#   without one is an error in TRL too (at the first rollout; here at construction).
# - `args` (TRL's default config) -> the offline config fields.


def test_environment_with_a_dataset(model_dir, tmp_path):
    from datasets import Dataset

    from trl_grpo_ext import GroupRelativeConfig as GRPOConfig
    from trl_grpo_ext import GroupRelativeTrainer as GRPOTrainer

    # Each row carries the prompt and the task data (here, the counter target to reach).
    dataset = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)
            ],
            "target": list(range(1, 7)),
        }
    )

    class IncrementEnv:
        def reset(self, target, **kwargs) -> None:  # the row's `target` arrives as a keyword
            self.counter = 0
            self.target = target

        def get_reward(self) -> float:
            return float(self.counter == self.target)

        def increment(self, step: int) -> int:  # exposed as a tool
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            self.counter += step
            return self.counter

    trainer = GRPOTrainer(
        model=model_dir,
        train_dataset=dataset,  # the dataset owns the task; "target" reaches reset(target=...)
        environment_factory=IncrementEnv,
        args=GRPOConfig(**offline(tmp_path, per_device_train_batch_size=4)),
    )
    targets = []

    def turn(context):
        if "<tool_response>" not in context:
            targets.append(int(re.findall(r"to (\d)\.", last_user_text(context))[0]))
        return increment_to_target(context)

    scripted_model(trainer, turn)
    trainer.train()

    assert logged(trainer)["rewards/IncrementEnv/mean"] == 1.0
    # the instances reached the prompts' targets: `reset` had each row's `target`
    counters = sorted(env.counter for env in trainer.environments)
    assert counters == sorted(targets) and len(targets) == 4


# grpo_trainer.md, "Rewards". Substitutions:
# - `IncrementEnv` is the one of "Environments" above; `format_reward`'s elided body (`...`)
#   -> 0.5 for a completion that ends with "Done.", else 0.
# - `max_steps=1000` -> 1, and the offline config fields.
# - the model increments by the target and answers "Done." in one rollout of each group, "Ok."
#   in the other, so the two sources give distinct sums.


def test_environment_and_trainer_rewards(model_dir, tmp_path):
    from trl_grpo_ext import GroupRelativeConfig as GRPOConfig
    from trl_grpo_ext import GroupRelativeTrainer as GRPOTrainer

    IncrementEnv = increment_env_class()

    def format_reward(completions, **kwargs):  # trainer-owned: scores the completion text
        return [0.5 if messages[-1]["content"] == "Done." else 0.0 for messages in completions]

    trainer = GRPOTrainer(
        model=model_dir,
        args=GRPOConfig(**offline(tmp_path)),
        reward_funcs=format_reward,  # trainer-owned: scores the completion
        environment_factory=IncrementEnv,  # env-owned: scores its internal state via `get_reward`
    )
    answers = iter(["Done.", "Ok."])

    def turn(context):
        return next(answers) if "<tool_response>" in context else increment_to_target(context)

    scripted_model(trainer, turn)
    trainer.train()

    assert trainer.reward_names == ["format_reward", "IncrementEnv"]
    metrics = logged(trainer)
    assert metrics["rewards/format_reward/mean"] == 0.25
    assert metrics["rewards/IncrementEnv/mean"] == 1.0
    assert metrics["reward"] == 1.25  # summed: (1.5 + 1.0) / 2


# grpo_trainer.md, "Multiple environments". Substitutions:
# - `reward_func`, which the example does not define -> one that branches on the environment's
#   type, as the text after the example suggests.
# - `GRPOConfig(chat_template_kwargs=...)` gets `max_steps=1` (else one epoch of 1000 rows) and
#   the offline config fields; 8 completions, so both environments are drawn.
# - the model calls the one tool its prompt shows (`run_code` or `move`); their bodies are `...`
#   as in the example, so each returns None, which the model reads as "None".


def test_multiple_environments(model_dir, tmp_path):
    import random

    from datasets import Dataset

    from trl_grpo_ext import GroupRelativeConfig as GRPOConfig
    from trl_grpo_ext import GroupRelativeTrainer as GRPOTrainer

    class CodingEnv:
        def reset(self, **kwargs) -> str:
            n = random.randint(1, 20)
            return f"Compute the {n}th Fibonacci number."

        def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
            """Run the given Python code and return its stdout.

            Args:
                code: The Python source to execute.

            Returns:
                The captured standard output.
            """
            ...

    class GameEnv:
        def reset(self, **kwargs) -> str:
            return "Reach the goal tile."

        def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
            """Apply an action to the game and return the new observation.

            Args:
                action: One of "up", "down", "left", "right".

            Returns:
                The observation after the move.
            """
            ...

    # The dataset only routes: each row picks the environment for that rollout
    dataset = Dataset.from_dict({"environment": ["coding", "game"] * 500})

    # --- what `reward_func` stands for
    kinds = []

    def reward_func(environments, **kwargs):
        kinds.extend(type(env).__name__ for env in environments)
        return [1.0 if isinstance(env, CodingEnv) else 0.0 for env in environments]

    # ---

    trainer = GRPOTrainer(
        model=model_dir,
        args=GRPOConfig(
            chat_template_kwargs={"enable_thinking": False},
            **offline(tmp_path, per_device_train_batch_size=8),
        ),
        train_dataset=dataset,
        reward_funcs=reward_func,
        environment_factory={"coding": CodingEnv, "game": GameEnv},
    )
    tasks = []

    def turn(context):
        if "<tool_response>" in context:
            assert last_user_text(context) == "<tool_response>\nNone\n</tool_response>"
            return "Done."
        task, tools = last_user_text(context), schemas(context)
        tasks.append(task)
        if re.fullmatch(r"Compute the \d+th Fibonacci number\.", task):
            assert tools == ["run_code"]  # only the row's environment's tools
            return call("run_code", code="print(1)")
        assert (task, tools) == ("Reach the goal tile.", ["move"])
        return call("move", action="up")

    scripted_model(trainer, turn)
    trainer.train()

    assert len(tasks) == 8 and {"CodingEnv", "GameEnv"} == set(kinds)
    # each rollout's environment is the one its prompt came from
    expected = ["GameEnv" if task == "Reach the goal tile." else "CodingEnv" for task in tasks]
    assert kinds == expected
    assert logged(trainer)["tools/call_frequency"] == 1.0
    assert logged(trainer)["tools/failure_frequency"] == 0.0


# ------------------------------------------------------------------------------------ OpenEnv


def fake_module(monkeypatch, name: str, **attributes) -> None:
    """Installs a module `name` with `attributes` in `sys.modules` for the test."""
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


def ns(**fields) -> types.SimpleNamespace:
    return types.SimpleNamespace(**fields)


# openenv.md, "Quick start" (examples/scripts/openenv/echo.py). Substitutions:
# - the `echo_env` package, a client of the Echo server on the Hub -> a local module with the
#   same `EchoEnv(base_url=...).step(EchoAction(message=...))`, whose reward is the length of
#   the message divided by 10.
# - the dataset's 64 rows -> 4, and the offline config fields (`max_steps=1`).
# - the model echoes "Hello World!" in one rollout of the group and "Hi" in the other.


def test_openenv_echo(model_dir, tmp_path, monkeypatch):
    class EchoAction:
        def __init__(self, message):
            self.message = message

    class FakeEchoEnv:
        def __init__(self, base_url):
            self.base_url = base_url

        def step(self, action):
            message = action.message
            return ns(observation=ns(reward=len(message) / 10, echoed_message=message))

    fake_module(monkeypatch, "echo_env", EchoEnv=FakeEchoEnv)
    fake_module(monkeypatch, "echo_env.models", EchoAction=EchoAction)

    from datasets import Dataset
    from echo_env import EchoEnv
    from echo_env.models import EchoAction

    from trl_grpo_ext import GroupRelativeConfig as GRPOConfig
    from trl_grpo_ext import GroupRelativeTrainer as GRPOTrainer

    ENV_URL = "https://openenv-echo-env.hf.space"

    class EchoToolEnv:
        def __init__(self):
            self.env = EchoEnv(base_url=ENV_URL)
            self.reward = 0.0

        def reset(self, **kwargs) -> str | None:
            self.reward = 0.0
            return None

        def echo(self, message: str) -> str:
            """
            Echo the message back from the environment.

            Args:
                message: The message to echo

            Returns:
                The echoed message.
            """
            observation = self.env.step(EchoAction(message=message))
            self.reward = observation.observation.reward
            return observation.observation.echoed_message

    def reward_func(environments, **kwargs):
        return [env.reward for env in environments]

    dataset = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": "Try to echo 'Hello World!' in the environment."}]
            ]
            * 4
        }
    )

    trainer = GRPOTrainer(
        model=model_dir,
        train_dataset=dataset,
        reward_funcs=reward_func,
        args=GRPOConfig(
            chat_template_kwargs={"enable_thinking": False},
            log_completions=True,
            **offline(tmp_path),
        ),
        environment_factory=EchoToolEnv,
    )
    messages = iter(["Hello World!", "Hi"])

    def turn(context):
        if "<tool_response>" in context:
            return "Done."
        assert last_user_text(context) == "Try to echo 'Hello World!' in the environment."
        return call("echo", message=next(messages))

    scripted_model(trainer, turn)
    trainer.train()

    assert logged(trainer)["rewards/reward_func/mean"] == pytest.approx((1.2 + 0.2) / 2)
    assert sorted(env.reward for env in trainer.environments[:2]) == [0.2, 1.2]


# openenv.md, "Advanced example: Wordle" (Environment class; Reward function and training).
# Substitutions:
# - the `textarena_env` package, a client of the Wordle server on the Hub -> a local module with
#   the same `TextArenaEnv(base_url=...)`, `reset()` and `step(TextArenaAction(message=...))`,
#   a game whose secret is "[crane]" that returns the whole history, as TextArena does.
# - `use_vllm=True, vllm_mode="colocate"` -> the trainer's default engine (replaced by the
#   script), `gradient_accumulation_steps=64` -> 1, `num_generations=4` kept, 1000 rows -> 4.
# - the model guesses "[slate]", then "[crane]", then guesses again after the game is over:
#   `guess` raises `ValueError("Game over.")`, which must come back to it as the result.


def test_openenv_wordle(model_dir, tmp_path, monkeypatch):
    class TextArenaAction:
        def __init__(self, message):
            self.message = message

    class FakeTextArenaEnv:
        def __init__(self, base_url):
            self.base_url = base_url

        def reset(self):
            self.history = "Wordle: guess the 5-letter word in 6 tries."
            return ns(observation=ns(messages=[ns(content=self.history)]))

        def step(self, action):
            won = action.message == "[crane]"
            self.history += f"\n{action.message}: {'GGGGG' if won else 'XXYXG'}"
            return ns(
                observation=ns(messages=[ns(content=self.history)]),
                reward=float(won),
                done=won,
            )

    fake_module(
        monkeypatch,
        "textarena_env",
        TextArenaAction=TextArenaAction,
        TextArenaEnv=FakeTextArenaEnv,
    )

    from textarena_env import TextArenaAction, TextArenaEnv

    class WordleEnv:
        def __init__(self):
            self.client = TextArenaEnv(base_url="https://openenv-wordle.hf.space")

        def reset(self, **kwargs) -> str | None:
            result = self.client.reset()
            self._last_full_feedback = result.observation.messages[0].content
            self.reward = 0.0
            self.done = False
            return self._last_full_feedback

        def guess(self, guess: str) -> str:
            """
            Make a guess in the Wordle environment.

            Args:
                guess: The guessed word, formatted as '[abcde]'

            Returns:
                The feedback message from the environment.
            """
            if self.done:
                raise ValueError("Game over.")
            result = self.client.step(TextArenaAction(message=guess))
            _full_feedback = result.observation.messages[0].content
            feedback = _full_feedback[len(self._last_full_feedback) :]
            self._last_full_feedback = _full_feedback
            if "You attempted an invalid move" in feedback:
                self.reward = 0.0
            else:
                self.reward = result.reward
            self.done = result.done
            return feedback

    from datasets import Dataset

    from trl_grpo_ext import GroupRelativeConfig as GRPOConfig
    from trl_grpo_ext import GroupRelativeTrainer as GRPOTrainer

    def reward_func(environments, **kwargs) -> list[float]:
        return [env.reward for env in environments]

    prompt = """You are an expert Wordle solver with deep knowledge of English vocabulary...
Use the tool `guess` to make a guess."""

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": prompt}]] * 4})

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=reward_func,
        train_dataset=dataset,
        args=GRPOConfig(
            chat_template_kwargs={"enable_thinking": False},
            max_completion_length=1024,
            num_generations=4,
            gradient_accumulation_steps=1,
            **offline(tmp_path, "num_generations", per_device_train_batch_size=4),
        ),
        environment_factory=WordleEnv,
    )
    results, guesses = [], ["[slate]", "[crane]", "[crane]"]

    def turn(context):
        rounds = context.count("<tool_response>")
        if rounds:
            results.append(last_user_text(context))
        return call("guess", guess=guesses[rounds]) if rounds < 3 else "I give up."

    scripted_model(trainer, turn)
    trainer.train()

    assert results[:4] == ["<tool_response>\n\n[slate]: XXYXG\n</tool_response>"] * 4
    assert results[4:8] == ["<tool_response>\n\n[crane]: GGGGG\n</tool_response>"] * 4
    assert results[8:] == ["<tool_response>\n{'error': 'Game over.'}\n</tool_response>"] * 4
    assert logged(trainer)["rewards/reward_func/mean"] == 1.0
    assert logged(trainer)["tools/call_frequency"] == 3.0
    assert logged(trainer)["tools/failure_frequency"] == pytest.approx(1 / 3)
