"""The package's layering (DESIGN.md, "Generation"): nothing in `trl_grpo_ext/generation/`
imports the training side (trainer, checkpoints, batches, hub, objective, ...); what training
needs from generation, it asks for. The modules both sides share are `logprobs.py`, the
log-prob math, which imports neither: only `packed_attention.py`, its attention over packed
rows; and `internals.py`, the table of fast paths on libraries' private internals, which
imports nothing from the package."""

import ast
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trl_grpo_ext"
GENERATION_MAY_IMPORT = (
    "trl_grpo_ext.generation",
    "trl_grpo_ext.logprobs",
    "trl_grpo_ext.internals",
)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """The absolute names of the modules that `source` (the module `module`) imports, at any
    depth (imports inside functions too); `from X import name` counts as importing `X.name`
    when X is the package itself, as that may be a submodule."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            names.add(name)
            if node.module is None:  # from . import x, from .. import x
                names.update(f"{name}.{alias.name}" for alias in node.names)
    return names


def outside(names: set[str], allowed: tuple[str, ...]) -> set[str]:
    """The package's modules among `names` that are not under one of `allowed`."""
    ours = {n for n in names if n == "trl_grpo_ext" or n.startswith("trl_grpo_ext.")}
    return {n for n in ours if not any(n == a or n.startswith(a + ".") for a in allowed)}


def module_files(folder: Path):
    for path in sorted(folder.glob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = path.name == "__init__.py"
        module = ".".join(parts[:-1] if is_package else parts)
        yield path, module, is_package


@pytest.mark.parametrize(
    "path, module, is_package",
    list(module_files(PACKAGE / "generation")),
    ids=lambda value: value.name if isinstance(value, Path) else None,
)
def test_generation_imports_nothing_from_the_training_side(path, module, is_package):
    names = imported_modules(path.read_text(encoding="utf-8"), module, is_package)
    assert not outside(names, GENERATION_MAY_IMPORT), (
        f"{path.relative_to(PACKAGE.parent)} imports {sorted(outside(names, GENERATION_MAY_IMPORT))}"
        ": generation must not depend on training-side modules; move what it needs into "
        "generation/ (or pass it in), and let the training side import it from there."
    )


def test_logprobs_imports_nothing_from_the_package_but_its_attention_and_internals():
    names = imported_modules((PACKAGE / "logprobs.py").read_text(), "trl_grpo_ext.logprobs")
    assert not outside(names, ("trl_grpo_ext.packed_attention",))
    source = (PACKAGE / "packed_attention.py").read_text()
    names = imported_modules(source, "trl_grpo_ext.packed_attention")
    assert not outside(names, ("trl_grpo_ext.internals",))
    source = (PACKAGE / "internals.py").read_text()
    assert not outside(imported_modules(source, "trl_grpo_ext.internals"), ())


@pytest.mark.parametrize(
    "line, found",
    [
        ("from ..checkpoints import ResumableWorker", "trl_grpo_ext.checkpoints"),
        ("from .. import trainer", "trl_grpo_ext.trainer"),
        ("from .. import GroupRelativeTrainer", "trl_grpo_ext"),  # its __init__ imports the trainer
        ("import trl_grpo_ext.batches", "trl_grpo_ext.batches"),
        ("def f():\n    from ..objective import policy_loss", "trl_grpo_ext.objective"),
    ],
)
def test_the_walk_finds_training_side_imports(line, found):
    names = imported_modules(line, "trl_grpo_ext.generation.engines")
    assert found in outside(names, GENERATION_MAY_IMPORT)


def test_the_walk_allows_generation_and_logprobs():
    source = "from .rollout import Rollout\nfrom ..logprobs import float32_head\nimport torch"
    names = imported_modules(source, "trl_grpo_ext.generation.engines")
    assert names == {"trl_grpo_ext.generation.rollout", "trl_grpo_ext.logprobs", "torch"}
    assert not outside(names, GENERATION_MAY_IMPORT)


def private_attributes_used(source: str, owners: tuple[str, ...]) -> set[str]:
    """`owner._name` and `owner.attribute._name` attributes read or written in `source`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in owners:
                found.add(f"{base.id}.{node.attr}")
    return found


def test_checkpoints_use_the_public_methods_of_trainer_and_producer():
    """Rollout state goes in and out of a checkpoint through `trainer.rollout_state()` and
    `load_rollout_state` (and the producer's `state`/`load_state`), never private fields."""
    source = (PACKAGE / "checkpoints.py").read_text()
    assert private_attributes_used(source, ("trainer",)) == set()
    # the walk does find such uses
    assert private_attributes_used("trainer.rollouts._restored = 1", ("trainer",)) == {
        "trainer._restored"
    }


# A function longer than this reads as several steps: split it at those steps, or make its cases
# a table (STYLE.md: a table of functions reads better than a chain of branches). Counted from
# the `def` line to the last line, docstring included.
MAX_FUNCTION_LINES = 100
# Functions allowed past it for now, as "path/to/module.py:Class.function", each with the reason.
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """`{"Class.function": lines}` of the functions and methods in `source`, at any depth,
    longer than `limit` lines."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    if lines > limit:
                        found[name] = lines
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_function_of_the_package_is_longer_than_the_limit():
    too_long = {
        f"{path.relative_to(PACKAGE.parent)}:{name}": lines
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in long_functions(path.read_text(encoding="utf-8")).items()
    }
    unexpected = {
        name: lines for name, lines in too_long.items() if name not in LONG_FUNCTIONS_ALLOWED
    }
    assert not unexpected, (
        f"functions over {MAX_FUNCTION_LINES} lines: {unexpected}; split them at their natural "
        "steps (or make a table of their cases)."
    )
    stale = sorted(set(LONG_FUNCTIONS_ALLOWED) - set(too_long))
    assert not stale, f"no longer over the limit: take {stale} off LONG_FUNCTIONS_ALLOWED."


def function_of(name: str, lines: int, indent: str = "") -> str:
    """The source of a function of `lines` lines, its `def` line included."""
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    return textwrap.indent(f"def {name}():\n{body}", indent)


def test_the_walk_measures_functions_and_methods_at_any_depth():
    source = (
        function_of("fits", MAX_FUNCTION_LINES)
        + "class Loop:\n"
        + function_of("run", MAX_FUNCTION_LINES + 1, "    ")
        + "async def outer():\n"
        + function_of("inner", MAX_FUNCTION_LINES + 1, "    ")
        + "    return 2\n"
    )
    assert long_functions(source) == {
        "Loop.run": MAX_FUNCTION_LINES + 1,
        "outer": MAX_FUNCTION_LINES + 3,
        "outer.inner": MAX_FUNCTION_LINES + 1,
    }
