"""The `trl-grpo-ext` command line (trl_grpo_ext/cli.py): `grpo` trains the tiny preset from its
YAML and from flags alone, finds a reward function in a file of the working directory, and lets
a flag beat the YAML; `trl grpo` command lines of TRL's documentation parse to the same settings
under TRL's parser and ours; accelerate flags build the `accelerate launch` command line; unknown
flags name the closest valid one; `eval` reports a trained adapter, with tools; `plan` and `env`
print their tables. A newcomer's tiny run prints no warning of transformers' from our code paths."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest
import yaml

from trl_grpo_ext import cli
from trl_grpo_ext.evaluation import read_jsonl
from trl_grpo_ext.script_args import make_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(ROOT, "recipes", "configs", "tiny_cpu.yaml")
# The tiny preset cut to one step of a small batch, a short warm-up and a few held-out problems.
SHORT = [
    "--max_steps", "1",
    "--num_train_samples", "32",
    "--num_eval_samples", "4",
    "--tiny_warmup_max_steps", "10",
    "--per_device_train_batch_size", "16",
    "--logging_steps", "1",
    "--eval_every_steps", "0",
]  # fmt: skip
# The warnings a newcomer's run printed (issue 52): transformers' about top_k with greedy
# decoding, and its FutureWarning about the is_gradient_checkpointing alias.
NEWCOMER_WARNINGS = ("generation flags are not valid", "is_gradient_checkpointing")


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory):
    """`trl-grpo-ext grpo --config tiny_cpu` (the preset by name), with `--max_steps 1` over the
    YAML's 400, from a fresh warm-up; what it printed and warned."""
    tmp = tmp_path_factory.mktemp("cli")
    argv = ["grpo", "--config", "tiny_cpu", *SHORT, "--output_dir", str(tmp / "run")]
    argv += ["--tiny_cache_dir", str(tmp / "cache")]
    logged = io.StringIO()
    handler = logging.StreamHandler(logged)
    logging.getLogger("transformers").addHandler(handler)  # its own logs do not propagate
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = cli.main(argv)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    messages = [str(w.message) for w in caught] + logged.getvalue().splitlines()
    return {"code": code, "dir": tmp / "run", "warnings": messages}


def test_grpo_trains_the_tiny_preset_and_a_flag_beats_the_yaml(preset_run):
    assert preset_run["code"] == 0
    run = preset_run["dir"]
    for name in ("adapter_model.safetensors", "before_after.md", "metrics.jsonl"):
        assert (run / name).exists(), name
    steps = {record["step"] for record in read_jsonl(str(run / "metrics.jsonl"))}
    assert max(steps) == 1  # --max_steps 1 on the command line, 400 in the YAML


def test_the_tiny_run_emits_none_of_the_newcomer_warnings(preset_run):
    """Neither as a Python warning nor in transformers' log, warm-up included."""
    assert not [w for w in preset_run["warnings"] if any(s in w for s in NEWCOMER_WARNINGS)]


