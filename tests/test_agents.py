"""The trainer with tools, environments and a rollout function (TRL's contract): what is
trained on is what was sampled, tool results get no gradient, environments and their rewards."""

import pytest
import torch
from agent_helpers import ScriptedEngine, add, call, encode, needs_trl_1_16, qwen3_tokenizer
from datasets import Dataset
from trainer_helpers import make_trainer

from trl_grpo_ext.tiny import build_tiny_model

pytestmark = needs_trl_1_16


def chat(text):
    return [{"role": "user", "content": text}]


def tool_trainer(tmp_path, **kwargs):
    tokenizer = qwen3_tokenizer()
    model = build_tiny_model(tokenizer, seed=0, initializer_range=0.2)
    kwargs.setdefault(
        "dataset", Dataset.from_list([{"prompt": chat(f"{a} + 5?")} for a in range(4)])
    )
    return make_trainer(
        tmp_path,
        model=model,
        tokenizer=tokenizer,
        **{
            "num_generations": 2,
            "per_device_train_batch_size": 4,
            "max_completion_length": 256,
            "max_prompt_length": None,  # the tools' schemas are long in bytes
            **kwargs,
        },
    )


def calls_then_answers(tokenizer, call_text=None):
    """A turn that makes the call when the context has no tool result yet, else an answer."""
    call_ids = encode(tokenizer, call_text or call("add", a=2, b=3))
    answer_ids = encode(tokenizer, "It is 5.")
    response = tokenizer("<tool_response>", add_special_tokens=False)["input_ids"]

    def turn(context):
        has_result = any(context[i : i + len(response)] == response for i in range(len(context)))
        return answer_ids if has_result else call_ids

    return turn, call_ids, answer_ids


def rewards_by_length(completions, **kwargs):
    """Alternating 0, 1: every group has a learning signal."""
    return [float(i % 2) for i in range(len(completions))]


class Recording:
    """Records every micro-batch `compute_objective` sees and the gradient of its loss with
    respect to the per-token log-probs."""

    def __init__(self, trainer):
        self.batches, self.grads = [], []
        compute, logprobs = trainer.compute_objective, trainer._token_logprobs

        def token_logprobs(model, batch, return_entropy=False, **kwargs):
            logps, entropy = logprobs(model, batch, return_entropy=return_entropy, **kwargs)
            logps.retain_grad()
            self.logps = logps
            return logps, entropy

        def objective(model, batch):
            loss, metrics = compute(model, batch)
            self.batches.append(batch)
            self.grads.append(torch.autograd.grad(loss, self.logps, retain_graph=True)[0])
            return loss, metrics

        trainer._token_logprobs, trainer.compute_objective = token_logprobs, objective


def test_trained_tokens_are_the_sampled_ones_and_tool_results_get_no_gradient(tmp_path):
    trainer = tool_trainer(tmp_path, tools=[add], reward_funcs=rewards_by_length, max_steps=1)
    tokenizer = trainer.processing_class
    turn, call_ids, answer_ids = calls_then_answers(tokenizer)
    trainer.rollouts.engine = engine = ScriptedEngine(turn)
    recording = Recording(trainer)
    trainer.train()

    suffix = trainer.rollouts.tool_loop.format.result_ids(
        [{"role": "tool", "name": "add", "content": "5"}]
    )
    sampled = call_ids + suffix + answer_ids
    batch = recording.batches[0]
    width = batch["completion_ids"].shape[1]
    assert width == len(sampled)
    for row in range(len(batch["completion_ids"])):
        assert batch["completion_ids"][row].tolist() == sampled
        prompt = batch["input_ids"][row, :-width][batch["attention_mask"][row, :-width].bool()]
        # token-in: the second turn continued from exactly the trained prefix
        assert prompt.tolist() + call_ids + suffix in [c for turn in engine.prompts for c in turn]
    tool = slice(len(call_ids), len(call_ids) + len(suffix))
    assert batch["completion_mask"][:, tool].eq(0).all()
    assert batch["completion_mask"][:, : len(call_ids)].eq(1).all()
    assert batch["attention_mask"][:, -width:].eq(1).all()  # the results are read
    grad = recording.grads[0]
    assert grad[:, tool].eq(0).all()
    assert grad[:, : len(call_ids)].abs().sum() > 0
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] == 1.0 and logged["tools/failure_frequency"] == 0.0
    # lengths count the model's tokens only, as TRL
    assert logged["completions/mean_length"] == len(call_ids) + len(answer_ids)


