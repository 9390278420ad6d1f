"""`use_liger_kernel=True` as TRL 1.16 takes it: its deprecation warning, its refusal of Liger's
fused linear cross-entropy, the kernel config it hands to `transformers.Trainer`; and, here,
the errors that say at construction what cannot run (the CPU, liger-kernel not installed).
Training with Liger's kernels on a GPU is in tests/test_cuda.py."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
from trainer_helpers import make_trainer
from trl_reference import matches_trl

from trl_grpo_ext import GroupRelativeConfig
from trl_grpo_ext.liger import prepare_liger_kernel

LIGER_INSTALLED = importlib.util.find_spec("liger_kernel") is not None


def trl_trainer(tmp_path, tiny_model_dir, **config):
    import trl
    from datasets import Dataset

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=2,
        report_to="none",
        **config,
    )
    return trl.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "1 + 1 ="}] * 2),
    )


def liger_warnings(caught) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, FutureWarning) and "use_liger_kernel" in str(w.message)
    ]


@matches_trl
def test_use_liger_kernel_warns_as_trl_and_on_the_cpu_says_which_setting_to_change(
    tmp_path, tiny_model_dir
):
    """TRL constructs on the CPU and fails when train() patches the model; ours says so at
    construction, after TRL's deprecation warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = trl_trainer(tmp_path, tiny_model_dir, use_liger_kernel=True)
    with warnings.catch_warnings(record=True) as ours_caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="needs a GPU.*Set use_liger_kernel=False"):
            make_trainer(tmp_path / "ours", use_liger_kernel=True)
    assert len(liger_warnings(caught)) == 1 and "deprecated" in liger_warnings(caught)[0]
    assert liger_warnings(ours_caught) == liger_warnings(caught)
    assert theirs.args.liger_kernel_config == {"fused_linear_cross_entropy": False}


@matches_trl
def test_fused_linear_cross_entropy_is_refused_as_trl(tmp_path, tiny_model_dir):
    kernel_config = {"fused_linear_cross_entropy": True}
    refusal = r'`liger_kernel_config=\{"fused_linear_cross_entropy": True\}` is not supported'
    with pytest.raises(ValueError, match=refusal), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trl_trainer(
            tmp_path, tiny_model_dir, use_liger_kernel=True, liger_kernel_config=kernel_config
        )
    with pytest.raises(ValueError, match=refusal + ".*Leave fused_linear_cross_entropy unset"):
        with pytest.warns(FutureWarning):
            make_trainer(
                tmp_path / "ours", use_liger_kernel=True, liger_kernel_config=kernel_config
            )


def liger_args(tmp_path, **config) -> GroupRelativeConfig:
    return GroupRelativeConfig(
        str(tmp_path), use_cpu=True, report_to="none", use_liger_kernel=True, **config
    )


@pytest.mark.skipif(LIGER_INSTALLED, reason="liger-kernel is installed")
def test_without_liger_kernel_on_a_gpu_the_error_names_the_package(tmp_path):
    """The user's other kernel settings are kept; the fused cross-entropy is turned off (as
    TRL), before the installation is checked."""
    args = liger_args(tmp_path, liger_kernel_config={"rms_norm": False})
    with pytest.warns(FutureWarning), pytest.raises(ImportError, match="pip install liger-kernel"):
        prepare_liger_kernel(args, device="cuda")
    assert args.liger_kernel_config == {"rms_norm": False, "fused_linear_cross_entropy": False}


def test_without_use_liger_kernel_nothing_is_checked_or_changed(tmp_path):
    args = GroupRelativeConfig(str(tmp_path), use_cpu=True, report_to="none")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare_liger_kernel(args)
    assert args.liger_kernel_config is None
