"""A TRL user's vision-language GRPO script, run on our trainer with only the import changed.

`tests/trl_examples/grpo_vlm.py` is the project's own script, written from TRL's documented usage
(it imports `GRPOConfig` and `GRPOTrainer` from `trl`, as a TRL user's script does). It runs with
the settings of two commands: GRPO, and GSPO's sequence-level importance sampling. With the
environment variable `TRL_REPO` set to a TRL source tree (a checkout or a bare clone), TRL's own
`examples/scripts/grpo_vlm.py` and `gspo_vlm.py` from that tree run too, with the same settings
(TRL's packages on PyPI do not hold them). Each script runs as written, with one line added before
its `if __name__ == "__main__":`:

    from trl_grpo_ext import GroupRelativeConfig as GRPOConfig, GroupRelativeTrainer as GRPOTrainer

What running offline on a CPU in seconds needs, and nothing else:
- `load_dataset("lmms-lab/multimodal-open-r1-8k-verified")` returns 104 rows of the same
  columns (`image`, `problem`, `solution`) with small pictures, built here;
- `--model_name_or_path` is a folder with the tiny VLM (`trl_grpo_ext.tiny_vlm`);
- the commands' settings, shrunk: one step, 2 completions of 8 tokens, LoRA on `q_proj` and
  `v_proj`, float32, no vLLM (images with vLLM are an error for now, docs/vision-language.md).
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from trl_grpo_ext.tiny_vlm import save_tiny_vlm

TRL_REPO = os.environ.get("TRL_REPO")  # a TRL source tree, whose scripts run too
OUR_SCRIPT = Path(__file__).parent / "trl_examples" / "grpo_vlm.py"
IMPORT = (
    "from trl_grpo_ext import GroupRelativeConfig as GRPOConfig, "
    "GroupRelativeTrainer as GRPOTrainer\n"
)

# Runs a script with `datasets.load_dataset` answering the example's Hub dataset offline.
RUNNER = """
import runpy, sys
import datasets
from PIL import Image

def load_dataset(path, name=None, split=None, **kwargs):
    assert path == "lmms-lab/multimodal-open-r1-8k-verified", path
    assert name is None and split == "train", (name, split)
    colors = {"red": (255, 0, 0), "blue": (0, 0, 255)}
    rows = [
        {
            "image": Image.new("RGB", (24 + i % 5, 20), colors[color]).convert(
                "RGB" if i % 3 else "L"  # the script converts grey pictures to RGB
            ),
            "problem": f"Which color is picture {i}?",
            "solution": color,
        }
        for i in range(52)
        for color in colors
    ]
    return datasets.Dataset.from_list(rows)

