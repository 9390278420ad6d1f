"""Checkpoints: finding the one to resume from, and the rollout state they carry.

A GRPO optimizer step trains on rollouts sampled earlier: the rest of a generation window
(`steps_per_generation > gradient_accumulation_steps`, or `num_iterations > 1`) and, with
`max_staleness`, the batches the rollout worker was asked for ahead of time. Sampled again after a
resume, with the restored (newer) weights, they would be other rollouts and the resumed run would
silently leave the uninterrupted one. So each checkpoint also holds, per process:

- `rollout_buffer.safetensors`: the tensors (`rollout_buffer_<rank>.*` with several processes);
  `micro_batch.<i>.<key>` for micro-batch `i` of the buffered generation batch (only when the
  checkpoint falls inside a window), `in_flight.<index>.<field>` for each in-flight batch;
- `rollout_buffer.json`: the rest: the keys of each micro-batch and its non-tensor values, the
  prompt tokens, seed and weights version of each in-flight batch, and the metrics gathered since
  the last log.

The guarantee: resuming from any checkpoint, with the same configuration and
`ignore_data_skip=False` (the default), trains on the same rollouts as the uninterrupted run. On
the same hardware and software (tested on CPU) the weights, optimizer state and logged metrics are
bit-identical. One exception, from `transformers.Trainer` itself: its `loss` log averages over the
steps since the last log in this process, so it matches only when checkpoints fall on logging
steps (`save_steps` a multiple of `logging_steps`); our metrics gathered since the last log are
saved, so they match in any case. The per-completion table printed with `log_completions` is not
saved (the first log after a resume inside a window prints none).

- Synchronous mode: the buffer holds the generation batch as trained on: token ids, masks,
  advantages, the sampling policy's (and reference) log-probs and the token count of each optimizer
  step; the data loader, fast-forwarded by the Trainer past `global_step * accumulation` prompt
  batches, sits on the same slot of the window (it repeats each generation batch's prompts once per
  micro-batch slot), and the next generation batch is sampled from its own seed. With
  `ignore_data_skip=True` the saved window is still finished (it is self-contained); the prompts
  after it come from the restarted epoch, as asked.
- Asynchronous mode (`max_staleness=k`): the worker handles messages in order, so which weights
  generate batch j is fixed by the schedule (those of step j - k, or later at an epoch's start),
  not by timing. Saving waits for the batches in flight (submitted, not yet trained on; at most k)
  and stores their tokens, behaviour log-probs and weights version; the resumed trainer serves
  them instead of sampling them again, and every later batch is submitted after the same weights
  as before. The prompt rows pulled ahead are not stored: the fast-forwarded loader yields them
  again. The in-flight batches' prompt tokens and seeds are stored to check that: a batch whose
  prompts differ (`ignore_data_skip=True`, another dataset) is generated again, with a warning.
- Asynchronous mode with tools or environments: the exception. A multi-turn batch in flight is
  scored with its environments (`get_reward`, `environments=`), live objects whose state the
  tool calls changed and a checkpoint cannot hold; rebuilding them would mean replaying `reset`
  and every recorded call. So such batches are not stored (only their indices, as
  `in_flight_not_kept`): the resumed run samples them again, with the restored weights, and
  warns that it differs from the uninterrupted one from there on. With `max_staleness=0` no
  batch is in flight at a checkpoint and the resume is exact; the synchronous mode's buffered
  window, already scored, is stored as usual.

A checkpoint written before these files existed still resumes: a window in progress, or batches
in flight, are sampled again with the restored weights, with a warning.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file

from .generation.async_rollout import GeneratedBatch, InFlightBatch

ROLLOUT_STATE_NAME = "rollout_buffer"
ROLLOUT_STATE_FORMAT = 1
_GENERATED_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "behaviour_logps")


def is_complete_checkpoint(path: str) -> bool:
    """A checkpoint is complete when its `trainer_state.json`, written last, parses."""
    try:
        with open(os.path.join(path, "trainer_state.json")) as handle:
            json.load(handle)
        return True
    except (OSError, ValueError):
        return False


def checkpoint_step(path: str) -> int:
    """The optimizer steps a complete checkpoint has seen (`global_step` of its trainer state)."""
    with open(os.path.join(path, "trainer_state.json")) as handle:
        return int(json.load(handle)["global_step"])


def start_metrics_log(output_dir: str, resume=None, is_main_process: bool = True) -> str:
    """The path of a recipe's `metrics.jsonl` in `output_dir`. A run resumed from the checkpoint
    `resume` (a folder) keeps the records up to it (`evaluation.keep_records_up_to`); a new run
    in a folder that holds a log keeps that log under another name (`evaluation.set_aside`).
    Nothing is deleted."""
    from .evaluation import keep_records_up_to, set_aside

    path = os.path.join(output_dir, "metrics.jsonl")
    if is_main_process and os.path.exists(path):
        kept = keep_records_up_to(path, checkpoint_step(resume)) if resume else set_aside(path)
        print(f"The earlier metrics log of {output_dir} is kept as {kept}.")
    return path


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` in `output_dir` whose writing finished, or None."""
    if not os.path.isdir(output_dir):
        return None
    candidates = []
    for name in os.listdir(output_dir):
        prefix, _, step = name.partition("-")
        if prefix == "checkpoint" and step.isdigit():
            candidates.append((int(step), os.path.join(output_dir, name)))
    for _, path in sorted(candidates, reverse=True):
        if is_complete_checkpoint(path):
            return path
        warnings.warn(
            f"Skipping {path}: its writing was interrupted (left in place).", stacklevel=3
        )
    return None


