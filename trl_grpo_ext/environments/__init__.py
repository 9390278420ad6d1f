"""Environments and tasks from the ecosystem as the trainer's keyword arguments.

Each adapter returns a dict for `GroupRelativeTrainer(model, args=args, **from_x(...))`:

- `from_reasoning_gym(names, size=..., seed=..., **config)`: reasoning-gym's procedural tasks
  (`train_dataset`, `reward_funcs`: its own `score_answer`).
- `from_verifiers(env)`: a verifiers (`verifiers.v1`) environment or taskset (`train_dataset`,
  `reward_funcs` with `reward_weights`, and its tools as an `environment_factory`).
- `from_openenv(url or client class, ...)`: an OpenEnv environment server (`environment_factory`
  with the server's reward; one reset session per rollout).

Importing this package needs none of the three source packages; an adapter whose package is
missing raises an `ImportError` that says `pip install 'trl_grpo_ext[environments]'`.
See docs/environments.md.
"""

from .openenv import from_openenv
from .reasoning_gym import from_reasoning_gym
from .verifiers import from_verifiers

__all__ = ["from_openenv", "from_reasoning_gym", "from_verifiers"]
