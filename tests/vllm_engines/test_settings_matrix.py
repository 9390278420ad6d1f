"""The trainer on a real vLLM engine across the settings a user picks, not the ones that work.

Axes: the engine (colocated, server), `max_staleness` (0, 1, 3), `lora_r` (4, 16), with and
without a periodic `trainer.evaluate()`, and a run resumed from a mid-run checkpoint. The full
product is 48 cells; CELLS is a pairwise covering array of 6: every value of every axis meets
every value of every other axis in at least one cell (test_cells_cover_every_pair_of_values
checks it). It is built from three rows, one per staleness, and their complements: on the four
two-valued axes the rows are 0000, 0011 and 0101, so every pair of those axes is equal in one
row and different in another.

Each cell trains MAX_STEPS steps of the tiny model (the resumed cells: SAVE_STEPS, stop, then
resume to MAX_STEPS) in a process of its own, with a private TMPDIR and under a wall-clock
timeout, and checks: no error (a traceback logged by a run that ended normally counts), no hang
(a process still running at the timeout dumps its threads' stacks, is killed, and the cell
fails), the staleness bound held (and was used when k > 0), the adapter versions that sampled
the batches were published in order, the engine was never used by two threads at once, no file
left in TMPDIR and no process left in the cell's process group. The server cells share the
session's server (`--enable-lora --max-lora-rank 16`), one cell at a time.

Budget: CELL_TIMEOUT (300 s) per process; 9 processes (6 cells, 3 of them in two parts), run two
at a time (`run_two_at_a_time`), so at most about 30 minutes if every one hung (a part that
fails ends its cell). Measured one at a time with every cell passing, on 2 CPU cores shared
with other jobs (load 4-7): 6 min 52 s for the module, server included, and 4.1 CPU-minutes (a
colocated process ~36 s of CPU, a server one ~12 s): its processes waited much of the time, hence
two at a time. A hang costs its 300 s. Since the cells reuse the tests' precompiled header
(`share_precompiled_headers`), a colocated process takes ~20 s of CPU, and the module under
two minutes of `make test-vllm`.
"""

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_helpers import INDUCTOR_HEADERS, share_precompiled_headers  # noqa: E402

pytestmark = pytest.mark.vllm

CELL_SCRIPT = Path(__file__).with_name("matrix_cell.py")
AXES = ("engine", "max_staleness", "lora_r", "evaluate", "resume")
VALUES = {
    "engine": ("colocate", "server"),
    "max_staleness": (0, 1, 3),
    "lora_r": (4, 16),
    "evaluate": (False, True),
    "resume": (False, True),
}
CELLS = [
    # engine,   k, lora_r, evaluate, resume
    ("colocate", 0, 4, False, False),
    ("server", 0, 16, True, True),
    ("colocate", 1, 16, False, True),
    ("server", 1, 4, True, False),
    ("colocate", 3, 16, True, False),
    ("server", 3, 4, False, True),
]
MAX_STEPS = 6  # more than the largest staleness, so a batch k steps old is trained on
SAVE_STEPS = 3  # the resumed cells stop after this checkpoint, then resume from it
CELL_TIMEOUT = 300  # seconds per process; a cell's process still running then is a hang
# vLLM's sampler is compiled by torch (inductor), whose cache lives in TMPDIR: a cache meant to be
# kept and shared between runs, not a leak of the trainer's. The cells share the usual one, and
# the tests' precompiled headers (`share_precompiled_headers`): their folder in TMPDIR,
# `torchinductor_<user>`, is not counted as left behind.
INDUCTOR_CACHE = os.environ.get(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), INDUCTOR_HEADERS)
)


def cell_id(cell):
    engine, k, rank, evaluate, resume = cell
    return "-".join([engine, f"k{k}", f"r{rank}"] + ["eval"] * evaluate + ["resume"] * resume)


def test_cells_cover_every_pair_of_values():
    assert all(cell[i] in VALUES[axis] for cell in CELLS for i, axis in enumerate(AXES))
    for (i, first), (j, second) in itertools.combinations(enumerate(AXES), 2):
        covered = {(cell[i], cell[j]) for cell in CELLS}
        missing = set(itertools.product(VALUES[first], VALUES[second])) - covered
        assert not missing, (first, second, missing)


def group_processes(group: int) -> list[str]:
    """`pid command` of the live processes in process group `group`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
        state, _, pgrp = fields.split()[:3]
        if int(pgrp) == group and state != "Z":
            found.append(f"{stat.parent.name} {name}")
    return found


def run_part(settings: dict, folder: Path) -> tuple[dict | None, list[str]]:
    """Runs one process of a cell; returns its result (None if it failed) and the problems."""
    folder.mkdir()
    tmpdir = folder / "tmp"
    tmpdir.mkdir()
    share_precompiled_headers(tmpdir)
    (folder / "settings.json").write_text(json.dumps(settings))
    result_path = folder / "result.json"
    command = [sys.executable, str(CELL_SCRIPT), str(folder / "settings.json"), str(result_path)]
    env = dict(os.environ, TMPDIR=str(tmpdir), TORCHINDUCTOR_CACHE_DIR=INDUCTOR_CACHE)
    problems = []
    started = time.monotonic()
    with open(folder / "output.log", "w") as log:
        # A session of its own: whatever it starts can be found (and stopped) by its group.
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            process.wait(timeout=CELL_TIMEOUT)
        except subprocess.TimeoutExpired:
            problems.append(f"hang: still running after {CELL_TIMEOUT} s (killed)")
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    elapsed = time.monotonic() - started
    output = (folder / "output.log").read_text(errors="replace")
    if process.returncode != 0 and not problems:
        problems.append(f"error: exit status {process.returncode}:\n{last_error(output)}")
    elif process.returncode == 0 and "Traceback" in output:
        problems.append(f"an error logged by a run that ended normally:\n{last_error(output)}")
    elif problems:  # where it hung: the stacks the cell dumped before the timeout
        stacks = output[output.rfind("Timeout (") :] if "Timeout (" in output else ""
        problems.append(f"its threads before it was killed:\n{stacks[:6000]}")
    left = group_processes(process.pid)
    if left:
        problems.append(f"processes left: {left}")
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    leaked = sorted(path.name for path in tmpdir.iterdir() if path.name != INDUCTOR_HEADERS)
    if leaked:
        problems.append(f"left in TMPDIR: {leaked}")
    print(f"{folder.parent.name}/{folder.name}: {elapsed:.0f} s, exit status {process.returncode}")
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    return result, problems


def last_error(output: str, lines: int = 12) -> str:
    """The end of the process's output, from its last traceback if it has one."""
    start = output.rfind("Traceback (most recent call last)")
    tail = output[start:] if start >= 0 else output
    return "\n".join(tail.splitlines()[-lines:])


