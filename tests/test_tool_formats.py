"""The code-block tool format (`tools.code_block_format`): a ```python block the model writes is
a call of `run_python`, whose output comes back as an ```output block; what a small chat model
writes unprompted, where it cannot write a JSON tool call."""

import pytest
from agent_helpers import ScriptedEngine, encode, needs_trl_1_16
from datasets import Dataset
from trainer_helpers import make_trainer
from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

from trl_grpo_ext.generation.multi_turn import ToolCallFormat
from trl_grpo_ext.rewards import math_accuracy
from trl_grpo_ext.tiny import build_tiny_model, build_tiny_tokenizer
from trl_grpo_ext.tools import code_block_format, run_python

pytestmark = needs_trl_1_16


def parse(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.parse_response(ids, prefix="<|im_start|>assistant\n")


def code_call(code):
    return {"type": "function", "function": {"name": "run_python", "arguments": {"code": code}}}


def test_code_blocks_are_calls_and_outputs_come_back_as_output_blocks():
    tokenizer = code_block_format(build_tiny_tokenizer())
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)

    assert parse(tokenizer, "```python\nprint(2 * 3)\n```<|im_end|>") == {
        "role": "assistant",
        "tool_calls": [code_call("print(2 * 3)")],
    }
    # text around the block is the content; several blocks are several calls
    message = parse(
        tokenizer,
        "Let me compute.\n```python\nx = 2\nprint(x * 3)\n```\n```python\nprint(1)\n```\nDone."
        "<|im_end|>",
    )
    assert message["content"] == "Let me compute.\nDone."
    assert message["tool_calls"] == [code_call("x = 2\nprint(x * 3)"), code_call("print(1)")]
    assert parse(tokenizer, "It is 6.<|im_end|>") == {"role": "assistant", "content": "It is 6."}
    # another language's block is text
    assert "tool_calls" not in parse(tokenizer, "```bash\nls\n```<|im_end|>")

    format = ToolCallFormat(tokenizer)
    assert format.chat_template is None  # prefix-preserving: kept
    result = format.result_ids([{"role": "tool", "name": "run_python", "content": "6"}])
    assert tokenizer.decode(result) == (
        "\n<|im_start|>user\n```output\n6\n```<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_tokenizer_that_is_not_chatml_is_refused_with_what_to_do():
    tokenizer = build_tiny_tokenizer()
    tokenizer.eos_token = "<|endoftext|>"
    with pytest.raises(ValueError, match="ChatML.*Models without a tool format"):
        code_block_format(tokenizer)


def test_the_trainer_runs_the_code_the_model_writes_and_scores_its_answer(tmp_path):
    tokenizer = code_block_format(build_tiny_tokenizer())
    model = build_tiny_model(tokenizer, seed=0, initializer_range=0.2)
    question = [{"role": "user", "content": "What is 347 * 58?"}]
    trainer = make_trainer(
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        tools=[run_python],
        reward_funcs=math_accuracy,
        dataset=Dataset.from_list([{"prompt": question, "answer": "20126"}] * 2),
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=128,
        max_steps=1,
    )
    code = encode(tokenizer, "```python\nprint(347 * 58)\n```")
    answer = encode(tokenizer, "347 * 58 = 20126")
    output = tokenizer("```output\n20126\n```", add_special_tokens=False)["input_ids"]

    def turn(context):
        seen = any(context[i : i + len(output)] == output for i in range(len(context)))
        return answer if seen else code

    trainer.rollouts.engine = ScriptedEngine(turn)
    rollout = trainer.rollouts.generate(trainer.train_dataset.to_list(), version=0)
    messages = rollout.completions[0]
    assert messages[0]["tool_calls"] == [code_call("print(347 * 58)")]
    assert messages[1] == {"role": "tool", "name": "run_python", "content": "20126"}
    assert messages[2]["content"] == "347 * 58 = 20126"
    assert rollout.tool_calls.tolist() == [1, 1, 1, 1]
    assert math_accuracy(completions=rollout.completions, answer=["20126"] * 4) == [1.0] * 4
