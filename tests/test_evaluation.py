"""The evaluation harness: pass@k, strict vs lenient scoring, base / local adapter / Hub adapter."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_grpo_ext import evaluation
from trl_grpo_ext.data import synthetic_dataset
from trl_grpo_ext.evaluation import (
    EvalReport,
    before_after_table,
    evaluate_math,
    load_model_for_eval,
    pass_at_k,
    plot_training_curve,
    score_completions,
)
from trl_grpo_ext.rewards import get_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 3, 2) == 1.0  # every pair holds a right one


def test_strict_needs_the_boxed_format_lenient_only_the_answer():
    completions = [
        r"so \boxed{5}",
        "the answer is 5",
        r"\boxed{6}",
        "<think>2+3</think> \\boxed{5}",
    ]
    strict, lenient = score_completions(completions, ["5"] * 4)
    assert lenient == [1.0, 1.0, 0.0, 1.0]
    assert strict == [1.0, 0.0, 0.0, 1.0]
    # With the <think> format reward, strict also needs the reasoning block.
    strict, _ = score_completions(completions, ["5"] * 4, format_reward=get_reward("format"))
    assert strict == [0.0, 0.0, 0.0, 1.0]
    # A completion cut at the token cap did not finish: right, but not strict.
    strict, lenient = score_completions(
        completions, ["5"] * 4, truncated=[True, False, False, False]
    )
    assert strict == [0.0, 0.0, 0.0, 1.0] and lenient[0] == 1.0


def test_report_from_scripted_completions(monkeypatch, tiny_tokenizer):
    dataset = synthetic_dataset(4, split="test", system_prompt="")
    answers = dataset["answer"]

    def scripted(model, tokenizer, prompts, *, max_new_tokens, num_samples=1, **kwargs):
        assert max_new_tokens == 7
        texts, counts, cut = [], [], []
        for i, _ in enumerate(prompts):
            if num_samples == 1:  # greedy: problems 0 and 1 right, 1 without the box
                group = [rf"\boxed{{{answers[0]}}}" if i == 0 else answers[1] if i == 1 else "x"]
            else:  # 4 samples: problem i has i right ones
                group = [rf"\boxed{{{answers[i]}}}"] * i + ["no"] * (num_samples - i)
            texts.append(group)
            counts.append([3] * len(group))
            cut.append([False] * len(group))
        return texts, counts, cut

    monkeypatch.setattr(evaluation, "generate", scripted)
    report = evaluate_math(
        None, tiny_tokenizer, dataset, max_new_tokens=7, num_samples=4, k_values=(1, 2)
    )
    assert report.num_problems == 4 and report.max_new_tokens == 7
    assert report.greedy_lenient == 0.5 and report.greedy_strict == 0.25
    assert report.pass_at_k["pass@1"] == pytest.approx((0 + 0.25 + 0.5 + 0.75) / 4)
    assert report.pass_at_k["pass@2"] == pytest.approx((0 + 0.5 + 5 / 6 + 1) / 4)
    assert "4 problems, at most 7 new tokens" in report.summary()
    with pytest.raises(ValueError, match="k <= num_samples"):
        evaluate_math(None, tiny_tokenizer, dataset, num_samples=2, k_values=(4,))


def test_greedy_is_deterministic_and_respects_the_token_cap(tiny_model_dir):
    model, tokenizer = load_model_for_eval(tiny_model_dir)
    dataset = synthetic_dataset(6, split="test", system_prompt="")
    first = evaluate_math(model, tokenizer, dataset, max_new_tokens=5, batch_size=4)
    second = evaluate_math(model, tokenizer, dataset, max_new_tokens=5, batch_size=6)
    assert first.samples == second.samples  # batching does not change greedy completions
    assert first.mean_completion_tokens <= 5
    sampled = evaluate_math(
        model, tokenizer, dataset, max_new_tokens=5, greedy=False, num_samples=3, k_values=(1, 3)
    )
    assert sampled.greedy_lenient is None and set(sampled.pass_at_k) == {"pass@1", "pass@3"}


def test_a_streamed_dataset_gets_the_report_of_its_rows(tiny_model_dir):
    # `load_dataset(..., streaming=True)` gives an IterableDataset: the harness reads it whole.
    model, tokenizer = load_model_for_eval(tiny_model_dir)
    dataset = synthetic_dataset(5, split="test", system_prompt="")
    options = dict(max_new_tokens=5, num_samples=2, k_values=(1, 2), num_examples=5)
    rows = evaluate_math(model, tokenizer, dataset, **options)
    stream = evaluate_math(model, tokenizer, dataset.to_iterable_dataset(), **options)
    assert stream.num_problems == 5 and stream.samples == rows.samples
    assert [sample["answer"] for sample in stream.samples] == list(dataset["answer"])


def _make_adapter(base_dir, adapter_dir):
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(adapter_dir)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(adapter_dir)
    return peft_model


def test_base_plus_local_adapter(tiny_model_dir, tmp_path):
    adapter_dir = str(tmp_path / "adapter")
    trained = _make_adapter(tiny_model_dir, adapter_dir).eval()
    base, _ = load_model_for_eval(tiny_model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with_adapter, tokenizer = load_model_for_eval(tiny_model_dir, adapter_dir)
    # PEFT reads transformers' deprecated `is_gradient_checkpointing`: no FutureWarning shown
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    input_ids = torch.tensor([tokenizer("What is 2 + 3?")["input_ids"]])
    with torch.no_grad():
        expected = trained(input_ids).logits
        assert torch.allclose(with_adapter(input_ids).logits, expected, atol=1e-5)
        assert not torch.allclose(base(input_ids).logits, expected, atol=1e-3)


def test_base_plus_hub_adapter_from_the_offline_cache(tiny_model_dir, tmp_path, monkeypatch):
    """A Hub repository id resolves through the Hub cache (offline here): the same files that
    `hf_hub_download` would have fetched, laid out as the cache stores them."""
    import huggingface_hub.constants as hub_constants

    adapter_dir = str(tmp_path / "adapter")
    trained = _make_adapter(tiny_model_dir, adapter_dir).eval()
    cache = tmp_path / "hub"
    repo = cache / "models--user--tiny-adapter"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in os.listdir(adapter_dir):
        (snapshot / name).write_bytes((tmp_path / "adapter" / name).read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    model, tokenizer = load_model_for_eval(tiny_model_dir, "user/tiny-adapter")
    input_ids = torch.tensor([tokenizer("What is 2 + 3?")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids).logits, trained(input_ids).logits, atol=1e-5)


def test_eval_script_on_a_local_adapter(tiny_model_dir, tmp_path):
    adapter_dir = str(tmp_path / "adapter")
    _make_adapter(tiny_model_dir, adapter_dir)
    output = tmp_path / "report.json"
    command = [
        sys.executable,
        os.path.join(ROOT, "recipes", "eval_math.py"),
        "--adapter", adapter_dir,
        "--dataset_name", "synthetic",
        "--system_prompt", "",
        "--num_problems", "8",
        "--max_new_tokens", "4",
        "--num_samples", "2",
        "--k", "1", "2",
        "--output", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "8 problems, at most 4 new tokens" in result.stdout
    report = json.loads(output.read_text())
    assert report["num_problems"] == 8 and set(report["pass_at_k"]) == {"pass@1", "pass@2"}
    assert report["model"].endswith(f" + {adapter_dir}")


def test_table_and_curve(tmp_path):
    before = EvalReport(num_problems=200, max_new_tokens=12, greedy_strict=0.2, greedy_lenient=0.25)
    after = EvalReport(num_problems=200, max_new_tokens=12, greedy_strict=0.6, greedy_lenient=0.61)
    table = before_after_table(before, after)
    assert "| greedy pass@1, answer right (lenient) | 25.0% | 61.0% |" in table
    assert "| problems | 200 | 200 |" in table
    assert "| greedy pass@1, boxed and finished too (strict) | 20.0% | 60.0% |" in table
    # Scored by an environment's accuracy: strict is a right answer in a finished completion.
    unboxed = before_after_table(before, after, boxed=False)
    assert "| greedy pass@1, finished too (strict) | 20.0% | 60.0% |" in unboxed
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": s, "reward": s / 100} for s in range(10, 60, 10)]
    records += [{"step": 0, "heldout/accuracy": 0.25}, {"step": 50, "heldout/accuracy": 0.6}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    png = plot_training_curve(str(metrics), str(tmp_path / "curve.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert plot_training_curve(str(tmp_path / "none.jsonl"), str(tmp_path / "x.png")) is None


def test_on_a_trainer_the_harness_ends_completions_as_training_does(tmp_path):
    """Through the trainer's producer, a completion stopped at a stop string (no eos; the engine
    pads it, as `generate` pads a stop) is ended, with the tokens up to the stop, exactly the
    rollout training would score."""
    from agent_helpers import ScriptedEngine
    from trainer_helpers import make_trainer

    trainer = make_trainer(tmp_path, generation_kwargs={"stop": ["</a>"]})
    tokenizer = trainer.processing_class
    stopped = tokenizer("so 5</a>", add_special_tokens=False)["input_ids"]
    pad = tokenizer.pad_token_id
    trainer.rollouts.engine = ScriptedEngine(lambda context: stopped + [pad] * 3)
    problems = Dataset.from_list([{"prompt": "2+3=", "answer": "5"}])
    completions, counts, truncated = evaluation.generate(
        None,
        tokenizer,
        problems["prompt"],
        max_new_tokens=8,
        trainer=trainer,
        rows=problems.to_list(),
    )
    assert completions == [["so 5</a>"]] and counts == [[len(stopped)]]
    assert truncated == [[False]]
    rollout = trainer.generate_rollouts(problems.to_list())
    assert rollout.completions[0] == "so 5</a>" and not rollout.is_truncated.any()
    report = evaluation.evaluate_on_processes(trainer, problems, max_new_tokens=8, num_examples=1)
    assert report.truncated_fraction == 0.0 and report.mean_completion_tokens == len(stopped)
    assert report.samples[0]["completion"] == "so 5</a>"
