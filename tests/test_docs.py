"""The documentation's code runs: every example file, every inline Python block, the figure script.

The examples under `docs/examples/` are included into the pages with pymdownx.snippets, so what
a reader copies is what runs here, against the tiny offline model. `make docs` (mkdocs --strict)
checks links and references; these tests need no docs tooling.
"""

import importlib.util
import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import trl
import yaml
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"
# Modules the examples import; not included into a page themselves.
HELPER_MODULES = {"toy_task.py"}

FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SNIPPET = re.compile(r'^-{1,}8<-{1,}\s+"([^"]+)"\s*$', re.MULTILINE)


def example_files():
    return sorted(p for p in EXAMPLES.glob("*.py") if p.name not in HELPER_MODULES)


def pages():
    return sorted(DOCS.glob("*.md"))


def python_blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text(encoding="utf-8"))


def snippet_references() -> list[tuple[Path, str]]:
    return [
        (page, reference)
        for page in pages()
        for block in python_blocks(page)
        for reference in SNIPPET.findall(block)
    ]


# Examples with tools, which need trl>=1.16 (`generation.multi_turn.MIN_TRL`).
NEEDS_TRL_1_16 = {"agents.py", "tool_format.py"}


@pytest.mark.parametrize("example", example_files(), ids=lambda p: p.name)
def test_example_runs(example, tmp_path, monkeypatch):
    """Each example runs as a script (its own asserts check its numbers), outputs in tmp."""
    if example.name in NEEDS_TRL_1_16 and Version(trl.__version__) < Version("1.16"):
        pytest.skip(f"tools need trl>=1.16, found {trl.__version__}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    runpy.run_path(str(example), run_name="__main__")


def test_inline_python_blocks_compile():
    """Fenced Python blocks written in the pages (not included from a file) are valid Python."""
    checked = 0
    for page in pages():
        for index, block in enumerate(python_blocks(page)):
            if SNIPPET.search(block):
                continue  # included from docs/examples, run by test_example_runs
            compile(block, f"{page.name}, python block {index + 1}", "exec")
            checked += 1
    assert checked > 0, "no page has an inline Python block: the pattern or the pages changed"


# Any line that opens a Python code block, however it is written (indented in a list, `~~~`,
# `py`), so that a block the pattern of `python_blocks` misses is an error, not a block that no
# test compiles or runs.
ANY_PYTHON_FENCE = re.compile(r"^[ \t]*(?:```|~~~)[ \t]*\{?\.?(?:python3?|py|pycon)\b", re.M | re.I)


def test_every_python_block_of_the_pages_is_checked():
    """Each Python block of each page is found, and then compiled (inline blocks) or run (the
    examples it includes): no block is left out because of how its fence is written."""
    for page in pages():
        text = page.read_text(encoding="utf-8")
        found, written = len(python_blocks(page)), len(ANY_PYTHON_FENCE.findall(text))
        assert found == written, (
            f"{page.name} has {written} Python blocks, of which {found} are checked: open each "
            "one with ```python at the start of a line (not indented, not ~~~ or ```py)."
        )


@pytest.mark.parametrize(
    "block",
    ["   ```python\nx = 1\n   ```\n", "~~~python\nx = 1\n~~~\n", "```py\nx = 1\n```\n"],
)
def test_a_python_block_the_pattern_misses_is_seen(block):
    assert len(FENCE.findall(block)) == 0 and len(ANY_PYTHON_FENCE.findall(block)) == 1


def test_snippets_point_at_existing_sections():
    references = snippet_references()
    assert references, "no page includes an example; the pattern or the pages changed"
    for page, reference in references:
        name, _, section = reference.partition(":")
        path = EXAMPLES / name
        assert path.is_file(), f"{page.name} includes {name}, which is not in docs/examples"
        if section:
            text = path.read_text(encoding="utf-8")
            for kind in ("start", "end"):
                assert f"--8<-- [{kind}:{section}]" in text, (
                    f"{page.name} includes section {section!r} of {name}, which has no "
                    f"[{kind}:{section}] marker"
                )


API_REFERENCE = re.compile(r"\]\[(trl_grpo_ext(?:\.\w+)*)\]|^::: (trl_grpo_ext(?:\.\w+)*)", re.M)


def resolve(dotted: str):
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            target = getattr(target, name)
        return target
    raise ModuleNotFoundError(dotted)


def test_api_references_name_existing_objects():
    """A cross-reference `[name][trl_grpo_ext.module.object]` or an API entry
    `::: trl_grpo_ext.module.object` still names something after code has moved."""
    references = {
        (page.name, first or second)
        for page in pages()
        for first, second in API_REFERENCE.findall(page.read_text(encoding="utf-8"))
    }
    assert len(references) > 20, "the pattern or the pages changed"
    broken = []
    for page, dotted in sorted(references):
        try:
            resolve(dotted)
        except (ImportError, AttributeError):
            broken.append(f"{page}: {dotted}")
    assert not broken, f"references to objects that do not exist: {broken}"


def test_every_example_is_included_in_a_page():
    included = {reference.partition(":")[0] for _, reference in snippet_references()}
    orphans = [p.name for p in example_files() if p.name not in included]
    assert not orphans, f"examples no page shows (include them or delete them): {orphans}"


def test_nav_lists_existing_pages():
    class Loader(yaml.SafeLoader):
        """Reads MkDocs' own tags (`!relative`) as plain strings."""

    Loader.add_multi_constructor("!", lambda loader, suffix, node: loader.construct_scalar(node))
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)
    listed = [next(iter(entry.values())) for entry in config["nav"]]
    missing = [page for page in listed if not (DOCS / page).is_file()]
    assert not missing, f"mkdocs.yml lists pages that do not exist: {missing}"
    unlisted = sorted({p.name for p in pages()} - set(listed))
    assert not unlisted, f"pages missing from the nav in mkdocs.yml: {unlisted}"


