"""What `generate` samples is what the configuration says: never the checkpoint's own
`generation_config`, in training, `evaluate()` and the evaluation harness alike. Prompts are
rendered and tokenised the same way everywhere."""

import warnings

import pytest
import torch
from datasets import Dataset
from tokenizers import processors
from trainer_helpers import digit_sums, logged, lora_config, make_trainer
from transformers import GenerationConfig
from transformers.generation import logits_process as lp
from transformers.generation.utils import GenerationMixin

from trl_grpo_ext import evaluation
from trl_grpo_ext.generation import PromptEncoder, sampling_config
from trl_grpo_ext.tiny import build_tiny_tokenizer, tiny_model_and_tokenizer


@pytest.fixture
def built_processors(monkeypatch):
    """Records the logits processors of every `generate` call."""
    calls = []
    original = GenerationMixin._get_logits_processor

    def recording(self, *args, **kwargs):
        processors_ = original(self, *args, **kwargs)
        calls.append(list(processors_))
        return processors_

    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", recording)
    return calls


def opinionated_model():
    """The tiny model with a checkpoint generation config like Qwen2.5-Instruct's."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    model.generation_config.top_k = 20
    model.generation_config.min_p = 0.05
    model.generation_config.top_p = 0.8
    model.generation_config.temperature = 0.7
    model.generation_config.repetition_penalty = 1.05
    return model, tokenizer


def kinds(processor_list):
    return {type(p) for p in processor_list}


def test_training_samples_with_the_config_settings_not_the_checkpoints(tmp_path, built_processors):
    model, tokenizer = opinionated_model()
    trainer = make_trainer(
        tmp_path, model=model, tokenizer=tokenizer, max_steps=1, temperature=0.9, top_p=0.95
    )
    trainer.train()
    assert built_processors
    for processor_list in built_processors:
        # top_k=0 and min_p=None build no filter; repetition_penalty=1.0 none either.
        assert kinds(processor_list) == {lp.TemperatureLogitsWarper, lp.TopPLogitsWarper}
        temperature, top_p = processor_list
        assert temperature.temperature == 0.9
        assert top_p.top_p == 0.95
    assert model.generation_config.top_k == 20  # the checkpoint's file is left as it was


def test_generation_kwargs_override_the_sampling_fields(tmp_path, built_processors):
    model, tokenizer = opinionated_model()
    trainer = make_trainer(
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        max_steps=1,
        top_k=0,
        generation_kwargs={"top_k": 7, "temperature": 0.5},
    )
    trainer.train()
    for processor_list in built_processors:
        assert kinds(processor_list) == {lp.TemperatureLogitsWarper, lp.TopKLogitsWarper}
        by_kind = {type(p): p for p in processor_list}
        assert by_kind[lp.TemperatureLogitsWarper].temperature == 0.5
        assert by_kind[lp.TopKLogitsWarper].top_k == 7


def test_evaluate_samples_num_generations_eval_with_the_training_settings(
    tmp_path, built_processors
):
    model, tokenizer = opinionated_model()
    seen = []

    def count_completions(completions, **kwargs):
        seen.append(len(completions))
        return [0.0] * len(completions)

    trainer = make_trainer(
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        reward_funcs=count_completions,
        num_generations_eval=3,
        per_device_train_batch_size=8,
        temperature=0.9,
    )
    dataset = Dataset.from_list([{"prompt": f"{a}+1=", "answer": "x"} for a in range(4)])
    metrics = trainer.evaluate(dataset)
    assert metrics["eval_reward"] == 0.0
    assert seen == [2 * 3, 2 * 3]  # 2 prompts per generation batch, 3 completions each
    for processor_list in built_processors:
        assert kinds(processor_list) == {lp.TemperatureLogitsWarper}


def test_evaluation_harness_ignores_the_checkpoints_sampling_settings(built_processors):
    model, tokenizer = opinionated_model()
    evaluation.generate(
        model, tokenizer, ["1+1="], max_new_tokens=2, num_samples=2, temperature=0.6
    )
    assert built_processors  # one call per step of prompt-once sampling
    for sampled in built_processors:
        assert kinds(sampled) == {lp.TemperatureLogitsWarper}
        assert sampled[0].temperature == 0.6
    built_processors.clear()
    evaluation.generate(model, tokenizer, ["1+1="], max_new_tokens=2)  # greedy
    (greedy,) = built_processors
    assert greedy == []  # no repetition penalty, no filter: the argmax of the model's logits


def test_sampling_config_sets_every_sampling_field():
    config = sampling_config(max_new_tokens=4, eos_token_id=[2], pad_token_id=0)
    assert (config.top_k, config.min_p, config.top_p, config.temperature) == (0, None, 1.0, 1.0)
    assert config.do_sample and config.repetition_penalty == 1.0
    greedy = sampling_config(max_new_tokens=4, eos_token_id=[2], pad_token_id=0, greedy=True)
    assert not greedy.do_sample
    assert isinstance(greedy, GenerationConfig)


# ------------------------------------------------------------------------------ prompts


def bos_tokenizer():
    """The tiny tokenizer, adding a BOS token (<|im_start|>) to plain text like Llama's."""
    tokenizer = build_tiny_tokenizer()
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    tokenizer.bos_token = "<|im_start|>"
    return tokenizer, bos


