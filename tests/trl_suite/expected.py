"""TRL's GRPO tests expected to fail on our trainer: test id (`Class::test[params]`) -> (reason,
strict). Every entry is lasting (a TRL-private attribute, a Hub model or dataset without an
offline stand-in, a check TRL 1.16 no longer makes): a test that starts passing is reported,
so the list stays true. Measured at TRL's commit f2cd577 (docs/coming-from-trl.md)."""

from __future__ import annotations

T = "TestGRPOTrainer::"
VLM = "TestGRPOTrainerVLM::"
DISPATCH = "TestGRPORolloutDispatch::"


def _private(what: str) -> tuple[str, bool]:
    return f"reads or sets TRL's private internals: {what}", True


def _no_stand_in(what: str) -> tuple[str, bool]:
    return f"needs {what} from the Hub, which has no offline stand-in here", True


_ROLLOUT_DISPATCH = _private(
    "builds the trainer with object.__new__, sets `tools`, `_tokenizer`, `vllm_generation`, "
    "`_metrics` and calls `_generate`"
)
_OLD_LIGER = (
    "checks of the fused Liger GRPO loss, which TRL 1.16 no longer has (nor these checks); "
    "Liger's kernels need a GPU here, where the test expects a PEFT error",
    True,
)
_QWEN_IDS = (
    "patches `generate` to write Qwen3's token ids, outside the stand-in's 259-token vocabulary",
    True,
)
_VLM_HUB = _no_stand_in("a VLM other than Llava and the `zen-image` dataset")

EXPECTED: dict[str, tuple[str, bool]] = {
    # TRL-private internals
    DISPATCH + "test_generate_prefers_rollout_func": _ROLLOUT_DISPATCH,
    DISPATCH + "test_generate_rollout_func_syncs_vllm_weights_when_needed": _ROLLOUT_DISPATCH,
    DISPATCH
    + "test_generate_rollout_func_raises_when_required_keys_are_missing": _ROLLOUT_DISPATCH,
    T + "test_entropy_bonus_flows_gradients": _private(
        "`_entropy_bonus_enabled` and `_get_per_token_logps_and_entropies`"
    ),
    T + "test_train_reward_func_with_log_extra": _private(
        "`_logs` (ours: `reward_logs`, and the logged table)"
    ),
    T + "test_prepare_input_called_with_correct_data": _private(
        "patches `training_step` and reads its inputs as TRL's raw rows (ours, as transformers' "
        "Trainer, passes the tokenized batch); its prompts are the Hub zen dataset's own words"
    ),
    T + "test_train_with_multiple_environments": _private("`_env_tools`"),
    # What the offline stand-ins cannot reproduce
    # (the tool tests need jmespath, skipped without it; tests/test_trl_agents_ported.py ports
    # them with a scripted engine in the stand-in's tokens)
    T + "test_train_with_tools[tools0]": _QWEN_IDS,
    T + "test_train_with_tools[tools1]": _QWEN_IDS,
    T + "test_train_with_environment_factory": _QWEN_IDS,
    T + "test_train_with_environment_owned_reward": _QWEN_IDS,
    T + "test_train_with_environment_owned_data": _QWEN_IDS,
    T + "test_train_with_malformed_tool_calls": _QWEN_IDS,
    VLM + "test_train_with_tools_multimodal_response": _VLM_HUB,
    T + "test_train[trl-internal-testing/tiny-NemotronHForCausalLM-nano]": _no_stand_in(
        "NemotronH (hybrid Mamba)"
    ),
    T + "test_trust_remote_code": _no_stand_in("a model whose code lives on the Hub"),
    T + "test_train_with_mask_truncated_completions": (
        "mocks `generate` with Qwen2.5's token ids (151645), outside the stand-in's 259-token "
        "vocabulary, and 3 rows per call",
        True,
    ),
    T + "test_train_with_mask_truncated_completions_all_masked": (
        "relies on Qwen2.5's 151k-token vocabulary making EOS unlikely; the stand-in's 259 "
        "tokens sample it",
        False,
    ),
    VLM + "test_train_vlm[trl-internal-testing/tiny-Gemma3ForConditionalGeneration]": _VLM_HUB,
    VLM + "test_train_vlm[trl-internal-testing/tiny-Gemma4ForConditionalGeneration]": _VLM_HUB,
    VLM + "test_train_vlm[trl-internal-testing/tiny-LlavaNextForConditionalGeneration]": _VLM_HUB,
    VLM + "test_train_vlm[trl-internal-testing/tiny-Qwen2_5_VLForConditionalGeneration]": _VLM_HUB,
    VLM + "test_train_vlm[trl-internal-testing/tiny-Qwen2VLForConditionalGeneration]": _VLM_HUB,
    VLM + "test_train_vlm[trl-internal-testing/tiny-Qwen3_5ForConditionalGeneration-NoThink]": (
        _VLM_HUB
    ),
    VLM + "test_train_vlm[trl-internal-testing/tiny-Qwen3_5MoeForConditionalGeneration-3.6]": (
        _VLM_HUB
    ),
    VLM + "test_train_vlm_with_pad_to_multiple_of": _VLM_HUB,
    VLM
    + "test_train_vlm_beta_non_zero[trl-internal-testing/tiny-Qwen2_5_VLForConditionalGeneration]": _VLM_HUB,  # noqa: E501
    VLM
    + "test_train_vlm_peft[trl-internal-testing/tiny-Qwen2_5_VLForConditionalGeneration]": _VLM_HUB,  # noqa: E501
    VLM
    + "test_train_vlm_and_importance_sampling[trl-internal-testing/tiny-Qwen2_5_VLForConditionalGeneration]": _VLM_HUB,  # noqa: E501
    VLM
    + "test_train_vlm_multi_image[trl-internal-testing/tiny-Qwen2_5_VLForConditionalGeneration]": _VLM_HUB,  # noqa: E501
    VLM + "test_train_vlm_log_multimodal_false": _VLM_HUB,
    # Checks of the fused Liger GRPO loss that this test file's TRL had; TRL 1.16 has neither
    # the loss nor these checks (its `use_liger_kernel` patches Liger's layer kernels, on a GPU),
    # and neither does this trainer (docs/coming-from-trl.md, "Liger")
    T + "test_liger_kernel_with_peft_lm_head_raises": _OLD_LIGER,
    T + "test_liger_kernel_with_peft_non_lm_head_target_allowed": _OLD_LIGER,
    T + "test_liger_kernel_with_peft_modules_to_save_lm_head_allowed": _OLD_LIGER,
    T + "test_liger_kernel_with_peft_prompt_learning_raises": _OLD_LIGER,
}
