"""The trainer with a real vLLM engine, colocated and on an unmodified server: it learns the toy
task of tests/test_learning.py, vLLM samples exactly the settings of the config, the behaviour
log-probs are the trainer's, every step generates with the adapter (or full weights) just
trained, asynchronous rollouts keep their staleness bound, and a run survives a server that dies.

The model is the vLLM-compatible tiny model of the conftest (2 heads of 32). Its chance of
starting with the right digit is lower than test_learning's model, so the first ~20 steps carry
almost no signal; a larger learning rate than test_learning's makes 40 steps enough.
"""

import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402
from trainer_helpers import logged, make_trainer, odd_first_byte, right_digit  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402

from trl_grpo_ext.checkpoints import last_complete_checkpoint  # noqa: E402
from trl_grpo_ext.evaluation import evaluate_on_processes  # noqa: E402
from trl_grpo_ext.generation.engines import in_eval_mode  # noqa: E402
from trl_grpo_ext.generation.transformers_engine import TransformersEngine  # noqa: E402
from trl_grpo_ext.generation.vllm_server import VLLMServerError  # noqa: E402

pytestmark = pytest.mark.vllm

MARGIN = 0.15  # as test_learning: absolute rise of the mean reward, last 10 steps over first 10
LEARNING = dict(
    reward_funcs=right_digit,
    num_generations=8,
    per_device_train_batch_size=32,
    max_completion_length=1,
    max_steps=40,
    learning_rate=3e-2,
)
LOGP_TOLERANCE = 1e-4  # engine against trainer log-probs, float32 on both sides


def vllm_trainer(model_dir, output_dir, **config):
    """A trainer on the vLLM-compatible tiny model (LoRA r=8 unless peft=False) with vLLM."""
    model = config.pop("model", None) or AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = config.pop("tokenizer", None) or AutoTokenizer.from_pretrained(model_dir)
    config.setdefault("vllm_max_model_length", 128)
    return make_trainer(output_dir, model=model, tokenizer=tokenizer, use_vllm=True, **config)


def record_calls(owner, name):
    """Replaces `owner.name` with a wrapper that records `(args, kwargs)` of each call."""
    calls, original = [], getattr(owner, name)

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    setattr(owner, name, recording)
    return calls


def assert_learns(trainer):
    rewards = logged(trainer, "reward")
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + MARGIN, (first, last, rewards)


def assert_engine_logps_are_the_trainers(trainer, min_steps):
    """TRL's metric of the engine/trainer log-prob mismatch, logged on steps that train."""
    differences = logged(trainer, "sampling/sampling_logp_difference/max")
    assert len(differences) >= min_steps
    assert max(differences) < LOGP_TOLERANCE, differences


def server_requests(calls, path=None):
    """`(path, payload)` of the recorded `VLLMServerEngine._request` calls (to `path` only)."""
    requests = [(args[0], args[1] if len(args) > 1 else None) for args, _ in calls]
    return [(p, payload) for p, payload in requests if path is None or p == path]


# ------------------------------------------------------------------------------------ colocate


def test_colocated_lora_learns_with_the_latest_adapter_each_step(vllm_model_dir, tmp_path):
    trainer = vllm_trainer(vllm_model_dir, tmp_path, vllm_mode="colocate", **LEARNING)
    generations = record_calls(trainer.rollouts.engine.llm, "generate")
    trainer.train()
    assert_learns(trainer)
    assert_engine_logps_are_the_trainers(trainer, min_steps=5)
    # one generation per step, each with a new LoRARequest: the adapter of that step
    adapters = [kwargs["lora_request"] for _, kwargs in generations]
    assert [adapter.lora_name for adapter in adapters] == [f"adapter-v{s}" for s in range(40)]
    assert [adapter.lora_int_id for adapter in adapters] == list(range(1, 41))
    # The held-out evaluation samples with the engine too, with the adapter of the last step
    # published first; its greedy answers are those of the trained model in transformers.
    dataset = trainer.train_dataset
    report = evaluate_on_processes(trainer, dataset, max_new_tokens=2, num_examples=0)
    assert generations[-1][1]["lora_request"].lora_name == "adapter-v40"
    trainer.rollouts.engine = TransformersEngine(lambda: in_eval_mode(trainer.model))
    expected = evaluate_on_processes(trainer, dataset, max_new_tokens=2, num_examples=0)
    assert report.to_dict() == expected.to_dict()


def test_colocated_engine_samples_exactly_the_settings_of_the_config(vllm_model_dir, tmp_path):
    trainer = vllm_trainer(
        vllm_model_dir,
        tmp_path,
        vllm_mode="colocate",
        max_steps=2,
        num_generations=4,
        max_completion_length=3,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
    )
    generations = record_calls(trainer.rollouts.engine.llm, "generate")
    trainer.train()
    eos = trainer.processing_class.eos_token_id
    seeds = []
    for _, kwargs in generations:
        for params in kwargs["sampling_params"]:  # one per prompt, B = 8 / 4 = 2
            assert (params.n, params.max_tokens, params.temperature) == (4, 3, 0.7)
            assert (params.top_p, params.top_k, params.repetition_penalty) == (0.9, 20, 1.1)
            assert params.min_p == pytest.approx(0.05) and params.min_tokens == 0
            assert params.stop_token_ids == [eos] and params.ignore_eos
            assert params.logprobs == 0
            seeds.append(params.seed)
    assert len(seeds) == 4 and len(set(seeds)) == 4  # no two prompts share a random stream


