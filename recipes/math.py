"""GRPO on math word problems, with LoRA, evaluated before and after on held-out problems.

    accelerate launch recipes/math.py --config recipes/configs/qwen2.5-0.5b-instruct_gsm8k_lora.yaml
    accelerate launch recipes/math.py --config recipes/configs/tiny_cpu.yaml   # offline, 2 CPUs

Top to bottom: seed, data, tokenizer, model, rewards, trainer, evaluate before, train, evaluate
after, save, push. Everything algorithmic lives in the package (`trl_grpo_ext`); the run folder
(`output_dir`) receives the adapter, `metrics.jsonl`, `reward_curve.png` and
`before_after.md`. The last line printed is `held-out accuracy: <before> -> <after>`.
`--resume_from_checkpoint true` (or a checkpoint folder) continues an interrupted run from its
last complete checkpoint (`save_strategy: steps`). `--plan true` prints the memory each phase of
the run will need and exits; a run the device cannot hold stops before loading any weights
(`--ignore_memory_plan true` runs it anyway).
"""

# ruff: noqa: E402
from __future__ import annotations

import os
import sys

# This folder holds a file named math.py, which would shadow the standard library's `math` for
# every import below when a script here runs (Python puts the script's folder first on sys.path).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [path for path in sys.path if os.path.abspath(path or os.curdir) != _HERE]

from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import get_peft_config, get_quantization_config

from trl_grpo_ext import GroupRelativeTrainer
from trl_grpo_ext.checkpoints import resolve_resume, start_metrics_log
from trl_grpo_ext.data import (
    check_chat_template,
    dataset_hub_id,
    load_math_dataset,
    with_examples,
)
from trl_grpo_ext.evaluation import (
    MetricsJsonlCallback,
    PeriodicEvalCallback,
    before_after_table,
    draw_reward_curve,
    evaluate_on_processes,
)
from trl_grpo_ext.memory_plan import recipe_memory_plan
from trl_grpo_ext.script_args import (
    apply_tool_format,
    check_dataset_arguments,
    environment_accuracy,
    load_chat_template,
    load_environment,
    load_messages,
    load_rewards,
    load_tools,
    make_parser,
    resolve_model_path,
    resume_argument,
    start_run,
)