def test_grpo_trains_from_flags_alone_with_a_reward_in_the_working_directory(tmp_path, monkeypatch):
    """No YAML: the flags of `trl grpo` and ours; `my_rewards.has_digit` is a file of the
    working directory, found though the working directory is not on sys.path (as under a
    console script: TRL issue 3448)."""
    (tmp_path / "my_rewards.py").write_text(
        "def has_digit(completions, **kwargs):\n"
        "    return [float(any(ch.isdigit() for ch in str(c))) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    kept = [p for p in sys.path if p and os.path.abspath(p) != str(tmp_path)]
    monkeypatch.setattr(sys, "path", kept)
    argv = [
        "grpo",
        "--model_name_or_path", "tiny",
        "--use_peft", "--lora_r", "8", "--lora_target_modules", "all-linear",
        "--dataset_name", "synthetic",
        "--system_prompt", "",
        "--reward_funcs", "accuracy_reward", "my_rewards.has_digit",
        "--num_generations", "8",
        "--max_completion_length", "12",
        "--use_cpu", "--report_to", "none", "--save_strategy", "no",
        "--output_dir", str(tmp_path / "run"),
        "--tiny_cache_dir", str(tmp_path / "cache"),
        *SHORT,
    ]  # fmt: skip
    assert cli.main(argv) == 0
    logged = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    names = {key for record in logged for key in record}
    # accuracy_reward, TRL's name, is this package's math_accuracy
    assert {"rewards/has_digit/mean", "rewards/math_accuracy/mean"} <= names


# ------------------------------------------------------- TRL's command lines, both parsers

# `trl grpo` command lines of TRL's documentation (docs/source/clis.md; the trl-training skill's
# GRPO example; the flags of docs/source/lora_without_regret.md's GRPO run), after `trl grpo`.
# `--use_cpu` is added to each: GRPOConfig's bf16 default fails its check on a machine without
# a GPU, under both parsers alike.
POLARIS = ["--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--dataset_name",
           "HuggingFaceH4/Polaris-Dataset-53K", "--reward_funcs", "accuracy_reward"]  # fmt: skip
DOC_COMMANDS = {
    "clis.md basic usage": POLARIS,
    "clis.md --num_processes": [*POLARIS, "--num_processes", "4"],
    "clis.md --accelerate_config": [*POLARIS, "--accelerate_config", "zero2"],
    "clis.md config file": {
        "model_name_or_path": "Qwen/Qwen2.5-0.5B",
        "dataset_name": "HuggingFaceH4/Polaris-Dataset-53K",
        "reward_funcs": ["accuracy_reward"],
        "num_processes": 4,
    },
    "clis.md dataset mixture": {
        "model_name_or_path": "Qwen/Qwen2.5-0.5B",
        "datasets": [{"path": "HuggingFaceH4/Polaris-Dataset-53K"}, {"path": "trl-lib/DeepMath-103K"}],
        "reward_funcs": ["accuracy_reward"],
    },
    "trl-training skill": [
        "--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--dataset_name", "trl-lib/gsm8k",
        "--reward_funcs", "accuracy_reward", "--output_dir", "Qwen2-0.5B-GRPO", "--push_to_hub",
    ],
    "lora_without_regret.md": (
        "--model_name_or_path Qwen/Qwen3-0.6B --dataset_name "
        "HuggingFaceH4/OpenR1-Math-220k-default-verified --output_dir grpo-full-qwen3-0.6b "
        "--learning_rate 1.0e-6 --lr_scheduler_type cosine --warmup_steps 0.0 --max_grad_norm 1.0 "
        "--beta 0.0 --max_completion_length 4096 --num_generations 16 --generation_batch_size 16 "
        "--gradient_accumulation_steps 8 --per_device_train_batch_size 1 --num_train_epochs 1 "
        "--lora_r 1 --lora_alpha 32 --lora_dropout 0.0 --lora_target_modules all-linear "
        "--vllm_mode colocate --save_strategy steps --save_steps 50 --save_total_limit 1 "
        "--logging_steps 1 --max_steps 200 --report_to trackio"
    ).split(),
}  # fmt: skip
# Shared fields whose defaults differ on purpose (docs/cli.md lists them): a CPU-first package
# (no bf16, no checkpointing by default), shorter completions, epsilon_high spelled out (TRL's
# None means epsilon), and the math recipe's default dataset and rewards (TRL's: none).
DIFFERENT_DEFAULTS = {
    "bf16", "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing",
    "activation_checkpointing_kwargs", "max_completion_length", "epsilon_high", "dataset_name",
    "reward_funcs",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(DOC_COMMANDS))
def test_trl_doc_command_lines_parse_to_the_same_settings(name, tmp_path):
    from trl.cli.accelerate_config import resolve_accelerate_config_argument
    from trl.scripts.grpo import make_parser as trl_make_parser

    command = DOC_COMMANDS[name]
    if isinstance(command, dict):
        (tmp_path / "grpo_config.yaml").write_text(yaml.safe_dump(command))
        argv, given = ["--config", str(tmp_path / "grpo_config.yaml")], set(command)
    else:
        argv, given = list(command), {token[2:] for token in command if token.startswith("--")}
    argv.append("--use_cpu")
    options = dict(return_remaining_strings=True, separate_remaining_strings=True)
    *theirs, their_config, their_cli = trl_make_parser().parse_args_and_config(argv, **options)
    ours_parser = make_parser()
    *ours, our_config, our_cli = ours_parser.parse_args_and_config(argv, **options)
    assert our_config == [] and their_cli == our_cli
    compared = set()
    for their_args, our_args in zip(theirs, ours):
        shared = {f.name for f in dataclasses.fields(their_args)} & {
            f.name for f in dataclasses.fields(our_args)
        }
        for field in sorted(shared):
            if field in given or field not in DIFFERENT_DEFAULTS:
                assert getattr(their_args, field) == getattr(our_args, field), field
                compared.add(field)
    assert given - {"num_processes", "accelerate_config"} <= compared
    # The same accelerate launch: TRL's from its leftovers, ours from the YAML and the flags.
    their_launch = resolve_accelerate_config_argument(their_config + their_cli)
    our_launch = cli.launch_arguments(ours_parser.launch_config, our_cli, [])
    # The same flags in the same order; with no config file, accelerate's defaults spelled out.
    quiet = [f"--{dest}" for dest in cli.QUIET_DEFAULTS]
    assert their_launch[::2] == [flag for flag in our_launch[::2] if flag not in quiet]
    if "--num_processes" in their_launch:
        assert our_launch[our_launch.index("--num_processes") + 1] == "4"
    if "--config_file" in their_launch:
        assert os.path.basename(our_launch[1]) == "deepspeed_zero2.yaml"


# ---------------------------------------------------------------- accelerate launch


def launched(monkeypatch, argv) -> list[str]:
    """The `accelerate launch` arguments `trl-grpo-ext grpo argv` launches with (not run)."""
    seen = []
    monkeypatch.setattr(cli, "accelerate_launch", seen.append)
    assert cli.main(["grpo", *argv]) == 0
    return seen[0]


def test_num_processes_launches_the_recipe_through_accelerate_and_beats_the_yaml(
    tmp_path, monkeypatch
):
    """The YAML asks for 4 processes and zero3, the command line for 2 and a gloo-friendly
    multi-process CPU run: the command line wins (TRL issue 7031), the launch flags leave the
    recipe's flags, and the recipe gets the YAML and the other flags unchanged."""
    config = yaml.safe_load(open(TINY_YAML))
    config.update(num_processes=4, accelerate_config="zero3")
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["--config", str(path), "--num_processes", "2", "--multi_gpu"]
    argv += ["--mixed_precision", "no", "--max_steps", "2", "--accelerate_config", "multi_gpu"]
    command = launched(monkeypatch, argv)
    recipe = command.index(os.path.join(ROOT, "recipes", "math.py"))
    launch, training = command[:recipe], command[recipe + 1 :]
    assert launch[launch.index("--num_processes") + 1] == "2"
    config_file = launch[launch.index("--config_file") + 1]
    assert config_file == os.path.join(ROOT, "recipes", "accelerate", "multi_gpu.yaml")
    assert "--multi_gpu" in launch and launch[launch.index("--mixed_precision") + 1] == "no"
    assert "--num_machines" not in launch  # the config file gives it
    assert training == ["--config", str(path), "--max_steps", "2"]
    # The recipe, launched so, reads the YAML without failing on its launch keys.
    script_args, training_args, *_ = make_parser().parse_args_and_config(training)
    assert training_args.max_steps == 2 and script_args.dataset_name == "synthetic"


@pytest.mark.slow
def test_two_cpu_processes_train_through_accelerate(tmp_path):
    """`--multi_gpu --num_processes 2 --mixed_precision no` on CPUs: accelerate starts two
    processes of the recipe (gloo), each evaluates its shard and prints the summary (about a
    minute on 2 cores)."""
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    command = [
        sys.executable, "-m", "trl_grpo_ext", "grpo", "--config", "tiny_cpu",
        "--multi_gpu", "--num_processes", "2", "--mixed_precision", "no",
        "--main_process_port", port, *SHORT, "--max_steps", "2",
        "--output_dir", str(tmp_path / "run"), "--tiny_cache_dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("accelerate launch --multi_gpu --num_processes 2")
    assert result.stdout.count("held-out accuracy:") == 2  # one line per process
    assert "were not passed to `accelerate launch`" not in result.stdout + result.stderr
    assert (tmp_path / "run" / "adapter_model.safetensors").exists()


def test_without_a_config_file_accelerates_defaults_are_spelled_out(tmp_path, monkeypatch):
    """So accelerate launches without its notice that it took them; a config file (given, or
    accelerate's default one) gives them instead."""
    monkeypatch.setattr(cli, "default_config_file", lambda: str(tmp_path / "none.yaml"))
    launch = cli.launch_arguments({}, ["--num_processes", "2", "--mixed_precision", "bf16"], [])
    assert launch == ["--num_processes", "2", "--mixed_precision", "bf16"] + [
        "--num_machines", "1", "--dynamo_backend", "no",
    ]  # fmt: skip
    assert cli.launch_arguments({}, [], []) == []  # no launch flag: no launch
    (tmp_path / "none.yaml").write_text("num_machines: 1\n")
    assert cli.launch_arguments({}, ["--num_processes", "2"], []) == ["--num_processes", "2"]


def test_accelerate_config_names_and_files():
    assert cli.accelerate_config_file("zero3").endswith("recipes/accelerate/deepspeed_zero3.yaml")
    assert cli.accelerate_config_file("fsdp").endswith("recipes/accelerate/fsdp.yaml")
    assert cli.accelerate_config_file("fsdp2").endswith("trl/accelerate_configs/fsdp2.yaml")
    assert cli.accelerate_config_file(TINY_YAML) == TINY_YAML
    with pytest.raises(cli.CliError, match="Did you mean zero3"):
        cli.accelerate_config_file("zer03")


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["grpo", "--learning_rat", "1e-5"], "unknown flag --learning_rat. Did you mean --learning_rate?"),
        (["grpo", "--num_proceses", "2"], "Did you mean --num_processes?"),
        (["grpo", "--config", "tiny_cp"], "Did you mean tiny_cpu?"),
        (["eval", "--num_sample", "4"], "Did you mean --num_samples?"),
        (["grpp"], "trl-grpo-ext: error: unknown command 'grpp'. Did you mean grpo?"),
    ],
)  # fmt: skip
def test_unknown_flags_name_the_closest_valid_one(argv, expected, capsys):
    assert cli.main(argv) == 2
    assert expected in capsys.readouterr().err


