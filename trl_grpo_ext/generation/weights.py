"""How an engine with its own copy of the weights (vLLM colocated or served, the process worker)
keeps it on the trainer's: `OwnWeights`, the `Engine` methods such an engine shares, and
`WeightPublisher`, which sends a vLLM engine the trainer's adapter or weights of a version (the
process worker's is `process_worker.ParameterPublisher`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable


class OwnWeights:
    """The `engines.Engine` methods of an engine that samples from its own copy of the weights.
    `publisher` keeps that copy current (`WeightPublisher`, `ParameterPublisher`: `snapshot`,
    `load`, `version`); the factory (`engines.build_engine`) sets it."""

    own_weights = True
    publisher = None

    @property
    def version(self) -> int | None:
        """The trainer's version (global step) whose weights the engine has; None before the
        first publication."""
        return self.publisher.version

    def publish(self, version: int) -> None:
        self.publisher.publish(version)

    def publish_later(self, version: int) -> Callable[[], None]:
        weights = self.publisher.snapshot(version)
        return lambda: self.publisher.load(weights, version)

    def close_publisher(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


class WeightPublisher:
    """Publishes the trainer's weights to an engine that holds its own copy.

    `publish(version)` does both halves at once; the asynchronous worker calls `snapshot` on the
    trainer's thread (so the weights cannot change under it) and `load` on its own.

    Versions are the trainer's global step, so one version always names the same weights. Under
    LoRA each version is an adapter folder; a folder is deleted once the engine has loaded a
    later version, never before: in asynchronous mode the trainer saves versions ahead of the
    engine. The first publication of a colocated engine under LoRA also hands it the base
    weights the trainer holds in memory (`base_weights`), which may differ from the checkpoint on
    disk the engine started from (a `revision`, resized embeddings, an earlier SFT step).

    Args:
        engine: a vLLM engine (`publish_adapter(folder, version)`, `load_weights(named)`).
        model (`Callable[[], nn.Module]`): returns the unwrapped model (a `PeftModel` under LoRA).
        is_adapter (`bool`): LoRA: publish the adapter only.
        folder (`str`, *optional*): where adapter versions are saved (a temporary folder when
            None, made at the first save and removed by `close`).
    """

    def __init__(self, engine, model, is_adapter: bool, folder: str | None = None):
        self.engine, self.model, self.is_adapter = engine, model, is_adapter
        self._temporary = folder is None
        self.folder = folder
        self.version: int | None = None  # the version the engine has
        self._lock = threading.Lock()  # `_folders` is shared by the trainer and the worker
        self._folders: dict[int, str] = {}  # version -> adapter folder still on disk
        # Only a colocated engine can take full weights; a server keeps its checkpoint's.
        self._base_pending = is_adapter and getattr(engine, "takes_base_weights", False)

    def publish(self, version: int) -> None:
        """Brings the engine to `version` now, on this thread. Full weights go to the engine
        straight from the model, without a copy."""
        if version == self.version:
            return
        if self.is_adapter:
            self.load(self.snapshot(version), version)
            return
        with gathered(self.model()) as model:
            self.engine.load_weights(named_weights(model))
        self.version = version

    def snapshot(self, version: int):
        """The weights of `version`, frozen: an adapter folder, or a copy of every tensor on the
        CPU (the trainer updates its own in place while the engine waits to load them)."""
        if not self.is_adapter:
            with gathered(self.model()) as model:
                return [(name, t.detach().to("cpu", copy=True)) for name, t in named_weights(model)]
        if self._base_pending:
            # Here, on the trainer's thread: a ZeRO-3 gather is a collective every process
            # makes in the same order, and the first snapshot comes before any generation.
            with gathered(self.model()) as model:
                self.engine.load_weights(base_weights(model))
            self._base_pending = False
        with self._lock:
            if version in self._folders:  # saved already (an evaluation, then the pipeline)
                return self._folders[version]
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix="trl_grpo_ext-adapters-")
            # Removed by `close`, or else once nothing refers to the publisher any more.
            weakref.finalize(self, shutil.rmtree, self.folder, True)
        path = os.path.join(self.folder, f"v{version}")
        with gathered(self.model(), adapter_only=True) as model:
            # A PeftModel saves the adapter only. Not resized embeddings, which PEFT would add
            # and vLLM refuses in an adapter: they reach the engine with the base weights.
            model.save_pretrained(path, save_embedding_layers=False)
        with self._lock:
            self._folders[version] = path
        return path

    def load(self, weights, version: int) -> None:
        if not self.is_adapter:
            self.engine.load_weights(weights)
            self.version = version
            return
        self.engine.publish_adapter(weights, version)
        self.version = version
        with self._lock:  # versions before this one are never loaded again
            done = [v for v in self._folders if v < version]
            paths = [self._folders.pop(v) for v in done]
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        if self._temporary and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def named_weights(model):
    """`(name, tensor)` of every weight of a model, under the checkpoint's names. Under FSDP2 a
    parameter is a shard (`DTensor`): its full tensor is gathered one at a time."""
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor


def base_weights(peft_model):
    """The base model's weights of a `PeftModel`, under the checkpoint's names (no adapter
    tensors, `base_layer` names restored), as TRL hands them to vLLM."""
    prefix = f"{peft_model.prefix}" if hasattr(peft_model, "prefix") else "lora_"
    for name, tensor in named_weights(peft_model):
        if prefix in name or "original_module" in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        yield name.replace("modules_to_save.default.", ""), tensor


@contextlib.contextmanager
def gathered(model, adapter_only: bool = False):
    """`model` with its parameters whole for the block. Under DeepSpeed ZeRO-3 each process holds
    a shard of every parameter; they are gathered (the adapter only, with `adapter_only`) as TRL
    does before handing weights to vLLM. Elsewhere, the model as it is."""
    parameters = [
        p
        for p in model.parameters()
        if hasattr(p, "ds_id") and (p.requires_grad or not adapter_only)
    ]
    if not parameters:
        yield model
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(parameters):
        yield model
