"""TRL's own vision-language GRPO example scripts, run on our trainer with only the import
changed.

The scripts (`examples/scripts/grpo_vlm.py`, `examples/scripts/gspo_vlm.py`) are read from a
TRL source tree, a checkout or a bare mirror, named by the `TRL_REPO` environment variable
(default: the stored snapshot at `/work/.mirror/huggingface+trl/repo`); the tests skip when
there is none. The project keeps no copy of them. Each script runs as written, with one line
added before its `if __name__ == "__main__":`:

    from trl_grpo_ext import GroupRelativeConfig as GRPOConfig, GroupRelativeTrainer as GRPOTrainer

What running offline on a CPU in seconds needs, and nothing else:
- `load_dataset("lmms-lab/multimodal-open-r1-8k-verified")` returns 104 rows of the same
  columns (`image`, `problem`, `solution`) with small pictures, built here;
- `--model_name_or_path` is a folder with the tiny VLM (`trl_grpo_ext.tiny_vlm`);
- the documented command's settings, shrunk: one step, 2 completions of 8 tokens, LoRA on
  `q_proj` and `v_proj` as documented, float32, no vLLM (images with vLLM are an error for now,
  docs/vision-language.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_grpo_ext.tiny_vlm import save_tiny_vlm

TRL_REPO = os.environ.get("TRL_REPO", "/work/.mirror/huggingface+trl/repo")
IMPORT = (
    "from trl_grpo_ext import GroupRelativeConfig as GRPOConfig, "
    "GroupRelativeTrainer as GRPOTrainer\n"
)

# Runs a script with `datasets.load_dataset` answering the example's Hub dataset offline.
RUNNER = """
import runpy, sys
import datasets
from PIL import Image

def load_dataset(name, split=None, **kwargs):
    assert name == "lmms-lab/multimodal-open-r1-8k-verified", name
    colors = {"red": (255, 0, 0), "blue": (0, 0, 255)}
    rows = [
        {
            "image": Image.new("RGB", (24 + i % 5, 20), colors[name]).convert(
                "RGB" if i % 3 else "L"  # the script converts grey pictures to RGB
            ),
            "problem": f"Which color is picture {i}?",
            "solution": name,
        }
        for i in range(52)
        for name in colors
    ]
    return datasets.Dataset.from_list(rows)

datasets.load_dataset = load_dataset
script, *sys.argv[1:] = sys.argv[1:]
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
"""


def trl_example(path: str) -> str:
    """The text of `path` in the TRL source tree, or a skip when there is none."""
    root = Path(TRL_REPO)
    if (root / path).is_file():
        return (root / path).read_text()
    git_dir = root / ".git" if (root / ".git").exists() else root
    shown = subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"HEAD:{path}"], capture_output=True, text=True
    )
    if shown.returncode != 0:
        pytest.skip(f"no TRL source tree with {path} at TRL_REPO={TRL_REPO}")
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
    "grpo_vlm.py": [  # the SmolVLM2 command's batch settings
        "--per_device_train_batch_size", "1",
        "--gradient_accumulation_steps", "2",
        "--num_generations", "2",
    ],
    "gspo_vlm.py": [  # its GSPO settings, the batch shrunk to 2 completions
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


@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_trls_vlm_example_trains_and_saves_an_adapter(tmp_path, tiny_vlm_folder, name):
    script = tmp_path / name
    script.write_text(with_our_trainer(trl_example(f"examples/scripts/{name}")))
    output = tmp_path / "out"
    command = [sys.executable, "-c", RUNNER, str(script), "--model_name_or_path", tiny_vlm_folder]
    command += ["--output_dir", str(output), *COMMON, *ARGUMENTS[name]]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    environment["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])
    run = subprocess.run(
        command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "GroupRelativeTrainer" in script.read_text()
    # It trained one step on our trainer and saved the LoRA adapter the script asks for.
    assert (output / "adapter_config.json").is_file()
    assert (output / "adapter_model.safetensors").is_file()
    assert "'train_runtime'" in run.stdout or "train_runtime" in run.stdout
