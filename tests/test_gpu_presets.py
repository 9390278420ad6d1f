"""The GPU presets run after the install the quickstart gives (`pip install -e .`, no extras):
each one, with the embedded tiny model and synthetic problems in place of the Hub's, runs the
recipe up to its first optimizer step on the CPU, every other setting as the preset has it. A
preset that asks for a package only an extra installs (TensorBoard was one), or whose settings
do not fit together, fails here rather than at the start of a user's first GPU run."""

import configparser
import glob
import math
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from test_recipe import ROOT, parser, recipe, recipe_of, vlm_recipe

GPU_PRESETS = sorted(
    path
    for path in glob.glob(os.path.join(ROOT, "recipes", "configs", "*.yaml"))
    if not path.endswith("_cpu.yaml")
)
TEXT_PRESETS = [path for path in GPU_PRESETS if recipe_of(path) is recipe]
VLM_PRESETS = [path for path in GPU_PRESETS if recipe_of(path) is vlm_recipe]

# What a preset may change only because there is no GPU, no Hub and no time here: the model
# and data (offline), the problem counts, the step count, the completion length (the tiny model
# writes on to the cap) and the output folder.
SWAPS = [
    "--model_name_or_path", "tiny",
    "--tiny_warmup_max_steps", "2",
    "--dataset_name", "synthetic",
    "--eval_dataset_name", "synthetic",
    "--num_train_samples", "64",
    "--num_eval_samples", "4",
    "--max_steps", "1",
    "--max_completion_length", "16",
]  # fmt: skip
# The same for the vision-language recipe: the tiny VLM of tiny_vlm.py and its color task.
VLM_SWAPS = [
    "--model_name_or_path", "tiny_vlm",
    "--tiny_warmup_steps", "2",
    "--dataset_name", "tiny_colors",
    "--dataset_test_split", "test",
    "--num_train_samples", "64",
    "--num_eval_samples", "4",
    "--max_steps", "1",
    "--max_completion_length", "16",
    # one group of 8 per step instead of 32 completions: bf16 on a CPU is slow
    "--per_device_train_batch_size", "8",
    "--gradient_accumulation_steps", "1",
]  # fmt: skip


def optional_modules() -> set[str]:
    """Top-level modules of the packages that only an extra of setup.cfg installs."""
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    base = set(_names(config["options"]["install_requires"]))
    extras = {name for value in config["options.extras_require"].values() for name in _names(value)}
    test_tools = {"pytest", "hypothesis"}  # the test run itself imports them
    modules = {name.replace("-", "_") for name in extras - base} - test_tools
    if "tensorboard" in modules:
        modules.add("tensorboardX")  # transformers takes either
    return modules


def _names(requirements: str) -> list[str]:
    return [re.split(r"[<>=!~\[; ]", line.strip())[0] for line in requirements.splitlines() if line]


@pytest.fixture
def quickstart_install(monkeypatch):
    """Imports as after `pip install -e .`: the extras' packages cannot be imported."""
    hidden = optional_modules()
    assert {"tensorboard", "vllm", "gguf"} <= hidden
    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    return hidden


def test_the_gpu_presets_are_the_ones_the_docs_name():
    names = {os.path.basename(path) for path in GPU_PRESETS}
    assert names == {
        "qwen2.5-0.5b-instruct_gsm8k_lora.yaml",
        "qwen2.5-0.5b-instruct_gsm8k_lora_vllm.yaml",
        "qwen2.5-1.5b-instruct_gsm8k_lora.yaml",
        "qwen3-0.6b_math_lora.yaml",
        "qwen2.5-vl-3b-instruct_multimodal-open-r1_lora.yaml",
    }


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny_cache"))