def resolve_resume(resume_from_checkpoint, output_dir: str):
    """What `Trainer.train` resumes from: `True` means the last complete checkpoint in
    `output_dir`; a checkpoint whose writing was interrupted is an error."""
    if resume_from_checkpoint is True:
        resume_from_checkpoint = last_complete_checkpoint(output_dir)
        if resume_from_checkpoint is None:
            raise ValueError(
                f"No complete checkpoint in {output_dir} to resume from; pass "
                "resume_from_checkpoint=None to start afresh."
            )
    elif isinstance(resume_from_checkpoint, str) and not is_complete_checkpoint(
        resume_from_checkpoint
    ):
        raise ValueError(
            f"{resume_from_checkpoint} is not a complete checkpoint (no readable "
            "trainer_state.json: its writing was interrupted). Resume from an earlier one."
        )
    return resume_from_checkpoint


# ----------------------------------------------------------------------------- rollout state


@dataclass
class RolloutState:
    """What the next optimizer steps train on beyond weights, optimizer and data position.

    Args:
        global_step (`int`): the optimizer steps taken when it was saved.
        micro_batches (`list[dict]`, *optional*): the buffered generation batch, one dict per
            micro-batch; None when the next step starts a new generation batch.
        in_flight (`dict[int, InFlightBatch]`): asynchronous mode: the batches submitted to the
            rollout worker and not trained on yet, by optimizer step.
        metrics (`dict[str, list[float]]`): metrics gathered since the last log.
        staleness_counts (`dict[int, int]`): the staleness histogram since the last log.
        not_kept (`list[int]`): multi-turn batches that were in flight and are not stored
            (their environments cannot be); a resumed run samples them again.
    """

    global_step: int
    micro_batches: list[dict] | None = None
    in_flight: dict[int, InFlightBatch] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    staleness_counts: dict[int, int] = field(default_factory=dict)
    not_kept: list[int] = field(default_factory=list)


def rollout_state_paths(
    checkpoint: str, process_index: int = 0, world_size: int = 1
) -> tuple[str, str]:
    """The `.safetensors` and `.json` files of one process's rollout state."""
    stem = ROLLOUT_STATE_NAME if world_size <= 1 else f"{ROLLOUT_STATE_NAME}_{process_index}"
    return os.path.join(checkpoint, f"{stem}.safetensors"), os.path.join(checkpoint, f"{stem}.json")


def _stored(tensor: torch.Tensor) -> torch.Tensor:
    # Micro-batches are views of one tensor; safetensors wants each in storage of its own.
    return tensor.detach().to("cpu", copy=True).contiguous()


def _json_value(value, where: str):
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{where} holds a {type(value).__name__}, which a checkpoint cannot store: micro-batch "
            "values must be tensors or JSON values (str, numbers, bools, None, lists, dicts)."
        ) from error
    return value


def save_rollout_state(
    output_dir: str, state: RolloutState, process_index: int = 0, world_size: int = 1
) -> None:
    """Writes `state` into the checkpoint folder: tensors as safetensors, the rest as JSON.

    Tensors keep their dtype and shape (0-d ones included). Other values of a micro-batch are
    stored as JSON, so tuples come back as lists; a value JSON cannot hold raises `TypeError`.
    """
    tensors: dict[str, torch.Tensor] = {}
    micro_batches = None
    if state.micro_batches is not None:
        micro_batches = []
        for i, batch in enumerate(state.micro_batches):
            values = {}
            for key, value in batch.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"micro_batch.{i}.{key}"] = _stored(value)
                else:
                    values[key] = _json_value(value, f"micro-batch {i}, key {key!r},")
            micro_batches.append({"keys": list(batch), "values": values})
    in_flight = []
    for index, pending in sorted(state.in_flight.items()):
        for name in _GENERATED_FIELDS:
            tensors[f"in_flight.{index}.{name}"] = _stored(getattr(pending.batch, name))
        in_flight.append(
            {
                "index": index,
                "version": pending.batch.version,
                "seed": pending.seed,
                "prompt_tokens": pending.prompt_tokens,
                "images": pending.images,
            }
        )
    manifest = {
        "format": ROLLOUT_STATE_FORMAT,
        "global_step": state.global_step,
        "micro_batches": micro_batches,
        "in_flight": in_flight,
        "in_flight_not_kept": list(state.not_kept),
        "metrics": {name: list(values) for name, values in state.metrics.items()},
        "staleness_counts": {str(k): v for k, v in state.staleness_counts.items()},
    }
    tensor_path, json_path = rollout_state_paths(output_dir, process_index, world_size)
    os.makedirs(output_dir, exist_ok=True)
    save_file(tensors, tensor_path)
    with open(json_path, "w") as handle:
        json.dump(manifest, handle, indent=1)


