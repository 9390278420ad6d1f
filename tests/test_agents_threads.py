"""Where tools run, through the trainer, side by side with `trl.GRPOTrainer` on scripted turns.

By default sync tools run on the thread that samples (the main thread here), one after another in
the order the model wrote them, as TRL runs them: an environment holding an SQLite connection, a
tool timed with `signal.alarm` (as math_verify is) and a turn `[write("hello"), read()]` work
unchanged. `tool_call_workers` > 1 opts into threads: each environment is made, reset, called and
scored on one worker thread, so the SQLite environment works there too; a tool that cannot run off
the main thread fails with a warning that says why.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
import time

import pytest
from agent_helpers import call, encode, needs_trl_1_16, qwen3_tokenizer, script_trl
from datasets import Dataset
from trl_reference import matches_trl

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny import save_tiny

pytestmark = needs_trl_1_16


class Notebook:
    """An environment whose tools write to and read its text."""

    def __init__(self):
        self.text = ""

    def reset(self, **row) -> None:
        self.text = ""

    def write(self, text: str) -> str:
        """Append text to the notebook.

        Args:
            text: What to append.
        """
        time.sleep(0.05)  # a read that runs meanwhile would see the old text
        self.text += text
        return "written"

    def read(self) -> str:
        """Read the notebook."""
        return self.text


class Ledger:
    """An environment holding an SQLite connection, opened in `__init__` (usable only on the
    thread that opened it); records on which threads it is used."""

    def __init__(self):
        self.threads = {threading.get_ident()}
        self.db = sqlite3.connect(":memory:")
        self.db.execute("CREATE TABLE entries (value TEXT)")

    def reset(self, **row) -> None:
        self.threads.add(threading.get_ident())
        self.db.execute("DELETE FROM entries")

    def record(self, value: str) -> str:
        """Record a value.

        Args:
            value: What to record.
        """
        self.threads.add(threading.get_ident())
        self.db.execute("INSERT INTO entries VALUES (?)", (value,))
        return "recorded"

    def entries(self) -> str:
        """The values recorded so far, in order."""
        self.threads.add(threading.get_ident())
        return ", ".join(value for (value,) in self.db.execute("SELECT value FROM entries"))

    def get_reward(self) -> float:
        self.threads.add(threading.get_ident())
        return float(self.db.execute("SELECT COUNT(*) FROM entries").fetchone()[0])


def checked_product(a: int, b: int) -> int:
    """Multiplies two integers, with a time limit (set with signal.alarm, as math_verify does).

    Args:
        a: The first integer.
        b: The second integer.
    """

    def too_slow(signum, frame):
        raise TimeoutError("too slow")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(5)
    try:
        return a * b
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


SCRIPTS = {  # the model's first turn; after the results, it answers "Done."
    "notebook": call("write", text="hello") + "\n" + call("read"),
    "ledger": call("record", value="a") + "\n" + call("record", value="b") + "\n" + call("entries"),
    "signal": call("checked_product", a=6, b=7),
}
EXPECTED = {  # the contents of the tool messages, as TRL gives them
    "notebook": ["written", "hello"],
    "ledger": ["recorded", "recorded", "a, b"],
    "signal": ["42"],
}


def turn(name: str, context: str) -> str:
    return "Done." if "<tool_response>" in context else SCRIPTS[name]


def setup(name: str) -> dict:
    """The trainer arguments of the case `name`."""
    if name == "signal":
        return {"tools": [checked_product]}
    return {"environment_factory": {"notebook": Notebook, "ledger": Ledger}[name]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)
    qwen3_tokenizer().save_pretrained(path)
    return path


def dataset() -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "Use the tools."}]] * 2})


def recorder(seen: list):
    def reward(completions, **kwargs):
        seen.extend(completions)
        return [1.0] * len(completions)

    return reward


def ours(name: str, model_dir: str, tmp_path, **config) -> tuple[list, GroupRelativeTrainer]:
    """Trains one step with the scripted model; the completions the reward saw, and the
    trainer."""
    seen = []
    args = GroupRelativeConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        max_prompt_length=None,
        max_completion_length=512,
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        logging_steps=1,
        seed=0,
        **config,
    )
    trainer = GroupRelativeTrainer(
        model=model_dir,
        reward_funcs=recorder(seen),
        args=args,
        train_dataset=dataset(),
        **setup(name),
    )
    from agent_helpers import ScriptedEngine

    tokenizer = trainer.processing_class
    trainer.rollouts.engine = ScriptedEngine(
        lambda ids: encode(tokenizer, turn(name, tokenizer.decode(ids)))
    )
    trainer.train()
    return seen, trainer


def trls(name: str, model_dir: str, tmp_path, monkeypatch) -> list:
    """The completions the reward saw when `trl.GRPOTrainer` trains one step on the same
    scripted turns."""
    import trl

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    seen = []
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=512,
        max_steps=1,
        logging_steps=1,
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=model_dir,
        reward_funcs=recorder(seen),
        args=args,
        train_dataset=dataset(),
        **setup(name),
    )
    script_trl(trainer, lambda context: turn(name, context))
    trainer.train()
    return seen


def tool_contents(completions: list) -> list[list]:
    return [[m["content"] for m in messages if m["role"] == "tool"] for messages in completions]


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_tools_run_as_in_trl_by_default(name, model_dir, tmp_path):
    """`[write("hello"), read()]` reads "hello"; the SQLite environment and the signal.alarm
    tool work; the same tool messages as `trl.GRPOTrainer` gives."""
    seen, trainer = ours(name, model_dir, tmp_path / "ours")
    assert tool_contents(seen) == [EXPECTED[name]] * 4
    assert trainer.args.tool_call_workers == 1
    assert trainer.state.log_history[0]["tools/failure_frequency"] == 0.0


@matches_trl
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_trl_gives_the_same_tool_results(name, model_dir, tmp_path, monkeypatch):
    assert tool_contents(trls(name, model_dir, tmp_path, monkeypatch)) == [EXPECTED[name]] * 4


def test_with_threads_each_environment_lives_on_one_worker_thread(model_dir, tmp_path):
    """`tool_call_workers: 4`: the SQLite environment is made, reset, called and scored on one
    worker thread (not the main thread), and every call of a rollout runs in order."""
    seen, trainer = ours("ledger", model_dir, tmp_path, tool_call_workers=4)
    assert tool_contents(seen) == [EXPECTED["ledger"]] * 4
    environments = trainer.environments
    assert len({id(e) for e in environments}) == 4
    for environment in environments:
        assert len(environment.threads) == 1
        assert environment.threads != {threading.main_thread().ident}
    # its get_reward ran there too: two entries recorded
    assert trainer.state.log_history[0]["rewards/Ledger/mean"] == 2.0


def test_with_threads_a_main_thread_tool_fails_with_a_warning_once(model_dir, tmp_path):
    with pytest.warns(RuntimeWarning) as warned:
        seen, _ = ours("signal", model_dir, tmp_path, tool_call_workers=2)
    messages = [str(w.message) for w in warned if "checked_product" in str(w.message)]
    assert len(messages) == 1  # once, though all 4 calls failed
    assert "signal only works in main thread" in messages[0]
    assert "tool_call_workers=1" in messages[0]
    assert all("signal only works in main thread" in c[0] for c in tool_contents(seen))


def test_rewards_are_unchanged_by_threads(model_dir, tmp_path):
    """The same completions and rewards with and without threads."""
    default, _ = ours("notebook", model_dir, tmp_path / "default")
    threaded, _ = ours("notebook", model_dir, tmp_path / "threads", tool_call_workers=3)
    assert default == threaded
