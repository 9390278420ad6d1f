"""A TRL 1.16 agent script switches by changing the import: one script that mixes `tools=`, an
environment with state, a reward reading `environments` and an extra dataset column, run by
`trl.GRPOTrainer` and by `GroupRelativeTrainer` with the same settings (our defaults otherwise:
no `max_prompt_length` override) on the same scripted turns, gives the same prompt ids,
completion ids, tool masks and reward keyword arguments."""

from __future__ import annotations

import pytest
from agent_helpers import (
    ScriptedEngine,
    add,
    call,
    encode,
    needs_trl_1_16,
    qwen3_tokenizer,
    script_trl,
)
from datasets import Dataset
from trl_reference import matches_trl

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.tiny import save_tiny

pytestmark = [needs_trl_1_16, matches_trl]


class Counter:
    """An environment with state: a counter to bring to the row's target."""

    def __init__(self):
        self.value, self.target = 0, None

    def reset(self, target: int, **row) -> str:
        self.value, self.target = 0, target
        return f" Reach {target}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.value += step
        return self.value


FIRST = call("add", a=2, b=3) + "\n" + call("increment", step=2)


def turn(context: str) -> str:
    return "Done." if "<tool_response>" in context else FIRST


def dataset() -> Dataset:
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "Count."}], "target": t} for t in (2, 3)]
    )


SHARED = dict(
    use_cpu=True,
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=512,
    max_steps=1,
    logging_steps=1,
    seed=0,
)


def reached(seen: list):
    def reached_target(completions, environments, target, **kwargs):
        seen.append(
            {
                "completions": completions,
                "target": target,
                "values": [environment.value for environment in environments],
                "keys": sorted(kwargs),
                "prompts": kwargs["prompts"],
                "completion_ids": kwargs["completion_ids"],
            }
        )
        return [float(e.value == t) for e, t in zip(environments, target)]

    return reached_target


def rows_of(prompt_ids, prompt_mask, completion_ids, completion_mask, tool_mask):
    """Per completion: its prompt's ids, its ids and its tool mask, without padding."""
    rows = []
    for p, pm, c, cm, t in zip(prompt_ids, prompt_mask, completion_ids, completion_mask, tool_mask):
        keep = cm.bool()
        rows.append((p[pm.bool()].tolist(), c[keep].tolist(), t[keep].tolist()))
    return rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)
    qwen3_tokenizer().save_pretrained(path)
    return path


def run_ours(model_dir, tmp_path):
    seen, rollouts = [], []
    args = GroupRelativeConfig(output_dir=str(tmp_path), **SHARED)
    trainer = GroupRelativeTrainer(
        model=model_dir,
        reward_funcs=reached(seen),
        args=args,
        train_dataset=dataset(),
        tools=[add],
        environment_factory=Counter,
    )
    tokenizer = trainer.processing_class
    trainer.rollouts.engine = ScriptedEngine(
        lambda ids: encode(tokenizer, turn(tokenizer.decode(ids)))
    )
    generate = trainer.generate_rollouts

    def recording(rows):
        rollout = generate(rows)
        rollouts.append(rollout)
        return rollout

    trainer.generate_rollouts = recording
    trainer.train()
    (r,) = rollouts
    return seen, rows_of(
        r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.tool_mask
    )


def run_trl(model_dir, tmp_path, monkeypatch):
    import trl

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    seen, outputs = [], []
    args = trl.GRPOConfig(output_dir=str(tmp_path), bf16=False, **SHARED)
    trainer = trl.GRPOTrainer(
        model=model_dir,
        reward_funcs=reached(seen),
        args=args,
        train_dataset=dataset(),
        tools=[add],
        environment_factory=Counter,
    )
    script_trl(trainer, turn)
    generate = trainer._generate_and_score_completions

    def recording(inputs):
        output = generate(inputs)
        outputs.append(output)
        return output

    trainer._generate_and_score_completions = recording
    trainer.train()
    (o,) = outputs
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask")
    return seen, rows_of(*(o[key].cpu() for key in keys))