@pytest.mark.parametrize("path", TEXT_PRESETS, ids=os.path.basename)
def test_a_gpu_preset_runs_its_first_step_after_the_quickstart_install(
    path, quickstart_install, tiny_cache, tmp_path
):
    from transformers.integrations import is_tensorboard_available

    assert not is_tensorboard_available()  # the fixture hides it
    with open(path) as handle:
        preset = yaml.safe_load(handle)
    # vLLM comes with the vllm extra; its generation is tested in tests/vllm_engines.
    no_vllm = ["--use_vllm", "false"] if preset.get("use_vllm") else []
    argv = [
        "--config", path, *SWAPS, *no_vllm,
        "--output_dir", str(tmp_path / "run"),
        "--tiny_cache_dir", tiny_cache,
    ]  # fmt: skip
    script_args, training_args, model_args = parser().parse_args_and_config(argv)
    assert training_args.gradient_checkpointing and model_args.use_peft
    trainer, before, after = recipe.main(script_args, training_args, model_args)
    assert trainer.state.global_step == 1
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
    assert before.num_problems == after.num_problems == 4
    assert after.max_new_tokens == 16
    assert os.path.exists(tmp_path / "run" / "adapter_model.safetensors")


@pytest.mark.parametrize("path", VLM_PRESETS, ids=os.path.basename)
def test_a_vlm_gpu_preset_runs_its_first_step_after_the_quickstart_install(
    path, quickstart_install, tmp_path
):
    """The tiny VLM and the color task in place of the Hub's model and problems; every other
    setting (LoRA, bf16, gradient checkpointing, the rewards, evaluation) as the preset has it."""
    argv = [
        "--config", path, *VLM_SWAPS,
        "--output_dir", str(tmp_path / "run"),
        "--tiny_cache_dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    script_args, training_args, model_args = parser(vlm_recipe).parse_args_and_config(argv)
    assert training_args.gradient_checkpointing and model_args.use_peft
    trainer, before, after = vlm_recipe.main(script_args, training_args, model_args)
    assert trainer.state.global_step == 1
    losses = [entry["train_loss"] for entry in trainer.state.log_history if "train_loss" in entry]
    assert len(losses) == 1 and math.isfinite(losses[0])
    assert len(trainer.eval_dataset) == 4 and trainer.model.peft_config["default"].r == 16
    assert {"eval_rewards/math_accuracy/mean", "eval_rewards/format/mean"} <= set(after)
    assert os.path.exists(tmp_path / "run" / "adapter_model.safetensors")


@pytest.mark.parametrize("path", GPU_PRESETS, ids=os.path.basename)
def test_a_preset_asks_for_the_format_its_rewards_score(path):
    """The `format` reward scores `<think>...</think>` then the answer. A Qwen3 model writes
    that by itself (thinking is on by default); any other model must be asked by the prompt,
    else the reward is 0 for every completion and "strict" accuracy reads 0% throughout. A
    completion that does what the prompt asks earns the format reward and counts as strict."""
    from trl_grpo_ext.data import SYSTEM_PROMPT
    from trl_grpo_ext.evaluation import score_completions
    from trl_grpo_ext.rewards import get_reward

    with open(path) as handle:
        preset = yaml.safe_load(handle)
    if "format" not in preset["reward_funcs"]:
        return
    system_prompt = preset.get("system_prompt", SYSTEM_PROMPT)
    thinks_by_default = "Qwen3" in preset["model_name_or_path"]
    assert thinks_by_default or ("<think>" in system_prompt and "</think>" in system_prompt)
    assert "\\boxed{" in system_prompt
    following = "<think>6 times 7 is 42.</think> The answer is \\boxed{42}."
    assert get_reward("format")(completions=[following]) == [1.0]
    strict, lenient = score_completions([following], ["42"], get_reward("format"), [False])
    assert strict == lenient == [1.0]


@pytest.mark.parametrize("path", GPU_PRESETS, ids=os.path.basename)
def test_a_preset_leaves_ddp_its_unused_parameter_search_off(path):
    """LoRA trains every adapter at every step; DDP's search for unused parameters (the
    Trainer's default for a PEFT model) would traverse the graph each step for nothing."""
    _, training_args, _ = parser(recipe_of(path)).parse_args_and_config(["--config", path])
    assert training_args.ddp_find_unused_parameters is False


def test_the_gpu_session_runs_each_preset_with_the_recipe_its_first_line_names(tmp_path):
    """benchmarks/gpu_session.sh (a GPU session in one command) launches every GPU preset for
    two steps. A preset that its recipe's parser refuses there costs a GPU session's minutes:
    each smoke command of a dry run parses here with the recipe it launches, and the swaps
    leave the preset's training settings (bf16, LoRA, gradient checkpointing) as they were."""
    out = tmp_path / "session"
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu_session.sh")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    launched, caches = {}, []
    for line in (out / "commands.sh").read_text().splitlines():
        if " recipes/" not in line:  # the install, the benchmarks
            continue
        words = shlex.split(line)
        scripts = [word for word in words if re.fullmatch(r"recipes/\w+\.py", word)]
        if not scripts or "--config_file" in words:  # the sharded runs: the text recipe only
            continue
        argv = words[words.index(scripts[0]) + 1 :]
        preset = os.path.join(ROOT, argv[argv.index("--config") + 1])
        module = recipe_of(preset)
        assert scripts[0] == f"recipes/{os.path.basename(module.__file__)}", preset
        script_args, training_args, model_args = parser(module).parse_args_and_config(argv)
        _, expected, expected_model = parser(module).parse_args_and_config(["--config", preset])
        assert training_args.max_steps == 2
        assert model_args.model_name_or_path in ("tiny", "tiny_vlm")
        for name in ("bf16", "gradient_checkpointing", "num_generations", "learning_rate"):
            assert getattr(training_args, name) == getattr(expected, name), (preset, name)
        assert (
            model_args.use_peft == expected_model.use_peft
            and model_args.lora_r == expected_model.lora_r
        )
        launched[os.path.basename(preset)] = module
        caches.append(training_args.cache_implementation)
    assert sorted(launched) == sorted(os.path.basename(path) for path in GPU_PRESETS)
    # compiled decoding, CUDA's default, in every smoke run but the 0.5B preset's again, which
    # turns it off (TRL's dynamic cache)
    assert caches.count(None) == len(caches) - 1 and caches.count("dynamic") == 1


def test_the_two_calls_of_a_gpu_session_run_every_step_once(tmp_path):
    """The 15 minutes of a lent GPU fit two calls (docs/benchmarks.md, "A GPU session"): SKIP's
    patterns split the steps between them, and together they run each step exactly once."""

    def steps(skip: str) -> dict[str, str]:
        out = tmp_path / skip.replace(" ", "_").replace("*", "")
        env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "SKIP": skip}
        script = os.path.join(ROOT, "benchmarks", "gpu_session.sh")
        done = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        rows = (out / "summary.csv").read_text().splitlines()[1:]
        return dict(row.split(",")[:2] for row in rows)

    first, second = (
        steps("profile levers sharded-* smoke-* benchmark-*"),
        steps("cuda-tests benchmark"),
    )
    assert first.keys() == second.keys()
    ran = {name for name, state in first.items() if state == "dry-run"}
    ran_again = {name for name, state in second.items() if state == "dry-run"}
    assert ran & ran_again == {"install"}
    assert ran | ran_again == first.keys()
    assert {
        "cuda-tests",
        "benchmark",
        "benchmark-static",
        "profile",
        "levers",
        "sharded-fsdp",
    } <= first.keys()
    assert sum(name.startswith("smoke-") for name in ran_again) == len(GPU_PRESETS) + 1


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_each_failure_is_written_as_it_happens(tmp_path, workers):
    """PYTEST_FAILURES_LOG (the GPU session's test step, whose time limit can stop pytest before
    its report): each failure's traceback is in that file once, the passing test not at all."""
    (tmp_path / "test_two.py").write_text(
        "def test_passes():\n    assert True\n\n\ndef test_fails():\n    assert 1 == 2, 'wrong'\n"
    )
    log = tmp_path / "failures.log"
    env = {**os.environ, "PYTEST_FAILURES_LOG": str(log)}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest"]
        + ["--basetemp", str(tmp_path / "temp")]  # not the temp folder's pytest-of-<user>
        + workers
        + [str(tmp_path / "test_two.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    text = log.read_text()
    headers = [line for line in text.splitlines() if line.startswith("== ")]
    assert len(headers) == 1 and headers[0].endswith("test_two.py::test_fails (call)")
    assert "AssertionError: wrong" in text and "test_passes" not in text
