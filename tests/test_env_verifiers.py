"""`from_verifiers`: a verifiers (`verifiers.v1`) taskset as the trainer's dataset, rewards with
their weights, and tools; the rewards equal the scores `Task.score` records for the same
completions, and the tools run through the trainer's multi-turn loop with exact tokens."""

import asyncio
import logging

import pytest

vf = pytest.importorskip(
    "verifiers.v1", reason="verifiers is not installed (pip install '.[environments]')"
)

from agent_helpers import ScriptedEngine, call, encode, needs_trl_1_16, qwen3_tokenizer  # noqa: E402
from trainer_helpers import make_trainer  # noqa: E402
from verifiers.v1.graph import MessageNode  # noqa: E402
from verifiers.v1.state import state_cls  # noqa: E402
from verifiers.v1.trace import AgentInfo, TraceTask  # noqa: E402

from trl_grpo_ext.config import GroupRelativeConfig  # noqa: E402
from trl_grpo_ext.environments import from_verifiers  # noqa: E402
from trl_grpo_ext.scoring import call_reward_funcs  # noqa: E402
from trl_grpo_ext.tiny import build_tiny_model  # noqa: E402


class SumData(vf.TaskData):
    answer: str = ""
    level: int = 0


class Calculator(vf.Toolset):
    """Adds numbers; counts its calls (one toolset per rollout)."""

    def __init__(self, config):
        super().__init__(config)
        self.calls = 0
        self.task_answer = None

    async def setup_task(self, task) -> None:
        self.task_answer = task.data.answer

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        self.calls += 1
        return a + b


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=2.0)
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward
    async def brevity(self, trace) -> float:
        return 1.0 / (1 + len(trace.last_reply))

    @vf.reward
    async def used_tool(self, trace) -> float:
        return float(len(trace.tool_messages) > 0)

    @vf.reward
    async def in_sandbox(self, trace, runtime) -> float:  # needs a verifiers runtime
        return 1.0

    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for level, (a, b) in enumerate([(2, 3), (4, 4), (1, 6)]):
            data = SumData(
                prompt=f"What is {a} + {b}?",
                system_prompt="Answer with the number.",
                answer=str(a + b),
                level=level,
            )
            yield SumTask(data)


class Forever(vf.Taskset[SumTask]):
    INFINITE = True

    def load(self):
        while True:
            yield SumTask(SumData(prompt="1 + 1?", answer="2"))


def reference_scores(task, messages):
    """What verifiers records for a trace of `task` whose sampled reply is `messages` (built here
    by hand with verifiers' own types): `{name: score}`."""
    nodes = [
        vf.SystemMessage(content=task.data.system_prompt),
        vf.UserMessage(content=task.data.prompt),
    ]
    trace = vf.Trace(
        task=TraceTask(type="SumTask", data=task.data, key=task.key, hash=task.hash),
        state=state_cls(SumTask)(),
        agent=AgentInfo(config=vf.AgentConfig(), name="reference"),
    )
    for position, message in enumerate(nodes + messages):
        trace.nodes.append(
            MessageNode(
                parent=position - 1 if position else None,
                message=message,
                sampled=message.role == "assistant",
            )
        )
    asyncio.run(task.score(trace))
    return {name: reward.score for name, reward in trace.rewards.items()}


def test_rows_are_the_tasks_in_order_with_their_own_fields():
    arguments = from_verifiers(SumTaskset(vf.TasksetConfig()))
    rows = arguments["train_dataset"]
    assert rows.column_names == ["prompt", "answer", "level", "verifiers_index"]
    assert rows[1]["prompt"] == [
        {"role": "system", "content": "Answer with the number."},
        {"role": "user", "content": "What is 4 + 4?"},
    ]
    assert rows["answer"] == ["5", "8", "7"]
    assert rows["level"] == [0, 1, 2]
    assert rows["verifiers_index"] == [0, 1, 2]