def test_the_same_script_gives_the_same_tokens_and_reward_arguments(
    model_dir, tmp_path, monkeypatch
):
    ours_seen, ours_rows = run_ours(model_dir, tmp_path / "ours")
    trl_seen, trl_rows = run_trl(model_dir, tmp_path / "trl", monkeypatch)
    assert ours_rows == trl_rows
    assert any(0 in mask for _, _, mask in ours_rows)  # tool results are in the completions
    (ours,), (theirs,) = ours_seen, trl_seen
    assert ours == theirs
    assert ours["values"] == [2, 2, 2, 2] and ours["target"] == [2, 2, 3, 3]
    assert {"log_metric", "log_extra", "trainer_state"} <= set(ours["keys"])


def fixed_rollouts(prompts, trainer):
    """A `rollout_func` with fields that are not per-completion lists (TRL copies them)."""
    eos = trainer.processing_class.eos_token_id
    return {
        "prompt_ids": [[5, 6]] * len(prompts),
        "completion_ids": [[10, 11, eos]] * len(prompts),
        "logprobs": None,
        "episode_stats": {"steps": 3},
        "env_name": "maze",
        "score": [float(i) for i in range(len(prompts))],
    }


def reads_fields(seen: list):
    def from_fields(completions, episode_stats, env_name, score, **kwargs):
        seen.append((episode_stats, env_name, score))
        return score

    return from_fields


@pytest.mark.parametrize("side", ["ours", "trl"])
def test_rollout_func_fields_reach_the_rewards_as_in_trl(side, model_dir, tmp_path, monkeypatch):
    import trl

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    seen = []
    rows = Dataset.from_list([{"prompt": "1+1="}, {"prompt": "2+2="}])
    if side == "ours":
        args = GroupRelativeConfig(output_dir=str(tmp_path), **SHARED)
        trainer_class = GroupRelativeTrainer
    else:
        args = trl.GRPOConfig(output_dir=str(tmp_path), bf16=False, **SHARED)
        trainer_class = trl.GRPOTrainer
    trainer = trainer_class(
        model=model_dir,
        reward_funcs=reads_fields(seen),
        args=args,
        train_dataset=rows,
        rollout_func=fixed_rollouts,
    )
    trainer.train()
    assert seen == [([{"steps": 3}] * 4, ["maze"] * 4, [0.0, 1.0, 2.0, 3.0])]


@pytest.mark.parametrize("side", ["ours", "trl"])
def test_evaluate_with_tools_reports_trls_metric_names(side, model_dir, tmp_path, monkeypatch):
    import trl

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    settings = {**SHARED, "per_device_eval_batch_size": 4}
    if side == "ours":
        args = GroupRelativeConfig(output_dir=str(tmp_path), **settings)
        trainer_class = GroupRelativeTrainer
    else:
        args = trl.GRPOConfig(output_dir=str(tmp_path), bf16=False, **settings)
        trainer_class = trl.GRPOTrainer
    trainer = trainer_class(
        model=model_dir,
        reward_funcs=reached([]),
        args=args,
        train_dataset=dataset(),
        eval_dataset=dataset(),
        tools=[add],
        environment_factory=Counter,
    )
    tokenizer = trainer.processing_class
    script = ScriptedEngine(lambda ids: encode(tokenizer, turn(tokenizer.decode(ids))))
    if side == "ours":
        trainer.rollouts.engine = script
    else:
        script_trl(trainer, turn)
    metrics = trainer.evaluate()
    assert metrics["eval_tools/call_frequency"] == 2.0  # add and increment, in every rollout
    assert metrics["eval_tools/failure_frequency"] == 0.0
    for name in ("eval_reward", "eval_reward_std", "eval_completions/mean_length"):
        assert name in metrics, sorted(metrics)
