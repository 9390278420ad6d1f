"""The trainer's side of an engine that holds its own copy of the weights (vLLM colocated or on a
server), with a stand-in engine: a copy of the model that loads published adapters from disk the
way vLLM does. The real engines are tested in tests/vllm_engines (`make test-vllm`)."""

import contextlib
import copy

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import digit_sums, logged, make_trainer

import trl_grpo_ext.generation.producer as producer_module
import trl_grpo_ext.trainer as trainer_module
from trl_grpo_ext.generation.engines import build_engine, in_eval_mode
from trl_grpo_ext.generation.settings import EngineSettings
from trl_grpo_ext.generation.transformers_engine import (
    TransformersEngine,
    generate_with_transformers,
    seeded,
)
from trl_grpo_ext.generation.weights import OwnWeights, WeightPublisher


class CopyEngine(OwnWeights):
    """A second copy of the policy, updated only through `publish_adapter` / `load_weights` (by a
    `WeightPublisher`, as a vLLM engine)."""

    def __init__(self, policy):
        with policy() as model:
            self.model = copy.deepcopy(model).eval()
        self.published, self.generated_with = [], []

    def trainable(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if "lora_" in n}

    def publish_adapter(self, folder, version):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, load_file(f"{folder}/adapter_model.safetensors"))
        self.published.append(version)

    def load_weights(self, named_tensors):
        state = dict(named_tensors)
        self.model.load_state_dict(state)
        self.published.append("full")

    def generate(self, prompt_ids, prompt_mask, generation_config, seed=None):
        self.generated_with.append(self.published[-1] if self.published else None)
        with seeded(seed) if seed is not None else contextlib.nullcontext():
            return generate_with_transformers(
                self.model,
                prompt_ids,
                prompt_mask,
                generation_config=generation_config,
                return_logprobs=True,
            )


@pytest.fixture
def copy_engine(monkeypatch):
    engines = []

    def build(args, policy, model, model_folder, lora_rank, tokenizer=None):
        engines.append(CopyEngine(policy))
        engines[-1].publisher = WeightPublisher(engines[-1], model, lora_rank is not None)
        return engines[-1]

    monkeypatch.setattr(producer_module, "build_engine", build)
    return engines


def trainable(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_each_step_generates_with_the_adapter_just_trained(tmp_path, copy_engine):
    trainer = make_trainer(tmp_path, use_vllm=True, max_steps=3, max_completion_length=3)
    (engine,) = copy_engine
    seen = []
    original = engine.generate

    def checking(*args, **kwargs):
        ours, theirs = trainable(trainer), engine.trainable()
        seen.append(max((ours[n] - theirs[n]).abs().max().item() for n in ours))
        return original(*args, **kwargs)

    engine.generate = checking
    trainer.train()
    assert engine.published == [0, 1, 2] and engine.generated_with == [0, 1, 2]
    assert seen == [0.0, 0.0, 0.0]  # the engine's adapter is the trainer's, bit for bit
    # Same weights, same numerics: the engine's log-probs are the trainer's, ratio 1.
    for key in ("sampling/sampling_logp_difference/max",):
        assert max(logged(trainer, key)) < 1e-5
    for key in ("min", "mean", "max"):
        assert logged(trainer, f"sampling/importance_sampling_ratio/{key}") == pytest.approx(
            [1.0] * 3, abs=1e-4
        )


def test_full_fine_tuning_publishes_all_weights(tmp_path, copy_engine):
    trainer = make_trainer(tmp_path, use_vllm=True, peft=False, max_steps=2)
    trainer.train()
    (engine,) = copy_engine
    assert engine.published == ["full", "full"]
    state = trainer.model.state_dict()
    # The engine got the weights of step 1 (before the last update); one more publish catches up.
    trainer.rollouts.engine.publish(trainer.state.global_step)
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_importance_sampling_correction_weighs_the_loss(tmp_path, copy_engine, monkeypatch):
    calls = []
    original = trainer_module.policy_loss

    def recording(*args, **kwargs):
        calls.append(kwargs["importance_weights"])
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "policy_loss", recording)
    trainer = make_trainer(
        tmp_path, use_vllm=True, max_steps=1, vllm_importance_sampling_mode="token_truncate"
    )
    trainer.train()
    assert calls[0] is not None and calls[0].shape == (8, 2)  # one weight per token
    calls.clear()
    trainer = make_trainer(
        tmp_path / "off", use_vllm=True, max_steps=1, vllm_importance_sampling_correction=False
    )
    trainer.train()
    assert calls == [None]
    assert logged(trainer, "sampling/importance_sampling_ratio/mean")  # measured all the same


