"""Each lever of our step on and off, in one process, on one model and device.

    .venv/bin/python benchmarks/levers.py --model smollm2 --threads 2
    python benchmarks/levers.py --model qwen2.5-0.5b --device cuda --dtype bfloat16   # one GPU

The model gets LoRA r=16 (alpha 32, all linear layers, no dropout) with non-zero B matrices, as
after some training. One generation batch (`--num-prompts` x `--group-size` completions of at
most `--max-tokens` tokens, temperature 1.0) is sampled by `generate_with_transformers` in
five ways, `--repeats` times in rotation, each repeat with its own seed shared by the five:

* ours: adapters merged (`generation.merged_adapters`), finished rows leaving the batch
  (`generation.compacting`), the KV cache growing in place (`generation.kv_room`), on a CPU
  the weights laid out once for oneDNN (`generation.packed_weights`);
* adapters unmerged;
* every row to the end;
* the KV cache grown by one concatenation per step (transformers' `DynamicLayer`);
* on a CPU, the linear layers calling `F.linear` (MKL) instead of their weights laid out once
  for oneDNN (`generation.packed_weights`; on a GPU the two are the same).

In bfloat16 or float16 our engine samples unmerged (the merge moves the log-probs about as
much again as bfloat16 itself does: benchmarks/merge_precision.py); this benchmark merges anyway, to
measure both the time and how far the sampled tokens' log-probs move.

Then, on the completions of one group of that batch (one micro-batch of the objective), the
log-probs' forward and backward passes, the same rotation: a packed row attending block by
block (ours, `packed_attention`), each block ending at its completion's end, the same row under
one whole-row mask, the completions as `--group-size` unpacked rows, the blocks with the
head's logits recomputed in the backward pass (two chunks) instead of kept (one chunk), and
every block `--max-tokens` long (the positions after a completion's end computed too). Each against the unpacked rows: the largest
difference of the log-probs and of the LoRA gradient (relative to its norm).

A random model (`qwen2.5-0.5b`, `tiny-random`: benchmarks/gpu.py's shapes; `hybrid-random`:
Qwen3.5's layer kinds at a CPU's size; nothing downloaded)
rarely samples the end-of-sequence token, so its output head gets a bias that makes the token
about `--eos-rate` likely per step: completion lengths then spread as a trained model's do,
which is what compacting is for. Times are medians over the repeats; on CUDA each variant's
peak memory above the model's is reported too.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
from gpu import SHAPES  # noqa: E402

MODELS = {
    "tiny": _common.tiny_model_dir,
    "smollm2": _common.smollm2_model_dir,
    "qwen2.5-0.5b": lambda dtype: _common.random_model_dir(SHAPES["qwen2.5-0.5b"], dtype),
    "tiny-random": lambda dtype: _common.random_model_dir(SHAPES["tiny"], dtype),
    "hybrid-random": lambda dtype: _common.random_model_dir(HYBRID, dtype),
}
RANDOM = ("qwen2.5-0.5b", "tiny-random", "hybrid-random")
# A Qwen3.5-style hybrid small enough for a CPU: three linear-attention layers to each full one.
HYBRID = {
    "hidden": 256,
    "layers": 8,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 768,
    "vocab": 4096,
    "full_every": 4,
}


def main(argv=None) -> dict:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=list(MODELS))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eos-rate", type=float, default=0.01, help="random models only")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA device; run with --device cpu.")
    if args.model in RANDOM:
        model_dir = MODELS[args.model](args.dtype)
    else:
        model_dir = MODELS[args.model]()
    model, tokenizer = _lora_model(model_dir, args)
    print(
        f"| {args.model} ({args.dtype}, {args.device}), LoRA r 16: {args.num_prompts} x "
        f"{args.group_size} completions of at most {args.max_tokens} tokens, "
        f"{args.repeats} repeats"
    )
    sampling, batch = _sampling(model, tokenizer, args)
    logprobs = _logprobs(model, batch, args)
    return {"sampling": sampling, "logprobs": logprobs}


def _lora_model(model_dir: str, args):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    if args.model in RANDOM:
        _common.bias_end_of_sequence(model, tokenizer.eos_token_id, args.eos_rate)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(model, lora).to(args.device)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "lora_B" in name:
                noise = 1e-3 * torch.randn(parameter.shape, generator=generator)
                parameter.copy_(noise.to(parameter.dtype))
    return model, tokenizer


def _timed(run, device: str):
    """(seconds, result, peak bytes above the memory allocated before; 0 on CPU)."""
    import torch

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    started = time.perf_counter()
    result = run()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() - before if cuda else 0
    return seconds, result, peak


def _rotate(variants: dict, repeats: int, device: str, seeded_runs: bool):
    """Every variant once per repeat, in turn; per variant the seconds, results and peaks."""
    import torch

    from trl_grpo_ext.generation.transformers_engine import seeded

    seconds = {name: [] for name in variants}
    results = {name: [] for name in variants}
    peaks = {name: 0 for name in variants}
    for repeat in range(-1, repeats):  # -1: warm-up, not counted
        for name, run in variants.items():
            context = (
                seeded(repeat, torch.device(device)) if seeded_runs else contextlib.nullcontext()
            )
            with context:
                took, result, peak = _timed(run, device)
            # As it goes: a run stopped at its time limit (a GPU session) still leaves these.
            print(
                f"  {name}, {'warm-up' if repeat < 0 else f'repeat {repeat + 1}'}: {took:.2f} s",
                flush=True,
            )
            if repeat >= 0:
                seconds[name].append(took)
                results[name].append(result)
                peaks[name] = max(peaks[name], peak)
    return seconds, results, peaks


def _sampling(model, tokenizer, args):
    import torch

    from trl_grpo_ext.generation import kv_room, merged_adapters
    from trl_grpo_ext.generation.rollout import completion_mask_from_ids
    from trl_grpo_ext.generation.transformers_engine import generate_with_transformers

    prompt_ids, prompt_mask, config, eos = _common.sampling_inputs(
        model, tokenizer, args.num_prompts, args.group_size, args.max_tokens
    )
    prompt_ids, prompt_mask = prompt_ids.to(args.device), prompt_mask.to(args.device)
    # Merged in any dtype here (see the docstring).
    merged = functools.partial(merged_adapters.merged_lora, low_precision=True)

    def sample(merge: bool, compact: bool, grow_in_place: bool = True, pack: bool = True):
        concatenate = mock.patch.object(kv_room, "make_room", lambda cache, max_length: None)
        with (
            merged(model, lay_out=pack) if merge else contextlib.nullcontext(),
            contextlib.nullcontext() if grow_in_place else concatenate,
        ):
            return generate_with_transformers(
                model,
                prompt_ids,
                prompt_mask,
                generation_config=config,
                compact_finished_rows=compact,
                pack_weights=pack,
            )  # (prompt ids, prompt mask, completion ids), prompts repeated G times

    variants = {
        "ours: merged, finished rows leave": lambda: sample(True, True),
        "adapters unmerged": lambda: sample(False, True),
        "every row to the end": lambda: sample(True, False),
        "KV cache grown by concatenation": lambda: sample(True, True, grow_in_place=False),
        "weights not laid out for oneDNN": lambda: sample(True, True, pack=False),
    }
    model.eval()
    with torch.no_grad():
        seconds, results, peaks = _rotate(variants, args.repeats, args.device, seeded_runs=True)
    tokens = {
        name: [int(completion_mask_from_ids(out[2], eos)[0].sum()) for out in outs]
        for name, outs in results.items()
    }
    reference = results["adapters unmerged"][-1]
    ids = torch.cat([reference[0], reference[2]], 1)
    mask, _ = completion_mask_from_ids(reference[2], eos)
    attention_mask = torch.cat([reference[1], mask.to(reference[1].dtype)], 1)
    with torch.no_grad():
        unmerged = _completion_logps(model, ids, attention_mask, reference[2])
        with merged(model):
            merged_logps = _completion_logps(model, ids, attention_mask, reference[2])
    moved = (merged_logps - unmerged).abs()[mask.bool()]
    print(
        "\n| sampling | s per batch | s per 1k tokens | ours / this | peak memory MiB | same tokens as ours |"
    )
    print("|---|---:|---:|---:|---:|---|")
    first = next(iter(variants))
    ours = sum(seconds[first]) / sum(tokens[first])
    same = {
        name: all(_same(a[2], b[2]) for a, b in zip(outs, results[first]))
        for name, outs in results.items()
    }
    for name in variants:
        per_token = sum(seconds[name]) / sum(tokens[name])
        print(
            f"| {name} | {statistics.median(seconds[name]):.2f} | {1000 * per_token:.3f} | "
            f"{ours / per_token:.2f}x | {_mib(peaks[name], args.device)} | {same[name]} |"
        )
    lengths = mask.sum(1).float()
    print(
        f"\ncompletion lengths {int(lengths.min())}-{int(lengths.max())} (mean "
        f"{float(lengths.mean()):.0f}); the merge moves the sampled tokens' log-probs by at "
        f"most {float(moved.max()):.2e}, {float(moved.mean()):.2e} on average"
    )
    batch = {"ids": ids, "attention_mask": attention_mask, "completion_ids": reference[2]}
    return {
        "seconds": seconds,
        "tokens": tokens,
        "same": same,
        "lengths": (int(lengths.min()), float(lengths.mean()), int(lengths.max())),
        "merge_logp_max": float(moved.max()),
    }, batch


def _completion_logps(model, ids, attention_mask, completion_ids, chunk_tokens=None):
    from trl_grpo_ext.logprobs import completion_logprobs

    return completion_logprobs(
        model, ids, attention_mask, completion_ids, logprob_chunk_tokens=chunk_tokens
    )


def _logprobs(model, batch, args):
    import torch

    from trl_grpo_ext import logprobs

    group = slice(0, args.group_size)  # one prompt's completions: one micro-batch
    ids, attention_mask = batch["ids"][group], batch["attention_mask"][group]
    completion_ids = batch["completion_ids"][group]
    completion_length = completion_ids.shape[1]
    mask = attention_mask[:, -completion_length:].to(torch.float32)
    trainable = [p for p in model.parameters() if p.requires_grad]
    positions = args.group_size * completion_length

    def forward_backward(chunk_tokens=None):
        logps = _completion_logps(model, ids, attention_mask, completion_ids, chunk_tokens)
        loss = (logps.float() * mask).sum() / mask.sum()
        grads = torch.autograd.grad(loss, trainable)
        return logps.detach(), torch.cat([g.flatten().float() for g in grads])

    def patched(**functions):
        def run(chunk_tokens=None):
            with contextlib.ExitStack() as stack:
                for name, function in functions.items():
                    stack.enter_context(mock.patch.object(logprobs, name, function))
                return forward_backward(chunk_tokens)

        return run

    whole_row = patched(attends_by_blocks=lambda config: False, packing_pays=lambda *a, **k: True)
    variants = {
        "ours: packed, by blocks, probabilities kept": forward_backward,
        "packed, one whole-row mask": whole_row,
        "unpacked rows": patched(packing_pays=lambda *a, **k: False),
        "by blocks, head recomputed (2 chunks)": lambda: forward_backward(positions // 2 + 1),
        "every block T tokens (after the ends too)": patched(
            attended_lengths=lambda completion_attention: torch.full(
                (len(completion_attention),),
                completion_attention.shape[1],
                device=completion_attention.device,
            )
        ),
    }
    model.train()
    seconds, results, peaks = _rotate(variants, args.repeats, args.device, seeded_runs=False)
    reference_logps, reference_grad = results["unpacked rows"][-1]
    ours = statistics.median(seconds[next(iter(variants))])
    print(
        f"\n| log-probs, forward + backward ({args.group_size} x {completion_length} tokens) "
        "| s | ours / this | peak memory MiB | max logp difference | gradient difference |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    errors = {}
    for name in variants:
        logps, grad = results[name][-1]
        errors[name] = (
            float(((logps - reference_logps).abs() * mask).max()),
            float((grad - reference_grad).norm() / reference_grad.norm()),
        )
        median = statistics.median(seconds[name])
        print(
            f"| {name} | {median:.3f} | {ours / median:.2f}x | {_mib(peaks[name], args.device)} | "
            f"{errors[name][0]:.1e} | {errors[name][1]:.1e} |"
        )
    return {"seconds": seconds, "errors": errors}


def _mib(peak: int, device: str) -> str:
    return f"{peak / 2**20:.0f}" if device == "cuda" else "-"  # measured on CUDA only


def _same(first, second) -> bool:
    return first.shape == second.shape and bool((first == second).all())


if __name__ == "__main__":
    main()