class Counter:
    """An environment: the model reaches a target by calling `increment`."""

    instances = 0

    def __init__(self):
        Counter.instances += 1
        self.value, self.target, self.resets = 0, None, []

    def reset(self, **row):
        self.value, self.target = 0, row["target"]
        self.resets.append(row)
        return f" Reach {self.target}."

    def increment(self, step: int) -> int:
        """Adds `step` to the counter.

        Args:
            step: How much to add.

        Returns:
            The new value.
        """
        self.value += step
        return self.value

    def get_reward(self) -> float:
        return float(self.value == self.target)


def test_environments_reset_per_rollout_give_tools_and_their_reward(tmp_path):
    rows = [{"prompt": chat("Count."), "target": t} for t in (3, 4)]
    seen = {}

    def reward_sees_environments(completions, environments, target, **kwargs):
        seen["values"] = [e.value for e in environments]
        seen["targets"] = target
        return [0.0] * len(completions)

    Counter.instances = 0
    trainer = tool_trainer(
        tmp_path,
        environment_factory=Counter,
        reward_funcs=reward_sees_environments,
        dataset=Dataset.from_list(rows),
        max_steps=1,
    )
    tokenizer = trainer.processing_class
    step3, answer = encode(tokenizer, call("increment", step=3)), encode(tokenizer, "Done.")
    trainer.rollouts.engine = ScriptedEngine([step3, answer])
    rollout = trainer.generate_rollouts(rows)
    rewards = trainer.score_rollouts(rollout)

    assert trainer.reward_names == ["reward_sees_environments", "Counter"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0]
    # one instance per rollout (the probe is reused), each reset with its own row
    assert Counter.instances == 4 and len({id(e) for e in rollout.environments}) == 4
    assert [e.target for e in rollout.environments] == [3, 3, 4, 4]
    assert rollout.environments[0].resets[-1] == rows[0]
    assert rollout.prompts[0][-1]["content"] == "Count. Reach 3."
    assert seen["values"] == [3, 3, 3, 3] and seen["targets"] == [3, 3, 4, 4]
    assert rewards[:, 1].tolist() == [1.0, 1.0, 0.0, 0.0]  # get_reward of each rollout's env
    assert rollout.tool_calls.tolist() == [1, 1, 1, 1]


def test_without_a_dataset_reset_supplies_the_prompt_and_max_steps_the_length(tmp_path):
    class Puzzle(Counter):
        def reset(self, **row):
            self.value, self.target = 0, 2
            return "Reach 2."

    trainer = tool_trainer(
        tmp_path, environment_factory=Puzzle, dataset=None, max_steps=2, reward_funcs=None
    )
    assert trainer.reward_names == ["Puzzle"]
    tokenizer = trainer.processing_class
    turn, _, _ = calls_then_answers(tokenizer, call("increment", step=2))
    trainer.rollouts.engine = ScriptedEngine(turn)
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.state.log_history[0]["rewards/Puzzle/mean"] == 1.0

    with pytest.raises(ValueError, match="max_steps"):
        tool_trainer(tmp_path, environment_factory=Puzzle, dataset=None, max_steps=-1)


def test_a_dict_of_environments_is_chosen_per_row(tmp_path):
    class Other(Counter):
        pass

    rows = [
        {"prompt": chat("a"), "target": 1, "environment": "count"},
        {"prompt": chat("b"), "target": 1, "environment": "other"},
    ]
    trainer = tool_trainer(
        tmp_path,
        environment_factory={"count": Counter, "other": Other},
        dataset=Dataset.from_list(rows),
        reward_funcs=rewards_by_length,
    )
    trainer.rollouts.engine = ScriptedEngine([encode(trainer.processing_class, "no")])
    rollout = trainer.generate_rollouts(rows)
    assert [type(e).__name__ for e in rollout.environments] == ["Counter"] * 2 + ["Other"] * 2
    assert "environment" not in rollout.environments[0].resets[-1]
    bad = [{**rows[0], "environment": "nope"}]
    with pytest.raises(ValueError, match="nope"):
        trainer.generate_rollouts(bad)


