"""Per-call overhead of `run_python`'s sandbox: the median wall time of a call that prints `1`.

    python benchmarks/sandbox_overhead.py [--calls 50] [--mechanisms namespaces bubblewrap process]

Each mechanism this machine can run is warmed up with one call, then timed over `--calls`
sequential calls of `print(1)`, called (`sandbox(code)`) and awaited (`async_call`, as the trainer
does). The program itself costs about the interpreter's start-up, which the process fallback
shows nearly alone. Prints, per mechanism, the median and the 10th and 90th
percentiles in seconds, and the per-call bounds that hold (`PythonSandbox.bounds()` where it
exists).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl_grpo_ext.tools import PythonSandbox, isolation  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--mechanisms", nargs="+", default=list(isolation.MECHANISMS))
    args = parser.parse_args()
    print(f"uid {os.geteuid()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    for mechanism in args.mechanisms:
        sandbox = PythonSandbox(isolation=mechanism)
        if sandbox("print(1)") != "1":
            print(f"{mechanism}: cannot run here")
            continue
        for way, call in (("called", sandbox), ("awaited", _awaited(sandbox))):
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                assert call("print(1)") == "1"
                times.append(time.perf_counter() - start)
            deciles = statistics.quantiles(times, n=10)
            print(
                f"{mechanism}, {way}: median {statistics.median(times):.3f} s "
                f"(p10 {deciles[0]:.3f}, p90 {deciles[-1]:.3f}) over {args.calls} calls"
            )
        if hasattr(sandbox, "bounds"):
            print(f"  {sandbox.bounds()}")


def _awaited(sandbox):
    """A call as the trainer makes it: `async_call` awaited on an event loop (one per call)."""
    return lambda code: asyncio.run(sandbox.async_call(code))


if __name__ == "__main__":
    main()
