"""The local process engine (`generation.process_worker`): `transformers` generation in a process
of its own, behind the same engine interface as vLLM, against the same sampling in this process."""

import os
import subprocess
import sys
import threading

import pytest
import torch
from logprob_helpers import processed_logprobs_by_hand

from trl_grpo_ext.generation import PromptEncoder, sampling_config
from trl_grpo_ext.generation.process_worker import ParameterPublisher, ProcessEngine
from trl_grpo_ext.generation.rollout import completion_mask_from_ids
from trl_grpo_ext.generation.transformers_engine import generate_with_transformers, seeded
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

PROMPTS = ["1+2=", "10+17=", "3+3=?"]


@pytest.fixture
def setup():
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    config = sampling_config(
        max_new_tokens=5,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=3,
        temperature=0.7,
    )
    prompts = PromptEncoder(tokenizer).encode(PROMPTS)
    # One thread, as the trainer starts it: OpenMP's thread pool does not survive a fork.
    engine = ProcessEngine(model, threads=1)
    yield model.eval(), config, prompts, engine
    engine.close()


def in_this_process(model, prompts, config, seed):
    """The reference: the same sampling here, on one thread as the engine's process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with seeded(seed):
            prompt_ids, prompt_mask, completion_ids, logps = generate_with_transformers(
                model, *prompts, generation_config=config, return_logprobs=True
            )
    finally:
        torch.set_num_threads(threads)
    return prompt_ids, prompt_mask, completion_ids, logps


def assert_same_batch(got, want, eos_token_ids):
    """The same tokens, and the same log-probs up to each completion's end (after it, what an
    engine returns is not part of the completion: `rollout.CompletionEnds` cuts it)."""
    for got_ids, want_ids in zip(got[:3], want[:3]):
        assert torch.equal(got_ids, want_ids)
    mask, _ = completion_mask_from_ids(want[2], eos_token_ids)
    torch.testing.assert_close(got[3] * mask, want[3] * mask)


def test_samples_what_transformers_samples_here_with_the_same_seed(setup):
    model, config, prompts, engine = setup
    got = engine.generate(*prompts, config, seed=7)
    assert got[2].shape[0] == len(PROMPTS) * 3
    assert_same_batch(got, in_this_process(model, prompts, config, seed=7), config.eos_token_id)


def test_published_parameters_are_the_ones_it_samples_with(setup):
    model, config, prompts, engine = setup
    other, _ = tiny_model_and_tokenizer(seed=1)
    other.eval()
    before = engine.generate(*prompts, config, seed=3)
    publisher = ParameterPublisher(engine, lambda: other)
    publisher.publish(1)
    assert publisher.version == 1
    after = engine.generate(*prompts, config, seed=3)
    assert not torch.equal(before[3], after[3])  # the weights did change
    assert_same_batch(after, in_this_process(other, prompts, config, seed=3), config.eos_token_id)


def test_a_snapshot_is_the_weights_when_it_was_taken(setup):
    model, config, prompts, engine = setup
    publisher = ParameterPublisher(engine, lambda: model)
    snapshot = publisher.snapshot(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # the next optimizer step, before the worker loads version 1
    publisher.load(snapshot, 1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.sub_(1.0)
    assert_same_batch(
        engine.generate(*prompts, config, seed=5),
        in_this_process(model, prompts, config, 5),
        config.eos_token_id,
    )


def test_a_failure_in_the_process_is_raised_here_and_the_engine_goes_on(setup):
    model, config, prompts, engine = setup
    prompt_ids, prompt_mask = prompts
    out_of_vocabulary = torch.full_like(prompt_ids, model.config.vocab_size + 5)
    with pytest.raises(RuntimeError, match="rollout worker failed:(.|\n)*IndexError"):
        engine.generate(out_of_vocabulary, prompt_mask, config, seed=1)
    assert_same_batch(
        engine.generate(*prompts, config, seed=2),
        in_this_process(model, prompts, config, 2),
        config.eos_token_id,
    )


def test_a_dead_process_is_an_error_not_a_hang(setup):
    _, config, prompts, engine = setup
    engine._process.kill()
    engine._process.join(timeout=10)
    with pytest.raises(RuntimeError, match="rollout worker died"):
        engine.generate(*prompts, config, seed=1)


def feeder_threads() -> set:
    """The threads that feed a `multiprocessing` queue's pipe, one per queue put to."""
    return {thread for thread in threading.enumerate() if thread.name == "QueueFeederThread"}


def test_close_stops_the_process_and_leaves_no_thread_or_pipe(setup):
    # The queues' feeder thread and pipes stay with the trainer's process until it ends unless
    # they are closed: one of each per asynchronous training run, in a notebook or a sweep.
    model, config, prompts, engine = setup
    before = feeder_threads()
    engine.load_weights({})
    engine.generate(*prompts, config, seed=1)
    assert feeder_threads() - before  # the requests' feeder, started by the first put
    fds = len(os.listdir("/proc/self/fd"))
    engine.close()
    assert not engine._process.is_alive()
    assert not feeder_threads() - before
    assert len(os.listdir("/proc/self/fd")) <= fds - 2  # the parent's ends of both pipes
    engine.close()  # twice is harmless (the fixture closes it again)


def test_closing_after_the_process_died_does_not_wait_on_it(setup):
    _, config, prompts, engine = setup
    before = feeder_threads()
    engine._process.kill()
    engine._process.join(timeout=10)
    engine.load_weights({"never": torch.zeros(3)})  # put, never read
    engine.close()
    assert not feeder_threads() - before


