"""Training on a CUDA device, where one is present (a GPU session runs this file; the CPU suite
skips it): sampling, the old and reference log-probs, the loss and the optimizer step on the GPU,
in bf16 with LoRA, as the GPU presets train. Every CUDA run once failed on a rollout whose prompt
ids stayed on the GPU while its completions were on the CPU. With liger-kernel installed,
`use_liger_kernel=True` trains with Liger's layer kernels (benchmarks/gpu_session.sh carries it)."""

import importlib.util
import math

import pytest
import torch
from trainer_helpers import logged, make_trainer

pytestmark = [
    pytest.mark.gpu,  # `pytest -m gpu` runs it; benchmarks/gpu_session.sh does
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("settings", [{}, {"beta": 0.04, "num_iterations": 2}])
def test_lora_training_on_cuda_updates_the_adapter_only(tmp_path, settings):
    trainer = make_trainer(tmp_path, bf16=True, max_completion_length=8, **settings)
    model = trainer.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    assert next(model.parameters()).device.type == "cuda"
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in name for name in changed)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
def test_use_liger_kernel_trains_with_ligers_layer_kernels_and_the_same_logprobs(
    tmp_path, monkeypatch
):
    """As in TRL 1.16: Liger's RMSNorm (and RoPE, SwiGLU) kernels patched in, its fused linear
    cross-entropy off (the model's forward is its own, so the fused LM head computes the
    log-probs), and the log-probs those of the unpatched model up to bf16 rounding."""
    from transformers.integrations.liger import apply_liger_kernel
    from transformers.models.qwen3 import modeling_qwen3

    from trl_grpo_ext.logprobs import completion_logprobs, transformers_model

    # Liger also patches the Qwen3 module's globals: restored for the tests after this one.
    for name in ("apply_rotary_pos_emb", "Qwen3RMSNorm", "Qwen3MLP"):
        monkeypatch.setattr(modeling_qwen3, name, getattr(modeling_qwen3, name))

    trainer = make_trainer(tmp_path, bf16=True, max_completion_length=8, use_liger_kernel=True)
    model = trainer.model
    base = transformers_model(model)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, base.config.vocab_size, (4, 12), generator=generator)
    input_ids = input_ids.to(base.device)

    def logps():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            mask = torch.ones_like(input_ids)
            return completion_logprobs(model, input_ids, mask, input_ids[:, -6:]).float()

    plain = logps()
    apply_liger_kernel(model, trainer.args.liger_kernel_config)  # what train() does first
    assert "LigerRMSNorm" in repr(base)
    assert "forward" not in vars(base)  # fused_linear_cross_entropy=False: forward not replaced
    torch.testing.assert_close(logps(), plain, atol=0.1, rtol=0.02)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in name for name in changed)
