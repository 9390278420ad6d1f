"""trl_grpo_ext: Group Relative Policy Optimization as a `transformers.Trainer`."""

from .config import GroupRelativeConfig
from .generation.rollout import Rollout
from .memory_plan import MemoryPlan, plan_memory
from .trainer import GroupRelativeTrainer

__version__ = "0.1.0"
__all__ = [
    "GroupRelativeConfig",
    "GroupRelativeTrainer",
    "MemoryPlan",
    "Rollout",
    "__version__",
    "plan_memory",
]