def test_rollout_func_samples_with_trls_contract(tmp_path):
    seen = {}

    def rollout_func(prompts, trainer):
        seen["prompts"], seen["trainer"] = prompts, trainer
        n = len(prompts)
        return {
            "prompt_ids": [[5, 6, 7]] * n,
            "completion_ids": [[10, 11, 12, trainer.processing_class.eos_token_id]] * n,
            "logprobs": [[-0.5, None, -0.5, -0.5]] * n,
            "env_mask": [[1, 0, 0, 1]] * n,
            "score": list(range(n)),
        }

    def from_field(completions, score, **kwargs):
        return [float(s) for s in score]

    trainer = make_trainer(
        tmp_path, rollout_func=rollout_func, reward_funcs=from_field, num_generations=2
    )
    rows = [{"prompt": "1+1="}, {"prompt": "2+2="}]
    rollout = trainer.generate_rollouts(rows)
    assert seen["prompts"] == ["1+1=", "1+1=", "2+2=", "2+2="] and seen["trainer"] is trainer
    assert trainer.score_rollouts(rollout)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert rollout.tool_mask.tolist() == [[1, 0, 0, 1]] * 4
    assert torch.isnan(rollout.behaviour_logps[:, 1]).all()
    assert not rollout.is_truncated.any()

    def short(prompts, trainer):
        return {"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": None}

    trainer.rollout_func = short
    with pytest.raises(ValueError, match="one per completion"):
        trainer.generate_rollouts(rows)
    trainer.rollout_func = lambda prompts, trainer: {"prompt_ids": []}
    with pytest.raises(ValueError, match="completion_ids"):
        trainer.generate_rollouts(rows)


def test_rollout_func_fields_that_are_not_lists_reach_every_completion(tmp_path):
    """As TRL merges them: a field that is not a list is every completion's; a list is one value
    per completion (a list of another length stays an error, never a silent shift)."""

    def rollout_func(prompts, trainer):
        n = len(prompts)
        return {
            "prompt_ids": [[5, 6]] * n,
            "completion_ids": [[10, trainer.processing_class.eos_token_id]] * n,
            "logprobs": None,
            "episode_stats": {"steps": 3},
            "env_name": "maze",
            "score": [float(i) for i in range(n)],
        }

    seen = {}

    def reads_fields(completions, episode_stats, env_name, score, **kwargs):
        seen.update(stats=episode_stats, names=env_name, score=score)
        return [0.0] * len(completions)

    trainer = make_trainer(
        tmp_path, rollout_func=rollout_func, reward_funcs=reads_fields, num_generations=2
    )
    rollout = trainer.generate_rollouts([{"prompt": "1+1="}, {"prompt": "2+2="}])
    trainer.score_rollouts(rollout)
    assert seen["stats"] == [{"steps": 3}] * 4
    assert seen["names"] == ["maze"] * 4
    assert seen["score"] == [0.0, 1.0, 2.0, 3.0]


def test_tools_with_a_template_that_cannot_call_them_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="cannot render a tool call"):
        make_trainer(tmp_path, tools=[add])  # the tiny model's plain ChatML template


def test_tools_need_conversational_prompts(tmp_path):
    trainer = tool_trainer(
        tmp_path, tools=[add], dataset=Dataset.from_list([{"prompt": "1+1="}] * 4)
    )
    with pytest.raises(ValueError, match="conversational"):
        trainer.generate_rollouts([{"prompt": "1+1="}])


def varied_turns(tokenizer, model):
    """Each rollout calls `increment` with a step of 2 or 3, then answers. The step depends on
    the rollout's place in its batch (so a group's members differ) and on the model's current
    weights, as a sampled one would: a batch sampled again after an update differs."""
    response = tokenizer("<tool_response>", add_special_tokens=False)["input_ids"]
    calls = []

    def turn(context):
        n = len(response)
        if any(context[i : i + n] == response for i in range(len(context) - n + 1)):
            return encode(tokenizer, "Done.")
        calls.append(None)
        trained = [p for p in model.parameters() if p.requires_grad][-1]
        weights = int(trained.detach().abs().sum().item() * 1e6)
        return encode(tokenizer, call("increment", step=2 + (len(calls) + weights) % 2))

    return turn


WINDOW = dict(
    max_steps=3,
    gradient_accumulation_steps=2,
    steps_per_generation=4,
    per_device_train_batch_size=2,
    learning_rate=3e-3,
    save_strategy="steps",
    save_steps=1,
)


