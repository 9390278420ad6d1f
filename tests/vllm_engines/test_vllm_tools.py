"""Multi-turn rollouts through a real colocated vLLM engine: a tiny model overfit to call `add`
twice and then answer samples three turns with vLLM, and the tokens trained on are exactly the
tokens vLLM sampled, with the rendered tool results between them (token-in, token-out); vLLM's
log-probs of its tokens are the behaviour log-probs, 0 on the results'."""

import pytest

pytest.importorskip("vllm")

from agent_helpers import (  # noqa: E402
    TOOL_PROMPT,
    add,
    assert_trained_on_sampled_turns,
    message_count,
    tool_calling_model,
)
from datasets import Dataset  # noqa: E402
from test_vllm_training import vllm_trainer  # noqa: E402

from trl_grpo_ext.generation.vllm_colocate import VLLMColocateEngine  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """The overfit tool-calling tiny model and its tokenizer (Qwen3's template), saved."""
    folder = tmp_path_factory.mktemp("tiny-tools")
    model, tokenizer = tool_calling_model()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_three_turns_sampled_by_colocated_vllm_are_the_tokens_trained_on(tool_model_dir, tmp_path):
    """Full fine-tuning: vLLM samples with the trainer's weights, loaded from the folder."""
    trainer = vllm_trainer(
        tool_model_dir,
        tmp_path,
        vllm_mode="colocate",
        peft=False,
        tools=[add],
        reward_funcs=message_count,
        dataset=Dataset.from_list([{"prompt": TOOL_PROMPT}]),
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=320,
        max_prompt_length=None,  # the tool's schema is long in bytes
        vllm_max_model_length=1152,  # the prompt (743 tokens) and the whole conversation
        temperature=0.1,  # near-greedy: the overfit model writes its conversation
        max_steps=1,
    )
    try:
        assert isinstance(trainer.rollouts.engine, VLLMColocateEngine)
        assert_trained_on_sampled_turns(trainer, [trainer.train_dataset[0]], engine_logps=True)
    finally:
        trainer.rollouts.shutdown()