def main(script_args, training_args, model_args, dataset_args=None):
    # Seed; pushes happen once at the end, adapter-only (never checkpoint pushes mid-run).
    push_to_hub, hub_token = start_run(script_args, training_args)  # the token stays in here

    # Data: training problems, and held-out problems for evaluation; an environment
    # (--environment) brings its own, with its rewards, which then score the evaluation.
    check_dataset_arguments(script_args, dataset_args)
    environment = load_environment(script_args, training_args) or {}
    accuracy = environment_accuracy(environment)  # None: math_accuracy scores the evaluation
    data_kwargs = dict(
        config=script_args.dataset_config,
        question_column=script_args.dataset_question_column,
        answer_column=script_args.dataset_answer_column,
        system_prompt=script_args.system_prompt or None,
        seed=training_args.seed,
        difficulty=script_args.synthetic_difficulty,
        validation_percent=script_args.synthetic_validation_percent,
    )
    train_dataset = environment.pop("train_dataset", None) or load_math_dataset(
        script_args.dataset_name,
        script_args.dataset_train_split,
        num_rows=script_args.num_train_samples,
        **data_kwargs,
    )
    eval_name = script_args.eval_dataset_name or (
        "math500" if script_args.dataset_name == "math" else script_args.dataset_name
    )
    eval_dataset = environment.pop("eval_dataset", None) or load_math_dataset(
        eval_name,
        script_args.dataset_test_split,
        num_rows=script_args.num_eval_samples,
        **data_kwargs,
    )
    if script_args.prompt_examples:  # e.g. a worked example of a tool call, before each question
        examples = load_messages(script_args.prompt_examples)
        train_dataset, eval_dataset = (
            with_examples(d, examples) for d in (train_dataset, eval_dataset)
        )

    # Tokenizer (with a chat template that has a tool format, when given), tools and model.
    model_path = resolve_model_path(script_args, model_args, training_args)
    tokenizer = AutoTokenizer.from_pretrained(model_path, revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if script_args.chat_template:
        tokenizer.chat_template = load_chat_template(script_args.chat_template)
    tools = load_tools(script_args.tools)
    if script_args.tool_format:
        apply_tool_format(tokenizer, script_args.tool_format, tools)
    check_chat_template(tokenizer, script_args.system_prompt or None)
    # Memory: each phase's peak predicted from the model's config and the prompts, before any
    # weights load; --plan prints the plan and stops; a run the device cannot hold stops here.
    if recipe_memory_plan(
        script_args, training_args, model_args, model_path, tokenizer, train_dataset, tools
    ):
        return None
    quantization_config = get_quantization_config(model_args)
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        revision=model_args.model_revision,
        dtype=model_args.dtype,
        attn_implementation=model_args.attn_implementation,
        quantization_config=quantization_config,
        # A quantized model is placed on this process's GPU when loaded.
        device_map={"": PartialState().local_process_index} if quantization_config else None,
    )

    # Rewards (a reward model first, if any), and the trainer with LoRA from the model arguments.
    reward_funcs = load_rewards(script_args, environment.pop("reward_funcs", None))
    format_reward = next((f for f in reward_funcs if getattr(f, "__name__", "") == "format"), None)
    eval_tokens = script_args.eval_max_new_tokens or training_args.max_completion_length
    # The metrics log: a resumed run keeps the records up to its checkpoint; a new run in a
    # folder that holds a log keeps that log under another name. Nothing is deleted.
    resume = resume_argument(training_args.resume_from_checkpoint)
    if resume:
        resume = resolve_resume(resume, training_args.output_dir)
    is_main = PartialState().is_main_process
    metrics_path = start_metrics_log(training_args.output_dir, resume, is_main)
    periodic = PeriodicEvalCallback(
        tokenizer,
        eval_dataset,
        eval_every=script_args.eval_every_steps,
        max_new_tokens=eval_tokens,
        metrics_path=metrics_path,
        best_dir=os.path.join(training_args.output_dir, "best") if script_args.keep_best else None,
        format_reward=format_reward,
        batch_size=script_args.eval_batch_size,
        # The trainer's generate_rollouts (its engine: vLLM, or transformers with ZeRO-3
        # weights gathered; its tools, as in training) and its saving (sharded weights
        # gathered): every process evaluates a shard and saves.
        trainer=lambda: trainer,
        save_model=lambda folder: trainer.save_model(folder),
        skip_last_step=True,  # the final evaluation below scores the same weights
        accuracy=accuracy,
    )
    trainer = GroupRelativeTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        callbacks=[MetricsJsonlCallback(metrics_path), periodic],
        tools=tools or None,
        **environment,  # what else the environment gives: environment_factory, rollout_func
    )
    trainer.base_model_id = script_args.base_model  # the Hub id a pushed adapter names

    # Evaluate before, train, evaluate after (greedy pass@1 on the same held-out problems).
    eval_kwargs = dict(
        max_new_tokens=eval_tokens,
        format_reward=format_reward,
        batch_size=script_args.eval_batch_size,
        accuracy=accuracy,
    )
    # Every process evaluates a shard and records (the main process writes, all may save).
    is_main = trainer.accelerator.is_main_process
    before = evaluate_on_processes(trainer, eval_dataset, **eval_kwargs)
    periodic.record(0, before, label="before")
    print(f"before training: {before.summary()}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    after = evaluate_on_processes(
        trainer,
        eval_dataset,
        num_samples=script_args.eval_num_samples,
        k_values=tuple(script_args.eval_k),
        temperature=training_args.temperature,
        **eval_kwargs,
    )
    final_model = trainer.accelerator.unwrap_model(trainer.model)
    periodic.record(trainer.state.global_step, after, model=final_model, label="after")
    print(f"after training: {after.summary()}", flush=True)

    # Save the adapter, the before/after table and the model card; then the reward curve, which
    # only adds to them (a plot that cannot be drawn is a warning, never the end of a run).
    table = before_after_table(before, after, boxed=accuracy is None)
    if is_main:
        with open(os.path.join(training_args.output_dir, "before_after.md"), "w") as handle:
            handle.write(table + "\n")
    train_name, test_name = (
        script_args.environment or dataset_hub_id(name) or name
        for name in (script_args.dataset_name, eval_name)
    )
    about_data = (
        f"Base model `{model_args.model_name_or_path}`; trained on `{train_name}` "
        f"({len(train_dataset)} problems), evaluated on {after.num_problems} held-out problems "
        f"of `{test_name}`."
    )
    trainer.model_card_sections.update({"Evaluation": table, "Base model and data": about_data})
    trainer.save_model(training_args.output_dir)
    curve = os.path.join(training_args.output_dir, "reward_curve.png")
    if is_main and draw_reward_curve(metrics_path, curve):
        trainer.model_card_sections = {
            "Evaluation": table,
            "Training curve": "![reward and held-out accuracy](reward_curve.png)",
            "Base model and data": about_data,
        }
    hub_datasets = {dataset_hub_id(script_args.dataset_name), dataset_hub_id(eval_name)} - {None}
    if script_args.environment:  # its data came from the environment, not dataset_name
        hub_datasets = set()
    trainer.model_card_datasets = sorted(hub_datasets)
    trainer.create_model_card()

    # Push the adapter, tokenizer, card and curve (token: --hub_token, else the saved login).
    if push_to_hub:
        trainer.push_to_hub(
            commit_message="GRPO math recipe",
            token=hub_token,
            extra_files=[curve] if os.path.exists(curve) else None,
        )
    print(table, flush=True)
    print(
        f"held-out accuracy: {before.greedy_lenient:.1%} -> {after.greedy_lenient:.1%}", flush=True
    )
    return trainer, before, after


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
