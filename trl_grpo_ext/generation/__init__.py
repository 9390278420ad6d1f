"""Everything between dataset rows and sampled token ids: prompt rendering and tokenisation,
and the sampling settings of `generate`, each built in one place, and the engines that sample.

- `prompts.py`, `sampling.py`: prompts to token ids; the `SamplingSettings` of a run and its
  `GenerationConfig`; `settings.py`: the package's other settings records, each built once from
  the config (nothing else here reads it);
- `engines.py`: the engine interface, `build_engine`, `EngineWorker`; `weights.py`: how an
  engine with its own copy of the weights keeps it on the trainer's;
- `transformers_engine.py`, `process_worker.py`, `vllm_colocate.py`, `vllm_server.py`: the
  engines (transformers here or in a process of its own, vLLM colocated or on a server);
  `compacting.py`: the transformers engine's sampling loop, in which finished rows leave the
  batch; `merged_adapters.py` and `packed_weights.py`: the weights it samples with (LoRA
  merged in; on a CPU, laid out once for oneDNN);
- `requests.py`: a batch of rows as one `Request` (built in one place) and `run_request`, the
  one function that samples a request on an engine for every caller;
- `async_rollout.py`: the asynchronous pipeline and its in-flight batches; `ahead.py`: the
  producer's schedule of batches sampled ahead (`max_staleness` >= 1);
- `rollout.py`: the `Rollout` record; `assembly.py`: engine output to `Rollout`;
  `producer.py`: rows in, `Rollout`s out;
- `images.py`: images in prompts (TRL's dataset format) and the processor's multimodal fields,
  carried per completion.

Nothing here imports the training side (`tests/test_layout.py` checks it)."""

from .prompts import PromptEncoder, check_chat_template, check_prompt_dataset, is_conversational
from .sampling import SamplingSettings, isolated_from_checkpoint, sampling_config

__all__ = [
    "PromptEncoder",
    "SamplingSettings",
    "check_chat_template",
    "check_prompt_dataset",
    "is_conversational",
    "isolated_from_checkpoint",
    "sampling_config",
]
