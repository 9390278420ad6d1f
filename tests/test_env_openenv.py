"""`from_openenv`: an OpenEnv environment server, started on loopback here (uvicorn, no Docker),
drives multi-turn rollouts: every rollout opens a session of its own and resets it before any
step, the model's tool calls step it, and the reward is the server's."""

import socket

import pytest

pytest.importorskip(
    "openenv.core", reason="openenv-core is not installed (pip install '.[environments]')"
)

from agent_helpers import ScriptedEngine, call, encode, needs_trl_1_16, qwen3_tokenizer  # noqa: E402
from datasets import Dataset  # noqa: E402
from openenv.core.env_server import Action, Environment, Observation, State  # noqa: E402
from pydantic import Field  # noqa: E402
from trainer_helpers import make_trainer  # noqa: E402

from trl_grpo_ext.environments import from_openenv  # noqa: E402
from trl_grpo_ext.environments.openenv import serve_environment  # noqa: E402
from trl_grpo_ext.tiny import build_tiny_model  # noqa: E402


class GuessAction(Action):
    guess: int = Field(description="The number guessed, from 0 to 9.")


class GuessObservation(Observation):
    feedback: str = ""


class GuessNumber(Environment):
    """Guess the number (the reset's seed): -0.1 per wrong guess, 1 for the right one. Records
    every session (one instance per WebSocket session) and what reached it."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    sessions: list = []

    def __init__(self):
        super().__init__()
        self.target, self.events = None, []
        GuessNumber.sessions.append(self)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = seed
        self.events.append("reset")
        return GuessObservation(feedback="Guess a number from 0 to 9.")

    def step(self, action, timeout_s=None, **kwargs):
        self.events.append(action.guess)
        if self.target is None:
            raise RuntimeError("a step before any reset")
        if action.guess == self.target:
            return GuessObservation(feedback="Correct!", done=True, reward=1.0)
        hint = "higher" if action.guess < self.target else "lower"
        return GuessObservation(feedback=hint, reward=-0.1)

    @property
    def state(self):
        return State(step_count=len(self.events))


@pytest.fixture(scope="module")
def server():
    running = serve_environment(GuessNumber, GuessAction, GuessObservation)
    yield running
    running.stop()


def guess_trainer(tmp_path, arguments, rows):
    tokenizer = qwen3_tokenizer()
    return make_trainer(
        tmp_path,
        model=build_tiny_model(tokenizer, seed=0, initializer_range=0.2),
        tokenizer=tokenizer,
        dataset=rows,
        reward_funcs=arguments.get("reward_funcs"),
        environment_factory=arguments["environment_factory"],
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=256,
        max_prompt_length=None,
        max_steps=1,
    )


def rows_of(*seeds):
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "Play."}], "seed": s} for s in seeds]
    )


@needs_trl_1_16
def test_multi_turn_rollouts_each_on_a_session_of_its_own_reset_before_any_step(tmp_path, server):
    arguments = from_openenv(server.url)
    rows = rows_of(3, 5)
    trainer = guess_trainer(tmp_path, arguments, rows)
    assert [tool.__name__ for tool in trainer.tools] == ["step"]
    assert trainer.reward_names == ["OpenEnv"]
    tokenizer = trainer.processing_class
    call_ids, answer_ids = encode(tokenizer, call("step", guess=3)), encode(tokenizer, "Done.")
    trainer.rollouts.engine = engine = ScriptedEngine([call_ids, answer_ids])
    GuessNumber.sessions.clear()
    rollout = trainer.generate_rollouts([rows[0], rows[1]])
    rewards = trainer.score_rollouts(rollout)

    # four sessions, one per rollout, each reset (with its row's seed) before its one step
    assert len(GuessNumber.sessions) == 4
    assert sorted(s.target for s in GuessNumber.sessions) == [3, 3, 5, 5]
    assert all(s.events == ["reset", 3] for s in GuessNumber.sessions)
    assert rollout.prompts[0][-1]["content"] == "Play.Guess a number from 0 to 9."
    feedback = ["Correct!", "Correct!", "higher", "higher"]
    for i in range(4):
        assert rollout.completions[i][1] == {"role": "tool", "name": "step", "content": feedback[i]}
        result_ids = trainer.rollouts.tool_loop.format.result_ids([rollout.completions[i][1]])
        length = int(rollout.completion_mask[i].sum())
        assert rollout.completion_ids[i, :length].tolist() == call_ids + result_ids + answer_ids
        mask = [1] * len(call_ids) + [0] * len(result_ids) + [1] * len(answer_ids)
        assert rollout.tool_mask[i, :length].tolist() == mask
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
        assert engine.prompts[1][i] == prompt + call_ids + result_ids  # token-in
    assert rewards[:, 0].tolist() == pytest.approx([1.0, 1.0, -0.1, -0.1])  # the server's

    # the next batch: new sessions again, each reset before its step
    engine.script = [call_ids, call_ids, answer_ids]
    engine.prompts.clear()
    rollout = trainer.generate_rollouts([rows[1], rows[1]])
    assert len(GuessNumber.sessions) == 8
    # two guesses of 3 against 5: the second is stepped too; the sum of the rewards is the reward
    assert all(s.events == ["reset", 3, 3] for s in GuessNumber.sessions[4:])
    assert trainer.score_rollouts(rollout)[:, 0].tolist() == pytest.approx([-0.2] * 4)


@needs_trl_1_16
def test_the_completion_as_the_action(tmp_path, server):
    arguments = from_openenv(
        server.url, mode="completion", action=lambda text: {"guess": int(text.strip()[:1] or -1)}
    )
    rows = rows_of(4, 7)
    trainer = guess_trainer(tmp_path, arguments, rows)
    assert trainer.tools == [] and trainer.reward_names == ["openenv"]
    trainer.rollouts.engine = ScriptedEngine([encode(trainer.processing_class, "4")])
    GuessNumber.sessions.clear()
    rollout = trainer.generate_rollouts([rows[0], rows[1]])
    rewards = trainer.score_rollouts(rollout)
    assert rewards[:, 0].tolist() == pytest.approx([1.0, 1.0, -0.1, -0.1])
    assert (
        all(s.events == ["reset", 4] for s in GuessNumber.sessions)
        and len(GuessNumber.sessions) == 4
    )


def test_the_episode_ends_and_a_session_not_reset_is_never_stepped(server):
    environment = from_openenv(server.url)["environment_factory"]()
    with pytest.raises(RuntimeError, match="not reset"):
        environment.step(guess=1)
    environment.reset(seed=2)
    assert environment.step(guess=2) == "Correct!"
    assert environment.step(guess=2) == "The episode is over: nothing was done."
    assert environment.get_reward() == 1.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_wrong_inputs_and_an_unreachable_server_are_clear_errors(server):
    port = free_port()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        from_openenv(f"http://127.0.0.1:{port}")
    with pytest.raises(ValueError, match="mode="):
        from_openenv(server.url, mode="single")
    with pytest.raises(ValueError, match="one of the two"):
        from_openenv(server.url, server=lambda: server.url)
    with pytest.raises(ValueError, match="url="):
        from_openenv("127.0.0.1:8000")
    with pytest.raises(TypeError, match="EnvClient"):
        from_openenv(server.url, client_class=dict)
    with pytest.raises(TypeError, match="not a callable"):
        from_openenv(server.url, action="guess")
    # a started server: `server=` starts it and gives its URL
    assert from_openenv(server=lambda: server.url)["environment_factory"]
