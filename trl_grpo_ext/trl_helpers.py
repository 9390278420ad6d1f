"""TRL's public helpers of `GRPOTrainer` that subclasses call or override, with TRL's names
and signatures: `reward_func_names`, `entropy_coef`, `get_high_entropy_mask` and the static
`get_off_policy_mask`, and `get_eval_dataloader` without workers for a streamed set.
`GroupRelativeTrainer`'s loss calls the two masks through these methods,
so a subclass's override changes the loss, as in TRL."""

from __future__ import annotations

import datasets
import torch

from .metrics import pooled_entropies
from .objective import entropy_quantile_mask, off_policy_mask
from .preparation import eval_set_by_name


class TrlHelpersMixin:
    """The helpers, over the trainer's `reward_names` and `accelerator`."""

    @property
    def reward_func_names(self) -> list[str]:
        """The reward functions' names, in order, as TRL's `GRPOTrainer.reward_func_names`
        (those of the metrics `rewards/<name>/mean`)."""
        return self.reward_names

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's current coefficient, as TRL's `GRPOTrainer.entropy_coef`: the
        configured `entropy_coef`, or where `use_adaptive_entropy` has moved it to."""
        return self.entropy_control.coef

    def get_high_entropy_mask(
        self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float
    ) -> torch.Tensor:
        """TRL's `get_high_entropy_mask`: the tokens of `mask` `(B, T)` whose entropy is at
        least the `threshold`-quantile of the completion tokens' entropies on all processes
        (`1 - top_entropy_quantile` in training); `(B, T)` bool. A subclass may override it."""
        pooled = pooled_entropies(self.accelerator, entropies, mask)
        return entropy_quantile_mask(entropies, mask, threshold, pooled_entropy=pooled)

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's `get_off_policy_mask` (DeepSeek-V3.2's off-policy sequence mask,
        `objective.off_policy_mask`): `(B, 1)`, 1.0 to keep a sequence, 0.0 to drop it. The
        loss calls it when `off_policy_mask_threshold` is set; a subclass may override it."""
        return off_policy_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )

    def get_eval_dataloader(self, eval_dataset=None):
        """transformers' evaluation loader (evaluate() reads the rows itself), with TRL's rule:
        a streamed set is read without workers, which would each read the stream; the
        `dataloader_num_workers` of `args` stays as given."""
        chosen = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(chosen, str):
            chosen = eval_set_by_name(self.eval_dataset, chosen)
        if not isinstance(chosen, datasets.IterableDataset):
            return super().get_eval_dataloader(eval_dataset)
        workers, self.args.dataloader_num_workers = self.args.dataloader_num_workers, 0
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.args.dataloader_num_workers = workers
