"""Runs TRL's own GRPO test file, `tests/test_grpo_trainer.py` of the TRL source tree at
`TRL_REPO` (a checkout or a bare clone), offline against `GroupRelativeTrainer`.

    TRL_REPO=/path/to/trl python tests/trl_suite/run.py [pytest arguments]

TRL's test file and its helpers (`__init__.py`, `conftest.py`, `testing_utils.py`,
`testing_constants.py`) are copied into `.trl-suite/trl_tests/` and run as they are, under
plugin.py (the aliased imports, the zen datasets, the expected failures of expected.py); the
stand-ins for TRL's Hub models are built once into `.trl-suite/hub` (stand_ins.py). TRL's source
distributions on PyPI hold no tests, hence the source tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FILES = [
    "__init__.py",
    "conftest.py",
    "testing_utils.py",
    "testing_constants.py",
    "test_grpo_trainer.py",
]


def trl_file(repo: Path, path: str) -> str:
    if (repo / path).is_file():
        return (repo / path).read_text()
    git_dir = repo / ".git" if (repo / ".git").exists() else repo
    shown = subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"HEAD:{path}"], capture_output=True, text=True
    )
    if shown.returncode:
        sys.exit(f"{path} not found in TRL_REPO={repo}: {shown.stderr.strip()}")
    return shown.stdout


def main(args: list[str]) -> int:
    repo = os.environ.get("TRL_REPO")
    if not repo:
        sys.exit(
            "Set TRL_REPO to a TRL source tree (a checkout or a bare clone of huggingface/trl)."
        )
    work = ROOT / ".trl-suite"
    tests = work / "trl_tests"
    tests.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        (tests / name).write_text(trl_file(Path(repo), f"tests/{name}"))
    (work / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    slow\nfilterwarnings =\n    ignore::DeprecationWarning\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_CACHE": str(work / "hub"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from stand_ins import build_hub_cache; build_hub_cache({str(work / 'hub')!r})",
        ],
        env=env,
        check=True,
    )
    command = [sys.executable, "-m", "pytest", "-p", "plugin", "-c", str(work / "pytest.ini")]
    command += [
        "--rootdir",
        str(work),
        "-p",
        "no:cacheprovider",
        str(tests / "test_grpo_trainer.py"),
    ]
    return subprocess.run(command + args, env=env, cwd=work).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