def test_asynchronous_rollouts_on_an_engine_keep_the_staleness_bound(tmp_path, copy_engine):
    trainer = make_trainer(
        tmp_path, use_vllm=True, max_staleness=1, max_steps=4, max_completion_length=2
    )
    trainer.train()
    (engine,) = copy_engine
    staleness = logged(trainer, "async/staleness")
    assert staleness and all(0 <= value <= 1 for value in staleness)
    assert max(staleness) == 1  # the engine did run ahead
    assert engine.published == sorted(engine.published)  # versions only advance


def test_a_server_serves_adapters_only(tmp_path):
    args = make_trainer(tmp_path, max_steps=1).args
    args.use_vllm, args.vllm_mode = True, "server"
    settings = EngineSettings.from_config(args)
    with pytest.raises(ValueError, match="full fine-tuning cannot be served"):
        build_engine(settings, policy=None, model=None, model_folder=None, lora_rank=None)


@pytest.mark.parametrize(
    ("world_size", "process_index", "name"),
    [(1, 0, "adapter-v3"), (2, 0, "adapter-p0-v3"), (2, 1, "adapter-p1-v3")],
)
def test_training_processes_sharing_a_server_publish_under_their_own_names(
    monkeypatch, world_size, process_index, name
):
    """Two processes loading (and unloading) the same adapter name on one server collide."""
    from trl_grpo_ext import GroupRelativeConfig
    from trl_grpo_ext.generation.vllm_server import VLLMServerEngine

    monkeypatch.setattr(VLLMServerEngine, "wait_until_ready", lambda self: None)
    loaded = []
    monkeypatch.setattr(VLLMServerEngine, "check_same_model", lambda self: None)
    monkeypatch.setattr(
        VLLMServerEngine, "_request", lambda self, path, payload: loaded.append(payload)
    )
    args = GroupRelativeConfig(
        "unused",
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url="http://server:8000",
        vllm_server_timeout=1.0,
        report_to="none",
    )
    monkeypatch.setattr(type(args), "world_size", world_size)
    monkeypatch.setattr(type(args), "process_index", process_index)
    settings = EngineSettings.from_config(args)
    engine = build_engine(settings, policy=None, model=None, model_folder=None, lora_rank=8)
    assert engine.own_weights and engine.publisher.engine is engine and engine.publisher.is_adapter
    engine.publish_adapter("folder", 3)
    assert engine.base_url == "http://server:8000"
    assert [payload["lora_name"] for payload in loaded] == [name]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vllm_mode": "remote"}, "vllm_mode"),
        ({"vllm_importance_sampling_mode": "tis"}, "vllm_importance_sampling_mode"),
        (
            {"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.0},
            "must be below",
        ),
        (
            {
                "vllm_importance_sampling_mode": "token_truncate",
                "vllm_importance_sampling_clip_max": None,
            },
            "set vllm_importance_sampling_clip_max",
        ),
    ],
)
def test_vllm_settings_are_validated(tmp_path, kwargs, message):
    from trl_grpo_ext import GroupRelativeConfig

    with pytest.raises(ValueError, match=message):
        GroupRelativeConfig(str(tmp_path), use_vllm=True, report_to="none", **kwargs)


def test_the_evaluation_harness_samples_with_the_engine_and_the_latest_adapter(
    tmp_path, copy_engine
):
    from trl_grpo_ext.evaluation import evaluate_on_processes

    dataset = digit_sums()
    trainer = make_trainer(tmp_path, use_vllm=True, max_steps=2, dataset=dataset)
    trainer.train()
    (engine,) = copy_engine
    report = evaluate_on_processes(trainer, dataset, max_new_tokens=3, num_examples=0)
    # Trained two steps, published before step 0 and 1; evaluation publishes step 2 first.
    assert engine.published == [0, 1, 2] and engine.generated_with[-1] == 2
    # The engine's copy holds the trained adapter: greedy answers equal the trainer's own.
    engine.generate = lambda *args, **kwargs: pytest.fail("the engine was not expected")
    trainer.rollouts.engine = TransformersEngine(lambda: in_eval_mode(trainer.model))
    expected = evaluate_on_processes(trainer, dataset, max_new_tokens=3, num_examples=0)
    assert report.to_dict() == expected.to_dict()


def evaluate_every_step_on_the_engine(trainer, dataset):
    """A periodic held-out evaluation after every step, sampling with the trainer's engine."""
    from trl_grpo_ext.evaluation import PeriodicEvalCallback

    periodic = PeriodicEvalCallback(
        trainer.processing_class,
        dataset,
        eval_every=1,
        max_new_tokens=2,
        trainer=lambda: trainer,
    )
    trainer.add_callback(periodic)
    return periodic


