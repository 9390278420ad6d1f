"""Runs each fast path on a library's private internals (`trl_grpo_ext.internals.FAST_PATHS`) on a
tiny model and says whether it ran, from what the code did, not from `internals.RAN`; and which
of them should run in this environment, from the installed releases against the table.

Shared by tests/test_internals.py (`.venv`, the newest releases, and `.venv-lowest`, the lowest)
and tests/vllm_engines/test_fast_paths.py (`.venv-vllm`, the vLLM test environment's pins).
"""

import functools
import importlib.metadata
import logging

import pytest
import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from trl_grpo_ext import internals, logprobs
from trl_grpo_ext.generation import PromptEncoder, compacting, merged_adapters, sampling_config
from trl_grpo_ext.generation.packed_weights import packed_linear_weights
from trl_grpo_ext.generation.process_worker import _register_output_capture
from trl_grpo_ext.generation.transformers_engine import generate_with_transformers, seeded
from trl_grpo_ext.sampler import EpochDataLoader
from trl_grpo_ext.tiny import tiny_model_and_tokenizer


def installed(library: str) -> str:
    return importlib.metadata.version(library)


def expected_to_run(name: str) -> bool:
    """Whether path `name` should run here: the installed release of its library (a local or
    pre-release build as its release) within the range the table states."""
    path = internals.FAST_PATHS[name]
    release = Version(Version(installed(path.library)).base_version)
    return release in SpecifierSet(path.tested)


@pytest.fixture
def fresh_internals(monkeypatch):
    """`internals` as in a new process: nothing decided, recorded or logged yet."""
    monkeypatch.setattr(internals, "RAN", {})
    monkeypatch.setattr(internals, "_REASONS", {})
    monkeypatch.setattr(internals, "_LOGGED", set())


def sampling_loop(monkeypatch) -> bool:
    """Samples 2 prompts x 2 completions; whether `compacting_sample` was `generate`'s loop."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    calls = []
    loop = compacting.compacting_sample

    @functools.wraps(loop)  # `generate` reads the loop's parameters
    def counted(*args, **kwargs):
        calls.append(1)
        return loop(*args, **kwargs)

    monkeypatch.setattr(compacting, "compacting_sample", counted)
    prompts = PromptEncoder(tokenizer).encode(["1+2=", "10+17="])
    config = sampling_config(
        max_new_tokens=6,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=2,
    )
    with seeded(0), torch.no_grad():
        completion_ids = generate_with_transformers(
            model.eval(), *prompts, generation_config=config
        )[2]
    assert completion_ids.shape == (4, 6)  # sampled either way
    return bool(calls)


def packed_weights(monkeypatch) -> bool:
    """Whether a 512 x 512 float32 layer (2^18 weights) is laid out for oneDNN while sampling;
    its output is `F.linear`'s either way."""
    layer = torch.nn.Linear(512, 512)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), packed_linear_weights(torch.nn.Sequential(layer)) as laid_out:
        out = layer(x)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    return laid_out == 1


def attention_by_blocks(monkeypatch) -> bool:
    """Whether the log-probs of two groups of 4 completions, each group packed into one row,
    attend block by block; the log-probs are those of the unpacked rows either way."""
    model, _ = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    registered = []
    register = logprobs.register_packed_mask

    def recorded(*args, **kwargs):
        registered.append(1)
        return register(*args, **kwargs)

    monkeypatch.setattr(logprobs, "register_packed_mask", recorded)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (2, 10), generator=generator)
    completion_ids = torch.randint(3, model.config.vocab_size, (8, 5), generator=generator)
    input_ids = torch.cat([prompts.repeat_interleave(4, 0), completion_ids], 1)
    attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        logps = logprobs.completion_logprobs(model, input_ids, attention_mask, completion_ids)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -6:-1]
    want = torch.log_softmax(logits.float(), -1).gather(-1, completion_ids.unsqueeze(-1))
    torch.testing.assert_close(logps, want.squeeze(-1), rtol=1e-5, atol=1e-5)
    return bool(registered)


def merged_lora(monkeypatch) -> bool:
    """Whether the LoRA adapters of a float32 tiny model are merged for sampling; its logits
    are the unmerged adapters' either way."""
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_model_and_tokenizer(seed=0)
    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(model, config).eval()
    input_ids = torch.arange(3, 11).view(1, 8)
    with torch.no_grad():
        want = model(input_ids=input_ids).logits
        with merged_adapters.merged_lora(model) as merged:
            got = model(input_ids=input_ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return merged


def worker_output_capture(monkeypatch) -> bool:
    """Whether a rollout worker's `_register_output_capture` records what the tiny model's
    classes capture (taken out of transformers' registry first, as in a spawned process)."""
    model, _ = tiny_model_and_tokenizer(seed=0)
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as registry

    keys = [str(type(model)), str(type(model.model))]
    saved = {key: dict.pop(registry, key, None) for key in keys}
    try:
        _register_output_capture(model)
        return all(dict.get(registry, key) is not None for key in keys)
    finally:
        for key, value in saved.items():
            dict.pop(registry, key, None)
            if value is not None:
                dict.__setitem__(registry, key, value)


def persistent_workers_end(monkeypatch) -> bool:
    """Whether the 2 persistent workers of a loader over 6 rows, after two epochs, are gone as
    soon as `end_workers` returns; the batches are those of a loader without workers either
    way."""
    dataset = [{"row": i} for i in range(6)]
    loader = EpochDataLoader(
        dataset, batch_size=2, collate_fn=list, num_workers=2, persistent_workers=True
    )
    batches = [list(loader) for _ in range(2)]
    want = list(torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=list))
    assert batches == [want, want]
    workers = list(loader._iterator._workers)
    assert all(worker.is_alive() for worker in workers)  # persistent between epochs
    loader.end_workers()
    ended = not any(worker.is_alive() for worker in workers)
    del loader  # where it is off, the workers end with the loader
    for worker in workers:
        worker.join(timeout=10)
    assert not any(worker.is_alive() for worker in workers)
    return ended


CHECKS = {
    "sampling_loop": sampling_loop,
    "packed_weights": packed_weights,
    "attention_by_blocks": attention_by_blocks,
    "merged_lora": merged_lora,
    "worker_output_capture": worker_output_capture,
    "persistent_workers_end": persistent_workers_end,
}


def assert_runs_as_its_range_says(name: str, monkeypatch, caplog) -> None:
    """Runs path `name` twice: it runs where its library's release is in its tested range;
    elsewhere it falls back, `internals.RAN` holds why (the release and the range), and that is
    logged once."""
    with caplog.at_level(logging.WARNING, logger=internals.__name__):
        ran = [CHECKS[name](monkeypatch) for _ in range(2)]
    path = internals.FAST_PATHS[name]
    logged = [record.getMessage() for record in caplog.records if repr(name) in record.getMessage()]
    if expected_to_run(name):
        assert ran == [True, True], (
            f"{name} did not run on {path.library} {installed(path.library)}"
        )
        assert internals.RAN[name] is True
        assert logged == []
    else:
        assert ran == [False, False], f"{name} ran on {path.library} {installed(path.library)}"
        reason = internals.RAN[name]
        assert installed(path.library) in reason and path.tested in reason
        assert len(logged) == 1 and reason in logged[0] and path.fallback in logged[0]