def test_colocated_full_fine_tuning_publishes_all_weights_each_step(vllm_model_dir, tmp_path):
    trainer = vllm_trainer(
        vllm_model_dir,
        tmp_path,
        vllm_mode="colocate",
        peft=False,
        reward_funcs=odd_first_byte,  # a signal every step, so every step logs the mismatch
        max_steps=3,
        max_completion_length=3,
        learning_rate=2e-3,
    )
    assert trainer.rollouts.engine.max_lora_rank is None  # no LoRA in the engine
    loads = record_calls(trainer.rollouts.engine, "load_weights")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert len(loads) == 3
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    # the engine's log-probs are the trainer's at every step: it had the weights just trained
    assert_engine_logps_are_the_trainers(trainer, min_steps=3)


# -------------------------------------------------------------------------------------- server


def test_server_lora_learns_with_the_latest_adapter_each_step(
    vllm_server, vllm_model_dir, tmp_path
):
    base_url = vllm_server
    trainer = vllm_trainer(
        vllm_model_dir, tmp_path, vllm_mode="server", vllm_server_base_url=base_url, **LEARNING
    )
    requests = record_calls(trainer.rollouts.engine, "_request")
    trainer.train()
    assert_learns(trainer)
    assert_engine_logps_are_the_trainers(trainer, min_steps=5)
    loads = server_requests(requests, "/v1/load_lora_adapter")
    loaded = [payload["lora_name"] for _, payload in loads]
    assert loaded == [f"adapter-v{step}" for step in range(40)]
    # every completion request names the adapter loaded last before it
    latest = None
    for path, payload in server_requests(requests):
        if path == "/v1/load_lora_adapter":
            latest = payload["lora_name"]
        elif path == "/v1/completions" and payload["logprobs"] == 1:  # not the log-prob check
            assert payload["model"] == latest
            fields = {key: payload[key] for key in ("n", "temperature", "top_p", "top_k")}
            assert fields == dict(n=8, temperature=1.0, top_p=1.0, top_k=0)
            assert (payload["max_tokens"], payload["repetition_penalty"]) == (1, 1.0)
    served = [entry["id"] for entry in trainer.rollouts.engine._request("/v1/models")["data"]]
    assert "adapter-v39" in served and "adapter-v38" not in served  # older versions unloaded


def test_server_asynchronous_rollouts_keep_the_staleness_bound(
    vllm_server, vllm_model_dir, tmp_path
):
    base_url = vllm_server
    trainer = vllm_trainer(
        vllm_model_dir,
        tmp_path,
        vllm_mode="server",
        vllm_server_base_url=base_url,
        max_staleness=1,
        reward_funcs=odd_first_byte,  # a signal every step: every step logs the mismatch
        max_steps=20,
        max_completion_length=2,
        learning_rate=3e-2,
    )
    publications = record_calls(trainer.rollouts.engine, "publish_adapter")
    trainer.train()
    entries = [entry for entry in trainer.state.log_history if "async/staleness" in entry]
    staleness = [entry["async/staleness"] for entry in entries]
    assert len(staleness) == 20 and set(staleness) == {0.0, 1.0}  # within the bound, and used
    # each version published as it was made, while the server generated
    assert [args[1] for args, _ in publications] == list(range(20))
    # a fresh batch was sampled with the trainer's weights; a stale one with the previous
    # version, which TRL's importance-sampling correction weighs (steps that train log these)
    key = "sampling/sampling_logp_difference/max"
    fresh = [entry[key] for entry in entries if key in entry and entry["async/staleness"] == 0]
    stale = [entry[key] for entry in entries if key in entry and entry["async/staleness"] == 1]
    assert len(fresh) >= 3 and len(stale) >= 3
    # Every fresh batch matches the trainer; stale ones differ, but one whose version barely
    # moved the weights (a step with little signal) can come close: the typical one is checked.
    stale_median = sorted(stale)[len(stale) // 2]
    assert max(fresh) < LOGP_TOLERANCE and stale_median > 100 * LOGP_TOLERANCE, (fresh, stale)


def test_a_server_killed_mid_run_fails_clearly_and_the_run_resumes(
    restartable_server, vllm_model_dir, tmp_path
):
    settings = dict(
        vllm_mode="server",
        vllm_server_base_url=restartable_server.base_url,
        vllm_server_timeout=5,  # how long the killed server is waited for
        reward_funcs=odd_first_byte,
        max_steps=5,
        max_completion_length=3,
        save_strategy="steps",
        save_steps=2,
    )

    class KillServerAfterFirstSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                restartable_server.kill()

    trainer = vllm_trainer(vllm_model_dir, tmp_path, **settings)
    trainer.add_callback(KillServerAfterFirstSave())
    with pytest.raises(VLLMServerError, match=restartable_server.base_url):
        trainer.train()
    checkpoint = last_complete_checkpoint(str(tmp_path))
    assert checkpoint is not None and checkpoint.endswith("checkpoint-2")
    saved_adapter = load_file(f"{checkpoint}/adapter_model.safetensors")

    restartable_server.start()  # same address, no adapters loaded
    resumed = vllm_trainer(vllm_model_dir, tmp_path, **settings)
    published = []
    original = resumed.rollouts.engine.publish_adapter

    def publishing(folder, version):
        published.append((version, load_file(f"{folder}/adapter_model.safetensors")))
        return original(folder, version)

    resumed.rollouts.engine.publish_adapter = publishing
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 5
    assert [version for version, _ in published] == [2, 3, 4]
    version_2 = published[0][1]  # the checkpoint's adapter, re-published to the new server
    assert version_2.keys() == saved_adapter.keys()
    assert all(torch.equal(version_2[name], saved_adapter[name]) for name in saved_adapter)
