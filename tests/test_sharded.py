"""The recipe with sharded weights on 2 CPU processes (`tests/sharded_run.py`): FSDP2 (the
weights are DTensors) and, where DeepSpeed is installed, ZeRO-3 (partitioned weights), with LoRA
and gradient checkpointing. The evaluations before, during and after training, the best adapter,
checkpoints, resuming and the push all need every process, as on GPUs."""

import importlib.util
import json
import os
import sys

import accelerate
import pytest
import yaml
from deadline import run_with_deadline
from packaging.version import Version
from safetensors import safe_open
from test_distributed import free_port
from test_recipe import ROOT, TINY_OVERRIDES

from trl_grpo_ext.evaluation import read_jsonl

SCRIPT = os.path.join(ROOT, "tests", "sharded_run.py")


CONFIGS = {"fsdp": "DistributedType.FSDP", "deepspeed_zero3": "DistributedType.DEEPSPEED"}


def cpu_config(name, folder) -> str:
    """The repository's accelerate config `name` with 2 CPU processes, no mixed precision."""
    with open(os.path.join(ROOT, "recipes", "accelerate", f"{name}.yaml")) as handle:
        config = yaml.safe_load(handle)
    config.update(num_processes=2, mixed_precision="no", use_cpu=name == "fsdp")
    path = os.path.join(folder, f"{name}_cpu.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump(config, handle)
    return path


def launch(name, tmp_path, output_dir, *extra):
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", cpu_config(name, tmp_path), "--main_process_port", str(free_port()),
        SCRIPT,
        "--config", os.path.join(ROOT, "recipes", "configs", "tiny_cpu.yaml"),
        *TINY_OVERRIDES,
        "--num_eval_samples", "7",  # 4 and 3 problems: the processes' shards differ
        "--save_strategy", "steps",
        "--save_steps", "2",
        "--gradient_checkpointing", "true",
        "--output_dir", str(output_dir),
        "--tiny_cache_dir", str(tmp_path / "cache"),
        *extra,
    ]  # fmt: skip
    # torchrun's agent leaves a torchelastic_* folder in the temp folder: one of the run's own.
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TMPDIR": str(temp)}
    # DeepSpeed's CPU accelerator compiles a shared-memory op once, into its own folder.
    env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
    done = run_with_deadline(command, 600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((output_dir / f"sharded-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request, tmp_path_factory):
    name = request.param
    if name.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (pip install deepspeed; it runs on CPU)")
    if name == "fsdp" and Version(accelerate.__version__) < Version("1.15"):
        # accelerate 1.4 (the oldest supported) asks for an accelerator device to build FSDP.
        pytest.skip(
            f"FSDP on CPU processes is tested with accelerate >= 1.15, not {accelerate.__version__}"
        )
    tmp_path = tmp_path_factory.mktemp(name)
    output_dir = tmp_path / "run"
    first = launch(name, tmp_path, output_dir, "--push_to_hub", "true", "--hub_model_id", "a/b")
    first_log = read_jsonl(output_dir / "metrics.jsonl")
    return name, tmp_path, output_dir, first, first_log


def check_sharded(seen, name):
    assert seen["distributed_type"] == CONFIGS[name] and seen["world_size"] == 2
    assert seen["step"] == 4 and seen["sharded"] and all(seen["sharded"])


def test_the_weights_are_sharded_on_both_processes(runs):
    for seen in runs[3]:
        check_sharded(seen, runs[0])


def test_every_evaluation_covers_all_problems_on_both_processes(runs):
    _, _, _, first, first_log = runs
    assert first[0]["before"] == first[1]["before"] and first[0]["after"] == first[1]["after"]
    assert first[0]["before"]["num_problems"] == first[0]["after"]["num_problems"] == 7
    labels = [(r["step"], r["heldout/label"]) for r in first_log if "heldout/label" in r]
    assert labels == [(0, "before"), (2, "periodic"), (4, "after")]


def test_saved_adapters_hold_whole_tensors(runs):
    """The best adapter (saved mid-run), the final one and the pushed one are full LoRA
    matrices gathered from both shards, not one process's half."""
    _, _, output_dir, first, _ = runs
    for folder in (output_dir / "best", output_dir):
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as tensors:
            shapes = {tuple(tensors.get_slice(name).get_shape()) for name in tensors.keys()}
        assert (16, 64) in shapes and (64, 16) in shapes, shapes  # lora_r 16, hidden 64
    assert "adapter_model.safetensors" in first[0]["uploads"][0]
    assert first[1]["uploads"] == []  # one process uploads


@pytest.mark.slow
def test_a_resumed_run_continues_from_its_checkpoint(runs):
    name, tmp_path, output_dir, first, _ = runs
    resumed = launch(
        name, tmp_path, output_dir, "--resume_from_checkpoint", str(output_dir / "checkpoint-2")
    )
    for seen in resumed:
        check_sharded(seen, name)
    log = read_jsonl(output_dir / "metrics.jsonl")
    steps = [(r["step"], r.get("heldout/label", "log")) for r in log if "train_runtime" not in r]
    assert steps[-3:] == [(3, "log"), (4, "log"), (4, "after")]
    # The log of steps 1-2 comes from the checkpoint; steps 3-4 are trained as the first run did.
    first_steps, resumed_steps = first[0]["entropy"], resumed[0]["entropy"]
    assert [step for step, _ in resumed_steps] == [step for step, _ in first_steps] == [1, 2, 3, 4]
    entropy = [value for _, value in first_steps]
    assert [value for _, value in resumed_steps] == pytest.approx(entropy, rel=1e-5)
