"""`trl-grpo-ext`: the command line, with the flags of `trl grpo`.

    trl-grpo-ext grpo --config tiny_cpu --max_steps 20      # a preset: recipes/configs/tiny_cpu.yaml
    trl-grpo-ext grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name gsm8k \
        --reward_funcs accuracy_reward --use_peft --num_processes 2   # through accelerate launch
    trl-grpo-ext eval --run_config recipes/configs/tiny_cpu.yaml --adapter runs/tiny_cpu
    trl-grpo-ext plan --config qwen2.5-0.5b-instruct_gsm8k_lora   # memory of each phase
    trl-grpo-ext env

The command line parses; the recipes train and evaluate. `grpo` parses with `recipes/math.py`'s
own parser (`script_args.make_parser`: `trl.TrlParser` over the dataclasses of `trl grpo`, ours in
place of TRL's) and runs that recipe's `main` in this process, or, given a flag of `accelerate
launch` (`--num_processes`, `--accelerate_config`, ...), runs `accelerate launch recipes/math.py`
with the other flags, as `trl grpo` launches `trl/scripts/grpo.py`. `eval` runs
`recipes/eval_math.py`. Both need the recipes of the repository (an editable install:
`pip install -e .`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parent.parent / "recipes"

RECIPES_MISSING = (
    "trl-grpo-ext runs the recipes and presets of the repository (recipes/), which a wheel does "
    "not hold: install from a clone with `pip install -e .`."
)

# `--accelerate_config` by name: the files of recipes/accelerate (TRL's names are also found in
# TRL's own `trl/accelerate_configs`: zero1, fsdp1, fsdp2).
ACCELERATE_CONFIGS = {
    "single_gpu": "single_gpu.yaml",
    "multi_gpu": "multi_gpu.yaml",
    "zero2": "deepspeed_zero2.yaml",
    "zero3": "deepspeed_zero3.yaml",
    "fsdp": "fsdp.yaml",
}

GRPO_HELP = """\
Train with GRPO: the math recipe (recipes/math.py) with the flags of `trl grpo`.