@pytest.fixture()
def figures(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("docs_figures", DOCS / "figures.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "docs_figures", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "IMG", tmp_path / "img")  # never overwrite docs/img in a test
    return module


def test_figures_from_functions_are_drawn(figures, tmp_path):
    assert figures.main(["group_advantages", "clipped_surrogate"]) == 0
    for name in ("group_advantages", "clipped_surrogate"):
        assert (tmp_path / "img" / f"{name}.png").stat().st_size > 10_000


def test_figures_skip_missing_inputs(figures, tmp_path, capsys):
    missing = str(tmp_path / "nothing-here")
    assert figures.main(["heldout_accuracy", "--default-run", missing]) == 0
    assert "skipped heldout_accuracy" in capsys.readouterr().out
    assert not (tmp_path / "img").exists()


def test_heldout_figure_reads_the_recipe_metrics(figures, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"step": 0, "heldout/accuracy": 0.25, "heldout/accuracy_strict": 0.2},
        {"step": 1, "reward": 0.1, "rewards/math_accuracy/mean": 0.1},
        {"step": 2, "reward": 0.4, "heldout/accuracy": 0.5, "heldout/accuracy_strict": 0.45},
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert figures.main(["heldout_accuracy", "--default-run", str(run)]) == 0
    assert (tmp_path / "img" / "heldout_accuracy.png").is_file()


def test_figures_reject_unknown_names(figures):
    with pytest.raises(SystemExit):
        figures.main(["no_such_figure"])


def test_config_table_lists_every_own_field():
    """The API page's table of GroupRelativeConfig fields is generated by docs/hooks.py."""
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.MARKER in (DOCS / "api.md").read_text(encoding="utf-8")
    table = hooks.on_page_markdown(hooks.MARKER, page=None, config=None, files=None)
    for name in ("num_generations", "loss_type", "beta", "scale_rewards", "epsilon_high"):
        assert f"| `{name}` |" in table
    assert "| `output_dir` |" not in table  # inherited fields stay in transformers' docs
