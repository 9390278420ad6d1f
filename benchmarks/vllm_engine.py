"""Generation speed: `transformers` against the colocated vLLM engine, base weights, an active LoRA
adapter, and the adapter merged into full weights (the two ways to publish LoRA weights).

Run in the vLLM environment (`make test-vllm` builds it):

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .venv-vllm/bin/python benchmarks/vllm_engine.py --model tiny

`--model` is `tiny` (the tiny model with head size 32, which vLLM's CPU attention supports) or a
model folder (e.g. SmolLM2-135M-Instruct from `models.gguf_to_folder`). Each figure is the median
of `--repeats` calls after one warm-up call; every call samples B prompts x G completions of up to
T tokens (temperature 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

for name, value in [
    ("VLLM_CPU_KVCACHE_SPACE", "1"),
    ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
    ("HF_HUB_OFFLINE", "1"),
]:
    os.environ.setdefault(name, value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(function, repeats):
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora-r", type=int, default=16)
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext.generation import sampling_config
    from trl_grpo_ext.generation.transformers_engine import generate_with_transformers
    from trl_grpo_ext.generation.vllm_colocate import ColocateSettings, VLLMColocateEngine
    from trl_grpo_ext.tiny import save_tiny

    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as folder:
        workdir = Path(folder)
        model_dir = args.model
        if model_dir == "tiny":
            model_dir = save_tiny(workdir / "tiny", num_attention_heads=2, num_key_value_heads=1)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        texts = [
            f"Question {index}: what is {index} plus {index * 3}?" for index in range(args.prompts)
        ]
        encoded = tokenizer(texts, padding=True, return_tensors="pt")
        prompts = encoded["input_ids"], encoded["attention_mask"]
        config = sampling_config(
            max_new_tokens=args.tokens,
            eos_token_id=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
            num_return_sequences=args.group,
        )
        # an adapter on every linear layer, as the benchmarks train (random B: a non-trivial adapter)
        peft_model = get_peft_model(
            model,
            LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear"),
        )
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.01)
        peft_model.save_pretrained(workdir / "adapter")
        merged = {
            name: tensor.clone()
            for name, tensor in peft_model.merge_and_unload().state_dict().items()
        }

        rows = []

        def tokens_per_s(seconds, output):
            generated = (output[2] != tokenizer.pad_token_id).sum().item()
            return generated / seconds

        with torch.no_grad():
            seconds, output = timed(
                lambda: generate_with_transformers(model, *prompts, generation_config=config),
                args.repeats,
            )
        rows.append(("transformers generate", seconds, tokens_per_s(seconds, output)))

        start = time.perf_counter()
        engine = VLLMColocateEngine(
            model_dir, ColocateSettings(max_model_len=1024, max_lora_rank=args.lora_r)
        )
        startup = time.perf_counter() - start
        seconds, output = timed(lambda: engine.generate(*prompts, config, seed=0), args.repeats)
        rows.append(("vLLM, base weights", seconds, tokens_per_s(seconds, output)))

        start = time.perf_counter()
        engine.publish_adapter(workdir / "adapter", 1)
        publish = time.perf_counter() - start
        seconds, output = timed(lambda: engine.generate(*prompts, config, seed=0), args.repeats)
        rows.append(("vLLM, LoRA adapter active", seconds, tokens_per_s(seconds, output)))

        engine.adapter = None
        start = time.perf_counter()
        engine.load_weights(merged.items())
        reload = time.perf_counter() - start
        seconds, output = timed(lambda: engine.generate(*prompts, config, seed=0), args.repeats)
        rows.append(("vLLM, adapter merged, full weights", seconds, tokens_per_s(seconds, output)))

        print(
            f"model {args.model}: B={args.prompts} G={args.group} T={args.tokens} r={args.lora_r}"
        )
        print(f"engine start-up {startup:.1f} s; publish adapter {publish:.3f} s; ", end="")
        print(f"reload merged weights {reload:.3f} s")
        print("| engine | s per call | tokens/s |\n| --- | --- | --- |")
        for name, seconds, rate in rows:
            print(f"| {name} | {seconds:.2f} | {rate:.0f} |")


if __name__ == "__main__":
    main()