Every flag of `trl grpo` is taken: GRPOConfig's fields (through GroupRelativeConfig, which adds
its own), ModelConfig's (--model_name_or_path, --use_peft, --lora_r, ...), the dataset arguments
(--dataset_name, --dataset_config, --dataset_train_split, ...) and --reward_funcs (this package's
rewards, TRL's names, or dotted paths, found from the working directory too). Ours: --tools,
--tool_format, --environment (reasoning_gym:TASK, or a dotted path to a function returning the
trainer's keyword arguments, in place of --dataset_name), the recipe's evaluation flags, and
--config NAME for a preset of recipes/configs ({presets}). --config FILE.yaml sets defaults;
flags on the command line override it.
"""

PLAN_HELP = """\
Print the memory plan of a run: each phase's predicted peak (weights, adapter and optimizer,
sampling KV cache, log-prob pass, backward) per process, from the model's config alone, before
any weights load, with the setting that lowers the peak. It takes the flags of
`trl-grpo-ext grpo` (a preset by name: {presets}); accelerate flags are accepted and unused.
"""

GRPO_EPILOG = """\
accelerate launch (any of its flags; with one, the run is launched through it):
  --num_processes N        processes (GPUs); on CPUs add --multi_gpu --mixed_precision no
  --accelerate_config NAME single_gpu, multi_gpu, zero2, zero3, fsdp (recipes/accelerate), TRL's
                           zero1, fsdp1, fsdp2, or an accelerate config file
  --mixed_precision, --multi_gpu, --main_process_port, --config_file, ...  (`accelerate launch -h`)

examples:
  trl-grpo-ext grpo --config tiny_cpu
  trl-grpo-ext grpo --config recipes/configs/qwen2.5-0.5b-instruct_gsm8k_lora.yaml --learning_rate 1e-5
  trl-grpo-ext grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name gsm8k \\
      --reward_funcs accuracy_reward --use_peft --lora_target_modules all-linear \\
      --accelerate_config multi_gpu --num_processes 2
"""


class CliError(Exception):
    """Bad input on the command line: printed as `trl-grpo-ext <command>: error: ...`, exit 2."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"grpo": grpo, "eval": evaluate, "plan": plan, "env": env}
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    name, rest = argv[0], argv[1:]
    try:
        if name not in commands:
            raise CliError(f"unknown command {name!r}.{closest(name, commands)}\n{USAGE}")
        return commands[name](rest) or 0
    except CliError as error:
        where = f"trl-grpo-ext {name}" if name in commands else "trl-grpo-ext"
        print(f"{where}: error: {error}", file=sys.stderr)
        return 2


USAGE = """\
usage: trl-grpo-ext {grpo,eval,plan,env} [flags]

  grpo   train with GRPO: the math recipe with the flags of `trl grpo` (and --config YAML)
  eval   greedy pass@1 and pass@k of a model or model + adapter, with tools if it was trained so
  plan   the predicted peak memory of each phase of a run (grpo's flags), before weights load
  env    versions, devices, the Python tool's sandbox and vLLM: what a bug report needs

`trl-grpo-ext <command> --help` lists a command's flags."""


def grpo(argv: list[str]) -> int:
    """`trl-grpo-ext grpo`: parse as `recipes/math.py` does, then run it here or launch it."""
    argv = resolve_preset(argv)
    arguments, launch, cli_remaining = parse_run(argv, "grpo")
    if launch:
        accelerate_launch(accelerate_command(launch, subtract(argv, cli_remaining)))
        return 0
    recipe("math").main(*arguments)
    return 0


def plan(argv: list[str]) -> int:
    """`trl-grpo-ext plan`: the memory plan of a run (the flags of `grpo`), as a table, from the
    model's config and the training prompts before any weights load: the recipe run with
    `--plan true`, which prints the plan and stops."""
    arguments, _, _ = parse_run(resolve_preset(argv), "plan")
    arguments[0].plan = True
    recipe("math").main(*arguments)
    return 0


def parse_run(argv: list[str], command: str):
    """`(dataclasses, accelerate launch arguments, the command line's leftovers)` of a run's
    flags, parsed by the recipe's parser; a flag or YAML key neither it nor accelerate knows is
    a `CliError`."""
    from .script_args import make_parser

    parser = make_parser(prog=f"trl-grpo-ext {command}")
    parser.description = (GRPO_HELP if command == "grpo" else PLAN_HELP).format(
        presets=", ".join(presets())
    )
    parser.epilog = GRPO_EPILOG if command == "grpo" else None
    parser.usage = f"trl-grpo-ext {command} [--config FILE.yaml | PRESET] [flags]" + (
        " [accelerate flags]" if command == "grpo" else ""
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    *arguments, config_remaining, cli_remaining = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    known = [flag for action in parser._actions for flag in action.option_strings]
    if config_remaining:
        key = config_remaining[0][2:]
        raise CliError(
            f"unknown key {key!r} in the --config file.{closest('--' + key, known, strip=True)}"
        )
    launch = launch_arguments(parser.launch_config, cli_remaining, known)
    return arguments, launch, cli_remaining


def resolve_preset(argv: list[str]) -> list[str]:
    """`--config NAME` of a preset (recipes/configs/NAME.yaml) as its path; a file as given."""
    if "--config" not in argv:
        return argv
    index = argv.index("--config")
    if index + 1 >= len(argv):
        raise CliError("--config needs a YAML file or a preset's name.")
    value = argv[index + 1]
    if os.path.isfile(value):
        return argv
    if not RECIPES.is_dir():
        raise CliError(f"--config {value}: no such file. {RECIPES_MISSING}")
    preset = RECIPES / "configs" / f"{value.removesuffix('.yaml')}.yaml"
    if preset.is_file():
        return argv[: index + 1] + [str(preset)] + argv[index + 2 :]
    raise CliError(
        f"--config {value}: no such file, nor a preset of {RECIPES / 'configs'} "
        f"({', '.join(presets())}).{closest(value, presets())}"
    )


def presets() -> list[str]:
    """The presets' names: the YAML files of recipes/configs."""
    folder = RECIPES / "configs"
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []


def launch_arguments(config: dict, cli_remaining: list[str], known: list[str]) -> list[str]:
    """The arguments of `accelerate launch`: the YAML's launch settings (`config`), overridden
    setting by setting by the command line's flags (TRL issue 7031: there the YAML's won);
    `--accelerate_config` becomes `--config_file`. A flag neither parser knows is an error that
    names the closest valid one."""
    from accelerate.commands.launch import launch_command_parser

    actions = {
        flag: action
        for action in launch_command_parser()._actions
        for flag in action.option_strings
    }
    settings: dict[str, list[str]] = {}  # accelerate's dest -> its tokens

    def add(flag: str, value) -> None:
        if flag == "--accelerate_config":
            settings["config_file"] = ["--config_file", accelerate_config_file(str(value))]
            return
        action = actions[flag]
        if action.nargs == 0:  # a switch (--multi_gpu): on with true, off with false
            if value is None or str(value).lower() in ("true", "1", "yes"):
                settings[action.dest] = [flag]
            else:
                settings.pop(action.dest, None)
        else:
            settings[action.dest] = [flag, str(value)]

    for key, value in config.items():
        add(f"--{key}", value)
    tokens = list(cli_remaining)
    while tokens:
        token = tokens.pop(0)
        flag, has_value, inline = token.partition("=")
        if flag != "--accelerate_config" and flag not in actions:
            if not token.startswith("-"):
                raise CliError(f"unexpected value {token!r}: each value follows its flag.")
            valid = known + [f for f in actions if f.startswith("--")] + ["--accelerate_config"]
            raise CliError(
                f"unknown flag {flag}.{closest(flag, valid)} "
                "`trl-grpo-ext grpo --help` lists the flags."
            )
        takes_value = flag == "--accelerate_config" or actions[flag].nargs != 0
        if takes_value and not has_value:
            if not tokens or tokens[0].startswith("--"):
                raise CliError(f"{flag} needs a value.")
            inline = tokens.pop(0)
        add(flag, inline if takes_value else None)
    if settings and "config_file" not in settings and not os.path.isfile(default_config_file()):
        # Without a config file accelerate takes these defaults with a notice; given, no notice.
        for dest, default in QUIET_DEFAULTS.items():
            settings.setdefault(dest, [f"--{dest}", default])
    return [token for flag_tokens in settings.values() for token in flag_tokens]


# accelerate launch's own defaults where no config file gives them.
QUIET_DEFAULTS = {"num_machines": "1", "mixed_precision": "no", "dynamo_backend": "no"}


def default_config_file() -> str:
    """accelerate's default config file (`accelerate config` writes it)."""
    from accelerate.commands.config import default_config_file

    return default_config_file


def accelerate_config_file(value: str) -> str:
    """`--accelerate_config`: a file, one of ours by name, or one of TRL's by name."""
    if os.path.isfile(value):
        return value
    if value in ACCELERATE_CONFIGS:
        return str(RECIPES / "accelerate" / ACCELERATE_CONFIGS[value])
    import importlib.resources

    trl_config = importlib.resources.files("trl.accelerate_configs").joinpath(f"{value}.yaml")
    if trl_config.is_file():
        return str(trl_config)
    names = list(ACCELERATE_CONFIGS) + ["zero1", "fsdp1", "fsdp2"]
    raise CliError(
        f"--accelerate_config {value}: no such file, nor one of {', '.join(names)}."
        f"{closest(value, names)}"
    )


def accelerate_command(launch: list[str], training: list[str]) -> list[str]:
    """The arguments of `accelerate launch`: its own, the recipe, the recipe's flags."""
    return [*launch, str(RECIPES / "math.py"), *training]


def accelerate_launch(command: list[str]) -> None:
    """`accelerate launch <command>`, in this process as `trl`'s CLI runs it (accelerate starts
    the recipe's processes and waits for them)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    print("accelerate launch " + " ".join(command), flush=True)
    launch_command(launch_command_parser().parse_args(command))


def subtract(tokens: list[str], removed: list[str]) -> list[str]:
    """`tokens` without `removed`, an ordered subsequence of it (the launch flags)."""
    left, pending = [], list(removed)
    for token in tokens:
        if pending and token == pending[0]:
            pending.pop(0)
        else:
            left.append(token)
    return left


def recipe(name: str):
    """The module of `recipes/<name>.py`, loaded from its file."""
    path = RECIPES / f"{name}.py"
    if not path.is_file():
        raise CliError(f"{path} is missing. {RECIPES_MISSING}")
    module_name = f"trl_grpo_ext_recipes_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def evaluate(argv: list[str]) -> int:
    """`trl-grpo-ext eval`: `recipes/eval_math.py` with its flags (and `--run_config` YAML)."""
    from transformers import HfArgumentParser

    script = recipe("eval_math")
    parser = HfArgumentParser(script.EvalArguments, prog="trl-grpo-ext eval", allow_abbrev=False)
    parser.description = (script.__doc__ or "").split("\n\n")[0] + (
        "\n\nGreedy pass@1 (strict: boxed final answer; lenient: answer right), sampled pass@k "
        "with --num_samples and --k, tool-call rates with --tools, a progress bar, and a report "
        "(--output report.json or report.md). --run_config takes the model, data, prompt and "
        "tool settings of a training YAML."
    )
    parser.usage = "trl-grpo-ext eval [--run_config FILE.yaml] [flags]"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    known = [flag for action in parser._actions for flag in action.option_strings]
    _, unknown = parser.parse_known_args(argv)
    for token in unknown[:1]:
        flag = token.partition("=")[0]
        raise CliError(
            f"unknown flag {flag}.{closest(flag, known)} `trl-grpo-ext eval --help` lists them."
        )
    script.main(script.parse_arguments(parser, argv))
    return 0


def env(argv: list[str]) -> int:
    """`trl-grpo-ext env`: what a bug report needs, as a table."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: trl-grpo-ext env\n\n" + env.__doc__.split(": ", 1)[1])
        return 0
    if argv:
        raise CliError(f"env takes no flags, got {' '.join(argv)}.")
    print("Copy-paste the following information when reporting an issue:\n")
    print(table(environment_rows()))
    return 0


def environment_rows() -> list[tuple[str, str]]:
    """(name, value) rows: the package, the platform, the stack's versions, the devices, the
    accelerate config, the Python tool's sandbox, and whether vLLM imports."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    rows = [("trl_grpo_ext", installed("trl_grpo_ext"))]
    rows += [("platform", platform.platform()), ("python", platform.python_version())]
    packages = ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "math-verify")
    rows += [(name, installed(name)) for name in packages]
    rows += [(name, installed(name)) for name in ("deepspeed", "bitsandbytes", "pyseccomp")]
    rows += [("devices", devices(torch))]
    accelerate_config = default_config_file()
    accelerate_config = accelerate_config if os.path.isfile(accelerate_config) else "none"
    rows += [("accelerate default config", accelerate_config)]
    rows += [("run_python sandbox", sandbox())]
    rows += [("vllm", vllm_import())]
    return rows


def devices(torch) -> str:
    """The accelerators torch sees (name and memory), else the CPU's core count."""
    if torch.cuda.is_available():
        names = []
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            names.append(f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB)")
        return f"CUDA {torch.version.cuda}: " + ", ".join(names)
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "Apple MPS"
    return f"CPU only ({os.cpu_count()} cores)"


def sandbox() -> str:
    """How run_python isolates programs here (tools/isolation.py), and its other bounds."""
    import logging

    from .tools import PythonSandbox

    package_logger = logging.getLogger("trl_grpo_ext")
    level = package_logger.level
    package_logger.setLevel(logging.ERROR)  # the fallback's long warning, for this table only
    try:
        return " ".join(PythonSandbox().bounds().split())  # "<mechanism>: <cgroup>; <seccomp>"
    finally:
        package_logger.setLevel(level)


def vllm_import() -> str:
    """vLLM's version if it imports (in a process of its own: it is slow and may crash), else
    why not."""
    code = "import vllm; print(vllm.__version__)"
    try:
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return "import vllm took over 300 s"
    if result.returncode == 0:
        return result.stdout.strip().splitlines()[-1]
    lines = result.stderr.strip().splitlines()
    if lines and lines[-1].startswith("ModuleNotFoundError: No module named 'vllm'"):
        return "not installed"
    return "fails to import: " + (lines[-1] if lines else f"exit code {result.returncode}")


def table(rows: list[tuple[str, str]]) -> str:
    """A Markdown table of two columns."""
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'component':<{width}} | version or state |", f"|{'-' * (width + 2)}|---|"]
    lines += [f"| {name:<{width}} | {value} |" for name, value in rows]
    return "\n".join(lines)


def closest(word: str, choices, strip: bool = False) -> str:
    """` Did you mean X?`, the closest of `choices` (difflib), or an empty string."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if not match:
        return ""
    return f" Did you mean {match[0].removeprefix('--') if strip else match[0]}?"


if __name__ == "__main__":
    sys.exit(main())