def test_plain_text_prompts_keep_the_bos_token_and_chat_prompts_get_none_added():
    tokenizer, bos = bos_tokenizer()
    ids, mask = PromptEncoder(tokenizer).encode(["1+1=", "10+10="])
    first_real = ids[mask.bool()].tolist()[0]
    assert first_real == bos and ids[1, 0] == bos
    chat = [[{"role": "user", "content": "1+1="}]]
    ids, _ = PromptEncoder(tokenizer).encode(chat)
    assert ids[0].tolist().count(bos) == 2  # the template's two <|im_start|>, none added


def test_chat_template_kwargs_reach_the_template(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
    )
    prompt = [{"role": "user", "content": "1+1="}]
    assert PromptEncoder(tokenizer).render(prompt) == "1+1="
    encoder = PromptEncoder(tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert encoder.render(prompt) == "1+1=<nothink>"


def test_long_prompts_are_cut_from_the_left_with_one_warning():
    tokenizer = build_tiny_tokenizer()
    encoder = PromptEncoder(tokenizer, max_prompt_length=4)
    with pytest.warns(UserWarning, match="2 of 3 prompts .* max_prompt_length=4"):
        ids, mask = encoder.encode(["123456", "1234", "abcdefgh"])
    assert tokenizer.decode(ids[0]) == "3456" and tokenizer.decode(ids[2]) == "efgh"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second cut says nothing
        encoder.encode(["abcdefgh"])
    assert encoder.num_truncated == 3


def test_conversational_data_without_a_chat_template_fails_at_construction(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    tokenizer.chat_template = None
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}] * 4)
    with pytest.raises(ValueError, match="no chat template"):
        make_trainer(tmp_path, model=model, tokenizer=tokenizer, dataset=data)


# ------------------------------------------------------------------------------ dropout


def test_disable_dropout_makes_the_first_ratio_exactly_one(tmp_path):
    trainer = make_trainer(
        tmp_path,
        peft_config=lora_config(dropout=0.5),
        max_steps=2,
        num_iterations=2,
        disable_dropout=True,
    )
    dropouts = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0 for m in dropouts)
    trainer.train()
    assert logged(trainer, "ratio_mean")[0] == 1.0  # same weights, no dropout: no clipping
    assert logged(trainer, "clip_ratio/region_mean")[0] == 0.0