def check_training(result: dict, k: int, first_version: int) -> list[str]:
    """The staleness bound held (and was used for k > 0), and the engine was given, in order,
    every adapter version that sampled a batch from `first_version` on."""
    problems = []
    if result["global_step"] != MAX_STEPS:
        problems.append(f"stopped at step {result['global_step']}, not {MAX_STEPS}")
    entries = [entry for entry in result["log_history"] if "async/staleness" in entry]
    staleness = [entry["async/staleness"] for entry in entries]
    if len(staleness) != MAX_STEPS or not all(0 <= s <= k for s in staleness):
        problems.append(f"staleness {staleness}: not one value in [0, {k}] per step")
    elif k > 0 and max(staleness) == 0:
        problems.append(f"staleness {staleness}: no step trained on an older batch")
    # The batch of step j (from 0; the log counts from 1) was sampled by version j - staleness;
    # versions before `first_version` sampled in the run that was resumed.
    sampled = {entry["step"] - 1 - int(entry["async/staleness"]) for entry in entries}
    needed = sorted(version for version in sampled if version >= first_version)
    published = result["published"]
    if published != sorted(published) or not set(needed) <= set(published):
        problems.append(
            f"adapter versions published {published}: out of order, or without some of the "
            f"versions {needed} that sampled the batches"
        )
    if result["overlaps"]:
        problems.append(f"the engine was used by two threads at once: {result['overlaps']}")
    return problems


def run_cell(cell, model_dir: Path, folder: Path, base_url: str | None) -> list[str]:
    """Runs one cell (its two parts when resumed) and returns its problems."""
    engine, k, rank, evaluate, resume = cell
    folder.mkdir()
    settings = dict(
        model_dir=str(model_dir),
        output_dir=str(folder / "run"),
        engine=engine,
        max_staleness=k,
        lora_r=rank,
        evaluate=evaluate,
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS if resume else 0,
        dump_stacks_after=CELL_TIMEOUT - 30,
    )
    if engine == "server":
        settings["base_url"] = base_url
    problems, stopped = [], None
    if resume:
        stopped, problems = run_part(dict(settings, phase="stop"), folder / "stop")
        problems = [f"first part, {problem}" for problem in problems]
        if stopped is not None and stopped["global_step"] != SAVE_STEPS:
            problems.append(f"the first part stopped at step {stopped['global_step']}")
    if not resume or stopped is not None:
        phase = "resume" if resume else "run"
        result, more = run_part(dict(settings, phase=phase), folder / phase)
        problems += more
        if result is not None:
            problems += check_training(result, k, first_version=SAVE_STEPS if resume else 0)
    return problems


def run_two_at_a_time(cells, run) -> dict:
    """`run(cell)` for every cell, two at a time, never two server cells together (they share
    one server; both would publish the same adapter names). A worker that is free takes the
    first cell it may start, the resumed cells (two processes each) first: no pair waits for its
    slower half, as pairs fixed in advance did. Returns `{cell: run(cell)}`; an error of the
    harness itself is the cell's problem."""
    pending = sorted(cells, key=lambda cell: not cell[AXES.index("resume")])
    results, serving = {}, []
    condition = threading.Condition()

    def next_cell():
        with condition:
            while True:
                startable = [cell for cell in pending if cell[0] != "server" or not serving]
                if startable or not pending:
                    break
                condition.wait()
            if not pending:
                return None
            pending.remove(startable[0])
            if startable[0][0] == "server":
                serving.append(startable[0])
            return startable[0]

    def worker():
        while (cell := next_cell()) is not None:
            try:
                results[cell] = run(cell)
            except Exception:  # noqa: BLE001 - the cell's test reports it
                results[cell] = [f"the harness failed:\n{traceback.format_exc()}"]
            with condition:
                if cell in serving:
                    serving.remove(cell)
                condition.notify_all()

    workers = [threading.Thread(target=worker) for _ in range(2)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return results


@pytest.fixture(scope="module")
def cell_runs(vllm_server, vllm_model_dir, tmp_path_factory):
    """The cells' problems, run two at a time (`run_two_at_a_time`): their processes wait on
    each other and on the server much of the time, so two at a time takes less wall-clock time
    on 2 cores. The server cells train on the session's server."""
    root = tmp_path_factory.mktemp("matrix")
    return run_two_at_a_time(
        CELLS, lambda cell: run_cell(cell, vllm_model_dir, root / cell_id(cell), vllm_server)
    )


@pytest.mark.parametrize("cell", CELLS, ids=[cell_id(cell) for cell in CELLS])
def test_settings_matrix_cell(cell, cell_runs):
    assert not cell_runs[cell], "\n".join(cell_runs[cell])