def counter_run(folder, checkpoint=None, **overrides):
    rows = [{"prompt": chat(f"Count to {t}."), "target": t} for t in (2, 3, 4, 3)]
    trainer = tool_trainer(
        folder,
        environment_factory=Counter,
        reward_funcs=None,
        dataset=Dataset.from_list(rows),
        **{**WINDOW, **overrides},
    )
    trainer.rollouts.engine = ScriptedEngine(varied_turns(trainer.processing_class, trainer.model))
    trainer.train(resume_from_checkpoint=checkpoint)
    weights = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad
    }
    return trainer, weights


def test_a_run_with_environments_resumes_bit_identical(tmp_path):
    """Checkpoint 1 falls inside a generation window: the buffered multi-turn rollouts (with
    their tool masks) are trained on after the resume; environments are rebuilt by the factory."""
    straight, weights = counter_run(tmp_path / "straight")
    assert any(entry.get("grad_norm", 0) > 0 for entry in straight.state.log_history)
    checkpoint = tmp_path / "straight" / "checkpoint-1"
    resumed, resumed_weights = counter_run(
        tmp_path / "resumed", str(checkpoint), save_strategy="no"
    )
    assert all(torch.equal(weights[n], resumed_weights[n]) for n in weights)

    def logs(trainer):  # without `step_time`, a wall-clock time
        return [
            {k: v for k, v in e.items() if k != "step_time"}
            for e in trainer.state.log_history
            if "loss" in e
        ]

    assert logs(resumed) == logs(straight)  # all 4 steps


def test_dynamic_sampling_resamples_multi_turn_groups_with_their_masks(tmp_path):
    """Groups whose rollouts all score the same are sampled again; the rollouts kept from both
    rounds keep their tool masks and environments."""
    # a target of 4 is never reached (steps are 2 or 3): those groups all score 0
    rows = [{"prompt": chat(f"Count to {t}."), "target": t} for t in (2, 4, 3, 4)]
    trainer = tool_trainer(
        tmp_path,
        environment_factory=Counter,
        reward_funcs=None,
        dataset=Dataset.from_list(rows),
        dynamic_sampling=True,
        max_resample_rounds=2,
        per_device_train_batch_size=8,
        num_generations=2,
        max_steps=1,
    )
    tokenizer = trainer.processing_class
    trainer.rollouts.engine = ScriptedEngine(varied_turns(tokenizer, trainer.model))
    recording = Recording(trainer)
    trainer.train()
    batch = recording.batches[0]
    suffix = trainer.rollouts.tool_loop.format.result_ids(
        [{"role": "tool", "name": "increment", "content": "2"}]
    )
    call_length = len(encode(tokenizer, call("increment", step=2)))
    tool = slice(call_length, call_length + len(suffix))
    logged = trainer.state.log_history[0]
    assert (
        logged["dynamic_sampling/rounds"] >= 1 and logged["dynamic_sampling/filtered_fraction"] > 0
    )
    trained = batch["completion_mask"].sum(dim=1) > 0
    assert trained.any()
    assert batch["completion_mask"][trained][:, tool].eq(0).all()
    assert batch["completion_mask"][trained][:, :call_length].eq(1).all()


def test_evaluate_runs_multi_turn_rollouts_and_scores_their_environments(tmp_path):
    rows = [{"prompt": chat(f"Count to {t}."), "target": t} for t in (2, 3)]
    trainer = tool_trainer(
        tmp_path, environment_factory=Counter, reward_funcs=None, dataset=Dataset.from_list(rows)
    )
    trainer.eval_dataset = Dataset.from_list(rows)
    turn, call_ids, answer_ids = calls_then_answers(
        trainer.processing_class, call("increment", step=2)
    )
    trainer.rollouts.engine = ScriptedEngine(turn)
    metrics = trainer.evaluate()
    assert metrics["eval_rewards/Counter/mean"] == 0.5  # target 2 is reached, 3 is not
    # TRL's evaluation metrics: each rollout called the tool once; lengths are the model's tokens
    assert metrics["eval_tools/call_frequency"] == 1.0
    assert metrics["eval_tools/failure_frequency"] == 0.0
    assert metrics["eval_completions/mean_length"] == len(call_ids) + len(answer_ids)
    assert metrics["eval_completions/clipped_ratio"] == 0.0
    assert metrics["eval_reward_std"] == pytest.approx(torch.tensor([1.0, 1, 0, 0]).std().item())
    assert trainer.state.log_history[-1]["eval_tools/call_frequency"] == 1.0


