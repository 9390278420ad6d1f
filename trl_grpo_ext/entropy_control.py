"""The coefficient of the entropy bonus (`entropy_coef`), static or adaptive, as TRL 1.16 has it.

The loss of a micro-batch is `L_policy - c * H`, with `H` the mean entropy of the tokens the
policy loss acts on (`objective.entropy_bonus`). With `use_adaptive_entropy` (Skywork-OR1,
https://huggingface.co/papers/2505.22312) the coefficient `c` changes once per optimizer step:
the mean entropy of the step's trained tokens over all processes, `H_step`, moves it by
`entropy_coef_delta` (up when `H_step <= entropy_target`, down otherwise) within
`[entropy_coef_min, entropy_coef_max]`, and the next step applies it only while
`H_step <= entropy_target` (else 0). Every micro-batch of a step applies the same `c`. The state
(the coefficient and the last step's entropy) is saved with each checkpoint, in TRL's file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import torch

from .objective import entropy_bonus

STATE_FILE = "entropy_ctrl_state.json"  # TRL's name, so either trainer reads the other's


class EntropyControl:
    """The entropy bonus's coefficient over a run (`args`: a `GroupRelativeConfig`)."""

    def __init__(self, args):
        self.args = args
        self.coef = args.entropy_coef
        self.adaptive = args.use_adaptive_entropy
        self.last_world_entropy = math.inf
        self._window: torch.Tensor | None = None  # (entropy sum, tokens) of this step so far

    @property
    def enabled(self) -> bool:
        """Whether the loss has an entropy term (for the whole run, as in TRL)."""
        return self.coef != 0.0 or self.adaptive

    def applied_coef(self) -> float:
        """The coefficient this optimizer step's micro-batches apply."""
        if self.adaptive and self.last_world_entropy > self.args.entropy_target:
            return 0.0
        return self.coef

    def add_bonus(
        self,
        loss: torch.Tensor,
        entropy: torch.Tensor,
        mask: torch.Tensor,
        entropy_mask: torch.Tensor | None,
        accumulation_steps: int,
        step_ends: bool,
        sum_over_processes: Callable[[torch.Tensor], torch.Tensor],
        record: bool = True,
    ) -> torch.Tensor:
        """`loss - coef * bonus / accumulation_steps`: TRL's entropy bonus, a plain mean over
        the trained tokens whatever the loss type, so scaled for gradient accumulation only;
        records the micro-batch's entropies for the adaptive coefficient (`record`; not in an
        evaluation, which TRL keeps from moving the coefficient)."""
        bonus = entropy_bonus(entropy, mask, entropy_mask)
        loss = loss - self.applied_coef() * bonus / accumulation_steps  # one coef per step
        if record:
            trained = mask if entropy_mask is None else mask * entropy_mask
            self.record(entropy, trained, step_ends, sum_over_processes)
        return loss

    def record(
        self,
        entropy: torch.Tensor,
        trained: torch.Tensor,
        step_ends: bool,
        sum_over_processes: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Adds a micro-batch's entropies `(B, T)` on its trained tokens `trained` `(B, T)`; at
        the step's last micro-batch, updates the adaptive coefficient from the step's mean."""
        if not self.adaptive:
            return
        trained = trained.to(entropy.dtype)
        stats = torch.stack([(entropy * trained).sum(), trained.sum()]).detach()  # (2,)
        self._window = stats if self._window is None else self._window + stats
        if not step_ends:
            return
        total = sum_over_processes(self._window)
        world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.coef = min(self.coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.coef = max(self.coef - args.entropy_coef_delta, args.entropy_coef_min)
        self.last_world_entropy = world_entropy
        self._window = None

    def save(self, checkpoint_dir: str) -> None:
        if self.adaptive:
            state = {"entropy_coef": self.coef, "last_world_entropy": self.last_world_entropy}
            with open(os.path.join(checkpoint_dir, STATE_FILE), "w") as handle:
                json.dump(state, handle)

    def load(self, checkpoint_dir: str) -> None:
        path = os.path.join(checkpoint_dir, STATE_FILE)
        if self.adaptive and os.path.exists(path):
            with open(path) as handle:
                state = json.load(handle)
            self.coef = state["entropy_coef"]
            self.last_world_entropy = state["last_world_entropy"]
