"""Side-by-side on one GPU: `GroupRelativeTrainer` against `trl.GRPOTrainer`, Qwen2.5-0.5B shape.

    python benchmarks/gpu.py                      # one NVIDIA GPU, no network, < 5 minutes
    python benchmarks/gpu.py --shape tiny --device cpu --dtype float32   # the CPU smoke test
    python benchmarks/gpu.py --engine vllm        # both trainers generate with vLLM colocated
    python benchmarks/gpu.py --device cpu --dtype float32 --num-prompts 1 --prompt-tokens 128 \
        --fixed-lengths --rounds 1 --steps 1    # the same shape on CPU (docs/benchmarks.md)
    python benchmarks/gpu.py ... --eos-rate 0.008   # lengths spread, the same way in both trainers

A randomly initialised Qwen2 model with the shape of Qwen2.5-0.5B (hidden 896, 24 layers, 14
heads, 2 key/value heads, intermediate 4864, vocabulary 151936) in bf16, LoRA r=16 on all linear
layers, gradient checkpointing, 8 prompts x 8 completions x 256 tokens per step (random weights
almost never sample end-of-sequence, so every completion has 256 tokens). Both trainers run in
their own processes, alternating ours, TRL, ours, TRL (`--rounds`), one warm-up step and
`--steps` measured steps each; the table (`_common.table`) reports the peak allocated CUDA
memory. The model is written once to `.cache/benchmarks/`.

`--engine vllm` (needs `pip install vllm`) generates with a colocated vLLM engine in both trainers
(`use_vllm=True, vllm_mode="colocate"`, `--vllm-gpu-memory-utilization` of the GPU for vLLM): ours
publishes each LoRA adapter version to it, TRL syncs merged weights. Where TRL's vLLM path fails,
the error is printed and TRL runs with `transformers` generation instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

SHAPES = {
    "qwen2.5-0.5b": {
        "hidden": 896,
        "layers": 24,
        "heads": 14,
        "kv_heads": 2,
        "intermediate": 4864,
        "vocab": 151936,
    },
    "tiny": {
        "hidden": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 128,
        "vocab": 512,
    },
}


def parse_shape(text: str) -> dict:
    """A preset name or `hidden=896,layers=24,heads=14,kv_heads=2,intermediate=4864,vocab=151936`."""
    if text in SHAPES:
        return dict(SHAPES[text])
    shape = dict(SHAPES["qwen2.5-0.5b"])
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in shape:
            raise SystemExit(f"--shape: unknown key {key!r}; use {sorted(shape)} or {list(SHAPES)}")
        shape[key] = int(value)
    return shape


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", help=parse_shape.__doc__)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per process")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8, help="completions per pass")
    parser.add_argument(
        "--prompt-tokens", type=int, default=None, help="prompts of exactly this many tokens"
    )
    parser.add_argument(
        "--fixed-lengths",
        action="store_true",
        help="every completion max-completion-length tokens (min_new_tokens, in both trainers)",
    )
    parser.add_argument(
        "--eos-rate",
        type=float,
        default=None,
        help="the end-of-sequence token about this likely per step (a bias on the random "
        "model's head, the same in both trainers): lengths spread as a trained model's do",
    )
    parser.add_argument(
        "--cache-implementation",
        default=None,
        help="both trainers' cache_implementation (static: on a GPU, generate compiles the "
        "decoding steps' forward)",
    )
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--in-process", action="store_true", help="smoke test: no subprocesses (memory is shared)"
    )
    args = parser.parse_args(argv)

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("No CUDA device; for a CPU smoke test pass --device cpu --shape tiny.")
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = "CPU"
    shape = parse_shape(args.shape)
    started = time.perf_counter()
    model_dir = _common.random_model_dir(shape, args.dtype)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {device_name}; {model_dir}")
    spec = {
        "model_dir": model_dir,
        "device": args.device,
        "dtype": args.dtype,
        "gradient_checkpointing": not args.no_gradient_checkpointing,
        "num_prompts": args.num_prompts,
        "num_generations": args.num_generations,
        "max_completion_length": args.max_completion_length,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "system_prompt": True,
        "prompt_tokens": args.prompt_tokens,
        "fixed_lengths": args.fixed_lengths,
        "eos_rate": args.eos_rate,
        "cache_implementation": args.cache_implementation,
    }
    if args.engine == "vllm":
        vllm = {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": args.vllm_gpu_memory_utilization,
            "vllm_max_model_length": 2048,
        }
        spec.update(engine_args=vllm, trl_fallback_engine_args={})
    with _common.work_folder(args.output_dir, "bench-gpu-") as output_dir:
        spec["output_dir"] = str(output_dir / "run")
        results = _common.run_alternating(spec, args.rounds, in_process=args.in_process)
    memory = "peak CUDA allocated" if args.device == "cuda" else "peak RSS"
    print(f"\nTotal {time.perf_counter() - started:.0f} s\n")
    table = _common.table(f"{args.shape}, {args.engine} ({device_name})", results, memory=memory)
    if results.get("trl_errors"):
        table += f"\n\nTRL with vLLM failed ({results['trl_errors'][0]}): TRL used transformers."
    print(table)
    report = {"args": vars(args), "shape": shape, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
