"""The vision-language recipe (`recipes/vlm_math.py`): the offline preset runs end to end on
the tiny VLM's color task, shrunk on the command line, and writes its outputs; a dataset without
images, or a model that reads none, is a clear error that says what to change. The presets'
fields and headers are checked with the math recipe's (tests/test_recipe.py), the GPU preset's
first step in tests/test_gpu_presets.py."""

import json
import os
import subprocess
import sys

import pytest
from datasets import Dataset
from PIL import Image
from test_recipe import ROOT, SUMMARY, parser, vlm_recipe

from trl_grpo_ext.data import load_vision_math_dataset, split_held_out

PRESET = os.path.join(ROOT, "recipes", "configs", "tiny_vlm_cpu.yaml")
SHRUNK = [
    "--max_steps", "2",
    "--num_train_samples", "32",
    "--num_eval_samples", "8",
    "--num_generations_eval", "2",
    "--logging_steps", "1",
]  # fmt: skip


def test_the_cpu_preset_runs_end_to_end_from_the_command_line(tmp_path):
    """`python recipes/vlm_math.py --config tiny_vlm_cpu.yaml` (what `accelerate launch` runs),
    offline: the tiny VLM is warmed up and cached, evaluated before and after on held-out
    pictures, and the run folder holds the adapter, processor, metrics and table."""
    run = tmp_path / "run"
    command = [
        sys.executable, os.path.join(ROOT, "recipes", "vlm_math.py"),
        "--config", PRESET, *SHRUNK,
        "--output_dir", str(run),
        "--tiny_cache_dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": path}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert SUMMARY.match(result.stdout.strip().splitlines()[-1]), result.stdout[-500:]
    for name in (
        "adapter_model.safetensors",
        "processor_config.json",
        "metrics.jsonl",
        "before_after.md",
        "reward_curve.png",
        "README.md",
    ):
        assert (run / name).exists(), name
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in records if "reward" in r] == [1, 2]
    heldout = [(r["step"], r["heldout/label"]) for r in records if "heldout/label" in r]
    assert heldout == [(0, "before"), (2, "after")]
    table = (run / "before_after.md").read_text()
    assert "| rewards/says_the_color/mean |" in table
    assert (
        "evaluated on 8 held-out problems, 2 sampled completions each"
        in (run / "README.md").read_text()
    )
    assert (tmp_path / "cache").is_dir()


def test_held_out_pictures_are_never_trained_on():
    train = load_vision_math_dataset("tiny_colors", "train", num_rows=16)
    test = load_vision_math_dataset("tiny_colors", "test", num_rows=16)
    pixels = {row["image"].tobytes() for row in train}
    assert not pixels & {row["image"].tobytes() for row in test}
    assert train["answer"][:4] == ["red", "blue", "red", "blue"]  # balanced steps


def _problems(tmp_path, image_column="image", count=6):
    rows = [
        {"problem": f"What is {i} + 1?", "solution": f"<answer> {i + 1} </answer>"}
        for i in range(count)
    ]
    for row in rows:
        if image_column:
            row[image_column] = Image.new("RGBA", (900, 300), (10, 20, 30, 255))
    path = tmp_path / "problems.parquet"
    Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def test_a_local_dataset_becomes_prompts_images_and_answers(tmp_path):
    dataset = load_vision_math_dataset(_problems(tmp_path), max_image_side=448, system_prompt="S")
    assert dataset.column_names == ["question", "prompt", "answer", "image"]
    row = dataset[0]
    assert row["prompt"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "What is 0 + 1?"},
    ]
    assert row["answer"] == "1" and row["image"].size == (448, 149) and row["image"].mode == "RGB"
    train, held_out = split_held_out(dataset, 2, seed=0)
    assert (len(train), len(held_out)) == (4, 2)
    assert not set(train["question"]) & set(held_out["question"])
    with pytest.raises(ValueError, match="num_eval_samples below"):
        split_held_out(dataset, 6)


def test_a_dataset_without_images_says_which_setting_to_change(tmp_path):
    text_only = _problems(tmp_path, image_column=None)
    with pytest.raises(ValueError, match="no image column 'image'.*dataset_image_column.*math.py"):
        load_vision_math_dataset(text_only)
    argv = [
        "--config", PRESET, *SHRUNK,
        "--dataset_name", text_only,
        "--dataset_test_split", "",
        "--output_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="dataset_image_column"):
        vlm_recipe.main(*parser(vlm_recipe).parse_args_and_config(argv))


def test_a_text_model_is_refused_before_it_is_loaded(tmp_path):
    from trl_grpo_ext.tiny import build_tiny_model

    folder = tmp_path / "text_model"
    build_tiny_model().save_pretrained(folder)
    argv = ["--config", PRESET, "--model_name_or_path", str(folder), "--output_dir", str(tmp_path)]
    script_args, training_args, model_args = parser(vlm_recipe).parse_args_and_config(argv)
    with pytest.raises(ValueError, match="does not read images.*vision-language model"):
        vlm_recipe.resolve_vlm_model_path(script_args, model_args, training_args)
