"""Our rewards follow TRL's convention: trl.GRPOTrainer accepts them unchanged."""

from datasets import Dataset

from trl_grpo_ext.rewards import get_reward, math_accuracy


def test_trl_grpo_trainer_runs_with_our_math_reward(tmp_path, tiny_model_dir):
    import trl

    dataset = Dataset.from_list(
        [{"prompt": f"What is {a}+{a}?", "answer": f"#### {2 * a}"} for a in range(8)]
    )
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        report_to="none",
        save_strategy="no",
    )
    trainer = trl.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[math_accuracy, get_reward("format")],
        args=args,
        train_dataset=dataset,
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["rewards/math_accuracy/mean"] == 0.0  # a random model gets none right
    assert "rewards/format/mean" in logged
