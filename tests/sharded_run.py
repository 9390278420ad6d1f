"""The math recipe with sharded weights on CPU processes, launched by tests/test_sharded.py:

    accelerate launch --config_file <FSDP or ZeRO-3 config, 2 processes> tests/sharded_run.py ARGS

DeepSpeed runs on CPU by itself (`DS_ACCELERATOR=cpu`, gloo). For FSDP:

accelerate chooses FSDP only on accelerator devices: on CPU processes it silently falls back to
DDP over gloo. PyTorch's `fully_shard` itself runs on CPU over gloo, so this script has
accelerate take the CPU processes for GPUs (MULTI_GPU instead of MULTI_CPU) and FSDP follows:
the parameters become DTensors sharded across the processes, and every forward pass gathers
them with collectives, as on GPUs. The Hub is intercepted for `--push_to_hub`; each process
writes what it saw to `<output_dir>/sharded-<rank>.json`.
"""

import importlib.util
import json
import os
import sys

import accelerate.state
from accelerate.utils import DistributedType

_init = accelerate.state.PartialState.__init__


def _as_if_on_gpus(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.MULTI_GPU


accelerate.state.PartialState.__init__ = _as_if_on_gpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    from huggingface_hub import HfApi
    from torch.distributed.tensor import DTensor
    from transformers import TrainerCallback

    from trl_grpo_ext.script_args import make_parser

    spec = importlib.util.spec_from_file_location("math_recipe", f"{ROOT}/recipes/math.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules["math_recipe"] = recipe
    spec.loader.exec_module(recipe)

    uploads = []
    HfApi.create_repo = lambda self, repo_id, **kwargs: None
    HfApi.upload_folder = lambda self, repo_id, folder_path, **kwargs: uploads.append(
        sorted(os.listdir(folder_path))
    )
    seen = {"sharded": []}

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            parameters = list(model.parameters())
            # FSDP2: DTensors; DeepSpeed ZeRO-3: partitioned parameters (`ds_id`).
            seen["sharded"].append(
                all(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in parameters)
            )

    original_train = recipe.GroupRelativeTrainer.train

    def train(trainer, *args, **kwargs):
        trainer.add_callback(Probe())
        seen["distributed_type"] = str(trainer.accelerator.distributed_type)
        return original_train(trainer, *args, **kwargs)

    recipe.GroupRelativeTrainer.train = train
    arguments = make_parser().parse_args_and_config(sys.argv[1:])  # the recipe's own parser
    trainer, before, after = recipe.main(*arguments)
    seen.update(
        rank=trainer.args.process_index,
        world_size=trainer.args.world_size,
        step=trainer.state.global_step,
        before=before.to_dict(),
        after=after.to_dict(),
        uploads=uploads,
        entropy=[[e["step"], e["entropy"]] for e in trainer.state.log_history if "entropy" in e],
    )
    path = os.path.join(trainer.args.output_dir, f"sharded-{seen['rank']}.json")
    with open(path, "w") as handle:
        json.dump(seen, handle)


if __name__ == "__main__":
    main()
