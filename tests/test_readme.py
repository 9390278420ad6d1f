"""The README's Python example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "the README has a Python example"
    assert len(blocks[0].splitlines()) <= 20  # short enough to read at a glance
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__"}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 3
    assert (tmp_path / "runs" / "tiny-model" / "config.json").exists()
