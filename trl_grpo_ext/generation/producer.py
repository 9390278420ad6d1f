"""`RolloutProducer`: dataset rows in, `Rollout`s out. The trainer's one generation path.

It holds everything between the prompts of a generation batch and the sampled token ids:

- the `PromptEncoder` (chat template, tokenisation, `max_prompt_length`) and the
  `RequestBuilder` that turns a batch of rows into one `Request` (prompts encoded once, their
  images' fields, each rollout's tools and environment), in one place (`requests.py`);
- the sampling settings, built once from the config (`generation_config` for training,
  `eval_generation_config` with `num_generations_eval` completions per prompt);
- the engine (`engines.build_engine`: transformers, vLLM colocated or a vLLM server), which
  `publish` keeps on the trainer's weights;
- with `max_staleness` k >= 1, the `RolloutsAhead` schedule (`ahead.py`): a rollout worker
  samples the batches of the next k steps while the trainer trains.

Every batch is one `Request`, run on an engine by `requests.run_request` (here, or on the
rollout worker's thread) and turned into a `Rollout` by `to_rollout`: the synchronous trainer,
`max_staleness` 0 (the synchronous trainer itself: it waits for each batch right after
publishing the weights), the asynchronous worker and evaluations alike. Synchronous sampling is
seeded per generation batch by the trainer.

With tools or environments (`agent`), a batch is started when its request is built
(`Agent.start`: environments reset, prompts rendered with the tools) and its turns are sampled
by `multi_turn.ToolLoop`. Environments come from a slot of the pool: slot 0 when synchronous,
else the slots of `ahead.py`, and one for batches sampled outside the schedule (`"outside"`:
`evaluate()`, `generate_rollouts` called directly).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, replace

import torch

from .ahead import OnWorkerThread, RolloutsAhead
from .assembly import RolloutAssembler
from .async_rollout import GeneratedBatch, RolloutPipeline
from .engines import build_engine, max_model_len
from .images import image_token_id, images_unsupported
from .multi_turn import ToolCallFormat, ToolLoop
from .prompts import PromptEncoder
from .requests import Request, RequestBuilder, run_request
from .rollout import CompletionEnds, Rollout, eos_token_ids
from .sampling import SamplingSettings
from .settings import GenerationSettings, RolloutSettings


class RolloutProducer:
    """Samples the completions of generation batches, synchronously or ahead of the trainer.

    Args:
        settings (`settings.GenerationSettings`): the sampling, engine and rollout records,
            built once from the config (`GenerationSettings.from_config`).
        tokenizer: renders, tokenises and decodes.
        eos_token_ids (`list[int]`): the tokens that end a completion.
        policy (`Callable[[], ContextManager]`): yields the model to generate with in this
            process (unwrapped, gathered under ZeRO-3, in eval mode).
        model (`Callable[[], nn.Module]`): the unwrapped model being trained (a `PeftModel`
            under LoRA), whose weights are published to the engine or the rollout worker.
        engine_folder (`str`, *optional*): the base weights of a colocated vLLM engine.
        lora_rank (`int`, *optional*): the adapters' rank under LoRA; None for full fine-tuning.
        agent (*optional*): multi-turn rollouts with tools (`tools.Agent`): `start(rows, group)`
            gives each rollout its prompt, tools and environment, `runner` runs tool calls.
        processor (*optional*): the model's multimodal processor, for prompts with images
            (`images.py`); its image token is never sampled.
    """

    def __init__(
        self,
        settings: GenerationSettings,
        tokenizer,
        eos_token_ids,
        *,
        policy,
        model,
        engine_folder=None,
        lora_rank=None,
        agent=None,
        processor=None,
    ):
        self.settings, self.tokenizer, self.eos_token_ids = settings, tokenizer, eos_token_ids
        rollout = self.rollout_settings = settings.rollout
        self.processor = processor
        self.policy, self.model = policy, model
        self.agent, self.tool_loop = agent, None
        format = chat_template = None
        if agent is not None:
            format = ToolCallFormat(tokenizer, rollout.chat_template_kwargs, processor)
            chat_template = format.chat_template
        self.encoder = PromptEncoder(
            tokenizer,
            rollout.max_prompt_length,
            rollout.chat_template_kwargs,
            chat_template,
            processor,
        )
        ids = dict(eos_token_id=eos_token_ids, pad_token_id=tokenizer.pad_token_id)
        if processor is not None:  # a sampled image token would have no image features
            ids["suppress_tokens"] = [image_token_id(processor, model())]
        self.generation_config = settings.sampling.generation_config(
            num_return_sequences=rollout.num_generations, **ids
        )
        self.eval_generation_config = settings.sampling.generation_config(
            num_return_sequences=rollout.num_generations_eval or rollout.num_generations, **ids
        )
        self.sampling = self.generation_config  # the eval one inside `evaluating()`
        self.engine = build_engine(
            settings.engine, policy, model, engine_folder, lora_rank, tokenizer
        )
        if format is not None:
            self.tool_loop = ToolLoop(
                format,
                agent.runner,
                eos_token_ids=eos_token_ids,
                stop_strings=self.generation_config.stop_strings,
                pad_token_id=tokenizer.pad_token_id,
                max_completion_length=settings.sampling.max_completion_length,
                max_model_len=max_model_len(settings.engine, model(), self.engine),
                max_iterations=rollout.max_tool_calling_iterations,
            )
        stops = self.generation_config.stop_strings
        self.ends = CompletionEnds.of(eos_token_ids, stops, tokenizer)
        self.requests = RequestBuilder(self.encoder, agent, self._check_images_supported)
        self.assembler = RolloutAssembler(
            tokenizer, eos_token_ids, self.ends, rollout.pad_to_multiple_of
        )
        self.staleness_counts: dict[int, int] = {}
        self.ahead = RolloutsAhead(self)  # with max_staleness >= 1
        self._scheduled: ScheduledBatch | None = None  # set by `scheduled`

    # ------------------------------------------------------------ synchronous

    def encode(self, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder.encode([row["prompt"] for row in rows])

    def publish(self, version: int) -> None:
        """Brings an engine with its own weights up to the trainer's (version = global step)."""
        self.engine.publish(version)

    @contextlib.contextmanager
    def scheduled(self, index: int, round_index: int = 0):
        """A block in which the next `generate` call is generation batch `index` (sampling
        round `round_index`) of the training schedule: the trainer calls the public
        `generate_rollouts` inside it in every mode, so an override of it always runs. In
        asynchronous mode that `generate` takes the batch from the rollout worker (`consume`);
        the record yielded then holds its staleness. Synchronous mode samples now, as outside
        the block."""
        record = ScheduledBatch(index, round_index)
        self._scheduled = record
        try:
            yield record
        finally:
            self._scheduled = None

    def generate(self, rows: list[dict], version: int) -> Rollout:
        """Samples `self.sampling.num_return_sequences` completions per row with the weights of
        `version` (the current ones): now, or, for the batch of a `scheduled` block in
        asynchronous mode, from the rollout worker (generated up to `max_staleness` steps
        earlier). transformers samples from the global generator (seeded by the caller); an
        engine with its own weights gets a seed drawn from it. While the asynchronous worker
        owns the engine (`evaluate()` during training), the sampling runs on the worker's
        thread, in turn with its batches."""
        batch, self._scheduled = self._scheduled, None  # a scheduled batch is taken once
        if batch is not None and self.rollout_settings.max_staleness:
            request, generated, batch.staleness = self.ahead.consume(
                rows, batch.index, version, batch.round_index
            )
            self.staleness_counts[batch.staleness] = (
                self.staleness_counts.get(batch.staleness, 0) + 1
            )
            return self.to_rollout(rows, request, generated)
        if batch is not None and self.rollout_settings.max_staleness == 0:
            # k = 0 waits for each batch right after publishing the weights: the synchronous
            # trainer itself, sampling here, whose staleness is 0
            batch.staleness = 0
            self.staleness_counts[0] = self.staleness_counts.get(0, 0) + 1
        seed = None
        if self.engine.own_weights:
            seed = int(torch.randint(0, 2**31 - 1, ()))
        return self._sample(rows, self.sampling, version, seed)

    def _sample(self, rows, generation_config, version, seed) -> Rollout:
        """Samples `rows` now, on this thread (or the worker's, while it owns the engine)."""
        engine = self.evaluation_engine(version)
        group = generation_config.num_return_sequences or 1
        request = self.requests.build(rows, group, self._outside_slot)
        generated = run_request(
            engine, generation_config, seed, request.engine_prompts, request.tools, self.tool_loop
        )
        return self.to_rollout(rows, request, GeneratedBatch(None, version, *generated))

    def to_rollout(self, rows, request: Request, batch: GeneratedBatch) -> Rollout:
        """The `Rollout` of a request from what its engine returned (`run_request`'s output,
        here or on the rollout worker's thread), for every caller."""
        ids, mask = batch.prompt_ids, batch.prompt_mask
        if batch.turns is not None:
            return self.assembler.turns_rollout(
                rows, request, ids, mask, batch.turns, batch.version
            )
        return self.build_rollout(
            rows,
            ids,
            mask,
            batch.completion_ids,
            batch.behaviour_logps,
            batch.version,
            prompts=request.prompts,
            image_inputs=request.completion_images,
        )

    def _check_images_supported(self) -> None:
        """Prompts with images go through the transformers engine only, for now: any other
        would sample from their text alone, so it is an error that says so."""
        unsupported = images_unsupported(self.settings.engine.use_vllm, self.engine)
        if unsupported:
            raise ValueError(unsupported)

    @classmethod
    def for_model(
        cls,
        model,
        tokenizer,
        *,
        chat_template_kwargs=None,
        engine=None,
        agent=None,
        max_completion_length: int | None = None,
        max_tool_calling_iterations: int | None = None,
    ):
        """A producer that samples from `model` alone, outside any trainer (the evaluation
        harness on a bare model, `evaluation.generate`): the config's defaults, prompts rendered
        with `chat_template_kwargs`, sampled by `engine` (by default `model`'s own `generate`,
        in eval mode), through the tools of `agent` (`tools.Agent`) when given, within
        `max_completion_length` tokens and `max_tool_calling_iterations` calls. Sample with
        `generate`, inside `evaluating(generation_config)`."""
        from .engines import in_eval_mode

        # the records' defaults: transformers in this process, one completion per prompt
        sampling = SamplingSettings()
        if max_completion_length is not None:
            sampling = replace(sampling, max_completion_length=max_completion_length)
        settings = GenerationSettings(
            sampling=sampling,
            rollout=RolloutSettings(
                chat_template_kwargs=chat_template_kwargs,
                max_tool_calling_iterations=max_tool_calling_iterations,
            ),
        )
        producer = cls(
            settings,
            tokenizer,
            eos_token_ids(model, tokenizer),
            policy=lambda: in_eval_mode(model),
            model=lambda: model,
            agent=agent,
        )
        if engine is not None:
            producer.engine = engine
        return producer

    @property
    def _outside_slot(self):
        """The environments' slot of batches sampled outside the training schedule: slot 0 when
        synchronous (free between steps), else one of their own."""
        return "outside" if self.rollout_settings.max_staleness else 0

    def evaluation_engine(self, version: int):
        """The engine to sample with outside the training schedule (evaluations), with the
        weights of `version`: published now, or, while the asynchronous worker owns the engine,
        published and sampled on the worker's thread, so that one thread alone uses the engine."""
        if self.ahead.engine_worker is not None:
            return OnWorkerThread(self.ahead, self.engine, version)
        self.publish(version)
        return self.engine

    @contextlib.contextmanager
    def evaluating(self, generation_config=None):
        """A block in which `generate` samples outside the training schedule with
        `generation_config` (evaluations: `trainer.evaluate` and the evaluation harness, through
        the public `generate_rollouts`), by default the run's evaluation settings
        (`num_generations_eval` completions per prompt). The tokens the run never samples (a
        VLM's image token) stay suppressed whatever `generation_config` says."""
        config = generation_config or self.eval_generation_config
        suppressed = self.generation_config.suppress_tokens
        if suppressed and config.suppress_tokens != suppressed:
            config = copy.deepcopy(config)
            config.suppress_tokens = suppressed
        self.sampling = config
        try:
            yield
        finally:
            self.sampling = self.generation_config

    def build_rollout(self, rows, prompt_ids, prompt_mask, completion_ids, logps, version, **kw):
        """A `Rollout` from an engine's `(N, T)` output (`RolloutAssembler.build_rollout`):
        each completion cut where it ends, decoded, the columns repeated per completion."""
        return self.assembler.build_rollout(
            rows, prompt_ids, prompt_mask, completion_ids, logps, version, **kw
        )

    def from_rollout_func(self, rows, rollout_func, version: int) -> Rollout:
        """The rollout a user's `rollout_func(prompts)` sampled (TRL's contract,
        `RolloutAssembler.from_rollout_func`), with the engine at the weights of `version`."""
        self.publish(version)  # a function that samples with the engine gets current weights
        group = self.sampling.num_return_sequences
        return self.assembler.from_rollout_func(rows, rollout_func, group, version)

    # ----------------------------------------------------------- asynchronous

    def pull(self, epoch_iterator, num_batches: int) -> list[list[dict]]:
        """The prompt batches of this step; with `max_staleness` those of the next steps stay
        in the lookahead, for the rollout worker (`RolloutsAhead.pull`)."""
        return self.ahead.pull(epoch_iterator, num_batches)

    @property
    def pipeline(self) -> RolloutPipeline | None:
        """The asynchronous rollout pipeline, once started."""
        return self.ahead.pipeline

    def _pipeline(self) -> RolloutPipeline:
        return self.ahead.start()

    def state(self) -> dict:
        """What a checkpoint holds of the producer: `in_flight` (the batches the rollout worker
        was asked for and not consumed; waits for them), `not_kept` (multi-turn ones among them,
        which cannot be stored) and `staleness_counts` (not logged yet)."""
        return {
            "in_flight": self.ahead.in_flight(),
            "not_kept": self.ahead.not_kept(),
            "staleness_counts": dict(self.staleness_counts),
        }

    def load_state(self, in_flight: dict, staleness_counts: dict[int, int]) -> None:
        """Puts back what `state` returned: the next rollout worker serves the `in_flight`
        batches instead of sampling them again (when asked for the same prompts and seed)."""
        self.ahead.restored = dict(in_flight)
        self.staleness_counts = dict(staleness_counts)

    def close(self) -> None:
        """Stops the rollout worker (the engine stays, for evaluation and the next `train`)."""
        self.ahead.close()

    def shutdown(self) -> None:
        """Stops the rollout worker and closes the engine: a colocated vLLM engine frees its
        memory and the temporary copy of the base model it was built on, and the published
        adapter versions are deleted. Nothing can be generated afterwards."""
        self.close()
        self.engine.close()


@dataclass
class ScheduledBatch:
    """A generation batch of the training schedule (`RolloutProducer.scheduled`); `staleness`
    is set once it came from the rollout worker (asynchronous mode)."""

    index: int
    round_index: int = 0
    staleness: int | None = None