def run_script(tmp_path, source: str) -> str:
    """Runs `source` as a script of its own (a `__main__` that a spawned worker can re-import
    under its guard); returns what it printed, after checking that it ended well."""
    script = tmp_path / "script.py"
    script.write_text(source)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


SEVERAL_THREADS = """
import torch
from trl_grpo_ext.generation import PromptEncoder, sampling_config
from trl_grpo_ext.generation.process_worker import ProcessEngine
from trl_grpo_ext.tiny import tiny_model_and_tokenizer

if __name__ == "__main__":
    torch.set_num_threads(2)
    (torch.randn(256, 256) @ torch.randn(256, 256)).sum()  # this process's OpenMP pool is up
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    config = sampling_config(max_new_tokens=4, eos_token_id=[tokenizer.eos_token_id],
                             pad_token_id=tokenizer.pad_token_id, num_return_sequences=2)
    engine = ProcessEngine(model, threads=2)
    completion_ids = engine.generate(*PromptEncoder(tokenizer).encode(["1+2="]), config, seed=0)[2]
    engine.close()
    print("sampled", tuple(completion_ids.shape))
"""


def test_a_worker_with_several_threads_samples_instead_of_hanging(tmp_path):
    """`rollout_worker_threads: 2`: a forked worker hung in its first parallel region (the
    parent's OpenMP pool does not survive a fork); the engine spawns it instead."""
    assert "sampled (2, 4)" in run_script(tmp_path, SEVERAL_THREADS)


SPAWNED = """
import torch
from PIL import Image
from transformers import GenerationConfig
from trl_grpo_ext.generation import PromptEncoder, sampling_config
from trl_grpo_ext.generation.process_worker import ProcessEngine, sample_batch
from trl_grpo_ext.tiny import tiny_model_and_tokenizer
from trl_grpo_ext.tiny_vlm import tiny_vlm_and_processor


def compare(model, ids, mask, config, fields=None):
    # sampled here first: a vision-language model's forward installs its hidden states capture
    want = sample_batch(model.eval(), (ids, mask), config, 7, fields)
    engine = ProcessEngine(model, threads=2)  # several threads: spawned, the model pickled
    try:
        got = engine.generate(ids, mask, config, seed=7, image_inputs=fields)
    finally:
        engine.close()
    assert torch.equal(got[2], want[2]), (got[2], want[2])
    torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    # as the trainer leaves a model it trains with gradient checkpointing: the hooks of
    # enable_input_require_grads, a local function, on the input embeddings (twice over)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    config = sampling_config(max_new_tokens=5, eos_token_id=[tokenizer.eos_token_id],
                             pad_token_id=tokenizer.pad_token_id, num_return_sequences=2)
    compare(model, *PromptEncoder(tokenizer).encode(["1+2=", "10+17="]), config)
    assert model.get_input_embeddings()._forward_hooks  # the trained model keeps its hooks
    print("gradient checkpointing: same samples")

    model, processor = tiny_vlm_and_processor(seed=0, initializer_range=0.2)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images = [[Image.new("RGB", (20, 30), color)] for color in ("red", "blue")]
    encoded = processor(text=[text] * 2, images=images, return_tensors="pt")
    ids, mask = encoded.pop("input_ids"), encoded.pop("attention_mask")
    config = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=4,
                              num_return_sequences=2, pad_token_id=0)
    compare(model, ids, mask, config, dict(encoded))
    print("vision-language model: same samples")
"""


def test_a_spawned_worker_samples_a_checkpointed_model_and_a_vision_language_one(tmp_path):
    """A worker that spawns (several threads, or a trainer on CUDA) receives the model pickled:
    the hooks gradient checkpointing leaves on it (local functions) failed to pickle, and a
    vision-language model's image features found no hidden states in the new process. Both
    now sample there what they sample here with the same seed."""
    printed = run_script(tmp_path, SPAWNED)
    assert "gradient checkpointing: same samples" in printed
    assert "vision-language model: same samples" in printed


FILTERED = {"temperature": 0.8, "top_k": 6, "top_p": 0.7}


@pytest.mark.parametrize("group_size", [1, 3])
def test_behaviour_logprobs_are_those_of_the_filtered_distribution(group_size):
    """With top-k and top_p < 1, each sampled token's log-prob is taken under the distribution
    it was drawn from (filtered, renormalised), as TRL asks vLLM for them, by the sampling
    function of the transformers engine (prompts encoded once, G = 3; or one row each) and by
    the process engine, against a hand computation from the model's logits."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    model.eval()
    config = sampling_config(
        max_new_tokens=5,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=group_size,
        **FILTERED,
    )
    prompts = PromptEncoder(tokenizer).encode(PROMPTS)
    here = in_this_process(model, prompts, config, seed=5)
    engine = ProcessEngine(model, threads=1)
    try:
        there = engine.generate(*prompts, config, seed=5)
    finally:
        engine.close()
    assert_same_batch(there, here, config.eos_token_id)
    mask, _ = completion_mask_from_ids(here[2], config.eos_token_id)
    expected = processed_logprobs_by_hand(model, here, mask, FILTERED)
    torch.testing.assert_close(here[3].double() * mask, expected, atol=1e-4, rtol=0)
    # The unfiltered log-probs differ: the filters removed mass at some step.
    unfiltered = processed_logprobs_by_hand(model, here, mask, {"temperature": 0.8})
    assert (expected - unfiltered).abs().max() > 1e-2
