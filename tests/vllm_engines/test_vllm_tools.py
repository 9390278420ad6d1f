"""Multi-turn rollouts through real vLLM engines: a tiny model overfit to call `add` twice and
then answer samples three turns with vLLM, colocated or on a server, synchronously or ahead of
the trainer (`max_staleness`), and the tokens trained on are exactly the tokens vLLM sampled, with
the rendered tool results between them (token-in, token-out); vLLM's log-probs of its tokens are
the behaviour log-probs, 0 on the results'. On the server (the session's, on the tiny model of the
conftest) the conversation is learnt by a LoRA adapter, which the trainer publishes to it. A server
that stops answering in the middle of a rollout ends the run with an error that names it."""

import threading

import pytest

pytest.importorskip("vllm")

from agent_helpers import (  # noqa: E402
    TOOL_PROMPT,
    TOOL_TURNS,
    add,
    assert_trained_on_sampled_turns,
    message_count,
    qwen3_tokenizer,
    tool_calling_adapter,
    tool_calling_model,
)
from datasets import Dataset  # noqa: E402
from test_server_faults import FaultProxy  # noqa: E402
from test_vllm_training import vllm_trainer  # noqa: E402
from trainer_helpers import logged  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from vllm_helpers import SERVER_MAX_MODEL_LEN  # noqa: E402

from trl_grpo_ext.generation.vllm_colocate import VLLMColocateEngine  # noqa: E402
from trl_grpo_ext.generation.vllm_server import VLLMServerEngine, VLLMServerError  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 1152  # the prompt (743 tokens) and the whole conversation


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """The overfit tool-calling tiny model and its tokenizer (Qwen3's template), saved."""
    folder = tmp_path_factory.mktemp("tiny-tools")
    model, tokenizer = tool_calling_model()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tool_adapter_dir(vllm_model_dir, tmp_path_factory):
    """A LoRA adapter of the server's tiny model that has learnt the conversation, saved."""
    folder = tmp_path_factory.mktemp("tool-adapter")
    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    tool_calling_adapter(base).save_pretrained(folder)
    return str(folder)