def test_no_grad_logprob_passes_run_without_dropout(tmp_path):
    """Old and reference log-probs are those of the policy, not of one random dropout mask."""
    trainer = make_trainer(tmp_path, peft_config=lora_config(dropout=0.5))
    model = trainer.model.train()
    batch = trainer._make_generation_batch(
        [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}]
    )[0]
    batch = {key: value for key, value in batch.items() if key != "num_items_in_batch"}
    first = trainer._logps_in_chunks(model, batch, 4)
    second = trainer._logps_in_chunks(model, batch, 4)
    assert torch.equal(first, second)
    assert model.training  # the model is handed back in train mode
    with torch.no_grad():  # the same chunks in eval mode (a whole-batch pass may round apart)
        model.eval()
        rows = batch["input_ids"].shape[0]
        expected = torch.cat(
            [
                trainer._token_logprobs(model, {k: v[i : i + 4] for k, v in batch.items()})
                for i in range(0, rows, 4)
            ]
        )
    torch.testing.assert_close(first, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------- other TRL fields


def test_remote_code_runs_only_when_asked(tmp_path, tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls = []
    for auto in (AutoModelForCausalLM, AutoTokenizer):
        original = auto.from_pretrained.__func__

        def recording(cls, path, *args, _original=original, **kwargs):
            calls.append((cls.__name__, kwargs.get("trust_remote_code")))
            return _original(cls, path, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", classmethod(recording))
    make_trainer(tmp_path, model=None, peft=False)  # built in memory: nothing loaded
    assert calls == []
    from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer

    for trust in (False, True):
        calls.clear()
        args = GroupRelativeConfig(
            str(tmp_path), num_generations=4, per_device_train_batch_size=8, report_to="none",
            trust_remote_code=trust,
        )  # fmt: skip
        GroupRelativeTrainer(
            tiny_model_dir,
            lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=digit_sums(),
        )
        assert calls == [("AutoModelForCausalLM", trust), ("AutoTokenizer", trust)]


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path):
    trainer = make_trainer(
        tmp_path,
        peft=False,
        beta=0.1,
        sync_ref_model=True,
        ref_model_mixup_alpha=0.5,
        ref_model_sync_steps=1,
        max_steps=1,
    )
    reference_before = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    policy = dict(trainer.model.named_parameters())
    moved = 0
    for name, value in trainer.ref_model.named_parameters():
        expected = 0.5 * reference_before[name] + 0.5 * policy[name].detach()
        torch.testing.assert_close(value, expected)
        moved += not torch.equal(value, reference_before[name])
    assert moved  # the policy did change, and the reference followed half way


def test_sync_ref_model_under_lora_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="sync_ref_model=True needs full fine-tuning"):
        make_trainer(tmp_path, beta=0.1, sync_ref_model=True)


def test_pad_to_multiple_of_pads_without_changing_the_training(tmp_path):
    def run(name, **config):
        # SGD: Adam's normalisation would blow float rounding of tiny gradients up to lr.
        trainer = make_trainer(
            tmp_path / name, max_steps=2, max_completion_length=3, optim="sgd", **config
        )
        batches = []
        original = trainer.compute_objective

        def recording(model, batch):
            batches.append(batch)
            return original(model, batch)

        trainer.compute_objective = recording
        trainer.train()
        weights = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
        return batches, weights, logged(trainer, "loss")

    padded, padded_weights, padded_loss = run("padded", pad_to_multiple_of=8)
    plain, plain_weights, plain_loss = run("plain")
    for batch in padded:
        assert batch["input_ids"].shape[1] % 8 == 0 and batch["completion_ids"].shape[1] == 8
    assert plain[0]["completion_ids"].shape[1] == 3
    assert padded_loss == pytest.approx(plain_loss, abs=1e-6)
    for name, value in plain_weights.items():
        torch.testing.assert_close(padded_weights[name], value, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- TRL's vLLM stop keys in generation_kwargs

# Capitals: about 1 in 10 byte tokens, and in no special token's text. Of 16 rows of 10 tokens
# sampled near uniformly, all stop or none does with probability about 0.1%.
STOPS = list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def sample_rows(tmp_path, seed, **generation_kwargs):
    trainer = make_trainer(
        tmp_path,
        max_completion_length=10,
        generation_kwargs=generation_kwargs or None,
        per_device_train_batch_size=16,
    )
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(4)]
    torch.manual_seed(seed)
    return trainer.rollouts.generate(rows, version=0)


def test_stop_ends_each_completion_at_its_first_stop_string(tmp_path, monkeypatch):
    criteria = []
    original = GenerationMixin._get_stopping_criteria

    def recording(self, *args, **kwargs):
        built = original(self, *args, **kwargs)
        criteria.extend(type(criterion).__name__ for criterion in built)
        return built

    monkeypatch.setattr(GenerationMixin, "_get_stopping_criteria", recording)
    free = sample_rows(tmp_path / "free", seed=3)
    stopped = sample_rows(tmp_path / "stop", seed=3, stop=STOPS, include_stop_str_in_output=True)
    assert "StopStringCriteria" in criteria  # `generate` itself stops, not only the mask
    tokenizer = build_tiny_tokenizer()
    ends = 0
    for row in range(len(free)):
        free_ids = free.completion_ids[row][free.completion_mask[row].bool()].tolist()
        ids = stopped.completion_ids[row][stopped.completion_mask[row].bool()].tolist()
        # The same draws: the completion is the unstopped one, cut after its first stop token.
        texts = [tokenizer.decode([token]) for token in free_ids]
        first = next((t for t, text in enumerate(texts) if set(text) & set(STOPS)), None)
        if first is None:
            assert ids == free_ids
            assert bool(stopped.is_truncated[row]) == bool(free.is_truncated[row])
        else:
            ends += 1
            assert ids == free_ids[: first + 1]
            assert not stopped.is_truncated[row]  # ended by a stop string, not by the length cap
            assert stopped.completions[row] == tokenizer.decode(ids, skip_special_tokens=True)
            assert set(tokenizer.decode(ids[-1:])) & set(STOPS)
    assert 0 < ends < len(free)  # both kinds of completion occur


def test_the_stop_keys_are_checked_and_stop_is_transformers_stop_strings():
    config = sampling_config(
        max_new_tokens=4, eos_token_id=[1], pad_token_id=0, generation_kwargs={"stop": "\n"}
    )
    assert config.stop_strings == ["\n"]
    with pytest.raises(ValueError, match="same setting: keep one"):
        sampling_config(
            max_new_tokens=4,
            eos_token_id=[1],
            pad_token_id=0,
            generation_kwargs={"stop": ["a"], "stop_strings": ["b"]},
        )
    for bad in ({"stop": [1]}, {"stop": [""]}, {"include_stop_str_in_output": "yes"}):
        with pytest.raises(ValueError, match="generation_kwargs"):
            sampling_config(
                max_new_tokens=4, eos_token_id=[1], pad_token_id=0, generation_kwargs=bad
            )


def test_vllm_gets_the_stop_keys_as_its_own():
    from trl_grpo_ext.generation.vllm_sampling import sampling_fields

    config = sampling_config(
        max_new_tokens=4,
        eos_token_id=[1],
        pad_token_id=0,
        generation_kwargs={"stop": ["</answer>", "\n\n"], "include_stop_str_in_output": True},
    )
    fields = sampling_fields(config, seed=0)  # no error: both are honoured
    assert fields["stop"] == ["</answer>", "\n\n"]
    assert fields["include_stop_str_in_output"] is True
    plain = sampling_fields(
        sampling_config(max_new_tokens=4, eos_token_id=[1], pad_token_id=0), seed=0
    )
    assert plain["stop"] == [] and plain["include_stop_str_in_output"] is False


def test_stop_ends_the_asynchronous_workers_completions_too(tmp_path):
    # The rollout worker's `generate` has no tokenizer to match strings with; the completion is
    # ended at its first stop string all the same, before the rewards see it.
    seen = []

    def recording(completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    trainer = make_trainer(
        tmp_path,
        reward_funcs=recording,
        max_staleness=1,
        max_steps=2,
        max_completion_length=10,
        generation_kwargs={"stop": STOPS},
    )
    trainer.train()
    assert len(seen) == 16
    ended = [text for text in seen if set(text) & set(STOPS)]
    assert ended and all(not set(text[:-1]) & set(STOPS) for text in ended)
    assert all(text[-1] in STOPS for text in ended)


def test_end_at_stop_strings_keeps_the_token_that_completes_the_first_stop():
    from trl_grpo_ext.generation.sampling import end_at_stop_strings

    tokenizer = build_tiny_tokenizer()  # one token per byte
    eos = tokenizer.eos_token_id
    rows = ["xy</a>zz</a>", "no stop here", "ab"]
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in rows]
    ids[2] = ids[2] + [eos] + tokenizer.encode("</a>", add_special_tokens=False)
    width = max(map(len, ids))
    completion_ids = torch.tensor(
        [row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids]
    )
    mask = torch.tensor([[1] * 12, [1] * 12, [1, 1, 1] + [0] * 9])  # up to the eos of row 2
    ended, stopped = end_at_stop_strings(tokenizer, completion_ids, mask, ["</a>", "zz z"])
    assert ended.sum(dim=1).tolist() == [6, 12, 3]  # "xy</a>"; unchanged; the eos came first
    assert stopped.tolist() == [True, False, False]
