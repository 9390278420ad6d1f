"""The trainer's side of checkpoints: resuming from the last complete checkpoint, and the
rollout state (the buffered generation batch, the metrics not logged yet, the batches in flight,
the adaptive entropy coefficient) written beside each checkpoint and put back on resume, through
`checkpoints.py`'s functions and the trainer's public `rollout_state`/`load_rollout_state`."""

from __future__ import annotations

from .checkpoints import (
    RolloutState,
    inside_window,
    resolve_resume,
    restore_trainer_rollout_state,
    save_trainer_rollout_state,
)


class RolloutCheckpointsMixin:
    """`train`, `rollout_state`, `load_rollout_state` and `_save_rng_state` of
    `GroupRelativeTrainer`, over its `_buffer`, `_metrics`, `rollouts`, `entropy_control` and
    `_train_loader`."""

    def train(self, resume_from_checkpoint=None, **kwargs):
        """As `Trainer.train`; `resume_from_checkpoint=True` skips incomplete checkpoints (one
        whose writing was interrupted) and resumes from the last complete one."""
        resume_from_checkpoint = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        if resume_from_checkpoint is not None:
            restore_trainer_rollout_state(self, resume_from_checkpoint)
            self.entropy_control.load(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            self.rollouts.close()
            loader = getattr(self, "_train_loader", None)
            if loader is not None:  # persistent data loader workers
                loader.end_workers()

    def rollout_state(self) -> RolloutState:
        """What the next optimizer steps train on beyond weights, optimizer and data position:
        the buffered generation batch (inside a window), the metrics not logged yet, and the
        producer's `state()` (batches in flight). Each checkpoint holds it (`checkpoints.py`)."""
        step = self.state.global_step
        buffered = (
            self._buffer if inside_window(step, self.args, self.micro_batches_per_epoch) else None
        )
        metrics = dict(self._metrics)
        return RolloutState(step, buffered, metrics=metrics, **self.rollouts.state())

    def load_rollout_state(self, state: RolloutState) -> None:
        """Puts back a `rollout_state()`, before `train` resumes from its checkpoint."""
        self._buffer = state.micro_batches
        self._metrics.clear()
        self._metrics.update(state.metrics)
        self.rollouts.load_state(state.in_flight, state.staleness_counts)

    def _save_rng_state(self, output_dir: str) -> None:
        """Also writes the rollout state (`checkpoints.save_trainer_rollout_state`): here every
        process writes its own, before `trainer_state.json` marks the checkpoint complete."""
        super()._save_rng_state(output_dir)
        save_trainer_rollout_state(self, output_dir)
        if self.args.should_save:
            self.entropy_control.save(output_dir)
