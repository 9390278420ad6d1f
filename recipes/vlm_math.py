"""GRPO on math problems with a picture each, for a vision-language model with LoRA on its
language model, evaluated before and after on held-out problems.

    accelerate launch recipes/vlm_math.py --config recipes/configs/qwen2.5-vl-3b-instruct_multimodal-open-r1_lora.yaml
    accelerate launch recipes/vlm_math.py --config recipes/configs/tiny_vlm_cpu.yaml   # offline, 2 CPUs

Top to bottom: seed, data, processor, model, rewards, trainer, evaluate before, train, evaluate
after, save, push. The data are TRL's VLM format: a text prompt and an `image` column, which the
trainer puts into the user message (docs/vision-language.md). Evaluation is
`trainer.evaluate()`: sampled completions of the held-out problems, with their images, scored by
the training rewards; the first reward's mean is the accuracy. The run folder (`output_dir`)
receives the adapter, `metrics.jsonl`, `reward_curve.png` and `before_after.md`; the last line
printed is `held-out accuracy: <before> -> <after>`.
"""

# ruff: noqa: E402
from __future__ import annotations

import os
import sys

# This folder holds recipes/math.py, which would shadow the standard library's `math` for every
# import below (Python puts the script's folder first on sys.path).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [path for path in sys.path if os.path.abspath(path or os.curdir) != _HERE]

from accelerate import PartialState
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.checkpoints import resolve_resume, start_metrics_log
from trl_grpo_ext.data import dataset_hub_id, load_vision_math_dataset, split_held_out
from trl_grpo_ext.eval_rewards import HeldOutRewardCallback, rewards_table
from trl_grpo_ext.evaluation import MetricsJsonlCallback, draw_reward_curve
from trl_grpo_ext.rewards import get_reward
from trl_grpo_ext.script_args import (
    VisionMathScriptArguments,
    resolve_vlm_model_path,
    resume_argument,
    start_run,
)