def test_rewards_and_weights_equal_verifiers_own_scores(caplog):
    taskset = SumTaskset(vf.TasksetConfig())
    with caplog.at_level(logging.WARNING):
        args = GroupRelativeConfig(output_dir="unused", report_to="none")
        arguments = from_verifiers(taskset, args=args)
    assert "in_sandbox" in caplog.text  # left out, as Task.score leaves it out without a runtime
    names = [f.__name__ for f in arguments["reward_funcs"]]
    assert names == ["brevity", "correct", "used_tool"]
    assert arguments.reward_weights == [1.0, 2.0, 1.0] == args.reward_weights

    tasks = list(taskset)
    with_tool = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calculator_add", "arguments": {"a": 2, "b": 3}},
                }
            ],
        },
        {"role": "tool", "name": "calculator_add", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    completions = [
        [{"role": "assistant", "content": "5"}],
        [{"role": "assistant", "content": "It is 5"}],
        with_tool,
        [{"role": "assistant", "content": "8"}],
        "7",
    ]
    indices = [0, 0, 0, 1, 2]
    rows = arguments["train_dataset"]
    rewards = call_reward_funcs(
        arguments["reward_funcs"],
        prompts=[rows[i]["prompt"] for i in indices],
        completions=completions,
        completion_ids=[[0]] * 5,
        **{name: [rows[i][name] for i in indices] for name in rows.column_names},
    )
    tool_call = vf.ToolCall(id="c0", name="calculator_add", arguments='{"a": 2, "b": 3}')
    by_hand_messages = [
        [vf.AssistantMessage(content="5")],
        [vf.AssistantMessage(content="It is 5")],
        [
            vf.AssistantMessage(content="", tool_calls=[tool_call]),
            vf.ToolMessage(tool_call_id="c0", content="5", name="calculator_add"),
            vf.AssistantMessage(content="5"),
        ],
        [vf.AssistantMessage(content="8")],
        [vf.AssistantMessage(content="7")],
    ]
    for row, (messages, index) in enumerate(zip(by_hand_messages, indices)):
        expected = reference_scores(tasks[index], messages)
        assert rewards[row].tolist() == pytest.approx([expected[name] for name in names])
    # by hand: right answers are correct, "It is 5" is not; only the third used the tool
    assert rewards[:, 1].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert rewards[:, 2].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert rewards[0, 0].item() == pytest.approx(0.5)


@needs_trl_1_16
def test_tools_run_through_the_multi_turn_loop_with_exact_tokens(tmp_path):
    arguments = from_verifiers(SumTaskset(vf.TasksetConfig()))
    tokenizer = qwen3_tokenizer()
    trainer = make_trainer(
        tmp_path,
        model=build_tiny_model(tokenizer, seed=0, initializer_range=0.2),
        tokenizer=tokenizer,
        dataset=arguments["train_dataset"],
        reward_funcs=arguments["reward_funcs"],
        environment_factory=arguments["environment_factory"],
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=256,
        max_prompt_length=None,
        max_steps=1,
    )
    assert [tool.__name__ for tool in trainer.tools] == ["calculator_add"]
    call_ids = encode(tokenizer, call("calculator_add", a=2, b=3))
    answer_ids = encode(tokenizer, "5")
    trainer.rollouts.engine = engine = ScriptedEngine([call_ids, answer_ids])
    rows = [arguments["train_dataset"][0], arguments["train_dataset"][1]]
    rollout = trainer.generate_rollouts(rows)
    rewards = trainer.score_rollouts(rollout)

    result_ids = trainer.rollouts.tool_loop.format.result_ids(
        [{"role": "tool", "name": "calculator_add", "content": "5"}]
    )
    expected = call_ids + result_ids + answer_ids
    for i in range(4):
        length = int(rollout.completion_mask[i].sum())
        assert rollout.completion_ids[i, :length].tolist() == expected
        mask = [1] * len(call_ids) + [0] * len(result_ids) + [1] * len(answer_ids)
        assert rollout.tool_mask[i, :length].tolist() == mask
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
        assert engine.prompts[1][i] == prompt + call_ids + result_ids  # token-in
        assert rollout.completions[i][1] == {
            "role": "tool",
            "name": "calculator_add",
            "content": "5",
        }
    # each rollout had toolsets of its own, set up for its task
    toolsets = [environment.toolsets[0] for environment in rollout.environments]
    assert len({id(t) for t in toolsets}) == 4 and [t.calls for t in toolsets] == [1] * 4
    assert [t.task_answer for t in toolsets] == ["5", "5", "8", "8"]
    # "5" is right for the first task only; every rollout used the tool
    assert rewards[:, 1].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert rewards[:, 2].tolist() == [1.0] * 4


def test_an_env_gives_its_taskset():
    class Holder(vf.Env):  # an Env's taskset is what from_verifiers reads
        def __init__(self, taskset):
            self.taskset = taskset

        async def run(self, task, agents):
            raise NotImplementedError

    arguments = from_verifiers(Holder(SumTaskset(vf.TasksetConfig())))
    assert arguments["train_dataset"]["answer"] == ["5", "8", "7"]


def test_wrong_inputs_are_clear_errors():
    with pytest.raises(TypeError, match="expected a verifiers.v1 Env"):
        from_verifiers([{"prompt": "1 + 1?"}])
    with pytest.raises(ValueError, match="infinite"):
        from_verifiers(Forever(vf.TasksetConfig()))
    assert len(from_verifiers(Forever(vf.TasksetConfig()).take(3))["train_dataset"]) == 3
    args = GroupRelativeConfig(output_dir="unused", report_to="none", reward_weights=[1, 1, 1])
    with pytest.raises(ValueError, match="reward_weights"):
        from_verifiers(SumTaskset(vf.TasksetConfig()), args=args)
