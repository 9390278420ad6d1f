"""Everything between dataset rows and sampled token ids: prompt rendering and tokenisation,
and the sampling settings of `generate`, each built in one place, and the engines that sample.

- `prompts.py`, `sampling.py`: prompts to token ids; the one `GenerationConfig` of a run;
- `engines.py`: the engine interface, `build_engine`, `WeightPublisher`, `EngineWorker`;
- `transformers_engine.py`, `process_worker.py`, `vllm_colocate.py`, `vllm_server.py`: the
  engines (transformers here or in a process of its own, vLLM colocated or on a server);
- `async_rollout.py`: the asynchronous pipeline and its in-flight batches;
- `rollout.py`: the `Rollout` record; `producer.py`: rows in, `Rollout`s out.

Nothing here imports the training side (`tests/test_layout.py` checks it)."""

from .prompts import PromptEncoder, check_chat_template, check_prompt_dataset, is_conversational
from .sampling import isolated_from_checkpoint, sampling_config, sampling_config_from_args

__all__ = [
    "PromptEncoder",
    "check_chat_template",
    "check_prompt_dataset",
    "is_conversational",
    "isolated_from_checkpoint",
    "sampling_config",
    "sampling_config_from_args",
]
