"""The fast paths that use a library's private internals: which, tested on what, and whether each
runs in this process.

Six paths reach into transformers, PEFT or torch below their public APIs (`FAST_PATHS`): five
speed-ups, and the end of persistent data loader workers with `train()`. Each states the
releases of its library it is tested on; outside them, or where the internals it needs are
missing, it does not run: the public way runs instead, and the reason is logged once per process
(a warning naming the path, the installed release and the tested range). `usable` is the one
place that decides; `RAN` records, for each path asked about, True where it ran and the reason
where it did not, for tests and bug reports.

To run a path on another release, run its tests there (`tests/test_internals.py` and the tests
each entry names) and widen `tested`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from collections.abc import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FastPath:
    """One fast path on a library's private internals.

    Args:
        library (`str`): the distribution whose internals it uses.
        tested (`str`): the releases it is tested on, a PEP 440 specifier.
        internals (`str`): what it uses below the library's public API.
        fallback (`str`): what runs instead outside `tested`.
        probe (`Callable[[], str | None]`, *optional*): within `tested`, what of those internals
            is missing (None when nothing is).
    """

    library: str
    tested: str
    internals: str
    fallback: str
    probe: Callable[[], str | None] | None = None


def _generate_internals() -> str | None:
    from transformers.generation import GenerateDecoderOnlyOutput, GenerationMixin

    if "cache" not in {field.name for field in dataclasses.fields(GenerateDecoderOnlyOutput)}:
        return "GenerateDecoderOnlyOutput has no `cache` field"
    for name in (
        "_prefill",
        "_update_model_kwargs_for_generation",
        "_optimize_model_for_decode",
        "_valid_auto_compile_criteria",
    ):
        if not hasattr(GenerationMixin, name):
            return f"GenerationMixin has no `{name}`"
    return None


def _onednn_ops() -> str | None:
    import torch

    if not torch.backends.mkldnn.is_available():
        return "this build of torch has no oneDNN"
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(torch.ops.mkldnn, name):
            return f"torch.ops.mkldnn has no `{name}`"
    return None


def _output_capture_registry() -> str | None:
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY  # noqa: F401
    except ImportError:
        return "transformers.utils.output_capturing has no `_CAN_RECORD_REGISTRY`"
    return None


def _dataloader_iterator() -> str | None:
    from torch.utils.data import DataLoader

    if "_iterator" not in vars(DataLoader([0])):
        return "torch.utils.data.DataLoader has no `_iterator`"
    return None


FAST_PATHS: dict[str, FastPath] = {
    "sampling_loop": FastPath(
        library="transformers",
        tested=">=5.24,<5.26",
        internals=(
            "a copy of GenerationMixin._sample calling _prefill, "
            "_update_model_kwargs_for_generation, _optimize_model_for_decode and "
            "_valid_auto_compile_criteria; GenerationConfig._pad_token_tensor; DynamicLayer's "
            "fields (kv_room); logits processors and stopping criteria matched by class name"
        ),
        fallback=(
            "`generate` itself: every row runs to the batch's end, the KV cache grows by "
            "concatenation, tokens drawn by torch.multinomial"
        ),
        probe=_generate_internals,
    ),
    "packed_weights": FastPath(
        library="torch",
        tested=">=2.13,<2.14",
        internals="torch.ops.mkldnn._reorder_linear_weight and torch.ops.mkldnn._linear_pointwise",
        fallback="F.linear (MKL) in every decoding step",
        probe=_onednn_ops,
    ),
    "attention_by_blocks": FastPath(
        library="transformers",
        tested=">=5.19,<5.26",
        internals=(
            "the model config's _attn_implementation, set to an attention function of ours "
            "while a packed row's mask lives"
        ),
        fallback="a packed row's attention under one whole-row mask (transformers' SDPA)",
    ),
    "merged_lora": FastPath(
        library="peft",
        tested=">=0.18,<0.22",
        internals=(
            "LoraLayer.merged_adapters set around a merge of our own, so that the layer's "
            "forward calls the base layer alone"
        ),
        fallback="sampling with the LoRA adapters unmerged",
    ),
    "worker_output_capture": FastPath(
        library="transformers",
        tested=">=5.19,<5.26",
        internals="transformers.utils.output_capturing._CAN_RECORD_REGISTRY, written directly",
        fallback=(
            "nothing registered in a spawned rollout worker: a vision-language model there may "
            "find no hidden states for its image features"
        ),
        probe=_output_capture_registry,
    ),
    "persistent_workers_end": FastPath(
        library="torch",
        tested=">=2.13,<2.14",
        internals=(
            "DataLoader._iterator, dropped at the end of train() so that its persistent workers end"
        ),
        fallback="the persistent workers end when the trainer is freed, as in transformers' Trainer",
        probe=_dataloader_iterator,
    ),
}

# path -> True where it ran in this process, the reason where it did not (the last decision)
RAN: dict[str, bool | str] = {}
# path -> None where it can run, else why not; decided once per process
_REASONS: dict[str, str | None] = {}
_LOGGED: set[str] = set()  # the paths whose fallback has been logged in this process


def installed_version(library: str) -> str | None:
    """The installed release of `library`, None where it is not installed."""
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None


def in_tested_range(name: str, version: str | None = None) -> bool:
    """Whether `version` (by default the installed one) of path `name`'s library is one it is
    tested on. A local or pre-release build counts as its release (2.13.0+cpu, 2.13.0a0 as
    2.13.0)."""
    path = FAST_PATHS[name]
    version = installed_version(path.library) if version is None else version
    if version is None:
        return False
    return Version(Version(version).base_version) in SpecifierSet(path.tested)


def why_off(name: str) -> str | None:
    """Why fast path `name` cannot run in this process, None when it can."""
    if name not in _REASONS:
        path = FAST_PATHS[name]
        version = installed_version(path.library)
        missing = path.probe() if path.probe is not None else None
        if not in_tested_range(name, version):
            _REASONS[name] = (
                f"{path.library} {version} is installed, and it is tested on "
                f"{path.library}{path.tested}"
            )
        elif missing is not None:
            _REASONS[name] = f"{missing} ({path.library} {version})"
        else:
            _REASONS[name] = None
    return _REASONS[name]


def usable(name: str) -> bool:
    """Whether fast path `name` runs: its library's installed release is in its tested range and
    the internals it uses are there. Records the answer in `RAN`; where it is no, logs why once
    per process."""
    reason = why_off(name)
    if reason is None:
        RAN[name] = True
        return True
    fell_back(name, reason)
    return False


def fell_back(name: str, reason: str) -> None:
    """Records that fast path `name` did not run, and why, in `RAN`; logs it the first time in
    this process."""
    RAN[name] = reason
    if name not in _LOGGED:
        _LOGGED.add(name)
        path = FAST_PATHS[name]
        logger.warning(
            "Fast path %r is off: %s (it uses %s). Running %s instead.",
            name,
            reason,
            path.internals,
            path.fallback,
        )