def test_an_unknown_key_in_the_yaml_names_the_closest_field(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    path.write_text("model_name_or_path: tiny\nlearning_rte: 0.1\n")
    assert cli.main(["grpo", "--config", str(path)]) == 2
    assert "unknown key 'learning_rte' in the --config file. Did you mean learning_rate?" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("command", ["grpo", "eval", "plan", "env"])
def test_help_of_each_command(command, capsys):
    with pytest.raises(SystemExit) if command != "env" else _nothing():
        cli.main([command, "--help"])
    text = capsys.readouterr().out
    assert text.startswith(f"usage: trl-grpo-ext {command}")
    if command == "grpo":
        assert "--num_processes N" in text and "--reward_funcs" in text and "tiny_cpu" in text


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------- eval, env


def test_eval_reports_a_trained_adapter_with_tools(preset_run, tmp_path, capsys):
    """The adapter `grpo` trained, evaluated with its run's YAML and run_python in the
    code-blocks format: the report has strict and lenient accuracy, pass@k and the tool-call
    rate, in JSON and in Markdown."""
    # The training YAML gives the data, prompt and token cap; the flag --num_problems beats its
    # num_eval_samples (200).
    common = ["--run_config", TINY_YAML, "--adapter", str(preset_run["dir"]), "--num_problems", "4"]
    common += ["--tools", "run_python", "--tool_format", "code_blocks"]
    common += ["--num_samples", "2", "--k", "1", "2", "--progress", "false"]
    assert cli.main(["eval", *common, "--output", str(tmp_path / "report.json")]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["num_problems"] == 4 and report["max_new_tokens"] == 12
    assert report["dataset"] == "synthetic" and set(report["pass_at_k"]) == {"pass@1", "pass@2"}
    assert report["greedy_strict"] is not None and report["greedy_lenient"] is not None
    assert report["tool_call_rate"] is not None  # the tools' path ran: None without tools
    assert "tool called in" in capsys.readouterr().out
    assert cli.main(["eval", *common, "--output", str(tmp_path / "report.md")]) == 0
    markdown = (tmp_path / "report.md").read_text()
    assert "| tool_call_rate |" in markdown and "| greedy_lenient |" in markdown


def test_eval_counts_the_tool_calls_of_a_model_and_adapter_with_tools(tmp_path, capsys):
    """The tiny model trained to answer "Add 2 and 3, then add 4." by calling `add` twice
    (agent_helpers.tool_calling_model), with a LoRA adapter on it (initialised to leave it
    unchanged), evaluated with that tool: the greedy completion calls it, no call fails, and the
    answer after the calls is right."""
    from agent_helpers import needs_trl_1_16, tool_calling_model
    from peft import LoraConfig, get_peft_model

    if needs_trl_1_16.args[0]:
        pytest.skip(needs_trl_1_16.kwargs["reason"])
    model, tokenizer = tool_calling_model()
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    get_peft_model(model, LoraConfig(r=4, target_modules="all-linear")).save_pretrained(
        tmp_path / "adapter"
    )
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"question": "Add 2 and 3, then add 4.", "answer": "9"}) + "\n")
    # Byte-level tokens: two calls, their results and the answer take about 220 of the budget.
    argv = [
        "eval", "--model_name_or_path", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"),
        "--dataset_name", str(problems), "--system_prompt", "", "--tools", "agent_helpers.add",
        "--max_new_tokens", "400", "--progress", "false", "--output", str(tmp_path / "report.json"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["tool_call_rate"], report["tool_error_rate"]) == (1.0, 0.0)
    assert report["greedy_lenient"] == 1.0
    assert "[add] 5" in report["samples"][0]["completion"]  # the first call's result
    assert "tool called in 100.0%, calls failed 0.0%" in capsys.readouterr().out


def test_plan_prints_the_memory_plan_of_a_preset(preset_run, capsys):
    """The flags of `grpo`, a flag over the YAML, printed as the plan's table."""
    cache = str(preset_run["dir"].parent / "cache")  # the warmed-up tiny model of the run
    argv = ["plan", "--config", "tiny_cpu", "--tiny_cache_dir", cache, *SHORT]
    assert cli.main([*argv, "--max_completion_length", "24"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("memory plan (cpu") :].splitlines()
    assert "+ 24 completion tokens" in table[0]  # the flag, not the YAML's 12
    phases = [line.split()[0] for line in table[2:-1]]
    assert phases == ["weights", "optimizer", "sampling", "logprobs", "backward"]
    assert sum("<- peak" in line for line in table) == 1 and table[-1].startswith("to lower")


def test_setup_cfg_declares_the_console_script():
    """`pip install -e .` installs `trl-grpo-ext` as `trl_grpo_ext.cli:main` (tests here call it
    in-process, or as `python -m trl_grpo_ext`)."""
    import configparser
    import importlib

    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    scripts = dict(
        line.replace(" ", "").split("=")
        for line in setup["options.entry_points"]["console_scripts"].strip().splitlines()
    )
    module, _, name = scripts["trl-grpo-ext"].partition(":")
    assert getattr(importlib.import_module(module), name) is cli.main


def test_env_prints_its_table(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| ")][1:]  # no header
    rows = dict(tuple(cell.strip() for cell in line.strip("|").split("|", 1)) for line in lines)
    import torch
    import trl

    assert rows["torch"] == torch.__version__.split("+")[0] or rows["torch"] == torch.__version__
    assert rows["trl"] == trl.__version__
    assert rows["run_python sandbox"].split(":")[0] in ("namespaces", "bubblewrap", "process")
    assert rows["vllm"]  # a version, "not installed", or why it fails to import
    assert "devices" in rows


def test_importing_the_package_warns_from_none_of_its_modules():
    """Every module of the package imported in a fresh interpreter, all warnings shown: none is
    attributed to a file of ours (e.g. torch's FutureWarning for a class under `no_grad`, which
    a newcomer's run printed at import, before any of the above)."""
    code = (
        "import pkgutil, importlib, warnings, json, trl_grpo_ext\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    for info in pkgutil.walk_packages(trl_grpo_ext.__path__, 'trl_grpo_ext.'):\n"
        "        if info.name.endswith('__main__'):\n"
        "            continue\n"
        "        try:\n"
        "            importlib.import_module(info.name)\n"
        "        except ImportError:\n"
        "            pass  # an optional integration's package absent\n"
        "print(json.dumps([f'{w.filename}:{w.lineno}: {w.message}' for w in caught]))\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert shown.returncode == 0, shown.stderr
    package = os.path.join(ROOT, "trl_grpo_ext")
    ours = [w for w in json.loads(shown.stdout.splitlines()[-1]) if w.startswith(package)]
    assert not ours