def test_prompts_whose_tool_schemas_do_not_fit_are_an_error_not_a_cut(tmp_path):
    """max_prompt_length limits what the user wrote: a prompt whose own messages are too long
    is an error (a cut from the left would drop the schemas), the schemas never count."""
    trainer = tool_trainer(tmp_path, tools=[add], max_prompt_length=64)
    with pytest.raises(ValueError, match="max_prompt_length=64 tokens without their tools'"):
        trainer.generate_rollouts([{"prompt": chat("1 + 5? " + "Think hard. " * 8)}])


def test_the_limit_on_prompts_leaves_out_the_tools_schemas(tmp_path):
    trainer = tool_trainer(tmp_path, tools=[add], max_prompt_length=64)
    trainer.rollouts.engine = ScriptedEngine(calls_then_answers(trainer.processing_class)[0])
    rollout = trainer.generate_rollouts([{"prompt": chat("1 + 5?")}])
    # kept whole: several hundred tokens with the schema, far more than 64
    assert rollout.prompt_mask.sum(dim=1).min() > 300
    rendered = trainer.processing_class.apply_chat_template(
        chat("1 + 5?"), tools=[add], tokenize=False, add_generation_prompt=True
    )
    assert (
        rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()
        == encode(trainer.processing_class, rendered)[:-1]
    )  # `encode` appends eos


def test_a_trl_tool_script_trains_with_the_default_config(tmp_path):
    """TRL has no max_prompt_length: a TRL tool script, the import changed, runs with our
    default (512), although its tools' schemas alone are longer than that."""
    from trl_grpo_ext import GroupRelativeConfig as GRPOConfig
    from trl_grpo_ext import GroupRelativeTrainer as GRPOTrainer

    tokenizer = qwen3_tokenizer()
    dataset = Dataset.from_list([{"prompt": chat(f"{a} + 5?")} for a in range(4)])
    trainer = GRPOTrainer(
        model=build_tiny_model(tokenizer, seed=0),
        processing_class=tokenizer,
        reward_funcs=rewards_by_length,
        train_dataset=dataset,
        tools=[add, divide],
        args=GRPOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            report_to="none",
            max_steps=1,
            num_generations=2,
            per_device_train_batch_size=4,
        ),
    )
    assert trainer.args.max_prompt_length == 512
    trainer.rollouts.engine = ScriptedEngine(calls_then_answers(tokenizer)[0])
    recording = Recording(trainer)
    trainer.train()
    batch = recording.batches[0]
    width = batch["completion_ids"].shape[1]
    prompt_tokens = batch["attention_mask"][:, :-width].sum(dim=1)  # (B,)
    assert prompt_tokens.min() > 512  # the schemas of two tools, kept whole
    assert trainer.state.log_history[0]["tools/call_frequency"] == 1.0