def load_rollout_state(
    checkpoint: str,
    device=None,
    process_index: int = 0,
    world_size: int = 1,
    needed: bool = False,
) -> RolloutState | None:
    """The rollout state saved in `checkpoint`, micro-batch tensors on `device` (in-flight batches
    stay on the CPU, where the worker returns them).

    None for a checkpoint without one (written by an older version), with a warning
    when it was `needed` (resuming inside a generation window, or with batches in flight): those
    rollouts will be regenerated, so the resumed run differs from the uninterrupted one."""
    tensor_path, json_path = rollout_state_paths(checkpoint, process_index, world_size)
    if not os.path.isfile(json_path):
        if needed:
            warnings.warn(
                f"{checkpoint} holds no rollout buffer (it was written by an older version): the "
                "rollouts of the current generation window, or those in flight, will be "
                "regenerated with the restored weights, so the resumed run will differ from the "
                "uninterrupted one.",
                stacklevel=4,
            )
        return None
    with open(json_path) as handle:
        manifest = json.load(handle)
    if manifest.get("format") != ROLLOUT_STATE_FORMAT:
        raise ValueError(
            f"{json_path} has format {manifest.get('format')!r}; this version of trl_grpo_ext "
            f"reads format {ROLLOUT_STATE_FORMAT}."
        )
    tensors = load_file(tensor_path)
    micro_batches = None
    if manifest["micro_batches"] is not None:
        micro_batches = [
            {
                key: entry["values"][key]
                if key in entry["values"]
                else tensors[f"micro_batch.{i}.{key}"].to(device)
                for key in entry["keys"]
            }
            for i, entry in enumerate(manifest["micro_batches"])
        ]
    not_kept = manifest.get("in_flight_not_kept", [])
    if not_kept:
        warnings.warn(
            f"{checkpoint} was saved with multi-turn batches in flight (steps {not_kept}), whose "
            "environments a checkpoint cannot hold: they are sampled again with the restored "
            "weights, so the resumed run differs from the uninterrupted one from there on. Set "
            "max_staleness=0 (or leave it unset) for exact resumes with tools or environments.",
            stacklevel=4,
        )
    in_flight = {}
    for entry in manifest["in_flight"]:
        index = entry["index"]
        generated = [tensors[f"in_flight.{index}.{name}"] for name in _GENERATED_FIELDS]
        in_flight[index] = InFlightBatch(
            entry["prompt_tokens"],
            entry["seed"],
            GeneratedBatch(index, entry["version"], *generated),
            entry.get("images"),
        )
    return RolloutState(
        global_step=manifest["global_step"],
        micro_batches=micro_batches,
        in_flight=in_flight,
        metrics=manifest["metrics"],
        staleness_counts={int(k): v for k, v in manifest["staleness_counts"].items()},
        not_kept=not_kept,
    )


# ------------------------------------------------------------------------ the trainer's side


def epoch_micro_step(global_step: int, args, micro_batches_per_epoch: int | None) -> int:
    """The index, within its epoch, of the first micro-batch of optimizer step `global_step`.

    An epoch of the data loader is whole generation windows; when that is not whole optimizer
    steps (`steps_per_generation` not a multiple of `gradient_accumulation_steps`), the
    Trainer's last step of each epoch is shorter, and the next epoch starts a new window.
    `micro_batches_per_epoch` is None for a stream (one endless epoch)."""
    accumulation = args.gradient_accumulation_steps
    if micro_batches_per_epoch:
        global_step %= -(-micro_batches_per_epoch // accumulation)  # the Trainer's steps/epoch
    return global_step * accumulation


def inside_window(global_step: int, args, micro_batches_per_epoch: int | None = None) -> bool:
    """Whether optimizer step `global_step` falls inside a generation window (the next step
    trains on buffered micro-batches rather than sampling a new generation batch)."""
    window = args.steps_per_generation * args.num_iterations
    return epoch_micro_step(global_step, args, micro_batches_per_epoch) % window != 0


def save_trainer_rollout_state(trainer, output_dir: str) -> None:
    """Writes a `GroupRelativeTrainer`'s rollout state (`trainer.rollout_state()`) into its
    checkpoint. Every process writes its own."""
    args = trainer.args
    save_rollout_state(output_dir, trainer.rollout_state(), args.process_index, args.world_size)


def restore_trainer_rollout_state(trainer, checkpoint: str) -> None:
    """Puts back what `save_trainer_rollout_state` saved (`trainer.load_rollout_state`). A
    checkpoint without a rollout state (an older version) leaves an empty one, with a warning
    where it was needed."""
    args = trainer.args
    step = checkpoint_step(checkpoint)
    state = load_rollout_state(
        checkpoint,
        trainer.accelerator.device,
        args.process_index,
        args.world_size,
        needed=bool(
            inside_window(step, args, trainer.micro_batches_per_epoch) or args.max_staleness
        ),
    ) or RolloutState(global_step=step)
    trainer.load_rollout_state(state)
