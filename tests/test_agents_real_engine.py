"""Multi-turn rollouts through the real transformers engine: a tiny model overfit to call `add`
twice and then answer samples three turns, and the tokens trained on are exactly the tokens it
sampled, with the rendered tool results between them (token-in, token-out)."""

import pytest
from agent_helpers import (
    TOOL_PROMPT,
    add,
    assert_trained_on_sampled_turns,
    message_count,
    needs_trl_1_16,
    one_thread,
    tool_calling_model,
)
from datasets import Dataset
from trainer_helpers import make_trainer

from trl_grpo_ext.generation.transformers_engine import TransformersEngine

pytestmark = needs_trl_1_16


@pytest.fixture(scope="module")
def tool_model():
    return tool_calling_model()


def test_three_turns_sampled_by_transformers_are_the_tokens_trained_on(tool_model, tmp_path):
    """Under LoRA: the engine samples with the adapter's model."""
    model, tokenizer = tool_model
    trainer = make_trainer(
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        tools=[add],
        reward_funcs=message_count,
        dataset=Dataset.from_list([{"prompt": TOOL_PROMPT}]),
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=320,
        max_prompt_length=None,  # the tool's schema is long in bytes
        temperature=0.1,  # near-greedy: the overfit model writes its conversation
        max_steps=1,
    )
    assert isinstance(trainer.rollouts.engine, TransformersEngine)
    with one_thread():
        assert_trained_on_sampled_turns(trainer, [trainer.train_dataset[0]])