def divide(a: int, b: int) -> float:
    """Divides two integers.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def test_held_out_evaluation_samples_through_the_tools_and_scores_the_last_answer(tmp_path):
    """The recipe's evaluation (`evaluate_on_processes`) runs the trainer's tools: a problem is
    right when the model's last message is, never because a tool's result holds the answer; the
    report counts the completions that called a tool and the calls that failed."""
    from trl_grpo_ext.evaluation import evaluate_on_processes

    trainer = tool_trainer(tmp_path, tools=[add, divide])
    tokenizer = trainer.processing_class
    turns = {
        "call add": encode(tokenizer, call("add", a=2, b=3)),
        "call divide": encode(tokenizer, call("divide", a=1, b=0)),
        "right": encode(tokenizer, "It is 5."),
        "no answer": encode(tokenizer, "I do not know."),
    }

    def turn(context):
        text = tokenizer.decode(context)
        first = "2 + 3?" in text
        if "<tool_response>" not in text:
            return turns["call add"] if first else turns["call divide"]
        return turns["right"] if first else turns["no answer"]

    trainer.rollouts.engine = engine = ScriptedEngine(turn)
    problems = Dataset.from_list(
        [{"prompt": chat("2 + 3?"), "answer": "5"}, {"prompt": chat("1 / 0?"), "answer": "5"}]
    )
    report = evaluate_on_processes(
        trainer, problems, max_new_tokens=256, num_samples=2, k_values=(1, 2), temperature=1.0
    )
    # the second problem's tool failed, and its last message has no number: wrong, although the
    # first call's result and the reference are both 5
    assert report.greedy_lenient == 0.5 and report.pass_at_k == {"pass@1": 0.5, "pass@2": 0.5}
    assert report.tool_call_rate == 1.0 and report.tool_error_rate == 0.5
    assert "[add] 5" in report.samples[0]["completion"]
    assert report.samples[0]["completion"].endswith("It is 5.")
    assert "[divide] {'error'" in report.samples[1]["completion"]
    # greedy: 2 rollouts in 2 rounds; sampled: 4 rollouts in 2 rounds
    assert [len(contexts) for contexts in engine.prompts] == [2, 2, 4, 4]


def test_a_stop_string_ends_a_turn_with_tools_and_no_padding_is_trained(tmp_path):
    """An engine stops a row at a stop string and pads it (no eos): the turn ends at the token
    that completes the stop, nothing after it is trained, and the rollout counts as ended."""
    trainer = tool_trainer(
        tmp_path,
        tools=[add],
        reward_funcs=rewards_by_length,
        max_steps=1,
        mask_truncated_completions=True,  # a rollout wrongly marked truncated would get no gradient
        generation_kwargs={"stop": ["</answer>"]},
    )
    tokenizer = trainer.processing_class
    turn, call_ids, _ = calls_then_answers(tokenizer)
    answer_ids = tokenizer("<answer>5</answer>", add_special_tokens=False)["input_ids"]
    pad = tokenizer.pad_token_id
    assert pad not in (tokenizer.eos_token_id, *answer_ids)

    def stops_at_the_answer(context):
        ids = turn(context)
        return ids if ids == call_ids else answer_ids + [pad, pad]  # as `generate` pads a stop

    trainer.rollouts.engine = ScriptedEngine(stops_at_the_answer)
    recording = Recording(trainer)
    trainer.train()

    suffix = trainer.rollouts.tool_loop.format.result_ids(
        [{"role": "tool", "name": "add", "content": "5"}]
    )
    batch = recording.batches[0]
    sampled = call_ids + suffix + answer_ids
    assert batch["completion_ids"].shape[1] == len(sampled)
    for row in range(len(batch["completion_ids"])):
        assert batch["completion_ids"][row].tolist() == sampled
    answer = slice(len(call_ids) + len(suffix), len(sampled))
    assert batch["completion_mask"][:, answer].eq(1).all()  # ended, not truncated: trained
    logged = trainer.state.log_history[0]
    assert logged["completions/clipped_ratio"] == 0.0
    assert logged["completions/mean_length"] == len(call_ids) + len(answer_ids)


@pytest.mark.parametrize("max_staleness", [None, 1])
def test_stop_strings_with_tools_on_the_transformers_engine_train_no_padding(
    tmp_path, max_staleness
):
    """The tiny model samples bytes; single-character stops end most turns early, while other
    rows of the batch go on (and the engine pads the stopped ones). Every trained token is one
    the model sampled before its turn's end; a row with a stop in its text ends right there."""
    stops = ["a", "e", "o", " "]
    trainer = tool_trainer(
        tmp_path,
        tools=[add],
        reward_funcs=rewards_by_length,
        max_steps=2,
        max_completion_length=24,
        generation_kwargs={"stop": stops},
        max_staleness=max_staleness,
    )
    tokenizer, pad = trainer.processing_class, trainer.processing_class.pad_token_id
    recording = Recording(trainer)
    trainer.train()
    rows = 0
    for batch in recording.batches:
        for ids, mask in zip(batch["completion_ids"], batch["completion_mask"]):
            trained = ids[mask.bool()].tolist()
            assert pad not in trained
            text = tokenizer.decode(trained, skip_special_tokens=False)
            if any(stop in text for stop in stops):
                shorter = tokenizer.decode(trained[:-1], skip_special_tokens=False)
                assert not any(stop in shorter for stop in stops)  # ended at its first stop
            rows += 1
    assert rows > 0
    stopped = [
        log["completions/clipped_ratio"]
        for log in trainer.state.log_history
        if "completions/clipped_ratio" in log
    ]
    assert stopped and max(stopped) < 1.0
