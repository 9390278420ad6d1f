"""Checks shared by the colocated and server engine tests: each takes an engine and compares
it with `transformers` on the same model and tokens."""

import copy
import getpass
import os
import shutil
import signal
import subprocess
import tempfile

import torch
from logprob_helpers import processed_logprobs_by_hand

from trl_grpo_ext.generation import sampling_config
from trl_grpo_ext.generation.sampling import end_at_stop_strings
from trl_grpo_ext.generation.transformers_engine import generate_with_transformers
from trl_grpo_ext.logprobs import completion_logprobs

MAX_LORA_RANK = 8  # the colocated engine's max_lora_rank in these tests
# The session server's --max-lora-rank: the settings matrix trains adapters of rank 16 on it.
SERVER_MAX_LORA_RANK = 16
# The session server's --max-model-len: room for test_vllm_tools.py's conversation.
SERVER_MAX_MODEL_LEN = 1152


# Torch's compiler (vLLM's sampler is compiled by it) keeps its cache in TORCHINDUCTOR_CACHE_DIR,
# but the precompiled header of the C++ it builds in `$TMPDIR/torchinductor_<user>` whatever the
# setting, and it builds that header again (~10 s of CPU, even when every kernel is cached) in a
# process whose TMPDIR lacks it.
INDUCTOR_HEADERS = f"torchinductor_{getpass.getuser()}"


def share_precompiled_headers(tmpdir) -> None:
    """Links `tmpdir/torchinductor_<user>` to the tests' own folder of precompiled headers, for a
    process started with TMPDIR `tmpdir` (a folder of its own, to see what it leaves there, or to
    remove it with what it left): the process finds the header built already. The link is no
    leftover (the checks skip that name), and removing `tmpdir` removes the link, not the
    headers."""
    shared = os.path.join(tempfile.gettempdir(), INDUCTOR_HEADERS)
    os.makedirs(shared, exist_ok=True)
    os.symlink(shared, os.path.join(tmpdir, INDUCTOR_HEADERS))


def config(tokenizer, **settings):
    settings.setdefault("max_new_tokens", 12)
    return sampling_config(
        eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, **settings
    )


def trainer_logprobs(model, output, temperature):
    """The trainer's `log softmax(z / T)[o_t]` of the engine's completions `(B*G, T)`."""
    prompt_ids, prompt_mask, completion_ids, _ = output
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    with torch.no_grad():
        return completion_logprobs(model, input_ids, attention_mask, completion_ids, temperature)


def completion_mask(completion_ids, eos_id):
    """1 up to and including each row's first eos `(B*G, T)`."""
    is_eos = completion_ids == eos_id
    after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return (~after_eos).float()


def assert_greedy_matches_transformers(engine, model, tokenizer, prompts):
    prompt_ids, prompt_mask = prompts
    greedy = config(tokenizer, greedy=True)
    output = engine.generate(prompt_ids, prompt_mask, greedy, seed=0)
    with torch.no_grad():
        reference = generate_with_transformers(
            model, prompt_ids, prompt_mask, generation_config=greedy, return_logprobs=True
        )
    assert torch.equal(output[0], reference[0]) and torch.equal(output[1], reference[1])
    assert torch.equal(output[2], reference[2])  # token for token
    mask = completion_mask(reference[2], tokenizer.eos_token_id)
    torch.testing.assert_close(output[3] * mask, reference[3] * mask, atol=1e-4, rtol=0)
    return output


