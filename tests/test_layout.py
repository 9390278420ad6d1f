"""The package's layering (DESIGN.md, "Generation"): nothing in `trl_grpo_ext/generation/`
imports the training side (trainer, checkpoints, batches, hub, objective, ...); what training
needs from generation, it asks for. The modules both sides share are `logprobs.py`, the
log-prob math, which imports neither: only `packed_attention.py`, its attention over packed
rows; and `internals.py`, the table of fast paths on libraries' private internals, which
imports nothing from the package."""

import ast
import dataclasses
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


def test_the_evaluation_harness_imports_nothing_from_training():
    """`evaluation.py` evaluates any model: it may sample with a trainer it is given (through
    the trainer's public `generate_rollouts`), but imports none of the training modules."""
    names = imported_modules((PACKAGE / "evaluation.py").read_text(), "trl_grpo_ext.evaluation")
    training = ("trl_grpo_ext.trainer", "trl_grpo_ext.checkpoints", "trl_grpo_ext.models")
    assert not {n for n in names if n in training or n == "trl_grpo_ext"}
    # the walk finds such an import inside a function too
    found = imported_modules("def f():\n    from .checkpoints import x", "trl_grpo_ext.evaluation")
    assert "trl_grpo_ext.checkpoints" in found


def config_fields() -> set[str]:
    from trl_grpo_ext import GroupRelativeConfig

    return {f.name for f in dataclasses.fields(GroupRelativeConfig)}


def config_reads(source: str, fields: set[str]) -> list[str]:
    """The reads of a configuration field (`args.x`, `config.x`, `self.args.x`,
    `getattr(args, "x")`) in `source` outside the record builders (`from_config`)."""
    found = []

    def visit(node, in_builder=False):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_builder = in_builder or node.name == "from_config"
        if not in_builder:
            owner = name = None
            if isinstance(node, ast.Attribute):
                owner, name = node.value, node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
            ):
                owner, name = node.args[0], node.args[1].value
            if isinstance(owner, ast.Attribute) and owner.attr == "args":
                owner = ast.Name(id="args")
            if isinstance(owner, ast.Name) and owner.id in ("args", "config") and name in fields:
                found.append(f"line {node.lineno}: {owner.id}.{name}")
        for child in ast.iter_child_nodes(node):
            visit(child, in_builder)

    visit(ast.parse(source))
    return found


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "generation").glob("*.py")), ids=lambda path: path.name
)
def test_generation_reads_the_config_only_in_its_record_builders(path):
    """Settings travel as typed records built once (`generation/settings.py`): a module that
    read `args.x` itself would fail wherever a producer has no config (the evaluation harness
    on a bare model)."""
    source = path.read_text(encoding="utf-8")
    assert not config_reads(source, config_fields())
    assert "SimpleNamespace" not in source


def test_the_config_walk_finds_reads_outside_the_builders():
    fields = {"max_staleness", "use_vllm", "seed"}
    source = (
        "def f(args, config, self):\n"
        "    args.max_staleness, self.args.seed, getattr(config, 'use_vllm')\n"
        "    config.hidden_size, generation_config.seed\n"
        "class Settings:\n"
        "    def from_config(cls, args):\n"
        "        return args.seed\n"
    )
    assert config_reads(source, fields) == [
        "line 2: args.max_staleness",
        "line 2: args.seed",
        "line 2: config.use_vllm",
    ]


def test_images_code_never_calls_back_into_the_producer():
    """The producer asks `images.py` once for a batch's fields and their per-sample split
    (`images.encode_with_images`); images code imports none of the modules that sample."""
    names = imported_modules(
        (PACKAGE / "generation" / "images.py").read_text(), "trl_grpo_ext.generation.images"
    )
    callers = ("producer", "requests", "ahead", "engines", "multi_turn", "assembly")
    assert not {n for n in names if n.rpartition(".")[2] in callers}