def test_periodic_evaluations_sample_with_the_engine_at_each_step(tmp_path, copy_engine):
    dataset = digit_sums()
    trainer = make_trainer(tmp_path, use_vllm=True, max_steps=2, dataset=dataset)
    periodic = evaluate_every_step_on_the_engine(trainer, dataset)
    trainer.train()
    (engine,) = copy_engine
    # Training samples with v0 and v1; after each step, the evaluation publishes that step's
    # weights first and samples with them.
    assert engine.published == [0, 1, 2]
    assert engine.generated_with == [0, 1, 1, 2]
    assert [step for step, _, _ in periodic.history] == [1, 2]


def test_the_transformers_engine_gets_the_fp32_head_setting(tmp_path):
    assert make_trainer(tmp_path, cast_lm_head_to_fp32=True).rollouts.engine.cast_lm_head_to_fp32
    assert not make_trainer(tmp_path).rollouts.engine.cast_lm_head_to_fp32


def test_evaluations_during_asynchronous_rollouts_leave_the_engine_to_the_worker(
    tmp_path, copy_engine
):
    import threading

    dataset = digit_sums()
    trainer = make_trainer(tmp_path, use_vllm=True, max_staleness=1, max_steps=2, dataset=dataset)
    periodic = evaluate_every_step_on_the_engine(trainer, dataset)
    (engine,) = copy_engine
    threads = []
    original = engine.generate
    engine.generate = lambda *a, **k: (
        threads.append(threading.current_thread().name) or original(*a, **k)
    )
    trainer.train()
    assert [step for step, _, _ in periodic.history] == [1, 2]
    # Only the rollout worker's thread sampled on the engine, the evaluations included: the
    # one after the last step with that step's weights, which training never published.
    assert threads and all(name.startswith("rollouts") for name in threads)
    assert engine.published == [0, 1, 2] and engine.generated_with[-1] == 2


def test_a_temporary_base_model_copy_is_removed_once_unused(tmp_path):
    """The copy saved for a colocated engine goes away even when no engine closes it (a fake
    engine, an engine that failed to start, a trainer never closed)."""
    import gc
    import os

    from trl_grpo_ext.generation.engines import engine_model_folder
    from trl_grpo_ext.tiny import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    model.config._name_or_path = ""  # built in memory: there is no folder to load it from
    engine_model = engine_model_folder(model, tokenizer)
    folder = engine_model.folder
    assert engine_model.temporary and os.path.isdir(folder)
    del engine_model
    gc.collect()
    assert not os.path.exists(folder)


def test_every_engine_implements_the_engine_protocol():
    """The four samplers have the protocol's methods, with its parameters (checked on the
    classes: the vLLM ones need vLLM to be built)."""
    import inspect

    from trl_grpo_ext.generation.engines import Engine
    from trl_grpo_ext.generation.process_worker import ProcessEngine
    from trl_grpo_ext.generation.vllm_colocate import VLLMColocateEngine
    from trl_grpo_ext.generation.vllm_server import VLLMServerEngine

    for engine in (TransformersEngine, ProcessEngine, VLLMColocateEngine, VLLMServerEngine):
        for method in ("generate", "publish", "publish_later", "close"):
            ours = inspect.signature(getattr(engine, method)).parameters
            declared = inspect.signature(getattr(Engine, method)).parameters
            assert list(ours) == list(declared), (engine.__name__, method)
        for attribute in ("own_weights", "version"):
            assert hasattr(engine, attribute), (engine.__name__, attribute)
        # Only the transformers engine samples with the trainer's weights: nothing to publish.
        assert engine.own_weights == (engine is not TransformersEngine)


def test_the_publishing_half_of_an_engine_reads_the_weights_when_asked(tmp_path):
    """`publish_later` reads the trainer's weights at once (the asynchronous worker loads them
    later, while the trainer has moved on): the engine gets the weights of the version asked
    for, not those of the moment it loads them."""
    from trl_grpo_ext.generation.process_worker import ParameterPublisher

    class Recording(OwnWeights):
        def __init__(self, model):
            self.loaded, self.publisher = [], ParameterPublisher(self, lambda: model)

        def load_weights(self, named):
            self.loaded.append({name: tensor.clone() for name, tensor in named.items()})

    model = torch.nn.Linear(2, 2)
    engine = Recording(model)
    load = engine.publish_later(1)
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # a training step between the read and the load
    assert engine.version is None
    load()
    assert engine.version == 1 and torch.equal(engine.loaded[0]["weight"], before)
    engine.publish(2)
    assert engine.version == 2 and torch.equal(engine.loaded[1]["weight"], model.weight)
    engine.publish(2)  # the version it has: nothing sent
    assert len(engine.loaded) == 2
