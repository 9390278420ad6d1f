"""Peak memory of the output head + log-prob pass at Qwen's vocabulary: chunked vs full logits.

One forward and backward pass of `logps = log_softmax(h W^T / tau)[o]` for `completions x tokens`
positions, with Qwen2.5-0.5B's shapes (hidden 896, vocabulary 151,936), float32, the loss
`sum(logps * advantages)`. Variants:

* `chunked`: `trl_grpo_ext.logprobs.head_token_logprobs` (this project; `--chunk-tokens`).
* `full_logits`: the full `(B, T, V)` logits, then `logprobs.token_logprobs` (this project's
  path before the chunked head).
* `trl_selective`: the full logits, then `trl.trainer.utils.selective_log_softmax`.
* `trl_fused`: TRL 1.16's fused head, `trl.kernels.ChunkedLogProbFunction` (what its
  `GRPOTrainer` runs since `add_fused_lm_head`), its default tiles of 4096 tokens x 32768 words.

Each variant runs in its own process. Peak extra memory is measured from the point where the
inputs (hidden states, head weight, token ids, advantages) exist: on CPU the process's peak
resident set (VmHWM, reset through `/proc/self/clear_refs`) minus the resident set then; on CUDA
`torch.cuda.max_memory_allocated` minus the memory allocated then. It includes the gradients
(`(B*T, H)` for h; `(V, H)` for W with `--train-head`), the same for every variant.

    python benchmarks/logprob_memory.py                          # 8 x 512 tokens
    python benchmarks/logprob_memory.py --completions 2 --tokens 256 --variants chunked trl_fused
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("chunked", "full_logits", "trl_selective", "trl_fused")


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current resident set
    except OSError:
        pass


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _peak_rss_bytes() -> int:
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _logprobs_function(variant: str, spec: dict):
    """`f(hidden, weight, token_ids) -> logps` of one variant, its modules imported now, so that
    importing them does not count as memory of the pass."""
    import torch.nn.functional as F

    temperature = spec["temperature"]
    if variant == "chunked":
        from trl_grpo_ext.logprobs import head_token_logprobs

        return lambda hidden, weight, token_ids: head_token_logprobs(
            hidden, weight, token_ids, temperature=temperature, chunk_tokens=spec["chunk_tokens"]
        )
    if variant == "full_logits":
        from trl_grpo_ext.logprobs import token_logprobs

        return lambda hidden, weight, token_ids: token_logprobs(
            F.linear(hidden, weight), token_ids, temperature
        )
    if variant == "trl_selective":
        from trl.trainer.utils import selective_log_softmax

        return lambda hidden, weight, token_ids: selective_log_softmax(
            F.linear(hidden, weight), token_ids, temperature
        )
    if variant == "trl_fused":
        from trl.kernels import ChunkedLogProbFunction

        def fused(hidden, weight, token_ids):
            logps = ChunkedLogProbFunction.apply(
                hidden.reshape(-1, hidden.shape[-1]),
                weight,
                None,  # bias
                token_ids.reshape(-1),
                temperature,
                32768,  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE, words per tile
                None,  # final_logit_softcapping
                1.0,  # logit_scale
                (),  # log-probs only
            )[0]
            return logps.view(token_ids.shape)

        return fused
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def run_variant(variant: str, spec: dict) -> dict:
    """One forward and backward pass in this process; returns the measurements."""
    import torch

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    logprobs = _logprobs_function(variant, spec)
    warm_up = torch.randn(64, 64, device=device, requires_grad=True)
    (warm_up @ warm_up).logsumexp(-1).sum().backward()  # thread pools, BLAS
    generator = torch.Generator().manual_seed(0)
    rows, length = spec["completions"], spec["tokens"]
    hidden = torch.randn(rows, length, spec["hidden"], generator=generator).to(device)
    weight = (torch.randn(spec["vocab"], spec["hidden"], generator=generator) * 0.02).to(device)
    token_ids = torch.randint(spec["vocab"], (rows, length), generator=generator).to(device)
    advantages = torch.randn(rows, 1, generator=generator).to(device)
    hidden.requires_grad_()
    weight.requires_grad_(spec["train_head"])
    del generator
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        _reset_peak()
        baseline = _status_bytes("VmRSS") or _peak_rss_bytes()
    start = time.perf_counter()
    logps = logprobs(hidden, weight, token_ids)  # (B, T)
    (logps * advantages).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - baseline
    else:
        peak = _peak_rss_bytes() - baseline
    seconds = time.perf_counter() - start
    return {
        "variant": variant,
        "peak_extra_bytes": peak,
        "seconds": seconds,
        "logps_sum": float(logps.detach().double().sum()),
        "grad_hidden_sum": float(hidden.grad.double().abs().sum()),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="None: the default, `logprobs.default_chunk_tokens(vocab)`",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--train-head", action="store_true", help="W requires grad too")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # a child process: one variant
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        print(json.dumps(run_variant(args.run, json.loads(args.spec))))
        return

    import torch

    spec = {
        "completions": args.completions,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "chunk_tokens": args.chunk_tokens,
        "temperature": args.temperature,
        "train_head": args.train_head,
        "device": args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        "threads": args.threads,
    }
    full_logits = args.completions * args.tokens * args.vocab * 4
    print(f"spec: {json.dumps(spec)}")
    print(f"one float32 copy of the full logits: {full_logits / 2**20:.0f} MiB")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    results = []
    for variant in args.variants:
        command = [sys.executable, __file__, "--run", variant, "--spec", json.dumps(spec)]
        output = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
        if output.returncode != 0:
            print(f"{variant}: failed\n{output.stderr[-2000:]}")
            continue
        results.append(json.loads(output.stdout.strip().splitlines()[-1]))

    reference = results[0] if results else None
    print(
        f"\n| variant | peak extra memory (MiB) | x full logits | / {reference['variant']} "
        "| seconds | logps sum | |grad h| sum |"
    )
    print("|---|---|---|---|---|---|---|")
    for result in results:
        peak = result["peak_extra_bytes"]
        print(
            f"| {result['variant']} | {peak / 2**20:.0f} | {peak / full_logits:.2f} "
            f"| {peak / reference['peak_extra_bytes']:.2f} | {result['seconds']:.1f} "
            f"| {result['logps_sum']:.6e} | {result['grad_hidden_sum']:.6e} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"spec": spec, "results": results}, indent=2))


if __name__ == "__main__":
    main()
