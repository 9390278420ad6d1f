"""Throughput of `math_accuracy` on realistic completions: GSM8K-style and LaTeX (MATH) answers.

    python benchmarks/rewards.py [--n 2000] [--batch 64] [--threads 4]

Completions are built from ../shared/data (GSM8K and MATH-500 reference solutions reworded as a
model would end them, about 40% made wrong) when it is there, else synthesised. Prints
completions per second, milliseconds per batch of `--batch`, and CPU milliseconds per completion
(this process and its verifier workers; steadier than wall-clock time on a shared machine):
  - in-process: one process, no verifier workers (`TRL_GRPO_EXT_VERIFY_WORKERS=0`), main thread;
  - worker pool: batches scored one after another from the main thread (how the trainer calls a
    reward function), spread over the verifier worker processes;
  - thread pool: `--threads` threads scoring batches at once, sharing the worker processes;
  - trl.rewards.accuracy_reward in-process, for reference.
The target is well under 1 s per batch of 64 (under 5% of a training step on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def _read_jsonl(path: Path) -> list[dict]:
    with path.open() as file:
        return [json.loads(line) for line in file]


def gsm8k_style(rows: list[dict], rng: random.Random) -> list[tuple[str, str]]:
    """(completion, reference) pairs: the reference reasoning, then a final answer line."""
    pairs = []
    endings = [
        "The answer is {}.",
        "#### {}",
        "So the total is ${}.",
        "The answer is $\\boxed{{{}}}$.",
    ]
    for index, row in enumerate(rows):
        reasoning, number = row["answer"].rsplit("####", 1)
        reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()
        number = number.strip().replace(",", "")
        if rng.random() < 0.4:  # a wrong answer
            number = str(int(float(number)) + rng.choice([-10, -1, 1, 2, 7, 100]))
        text = f"{reasoning}\n{endings[index % len(endings)].format(number)}"
        if index % 2:
            text = f"<think>\n{reasoning}\n</think>\n{text.rsplit(chr(10), 1)[-1]}"
        pairs.append((text, row["answer"]))
    return pairs


def latex_style(rows: list[dict], rng: random.Random) -> list[tuple[str, str]]:
    """(completion, reference) pairs: a MATH solution, its last boxed answer sometimes swapped."""
    pairs = []
    answers = [row["answer"] for row in rows]
    for index, row in enumerate(rows):
        text = row["solution"]
        if rng.random() < 0.4:
            position = text.rfind("\\boxed{")
            if position >= 0:
                text = text[:position] + "\\boxed{" + rng.choice(answers) + "}$."
        if index % 2:
            text = f"<think>\nLet me work it out.\n</think>\n{text}"
        pairs.append((text, row["answer"]))
    return pairs


def synthetic(n: int, rng: random.Random) -> list[tuple[str, str]]:
    pairs = []
    for index in range(n):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        if index % 2:
            answer = f"{a * b:,}"
            text = f"Each box holds {a} items and there are {b} boxes, so {a} * {b} = {answer}."
            pairs.append((text + f"\nThe answer is {answer}.", f"#### {a * b}"))
        else:
            guess = b + 1 if rng.random() < 0.4 else b
            text = f"Simplify: $\\frac{{{a}}}{{{a * b}}} = \\boxed{{\\frac{{1}}{{{guess}}}}}$."
            pairs.append((text, f"\\frac{{1}}{{{b}}}"))
    return pairs


def build(n: int, seed: int = 0) -> tuple[list[str], list[str], str]:
    rng = random.Random(seed)
    gsm8k, math500 = DATA / "gsm8k" / "test.jsonl", DATA / "math500" / "test.jsonl"
    if gsm8k.exists() and math500.exists():
        gsm_rows, math_rows = _read_jsonl(gsm8k), _read_jsonl(math500)
        pairs = gsm8k_style((gsm_rows * 2)[: n // 2], rng)
        pairs += latex_style((math_rows * (n // len(math_rows) + 1))[: n - n // 2], rng)
        source = "GSM8K test + MATH-500 reference solutions (../shared/data)"
    else:
        pairs, source = synthetic(n, rng), "synthetic"
    rng.shuffle(pairs)
    return [c for c, _ in pairs], [r for _, r in pairs], source


def batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _worker_cpu_seconds() -> float:
    """CPU time of this process's verifier workers so far (Linux /proc; 0 elsewhere)."""
    from trl_grpo_ext.rewards import _pool

    pool, total = _pool._pool, 0.0
    for worker in list(pool._all) if pool else []:
        try:
            fields = Path(f"/proc/{worker.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def run(label, reward, completions, references, batch: int, threads: int = 0) -> None:
    """Score all completions in batches of `batch` (from `threads` threads) and print the speed."""
    pairs = list(zip(batches(completions, batch), batches(references, batch)))

    def score(pair):
        return reward(completions=pair[0], answer=pair[1])

    cpu_start, workers_start = time.process_time(), _worker_cpu_seconds()
    start = time.perf_counter()
    if threads:
        with ThreadPoolExecutor(threads) as executor:
            scores = [s for chunk in executor.map(score, pairs) for s in chunk]
    else:
        scores = [s for pair in pairs for s in score(pair)]
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start + _worker_cpu_seconds() - workers_start
    n = len(completions)
    correct = sum(score == 1.0 for score in scores) / n
    print(
        f"{label:42s} {n / elapsed:6.0f} completions/s {1000 * elapsed * batch / n:6.1f} ms/batch "
        f"{1000 * cpu / n:5.2f} CPU ms/completion  accuracy {correct:.3f}"
    )


def trl_accuracy(completions, answer):
    """trl.rewards.accuracy_reward on the same data (it wants LaTeX references and messages)."""
    from trl.rewards import accuracy_reward

    solutions = [r.rsplit("####", 1)[-1].strip() if "####" in r else f"${r}$" for r in answer]
    return accuracy_reward([[{"role": "assistant", "content": c}] for c in completions], solutions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--no-trl", action="store_true", help="skip trl's accuracy_reward")
    args = parser.parse_args()

    from trl_grpo_ext.rewards import _pool, _verify, math_accuracy

    completions, references, source = build(args.n)
    print(
        f"{args.n} completions from {source}; {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}, python {platform.python_version()}"
    )
    print(f"{'':42s} {'wall':>32s} {'CPU, all processes':>24s}")
    data = (completions, references, args.batch)

    def cold_start(workers: str | None) -> None:
        """No parsed references cached: each run parses its references once, like a new run."""
        os.environ.pop("TRL_GRPO_EXT_VERIFY_WORKERS", None)
        if workers is not None:
            os.environ["TRL_GRPO_EXT_VERIFY_WORKERS"] = workers
        _pool.shutdown_pool()
        _verify.parse_reference.cache_clear()
        math_accuracy(completions=["#### 1"], answer=["1"])  # imports, starts the workers

    cold_start("0")
    run("in-process (no workers), main thread", math_accuracy, *data)
    cold_start(None)
    workers = _pool.get_pool().num_workers
    run(f"{workers} worker processes, batches from main thread", math_accuracy, *data)
    cold_start(None)
    run(f"{workers} worker processes, {args.threads} threads", math_accuracy, *data, args.threads)

    if not args.no_trl:
        run("trl accuracy_reward, main thread", trl_accuracy, *data)


if __name__ == "__main__":
    main()
