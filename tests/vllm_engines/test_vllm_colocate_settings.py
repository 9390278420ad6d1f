"""The colocated vLLM engine under settings a user picks: asynchronous rollouts several steps
ahead, LoRA ranks vLLM does not list, evaluations during asynchronous training, a model changed
in memory, a model vLLM's CPU build cannot run, and no temporary files left behind."""

import os
import tempfile
import threading

import pytest
import torch

pytest.importorskip("vllm")

from test_vllm_training import record_calls, vllm_trainer  # noqa: E402
from trainer_helpers import digit_sums, logged, lora_config, odd_first_byte  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, IntervalStrategy  # noqa: E402
from vllm_helpers import config  # noqa: E402

from trl_grpo_ext.generation.transformers_engine import generate_with_transformers  # noqa: E402

pytestmark = pytest.mark.vllm

SHORT = dict(reward_funcs=odd_first_byte, max_completion_length=2, learning_rate=3e-2)


@pytest.fixture
def private_tmpdir(tmp_path, monkeypatch):
    """A TMPDIR of the test's own, to see what the engine leaves behind."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def ours(folder):
    """What this package left in `folder`. (vLLM's in-process engine keeps its distributed
    init file, `vllm_dist_*`, until vLLM shuts down, which `close` cannot do: see its note.)"""
    return [path.name for path in folder.iterdir() if path.name.startswith("trl_grpo_ext-")]


def test_asynchronous_rollouts_three_steps_ahead_load_every_version(
    vllm_model_dir, tmp_path, private_tmpdir
):
    """The trainer saves adapter versions up to three steps ahead of the engine: each must still
    be on disk when the engine loads it (it was deleted by position before)."""
    trainer = vllm_trainer(
        vllm_model_dir, tmp_path, vllm_mode="colocate", max_staleness=3, max_steps=8, **SHORT
    )
    generations = record_calls(trainer.rollouts.engine.llm, "generate")
    # The engine loads version 1 only once the trainer has saved version 3, as when generation
    # is slower than training: versions 2 and 3 are on disk, not loaded yet.
    publisher = trainer.rollouts.engine.publisher
    saved_v3 = threading.Event()
    snapshot, load = publisher.snapshot, publisher.load

    def snapshotting(version):
        folder = snapshot(version)
        if version == 3:
            saved_v3.set()
        return folder

    def loading(weights, version):
        if version == 1:
            assert saved_v3.wait(timeout=120)
        return load(weights, version)

    publisher.snapshot, publisher.load = snapshotting, loading
    trainer.train()
    staleness = logged(trainer, "async/staleness")
    assert len(staleness) == 8 and 0 <= min(staleness) and max(staleness) <= 3
    assert max(staleness) > 0  # the worker did run ahead
    names = [kwargs["lora_request"].lora_name for _, kwargs in generations]
    versions = [int(name.removeprefix("adapter-v")) for name in names]
    assert versions == sorted(versions) and versions[-1] >= 4  # versions advanced
    trainer.rollouts.shutdown()
    assert ours(private_tmpdir) == []


@pytest.mark.parametrize(
    ("rank", "expected"), [(1, 1), (2, 8), (4, 8), (8, 8), (9, 16), (300, 320), (512, 512)]
)
def test_max_lora_rank_rounds_up_to_a_rank_vllm_accepts(rank, expected):
    from trl_grpo_ext.generation.vllm_colocate import supported_lora_rank

    assert supported_lora_rank(rank) == expected


def test_a_lora_rank_above_vllms_largest_is_a_clear_error():
    from trl_grpo_ext.generation.vllm_colocate import supported_lora_rank

    with pytest.raises(ValueError, match="lower lora_r .* to 512"):
        supported_lora_rank(513)


def test_lora_rank_4_with_a_larger_rank_pattern_trains_colocated(vllm_model_dir, tmp_path):
    """r=4 is no max_lora_rank vLLM accepts, and a rank_pattern entry of 12 raises the largest
    adapter rank to 12: the engine reserves 16."""
    peft_config = lora_config(r=4)
    peft_config.rank_pattern = {"q_proj": 12}
    trainer = vllm_trainer(
        vllm_model_dir,
        tmp_path,
        vllm_mode="colocate",
        peft_config=peft_config,
        max_steps=2,
        **SHORT,
    )
    assert trainer.rollouts.engine.max_lora_rank == 16
    trainer.train()
    assert trainer.rollouts.engine.adapter_version == 1
    trainer.rollouts.shutdown()


def test_evaluate_during_asynchronous_rollouts_samples_on_the_worker_thread(
    vllm_model_dir, tmp_path
):
    """`evaluate()` (eval_strategy="steps") runs while the worker generates ahead: its samples
    are drawn on the worker's thread, never alongside it, with the weights of that step."""
    trainer = vllm_trainer(
        vllm_model_dir,
        tmp_path,
        vllm_mode="colocate",
        max_staleness=1,
        max_steps=3,
        num_generations_eval=2,
        **SHORT,
    )
    trainer.eval_dataset = digit_sums(2)  # eval_strategy: steps, eval_steps: 1
    trainer.args.eval_strategy, trainer.args.eval_steps = IntervalStrategy.STEPS, 1
    llm = trainer.rollouts.engine.llm
    calls, active, overlaps = [], [], []
    original = llm.generate

    def recording(*args, **kwargs):
        if active:
            overlaps.append(threading.current_thread().name)
        active.append(1)
        try:
            calls.append((threading.current_thread().name, kwargs))
            return original(*args, **kwargs)
        finally:
            active.pop()

    llm.generate = recording
    trainer.train()
    assert len(logged(trainer, "eval_reward")) == 3 and overlaps == []
    assert all(name.startswith("rollouts") for name, _ in calls)
    # an evaluation samples num_generations_eval=2 per prompt, with the adapter of its step
    evaluations = [
        kwargs["lora_request"].lora_name
        for _, kwargs in calls
        if kwargs["sampling_params"][0].n == 2
    ]
    # (4 prompts in chunks of prompts_per_generation=2: two calls per evaluation)
    assert evaluations == ["adapter-v1"] * 2 + ["adapter-v2"] * 2 + ["adapter-v3"] * 2
    trainer.rollouts.shutdown()


