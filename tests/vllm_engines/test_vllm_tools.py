"""Multi-turn rollouts through real vLLM engines: a tiny model overfit to call `add` twice and
then answer samples three turns with vLLM, colocated or on a server, synchronously or ahead of
the trainer (`max_staleness`), and the tokens trained on are exactly the tokens vLLM sampled, with
the rendered tool results between them (token-in, token-out); vLLM's log-probs of its tokens are
the behaviour log-probs, 0 on the results'. A server killed in the middle of a rollout ends the
run with an error that names it."""

import threading

import pytest

pytest.importorskip("vllm")

from agent_helpers import (  # noqa: E402
    TOOL_PROMPT,
    TOOL_TURNS,
    add,
    assert_trained_on_sampled_turns,
    message_count,
    tool_calling_model,
)
from datasets import Dataset  # noqa: E402
from test_vllm_training import vllm_trainer  # noqa: E402
from trainer_helpers import logged  # noqa: E402
from vllm_helpers import RestartableServer, stop_server  # noqa: E402

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
def tool_server(tool_model_dir, tmp_path_factory):
    """A real vLLM server on the tool-calling model, started as the docs say, shared by the
    tests of this module; a test that kills it leaves it to the next one to start again
    (`RestartableServer.running`)."""
    server = RestartableServer(
        tool_model_dir, tmp_path_factory.mktemp("tool-server"), max_model_len=MAX_MODEL_LEN
    )
    server.start()
    try:
        yield server
    finally:
        if server.process is not None:
            stop_server(server.process)


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
    tool_model_dir, tool_server, tmp_path
):
    """Under LoRA (the server loads each adapter version), with what a user of a server sets (no
    `vllm_max_model_length`, a colocated engine's setting) and `max_staleness=1`. The check
    samples in this process first (`generate_rollouts`, as the synchronous trainer does), then
    through the rollout worker, which runs the tool loop on its thread; then two training steps,
    the second one's batch generated while the first trained."""
    trainer = tool_trainer(
        tool_model_dir,
        tmp_path,
        vllm_mode="server",
        vllm_server_base_url=tool_server.running().base_url,
        vllm_max_model_length=None,
        max_staleness=1,
        max_steps=2,
        dataset=Dataset.from_list([{"prompt": TOOL_PROMPT}] * 2),  # one epoch of two steps
    )
    try:
        assert isinstance(trainer.rollouts.engine, VLLMServerEngine)
        assert_trained_on_sampled_turns(trainer, [trainer.train_dataset[0]], engine_logps=True)
        assert trainer.rollouts.pipeline is not None  # the second batch came from the worker
        trainer.train()
        assert logged(trainer, "async/staleness") == [0.0, 1.0]
        assert logged(trainer, "tools/call_frequency") == [2.0, 2.0]
        assert logged(trainer, "tools/failure_frequency") == [0.0, 0.0]
    finally:
        trainer.rollouts.shutdown()


def test_a_tool_result_past_the_servers_max_model_len_ends_the_rollout_at_its_call(
    tool_model_dir, tool_server, tmp_path
):
    """The server's `--max-model-len` (1152) bounds the conversation, not the model's 2048
    positions: a result that would pass it ends the rollout at its call, as documented for
    `vllm_max_model_length`; the server used to refuse the next turn's prompt (HTTP 400), which
    failed the run."""
    trainer = tool_trainer(
        tool_model_dir,
        tmp_path,
        tools=[padded_add(400)],
        vllm_mode="server",
        vllm_server_base_url=tool_server.running().base_url,
        vllm_max_model_length=None,
        max_completion_length=700,  # room for the result: only the server's limit stops it
    )
    try:
        assert trainer.rollouts.tool_loop.max_model_len == MAX_MODEL_LEN
        rollout = trainer.generate_rollouts([trainer.train_dataset[0]])
        assert rollout.tool_calls.tolist() == [1, 1]  # the call ran
        first_turn = trainer.processing_class.decode(
            rollout.completion_ids[0][rollout.completion_mask[0].bool()]
        )
        assert first_turn == TOOL_TURNS[0] + "<|im_end|>"
        assert [[m["role"] for m in messages] for messages in rollout.completions] == [
            ["assistant"],
            ["assistant"],
        ]  # its result dropped
        assert not rollout.is_truncated.any()  # the rollout ended with its call's end of turn
    finally:
        trainer.rollouts.shutdown()


def test_a_server_killed_mid_rollout_fails_the_run_naming_it(tool_model_dir, tool_server, tmp_path):
    """Killed after the first turn of the first batch, while the rollout worker runs the tool
    loop on its thread (`max_staleness=1`): the error reaches `train()` once the server has not
    answered for `vllm_server_timeout` seconds, and the worker stops; no hang. Last in the
    module: the server stays down (a later test would start it again)."""
    server = tool_server.running()
    trainer = tool_trainer(
        tool_model_dir,
        tmp_path,
        vllm_mode="server",
        vllm_server_base_url=server.base_url,
        vllm_server_timeout=2,
        vllm_max_model_length=None,
        max_staleness=1,
        max_steps=2,
        dataset=Dataset.from_list([{"prompt": TOOL_PROMPT}] * 2),
    )
    engine, threads = trainer.rollouts.engine, []
    generate = engine.generate

    def killing_the_server(*args, **kwargs):
        threads.append(threading.current_thread().name)
        if len(threads) == 2:  # the second turn
            server.kill()
        return generate(*args, **kwargs)

    engine.generate = killing_the_server
    errors = []

    def train():
        try:
            trainer.train()
        except Exception as error:  # noqa: BLE001 - checked below
            errors.append(error)

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    worker.join(timeout=120)  # a hang, not a speed bound: the engine gives up after 2 s
    assert not worker.is_alive(), "train() neither failed nor finished"
    try:
        assert threads[1].startswith("rollouts")  # killed under the worker's tool loop
        assert len(errors) == 1 and isinstance(errors[0], VLLMServerError), errors
        assert server.base_url in str(errors[0])
        assert "did not answer for 2 s (vllm_server_timeout" in str(errors[0])
        assert trainer.state.global_step == 0
        assert trainer.rollouts.pipeline is None  # train() stopped the worker
    finally:
        trainer.rollouts.shutdown()
