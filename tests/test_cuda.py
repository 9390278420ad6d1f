"""Training on a CUDA device, where one is present (a GPU session runs this file; the CPU suite
skips it): sampling, the old and reference log-probs, the loss and the optimizer step on the GPU,
in bf16 with LoRA, as the GPU presets train. Every CUDA run once failed on a rollout whose prompt
ids stayed on the GPU while its completions were on the CPU."""

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