def main(script_args, training_args, model_args):
    # Seed; pushes happen once at the end, adapter-only (never checkpoint pushes mid-run).
    push_to_hub, hub_token = start_run(script_args, training_args)  # the token stays in here

    # Data: problems with their images; held-out problems from a test split, or set aside from
    # the training split (the default dataset has no other).
    data_kwargs = dict(
        config=script_args.dataset_config,
        image_column=script_args.dataset_image_column,
        question_column=script_args.dataset_question_column,
        answer_column=script_args.dataset_answer_column,
        system_prompt=script_args.system_prompt or None,
        max_image_side=script_args.max_image_side,
        seed=training_args.seed,
    )
    name, num_eval = script_args.dataset_name, script_args.num_eval_samples
    if script_args.dataset_test_split:
        train_dataset = load_vision_math_dataset(
            name,
            script_args.dataset_train_split,
            num_rows=script_args.num_train_samples,
            **data_kwargs,
        )
        eval_dataset = load_vision_math_dataset(
            name, script_args.dataset_test_split, num_rows=num_eval, **data_kwargs
        )
    else:
        dataset = load_vision_math_dataset(name, script_args.dataset_train_split, **data_kwargs)
        train_dataset, eval_dataset = split_held_out(dataset, num_eval, seed=training_args.seed)
        if script_args.num_train_samples is not None:
            count = min(script_args.num_train_samples, len(train_dataset))
            train_dataset = train_dataset.select(range(count))

    # Processor and model: a vision-language model from its Hub id or folder (the tiny one of
    # tiny_vlm.py, warmed up on the answer's format, for model_name_or_path: tiny_vlm).
    model_path = resolve_vlm_model_path(script_args, model_args, training_args)
    processor = AutoProcessor.from_pretrained(model_path, revision=model_args.model_revision)
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    quantization_config = get_quantization_config(model_args)
    model = AutoModelForImageTextToText.from_pretrained(
        model_path,
        revision=model_args.model_revision,
        dtype=model_args.dtype,
        attn_implementation=model_args.attn_implementation,
        quantization_config=quantization_config,
        # A quantized model is placed on this process's GPU when loaded.
        device_map={"": PartialState().local_process_index} if quantization_config else None,
    )

    # Rewards; the metrics log (a resumed run keeps the records up to its checkpoint); the
    # trainer, with LoRA from the model arguments (on the language model only: docs/vision-
    # language.md) and the held-out problems for its evaluations.
    reward_funcs = [get_reward(spec) for spec in script_args.reward_funcs]
    accuracy_key = f"eval_rewards/{reward_funcs[0].__name__}/mean"
    resume = resume_argument(training_args.resume_from_checkpoint)
    if resume:
        resume = resolve_resume(resume, training_args.output_dir)
    is_main = PartialState().is_main_process
    metrics_path = start_metrics_log(training_args.output_dir, resume, is_main)
    heldout = HeldOutRewardCallback(metrics_path, accuracy_key)
    trainer = GroupRelativeTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processor,
        peft_config=get_peft_config(model_args),
        callbacks=[MetricsJsonlCallback(metrics_path), heldout],
    )
    trainer.base_model_id = script_args.base_model  # the Hub id a pushed adapter names

    # Evaluate before, train, evaluate after: the same held-out problems, sampled at the
    # training temperature (num_generations_eval completions each). With eval_strategy: steps
    # the Trainer evaluates at the last step itself; that evaluation is the "after".
    heldout.label = "before"
    before = trainer.evaluate()
    print(f"before training: held-out accuracy {before[accuracy_key]:.1%}", flush=True)
    heldout.label = "periodic"  # eval_strategy: steps evaluates during training
    trainer.train(resume_from_checkpoint=resume)
    step, after = heldout.last
    if step != trainer.state.global_step or after is before:  # none at the last step
        heldout.label = "after"
        after = trainer.evaluate()
    print(f"after training: held-out accuracy {after[accuracy_key]:.1%}", flush=True)

    # Save the adapter and processor, the before/after table and the model card; then the
    # reward curve, which only adds to them (a plot that cannot be drawn is a warning).
    table = rewards_table(before, after)
    if is_main:
        with open(os.path.join(training_args.output_dir, "before_after.md"), "w") as handle:
            handle.write(table + "\n")
    train_name = dataset_hub_id(name) or name
    about_data = (
        f"Base model `{model_args.model_name_or_path}`; trained on `{train_name}` "
        f"({len(train_dataset)} problems with images), evaluated on {len(eval_dataset)} "
        f"held-out problems, {training_args.num_generations_eval or training_args.num_generations}"
        f" sampled completions each; the accuracy is the mean of `{reward_funcs[0].__name__}`."
    )
    trainer.model_card_sections.update({"Evaluation": table, "Base model and data": about_data})
    trainer.save_model(training_args.output_dir)
    curve = os.path.join(training_args.output_dir, "reward_curve.png")
    label = "held-out accuracy (sampled)"
    if is_main and draw_reward_curve(metrics_path, curve, accuracy_label=label):
        trainer.model_card_sections = {
            "Evaluation": table,
            "Training curve": "![reward and held-out accuracy](reward_curve.png)",
            "Base model and data": about_data,
        }
    trainer.model_card_datasets = [dataset_hub_id(name)] if dataset_hub_id(name) else []
    trainer.create_model_card()

    # Push the adapter, processor, card and curve (token: --hub_token, else the saved login).
    if push_to_hub:
        trainer.push_to_hub(
            commit_message="GRPO vision-language math recipe",
            token=hub_token,
            extra_files=[curve] if os.path.exists(curve) else None,
        )
    print(table, flush=True)
    print(f"held-out accuracy: {before[accuracy_key]:.1%} -> {after[accuracy_key]:.1%}", flush=True)
    return trainer, before, after


if __name__ == "__main__":
    parser = TrlParser((VisionMathScriptArguments, GroupRelativeConfig, ModelConfig))
    main(*parser.parse_args_and_config())