def padded_add(padding: int):
    """`add` (the same name, schema and docstring, so the prompt is the one the model learnt)
    returning its sum followed by `padding` letters: a long tool result."""

    def add(a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return f"{a + b}{'x' * padding}"

    return add


def tool_trainer(model_dir, output_dir, **config):
    """A trainer whose rollouts are the fixed conversation: one prompt, two rollouts."""
    settings = dict(
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
    return vllm_trainer(model_dir, output_dir, **{**settings, **config})


def server_tool_trainer(model_dir, adapter_dir, output_dir, base_url, **config):
    """A `tool_trainer` on the server at `base_url`, training the adapter that has learnt the
    conversation, with what a user of a server sets: no `vllm_max_model_length` (a colocated
    engine's setting)."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    settings = dict(vllm_mode="server", vllm_server_base_url=base_url, vllm_max_model_length=None)
    return tool_trainer(
        model_dir,
        output_dir,
        model=model,
        tokenizer=qwen3_tokenizer(),
        peft=False,  # the model is a PeftModel already
        **{**settings, **config},
    )


def test_three_turns_sampled_by_colocated_vllm_are_the_tokens_trained_on(tool_model_dir, tmp_path):
    """Full fine-tuning: vLLM samples with the trainer's weights, loaded from the folder."""
    trainer = tool_trainer(
        tool_model_dir,
        tmp_path,
        vllm_mode="colocate",
        peft=False,
        vllm_max_model_length=MAX_MODEL_LEN,
    )
    try:
        assert isinstance(trainer.rollouts.engine, VLLMColocateEngine)
        assert_trained_on_sampled_turns(trainer, [trainer.train_dataset[0]], engine_logps=True)
    finally:
        trainer.rollouts.shutdown()


def test_three_turns_sampled_by_a_vllm_server_ahead_of_the_trainer_are_the_tokens_trained_on(
    vllm_server, vllm_model_dir, tool_adapter_dir, tmp_path
):
    """Under LoRA, with `max_staleness=1`. The check samples in this process first
    (`generate_rollouts`, as the synchronous trainer does), then through the rollout worker,
    which runs the tool loop on its thread. The server wrote the conversation: it sampled with
    the published adapter, not its base model. (Training steps: the next test.)"""
    trainer = server_tool_trainer(
        vllm_model_dir, tool_adapter_dir, tmp_path, vllm_server, max_staleness=1
    )
    try:
        assert isinstance(trainer.rollouts.engine, VLLMServerEngine)
        assert_trained_on_sampled_turns(trainer, [trainer.train_dataset[0]], engine_logps=True)
        assert trainer.rollouts.pipeline is not None  # the second batch came from the worker
    finally:
        trainer.rollouts.shutdown()


def test_a_tool_result_past_the_servers_max_model_len_ends_the_rollout_at_its_call(
    vllm_server, vllm_model_dir, tool_adapter_dir, tmp_path
):
    """The server's `--max-model-len` (1152) bounds the conversation, not the model's 2048
    positions: a result that would pass it ends the rollout at its call, as documented for
    `vllm_max_model_length`; the server used to refuse the next turn's prompt (HTTP 400), which
    failed the run."""
    trainer = server_tool_trainer(
        vllm_model_dir,
        tool_adapter_dir,
        tmp_path,
        vllm_server,
        tools=[padded_add(400)],
        max_completion_length=700,  # room for the result: only the server's limit stops it
    )
    try:
        assert trainer.rollouts.tool_loop.max_model_len == SERVER_MAX_MODEL_LEN
        rollout = trainer.generate_rollouts([trainer.train_dataset[0]])
        assert rollout.tool_calls.tolist() == [1, 1]  # the call ran
        tokenizer = trainer.processing_class
        for ids, mask in zip(rollout.completion_ids, rollout.completion_mask):
            assert tokenizer.decode(ids[mask.bool()]) == TOOL_TURNS[0] + "<|im_end|>"
        roles = [[message["role"] for message in messages] for messages in rollout.completions]
        assert roles == [["assistant"], ["assistant"]]  # its result dropped
        assert not rollout.is_truncated.any()  # the rollout ended with its call's end of turn
    finally:
        trainer.rollouts.shutdown()


def test_a_server_gone_mid_rollout_fails_the_run_naming_it(
    vllm_server, vllm_model_dir, tool_adapter_dir, tmp_path
):
    """Training with `max_staleness=1`: the first step trains on a multi-turn batch of the
    rollout worker while the worker samples the next batch ahead of it. In the middle of that
    batch (after its first turn) the server's address stops answering (a proxy in front of it
    closes, as a killed server's port does): the error reaches `train()` at the second step,
    once the server has not answered for `vllm_server_timeout` seconds, and the worker stops; no
    hang. A server killed during a request is test_vllm_server.py's."""
    proxy = FaultProxy(vllm_server)
    trainer = server_tool_trainer(
        vllm_model_dir,
        tool_adapter_dir,
        tmp_path,
        proxy.url,
        vllm_server_timeout=2,
        max_staleness=1,
        max_steps=2,
        dataset=Dataset.from_list([{"prompt": TOOL_PROMPT}] * 2),  # one epoch of two steps
    )
    engine, threads = trainer.rollouts.engine, []
    generate = engine.generate

    def stopping_the_server(*args, **kwargs):
        threads.append(threading.current_thread().name)
        if len(threads) == 5:  # the second batch's second turn
            proxy.stop()
        return generate(*args, **kwargs)

    engine.generate = stopping_the_server
    errors = []

    def train():
        try:
            trainer.train()
        except Exception as error:  # noqa: BLE001 - checked below
            errors.append(error)

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    worker.join(timeout=180)  # a hang, not a speed bound: the engine gives up after 2 s
    assert not worker.is_alive(), "train() neither failed nor finished"
    try:
        assert len(threads) == 5 and all(name.startswith("rollouts") for name in threads)
        assert trainer.state.global_step == 1  # the first step trained
        assert logged(trainer, "tools/call_frequency") == [2.0]
        assert logged(trainer, "async/staleness") == [0.0]
        assert len(errors) == 1 and isinstance(errors[0], VLLMServerError), errors
        assert proxy.url in str(errors[0])
        assert "did not answer for 2 s (vllm_server_timeout" in str(errors[0])
        assert trainer.rollouts.pipeline is None  # train() stopped the worker
    finally:
        trainer.rollouts.shutdown()
        proxy.stop()  # again, if the test failed before it stopped


def test_a_stop_string_ends_the_answer_turn_and_no_padding_is_trained(tool_model_dir, tmp_path):
    """Colocated vLLM stops the answer turn ("It is 9.") at the stop " is" and pads the row; the
    rollout ends there, counts as ended, and no padding is among the model's tokens."""
    trainer = tool_trainer(
        tool_model_dir,
        tmp_path,
        vllm_mode="colocate",
        peft=False,
        vllm_max_model_length=MAX_MODEL_LEN,
        generation_kwargs={"stop": [" is"]},
    )
    tokenizer = trainer.processing_class
    try:
        rollout = trainer.generate_rollouts([trainer.train_dataset[0]])
        own = rollout.completion_mask * rollout.tool_mask
        for ids, mask, model_tokens in zip(rollout.completion_ids, rollout.completion_mask, own):
            assert tokenizer.pad_token_id not in ids[model_tokens.bool()].tolist()
            text = tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            assert text.endswith("It is"), text
        assert not rollout.is_truncated.any()
        assert rollout.completions[0][-1]["content"] == "It is"
    finally:
        trainer.rollouts.shutdown()
