"""A short run with `top_entropy_quantile`, launched by tests/test_distributed.py with 2 processes.
Records, for every call of the entropy mask, this process's completion-token entropies and the
tokens it kept, so that the test can recompute the threshold from both processes' entropies.

usage: distributed_entropy_run.py OUTPUT_DIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from trainer_helpers import digit_sums, make_trainer, odd_first_byte  # noqa: E402

from trl_grpo_ext import GroupRelativeTrainer  # noqa: E402

output_dir = sys.argv[1]
rank = int(os.environ.get("RANK", 0))
calls = []


class RecordingTrainer(GroupRelativeTrainer):
    def get_high_entropy_mask(self, entropies, mask, threshold):
        kept = super().get_high_entropy_mask(entropies, mask, threshold)
        is_token = mask.bool()
        calls.append({"entropy": entropies[is_token].tolist(), "kept": kept[is_token].tolist()})
        return kept


trainer = make_trainer(
    output_dir,
    trainer_class=RecordingTrainer,
    reward_funcs=[odd_first_byte],
    dataset=digit_sums(4),
    per_device_train_batch_size=8,
    max_completion_length=6,
    top_entropy_quantile=0.3,
    max_steps=2,
)
trainer.train()
with open(os.path.join(output_dir, f"entropy-{rank}.json"), "w") as handle:
    json.dump({"quantile": trainer.args.top_entropy_quantile, "calls": calls}, handle)