datasets.load_dataset = load_dataset
script, *sys.argv[1:] = sys.argv[1:]
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
"""


def trl_example(path: str) -> str:
    """The text of `path` in the TRL source tree at `TRL_REPO`, a checkout or a bare clone."""
    root = Path(TRL_REPO)
    if (root / path).is_file():
        return (root / path).read_text()
    git_dir = root / ".git" if (root / ".git").exists() else root
    shown = subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"HEAD:{path}"], capture_output=True, text=True
    )
    assert shown.returncode == 0, f"TRL_REPO={TRL_REPO} holds no {path}: {shown.stderr}"
    return shown.stdout


def with_our_trainer(source: str) -> str:
    marker = 'if __name__ == "__main__":'
    assert source.count(marker) == 1 and "GRPOTrainer(" in source
    return source.replace(marker, IMPORT + "\n\n" + marker)


@pytest.fixture(scope="module")
def tiny_vlm_folder(tmp_path_factory) -> str:
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), seed=0)


COMMON = [
    "--learning_rate", "1e-5",
    "--dtype", "float32",
    "--max_completion_length", "8",
    "--use_peft",
    "--lora_target_modules", "q_proj", "v_proj",
    "--log_completions",
    "--max_steps", "1",
    "--report_to", "none",
    "--use_cpu", "true",
    "--save_strategy", "no",
]  # fmt: skip
ARGUMENTS = {
    "grpo": [  # TRL's SmolVLM2 command's batch settings
        "--per_device_train_batch_size", "1",
        "--gradient_accumulation_steps", "2",
        "--num_generations", "2",
    ],
    "gspo": [  # TRL's GSPO command's settings, the batch shrunk to 2 completions
        "--per_device_train_batch_size", "2",
        "--num_generations", "2",
        "--importance_sampling_level", "sequence",
        "--epsilon", "3e-4",
        "--epsilon_high", "4e-4",
        "--beta", "0.0",
        "--loss_type", "grpo",
        "--steps_per_generation", "2",
    ],
}  # fmt: skip


WITHOUT_TRL_REPO = pytest.mark.skipif(not TRL_REPO, reason="TRL_REPO is not set: no TRL tree")
SCRIPTS = [  # (script, the command whose settings it runs with)
    pytest.param("ours", "grpo", id="ours-grpo"),
    pytest.param("ours", "gspo", id="ours-gspo"),
    pytest.param("examples/scripts/grpo_vlm.py", "grpo", id="trl-grpo", marks=WITHOUT_TRL_REPO),
    pytest.param("examples/scripts/gspo_vlm.py", "gspo", id="trl-gspo", marks=WITHOUT_TRL_REPO),
]


@pytest.mark.parametrize("script_name, setting", SCRIPTS)
def test_vlm_script_trains_and_saves_an_adapter(tmp_path, tiny_vlm_folder, script_name, setting):
    source = OUR_SCRIPT.read_text() if script_name == "ours" else trl_example(script_name)
    script = tmp_path / Path(script_name).name
    script.write_text(with_our_trainer(source))
    output = tmp_path / "out"
    command = [sys.executable, "-c", RUNNER, str(script), "--model_name_or_path", tiny_vlm_folder]
    command += ["--output_dir", str(output), *COMMON, *ARGUMENTS[setting]]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    environment["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])
    run = subprocess.run(
        command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    # It trained one step on our trainer (a metric TRL's trainer does not log) and saved the
    # LoRA adapter the script asks for.
    assert "'reward_std_in_groups'" in run.stdout, run.stdout[-3000:]
    assert (output / "adapter_config.json").is_file()
    assert (output / "adapter_model.safetensors").is_file()
    assert "train_runtime" in run.stdout
    # The trainer called the script's two reward functions (a format and an accuracy reward).
    assert len(set(re.findall(r"'rewards/(\w+)/mean'", run.stdout))) == 2, run.stdout[-3000:]


def our_script() -> dict:
    """The definitions of our script (its `__main__` block does not run)."""
    return runpy.run_path(str(OUR_SCRIPT))


def test_our_scripts_rewards_score_format_and_final_answer():
    script = our_script()

    def conversational(*texts):
        return [[{"role": "assistant", "content": text}] for text in texts]

    completions = conversational(
        "<think>blue and red</think> Red.",  # the answer after the reasoning
        "<think>2 + 2</think>\n$\\boxed{4.0}$",  # a boxed number: the same as "4"
        "<think>it is red</think> blue",  # "red" inside the reasoning does not count
        "Red",  # right answer, no reasoning: accurate, not formatted
        "<think>red</think>",  # no answer
        "<think>unclosed red",
    )
    solution = ["red", "<answer> 4 </answer>", "red", "red", "red", "red"]
    assert script["format_reward"](completions, solution=solution) == [1, 1, 1, 0, 0, 0]
    assert script["accuracy_reward"](completions, solution=solution) == [1, 1, 0, 1, 0, 0]
    # Plain-text completions too (a dataset of text prompts).
    assert script["accuracy_reward"](["<think>.</think> 0.50"], solution=["0.5"]) == [1.0]


def test_our_script_puts_the_picture_in_the_user_message():
    row = {"image": Image.new("L", (1024, 256)), "problem": "What is drawn?", "solution": "x"}
    converted = our_script()["with_prompt"](row)
    image = converted["image"]
    assert image.mode == "RGB" and image.size == (512, 128)  # RGB, longer side scaled to 512
    system, user = converted["prompt"]
    assert system["role"] == "system" and user["role"] == "user"
    assert user["content"] == [{"type": "image"}, {"type": "text", "text": "What is drawn?"}]
