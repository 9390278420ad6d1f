"""A short training run, launched by tests/test_distributed.py with 1 or 2 processes.

usage: distributed_run.py OUTPUT_DIR PER_DEVICE_BATCH [stream] [dynamic]

With `stream`, the prompts come as a streaming dataset (`datasets.IterableDataset`). With
`dynamic`, dynamic sampling keeps the groups whose rewards differ, and only the groups of
prompts with an even answer can: the others are dropped and more prompts drawn.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from trainer_helpers import digit_sums, make_trainer, odd_first_byte  # noqa: E402

output_dir, per_device = sys.argv[1], int(sys.argv[2])
stream, dynamic = "stream" in sys.argv[3:], "dynamic" in sys.argv[3:]
rank = int(os.environ.get("RANK", 0))


def prompt_value(prompts, completions, answer, trainer_state, **kwargs):
    """The reward of a prompt's answer, the same on any process; records who scored what."""
    with open(os.path.join(output_dir, f"calls-{rank}.jsonl"), "a") as handle:
        handle.write(json.dumps({"step": trainer_state.global_step, "prompts": prompts}) + "\n")
    return [float(value) for value in answer]


def logs_by_rank(completions, log_metric, log_extra, **kwargs):
    """Logs a metric of each process's own name, one of all, and a column on rank 0 only (TRL's
    `log_metric` and `log_extra`); scores 0, which changes no advantage."""
    log_metric(f"rank/{rank}", float(rank + 1))
    log_metric("rank/all", float(rank))
    if rank == 0:
        log_extra("rank_0_only", ["x"] * len(completions))
    return [0.0] * len(completions)


def odd_first_byte_if_even_answer(completions, answer, **kwargs):
    """`odd_first_byte` for the prompts whose answer is even, 0 for the others."""
    values = odd_first_byte(completions)
    return [value if int(a) % 2 == 0 else 0.0 for value, a in zip(values, answer)]


trainer = make_trainer(
    output_dir,
    reward_funcs=[
        prompt_value,
        odd_first_byte_if_even_answer if dynamic else odd_first_byte,
        logs_by_rank,
    ],
    dynamic_sampling=dynamic,
    dataset=digit_sums(4).to_iterable_dataset() if stream else digit_sums(4),
    per_device_train_batch_size=per_device,
    max_steps=3,
    log_completions=True,
    num_completions_to_print=0,
)
trainer.train()
weights = sum(
    p.detach().double().sum().item() for p in trainer.model.parameters() if p.requires_grad
)
with open(os.path.join(output_dir, f"result-{rank}.json"), "w") as handle:
    table = trainer._last_rollout_table
    json.dump({"log": trainer.state.log_history, "weights": weights, "table": table}, handle)