def test_the_engine_samples_from_the_weights_in_memory(vllm_model_dir, tmp_path):
    """A model changed after loading (here: one projection scaled, and the embeddings resized)
    is the one the engine samples from, not the checkpoint on disk."""
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(4.0)
        model.lm_head.weight[:, :].add_(0.5 * torch.randn_like(model.lm_head.weight))
    model.resize_token_embeddings(len(tokenizer) + 5)
    trainer = vllm_trainer(
        vllm_model_dir,
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        vllm_mode="colocate",
        max_steps=1,
        learning_rate=0.0,
        **{k: v for k, v in SHORT.items() if k != "learning_rate"},
    )
    trainer.train()
    # zero learning rate: the adapter is still the identity, so the engine's greedy answers must
    # be those of the changed model
    engine = trainer.rollouts.engine
    encoded = tokenizer(["1+1=", "2+0="], padding=True, return_tensors="pt")
    prompts = encoded["input_ids"], encoded["attention_mask"]
    greedy = config(tokenizer, greedy=True)
    with torch.no_grad():
        expected = generate_with_transformers(
            trainer.model.eval(), *prompts, generation_config=greedy
        )[2]
        on_disk = generate_with_transformers(
            AutoModelForCausalLM.from_pretrained(vllm_model_dir).eval(),
            *prompts,
            generation_config=greedy,
        )[2]
    assert not torch.equal(expected, on_disk)  # the change matters to greedy decoding
    assert torch.equal(engine.generate(*prompts, greedy)[2], expected)
    trainer.rollouts.shutdown()


def test_a_head_size_vllms_cpu_build_cannot_run_is_a_clear_error_before_start(tmp_path):
    from trl_grpo_ext.generation.vllm_colocate import ColocateSettings, VLLMColocateEngine
    from trl_grpo_ext.tiny import save_tiny

    folder = save_tiny(tmp_path / "heads16", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="head size 16.*--tiny_num_attention_heads 2"):
        VLLMColocateEngine(folder, ColocateSettings(max_model_len=128))


def test_full_fine_tuning_publishes_without_copies_and_leaves_no_files(
    vllm_model_dir, tmp_path, private_tmpdir
):
    """An in-memory model (no folder on disk) is saved once for the engine; after training and
    `shutdown`, the private TMPDIR is empty. Synchronous publication hands the engine the
    trainer's own tensors, not clones."""
    from trl_grpo_ext.tiny import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    model = build_tiny_model(
        tokenizer, seed=0, num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2
    )
    trainer = vllm_trainer(
        vllm_model_dir,
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        vllm_mode="colocate",
        peft=False,
        max_steps=2,
        **SHORT,
    )
    assert [p.name for p in private_tmpdir.iterdir() if p.name.startswith("trl_grpo_ext-base-")]
    engine = trainer.rollouts.engine
    handed = []
    original = engine.load_weights

    def loading(named_tensors):
        named_tensors = list(named_tensors)
        handed.append({name: tensor.data_ptr() for name, tensor in named_tensors})
        return original(named_tensors)

    engine.load_weights = loading
    trainer.train()
    pointers = {name: tensor.data_ptr() for name, tensor in trainer.model.state_dict().items()}
    assert len(handed) == 2 and handed[-1] == pointers
    trainer.rollouts.shutdown()
    assert engine.llm is None
    assert ours(private_tmpdir) == []
    assert not any(name.startswith("trl_grpo_ext-") for name in os.listdir(tmp_path))
