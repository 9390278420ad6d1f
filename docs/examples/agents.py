"""Agents: a tool and an environment on a conversational dataset, with the tiny offline model.

Runs in seconds on a CPU. The tiny model gets TRL's Qwen3 chat template, which renders the tools'
schemas and whose tool-call format TRL knows. It is a random model: it writes no tool calls, so
this run shows the wiring (schemas in the prompt, one environment per rollout, its reward) with
`tools/call_frequency` 0. docs/agents.md shows the same script with a model trained for tools.
"""

import os

import trl
from datasets import Dataset

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

model, tokenizer = tiny_model_and_tokenizer(seed=0)
with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3.jinja")) as file:
    tokenizer.chat_template = file.read()  # a template that renders tools and tool calls


# --8<-- [start:agent]
# A tool: type hints and a Google-style docstring, from which the chat template shows the model
# its JSON schema. The model calls it by its __name__.
def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


# An environment: one instance per rollout, reset with the rollout's dataset row. Its public
# methods are tools acting on that instance; get_reward() scores the rollout.
class Counter:
    def __init__(self):
        self.value, self.target = 0, 0

    def reset(self, target: int, **row) -> str:
        self.value, self.target = 0, target
        return " The counter is at 0."  # appended to the last message of the prompt

    def increment(self, step: int) -> int:
        """Adds `step` to the counter.

        Args:
            step: How much to add.

        Returns:
            The counter's new value.
        """
        self.value += step
        return self.value

    def get_reward(self) -> float:
        return 1.0 if self.value == self.target else 0.0


# A reward function sees each rollout's environment as `environments`.
def overshoot(completions, environments, **kwargs):
    return [-max(env.value - env.target, 0) / 10 for env in environments]


dataset = Dataset.from_list(
    [
        {"prompt": [{"role": "user", "content": f"Bring the counter to {a} * 7."}], "target": a * 7}
        for a in range(2, 10)
    ]
)
args = GroupRelativeConfig(
    output_dir="runs/agents",
    num_generations=2,
    per_device_train_batch_size=4,  # 2 prompts x 2 rollouts per step
    max_completion_length=64,  # the model's turns and the tool results together
    max_tool_calling_iterations=4,  # tool rounds per rollout at most
    tool_call_timeout=10.0,  # seconds; a slower call comes back as an error result
    max_steps=1,
    logging_steps=1,
    report_to="none",
)
trainer = GroupRelativeTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=overshoot,  # Counter.get_reward is added as a second reward, "Counter"
    args=args,
    train_dataset=dataset,
    tools=[multiply],
    environment_factory=Counter,
)
trainer.train()
log = trainer.state.log_history[0]
print(log["rewards/Counter/mean"], log["tools/call_frequency"], log["tools/failure_frequency"])
# --8<-- [end:agent]

assert trainer.reward_names == ["overshoot", "Counter"]
assert trainer.reward_weights.tolist() == [1.0, 1.0]
assert log["rewards/Counter/mean"] == 0.0  # no call, so no counter reached its target
assert log["tools/call_frequency"] == 0.0  # the random tiny model writes no tool calls