def assert_stop_strings_end_where_transformers_does(engine, model, tokenizer, prompts):
    """A `stop` of `generation_kwargs` ends the engine's greedy completions after the token that
    completes it, where `generate` with `stop_strings` ends them (`end_at_stop_strings` masks)."""
    free = engine.generate(*prompts, config(tokenizer, greedy=True))[2]  # (2, T)
    length = int(completion_mask(free, tokenizer.eos_token_id)[0].sum())
    texts = [tokenizer.decode([token]) for token in free[0, :length].tolist()]
    # A printable character that the first greedy completion produces after its first token.
    position = next(t for t, text in enumerate(texts) if t > 0 and text.isalnum())
    stop_config = config(tokenizer, greedy=True, generation_kwargs={"stop": texts[position]})
    transformers_ids = generate_with_transformers(
        model, *prompts, generation_config=stop_config, tokenizer=tokenizer
    )[2]
    ends = []
    for completion_ids in (engine.generate(*prompts, stop_config)[2], transformers_ids):
        mask = completion_mask(completion_ids, tokenizer.eos_token_id).long()
        mask, stopped = end_at_stop_strings(tokenizer, completion_ids, mask, [texts[position]])
        ends.append([ids[keep.bool()].tolist() for ids, keep in zip(completion_ids, mask)])
        assert stopped[0] and ends[-1][0] == free[0, : position + 1].tolist()
    assert ends[0] == ends[1]


def assert_sampled_logprobs_match_trainer(engine, model, tokenizer, prompts, temperature=0.7):
    prompt_ids, prompt_mask = prompts
    sampled = config(tokenizer, num_return_sequences=3, temperature=temperature)
    output = engine.generate(prompt_ids, prompt_mask, sampled, seed=7)
    assert output[2].shape[0] == 6 and output[0].shape == (6, prompt_ids.shape[1])
    torch.testing.assert_close(output[0][::3], prompt_ids)  # groups consecutive
    mask = completion_mask(output[2], tokenizer.eos_token_id)
    expected = trainer_logprobs(model, output, temperature)
    torch.testing.assert_close(output[3] * mask, expected * mask, atol=1e-4, rtol=0)
    # the same seed gives the same completions; the samples of a group differ
    again = engine.generate(prompt_ids, prompt_mask, sampled, seed=7)
    assert torch.equal(again[2], output[2])
    assert not torch.equal(output[2][0], output[2][1])
    return output


FILTERED = {"temperature": 1.3, "top_k": 5, "top_p": 0.8}


def assert_filtered_logprobs_are_the_processed_ones(engine, model, tokenizer, prompts):
    """With top-k and top_p < 1 the engine samples inside the filters and its log-probs are those
    of the distribution each token was drawn from (filtered, renormalised), the definition every
    engine shares, against a hand computation from the model's logits; the transformers engine
    meets the same one (tests/test_process_engine.py)."""
    output = engine.generate(*prompts, config(tokenizer, num_return_sequences=3, **FILTERED), 11)
    mask = completion_mask(output[2], tokenizer.eos_token_id)
    expected = processed_logprobs_by_hand(model, output, mask, FILTERED)
    torch.testing.assert_close(output[3].double() * mask, expected, atol=1e-4, rtol=0)
    transformers_output = generate_with_transformers(
        model,
        *prompts,
        generation_config=config(tokenizer, num_return_sequences=3, **FILTERED),
        return_logprobs=True,
    )
    mask = completion_mask(transformers_output[2], tokenizer.eos_token_id)
    expected = processed_logprobs_by_hand(model, transformers_output, mask, FILTERED)
    torch.testing.assert_close(transformers_output[3].double() * mask, expected, atol=1e-4, rtol=0)


def lora_adapter(base_model, path, seed, rank=4):
    """Saves a LoRA adapter with random (non-zero) weights, large enough to change greedy
    decoding, to `path`; returns the PEFT model (for reference outputs)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"],
        init_lora_weights=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(copy.deepcopy(base_model), config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model.eval()


# --------------------------------------------------------------- the server processes


def stop_server(process: subprocess.Popen) -> None:
    """Stops the server and every process it started (its engine core and workers)."""
    _signal_group(process, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    kill_server(process)


def kill_server(process: subprocess.Popen) -> None:
    """Kills the server at once, as a crash would, with its engine core and workers: killed
    alone, the server leaves them running, holding their memory."""
    _signal_group(process, signal.SIGKILL)
    process.wait()
    shutil.rmtree(getattr(process, "temp_folder", ""), ignore_errors=True)  # its temp files


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:  # the whole group has exited
        pass
