"""How much memory a run will hold in each of its phases, predicted from the model's config alone.

`plan_memory(args, model, peft_config, device)` reads the model's configuration (never its
weights), lays the model out on the meta device to count the parameters of every layer, and adds
up what each phase of a training step holds at its peak. Every phase holds the weights; the
phases after the first optimizer step also hold the trainable parameters' AdamW states:

- `weights`: the policy's weights, the adapter (LoRA), and a reference model (full fine-tuning
  with `beta > 0`);
- `optimizer`: + the gradients and AdamW's two float32 states per trainable parameter;
- `sampling`: + the KV cache of a generation batch (`layers x 2 x kv heads x head dim x rows x
  (prompt + completion) x bytes`; on CUDA the compiled decoding's static cache, rows and
  positions rounded up to their buckets), a decoding step's float32 logits and, on a CPU in float32,
  the linear layers' weights laid out again for oneDNN (`generation/packed_weights.py`);
  a colocated vLLM engine's share of the device instead (`vllm_gpu_memory_utilization`);
- `logprobs`: + the log-prob pass without gradient of a micro-batch: its last hidden states and
  the output head's chunk of logits (`logprobs.py`: about three float32 buffers of
  `chunk_tokens x V`; the model's full logits where the head is adapted);
- `backward`: + the activations that the forward pass of a micro-batch keeps for the backward
  pass (every layer's, or with gradient checkpointing each layer's input and one layer's),
  the head's chunk again and the gradients.

On a CUDA device the bytes are those `torch.cuda.max_memory_allocated` counts; on a CPU, those
above the process's resident memory after its imports, before the model loads. The activations
a layer keeps are counted from its widths (`ACTIVATION_WIDTHS`), for every row of a micro-batch in
full (packing a group's shared prompt, `logprobs.py`, saves little memory: measured on SmolLM2);
on a CPU the heap's slack and the runtime's fixed part are calibrated against measured peaks
(`benchmarks/memory_plan.py`, docs/benchmarks.md: 0.89x to 1.05x of them at three shapes). On
CUDA the plan is not yet checked against a measurement.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from .generation import compiled_decoding

__all__ = [
    "MemoryPlan",
    "adapter_parameters",
    "check_fits",
    "free_bytes",
    "kv_cache_bytes",
    "longest_prompt",
    "plan_memory",
    "recipe_memory_plan",
    "recipe_plan",
]

logger = logging.getLogger(__name__)

GIB = 2**30

# Values a decoder layer keeps per token for its backward pass, in units of the hidden size H,
# the MLP width I, the query width (heads x head dim) and the key/value width, with LoRA or full
# fine-tuning alike: the two norms' inputs and outputs (4 H), the attention's queries, keys,
# values and output (2 q + 2 kv), the MLP's gate, up, activation and product (4 I).
ACTIVATION_WIDTHS = {"hidden": 4, "intermediate": 4, "query": 2, "key_value": 2}
# On a CPU the plan is of the resident set, which holds more than the tensors alive: glibc's heap
# keeps blocks freed by one phase (the sampling's laid-out weights, the forward pass's
# activations) in pieces that the next reuses only in part, and the libraries' first use
# (threads, kernels, the optimizer's and data loader's objects) adds a fixed amount. Both are
# calibrated on measured peaks (`benchmarks/memory_plan.py`, docs/benchmarks.md): the tiny model's
# peak is the fixed part alone, SmolLM2-135M's (backward) and the Qwen2.5-0.5B shape's
# (sampling) were 1.11x and 1.12x the tensors' sum above it.
CPU_HEAP_FACTOR = 1.11
CPU_RUNTIME_BYTES = 36 * 2**20
# Prompt tokens assumed where `max_prompt_length` is None (the config's default limit).
UNLIMITED_PROMPT_TOKENS = 512
# Float32 logits buffers of one output-head chunk alive at once (`logprobs.py`).
CHUNK_BUFFERS = 3


@dataclass(frozen=True)
class MemoryPlan:
    """The predicted peak memory of each phase of a run (`plan_memory`).

    Args:
        peak_bytes (`int`): the largest phase's bytes.
        peak_phase (`str`): its name.
        phases (`dict[str, int]`): phase name -> bytes resident during it (weights included).
        advice (`str`): the setting that brings the peak phase down.
        device (`str`): the device the plan is for (`"cuda"`, `"cpu"`, ...).
    """

    peak_bytes: int
    peak_phase: str
    phases: dict[str, int]
    advice: str
    device: str = "cuda"
    assumed: str = ""  # the shapes the plan assumed, for the table's first line

    def table(self) -> str:
        """A text table: GiB per phase, the peak marked, and the advice under it."""
        width = max(len(name) for name in self.phases)
        title = (
            f"memory plan ({self.device}, predicted{'; ' if self.assumed else ''}{self.assumed})"
        )
        lines = [title, f"{'phase':<{width}}  GiB"]
        for name, value in self.phases.items():
            mark = "  <- peak" if name == self.peak_phase else ""
            lines.append(f"{name:<{width}}  {value / GIB:7.2f}{mark}")
        lines.append(f"to lower the peak ({self.peak_phase}): {self.advice}")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Shapes:
    """What the plan needs of a model: parameter counts and the layers' widths."""

    model_type: str
    vision_language: bool
    parameters: int  # all parameters (tied ones once)
    linear: dict[str, tuple[int, int]]  # name -> (in, out) of each nn.Linear
    decoder_linear: frozenset[str]  # those of the language model's decoder
    head_name: str | None  # the output head's module name
    vocab: int
    hidden: int
    intermediate: int
    query_width: int
    kv_width: int
    attention_heads: int
    layers: int
    cache_layers: list[int | None] = field(default_factory=list)  # window per KV layer


def plan_memory(
    args, model, peft_config=None, device="cuda", *, device_bytes: int | None = None
) -> MemoryPlan:
    """Predicts the peak memory of each phase of training with `args`, from the config only.

    Args:
        args (`GroupRelativeConfig`): the run's configuration (batch shapes, lengths, dtype,
            `beta`, gradient checkpointing, vLLM).
        model (`str` or `transformers.PretrainedConfig`): a Hub id or local folder, whose
            config alone is read (`AutoConfig.from_pretrained`), or the config itself.
        peft_config (`peft.LoraConfig`, *optional*): the adapter; None for full fine-tuning.
        device (`str` or `torch.device`, *optional*, defaults to `"cuda"`): the device the run
            trains on; on a CPU the float32 linear layers are laid out again while sampling.
        device_bytes (`int`, *optional*): the device's total memory, of which a colocated vLLM
            engine takes `vllm_gpu_memory_utilization`; None: asked of the device.

    Returns:
        `MemoryPlan`: bytes per phase, the peak phase and what to change to lower it.
    """
    config = _model_config(model, args)
    shapes = _shapes(config)
    device_type = torch.device(device).type
    dtype = _dtype(args, config)
    size = torch.finfo(dtype).bits // 8

    weights = shapes.parameters * size
    adapter = _adapter_parameters(shapes, peft_config) if peft_config is not None else 0
    if peft_config is not None:
        trainable, trainable_size = adapter, 4  # PEFT keeps adapters of bf16/fp16 in float32
    else:
        trainable, trainable_size = shapes.parameters, size
    reference = weights if (args.beta > 0 and peft_config is None) else 0
    states = 8 * trainable  # AdamW: two float32 states per trainable parameter
    gradients = trainable * trainable_size
    resident = weights + adapter * 4 + reference

    colocated = bool(args.use_vllm) and args.vllm_mode == "colocate"
    engine = 0
    if colocated:
        total = device_bytes if device_bytes is not None else _device_total_bytes(device_type)
        engine = int(args.vllm_gpu_memory_utilization * total)
    always_engine = 0 if args.vllm_enable_sleep_mode else engine
    trained = resident + states + always_engine  # after the first optimizer step

    rows = args.per_device_train_batch_size * args.steps_per_generation  # generation batch
    micro = args.per_device_train_batch_size
    # Without a limit on prompts (None, as TRL), the plan assumes prompts of the default limit.
    prompt = args.max_prompt_length or UNLIMITED_PROMPT_TOKENS
    completion = args.max_completion_length
    length = prompt + completion

    # Sampling: the KV cache of the generation batch, a step's logits (float32, three buffers:
    # logits, processed scores, probabilities) and the prompts' pass.
    if colocated:
        sampling = resident + states + engine
    elif args.use_vllm:  # a vLLM server samples: nothing more here
        sampling = trained
    else:  # the transformers engine samples in this process
        sampling = trained + _sampling_bytes(args, shapes, device_type, dtype, rows, prompt)

    positions = micro * completion
    head = _head_bytes(args, shapes, peft_config, micro, size)
    hidden_states = positions * shapes.hidden * size
    per_token = _activation_values_per_token(shapes, peft_config)
    one_layer = micro * length * per_token * size
    logprobs = trained + hidden_states + max(head, one_layer)

    layers = shapes.layers
    if args.gradient_checkpointing:
        kept = layers * micro * length * shapes.hidden * size + one_layer
    else:
        kept = layers * one_layer
    backward = trained + gradients + kept + 2 * hidden_states + head

    phases = {
        "weights": resident + always_engine,
        "optimizer": trained + gradients,
        "sampling": sampling,
        "logprobs": logprobs,
        "backward": backward,
    }
    if device_type == "cpu":  # the resident set: the allocator's slack and the runtime's own
        phases = {
            name: CPU_HEAP_FACTOR * value + CPU_RUNTIME_BYTES for name, value in phases.items()
        }
    phases = {name: int(value) for name, value in phases.items()}
    peak_phase = max(phases, key=phases.get)
    return MemoryPlan(
        peak_bytes=phases[peak_phase],
        peak_phase=peak_phase,
        phases=phases,
        advice=_advice(peak_phase, args, peft_config, rows),
        device=device_type,
        assumed=(
            f"{rows} rows sampled, {micro} a micro-batch, {prompt} prompt + {completion} "
            f"completion tokens, {str(dtype).removeprefix('torch.')}"
        ),
    )


def _head_bytes(args, shapes: _Shapes, peft_config, micro: int, size: int) -> int:
    """The output head over a micro-batch's completion positions: chunks of float32 logits, or
    the model's own full logits where the head is an adapted layer."""
    completion = args.max_completion_length
    positions = micro * completion
    chunk = min(args.logprob_chunk_tokens or _default_chunk_tokens(shapes.vocab), positions)
    head_adapted = peft_config is not None and shapes.head_name in _targets(shapes, peft_config)
    if head_adapted:  # the logits (B, T, V), then float32 buffers of 4 rows at a time
        rows_at_once = min(4, micro) * completion  # `token_logprobs`' default chunk_size
        return positions * shapes.vocab * size + CHUNK_BUFFERS * rows_at_once * shapes.vocab * 4
    return CHUNK_BUFFERS * chunk * shapes.vocab * 4


def _sampling_bytes(args, shapes: _Shapes, device_type: str, dtype, rows: int, prompt: int):
    """What sampling `rows` rows of `prompt` + `max_completion_length` tokens in this process
    holds beyond the trained weights: the KV cache (on CUDA compiled decoding's static cache,
    rows and positions bucketed), a step's logits or the prompts' pass, whichever is larger,
    and on a CPU in float32 the linear layers laid out again for oneDNN."""
    size = torch.finfo(dtype).bits // 8
    completion = args.max_completion_length
    cache_rows, cache_length = rows, prompt + completion
    if device_type == "cuda" and _decodes_compiled(args):  # a static cache, bucketed
        shape = compiled_decoding.decoding_shape(rows, prompt, completion)
        cache_rows, cache_length = shape.rows, shape.cache_length
    kv_cache = _kv_cache_bytes(shapes, cache_rows, cache_length, size)
    step_logits = CHUNK_BUFFERS * rows * shapes.vocab * 4
    prompts = rows // args.num_generations
    prefill = prompts * prompt * (2 * shapes.hidden + 2 * shapes.intermediate) * size
    laid_out = 0
    if device_type == "cpu" and dtype == torch.float32:
        laid_out = 4 * sum(i * o for i, o in shapes.linear.values() if i * o >= 2**18)
    return kv_cache + max(step_logits, prefill) + laid_out


def kv_cache_bytes(config, rows: int, tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the KV cache of `rows` sequences of `tokens` tokens for a model of `config`:
    `layers x 2 x kv heads x head dim x rows x tokens x bytes` (a sliding-window layer holds
    its window at most; layers without attention hold none)."""
    return _kv_cache_bytes(_shapes(config), rows, tokens, torch.finfo(dtype).bits // 8)


def adapter_parameters(config, peft_config) -> int:
    """Parameters of `peft_config`'s LoRA adapter on a model of `config`, from the shapes of
    the layers it adapts."""
    return _adapter_parameters(_shapes(config), peft_config)


def _kv_cache_bytes(shapes: _Shapes, rows: int, tokens: int, size: int) -> int:
    held = sum(min(window or tokens, tokens) for window in shapes.cache_layers)
    return held * 2 * shapes.kv_width * rows * size


def _decodes_compiled(args) -> bool:
    """Whether the transformers engine samples with compiled decoding on CUDA, whose static
    cache holds bucketed rows and positions (`generation.compiled_decoding`): the default,
    unless the settings name a cache or `disable_compile`."""
    kwargs = args.generation_kwargs or {}
    cache = kwargs.get("cache_implementation", args.cache_implementation)
    return cache is None and not kwargs.get("disable_compile") and kwargs.get("use_cache", True)


def _model_config(model, args):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        config = model
    elif isinstance(model, str):
        config = AutoConfig.from_pretrained(
            model, trust_remote_code=getattr(args, "trust_remote_code", False)
        )
    else:
        raise TypeError(
            f"model must be a Hub id, a folder or a PretrainedConfig, got {type(model).__name__}; "
            "for a loaded model pass model.config."
        )
    return config


def _dtype(args, config) -> torch.dtype:
    """The weights' dtype: `model_init_kwargs["dtype"]`, else bf16/fp16 from `args`, else the
    config's own dtype, else float32."""
    wanted = (getattr(args, "model_init_kwargs", None) or {}).get("dtype")
    if wanted in (None, "auto"):
        if getattr(args, "bf16", False):
            return torch.bfloat16
        if getattr(args, "fp16", False):
            return torch.float16
        wanted = getattr(config, "dtype", None)
    if isinstance(wanted, str):
        wanted = getattr(torch, wanted, None)
    return wanted if isinstance(wanted, torch.dtype) else torch.float32


def _shapes(config) -> _Shapes:
    """Counts the parameters of `config`'s model laid out on the meta device (no memory): a
    causal LM, or a vision-language model whole (`AutoModelForImageTextToText`, as loaded)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision_language = type(config) in AutoModelForImageTextToText._model_mapping
    auto = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    text = config.get_text_config()
    linear = {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    decoder = {id(module) for module in model.get_decoder().modules()}
    head = model.get_output_embeddings()
    head_name = next((name for name, module in model.named_modules() if module is head), None)
    hidden = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    cache_layers = [
        window if kind == "sliding_attention" else None
        for kind in kinds
        if kind in ("full_attention", "sliding_attention", "chunked_attention")
    ]
    return _Shapes(
        model_type=config.model_type,
        vision_language=vision_language,
        parameters=sum(p.numel() for p in model.parameters()),
        linear=linear,
        decoder_linear=frozenset(
            name
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and id(module) in decoder
        ),
        head_name=head_name,
        vocab=text.vocab_size,
        hidden=hidden,
        intermediate=getattr(text, "intermediate_size", None) or 4 * hidden,
        query_width=heads * head_dim,
        kv_width=kv_heads * head_dim,
        attention_heads=heads,
        layers=text.num_hidden_layers,
        cache_layers=cache_layers,
    )


def _targets(shapes: _Shapes, peft_config) -> set[str]:
    """The linear layers `peft_config` adapts, matched as PEFT matches them: a string is a
    regular expression over the full name, a list names module suffixes; `"all-linear"` is
    the decoder's linear layers (all but the output head; a vision-language model's language
    model only, as `models.language_model_lora` narrows it); None, PEFT's defaults for the
    architecture (all-linear for a vision-language model, as `language_model_lora` does)."""
    targets = peft_config.target_modules
    names = list(shapes.linear)
    if targets is None:  # PEFT's defaults for the architecture; all-linear for a VLM's LM
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        targets = "all-linear" if shapes.vision_language else DEFAULTS.get(shapes.model_type)
        if targets is None:
            raise ValueError(
                f"PEFT has no default target modules for model type {shapes.model_type!r}: set "
                "the adapter's target_modules (e.g. 'all-linear')."
            )
    if isinstance(targets, str):
        if targets == "all-linear":
            return set(shapes.decoder_linear) - {shapes.head_name}
        return {name for name in names if re.fullmatch(targets, name)}
    wanted = set(targets)
    return {name for name in names if name in wanted or name.rsplit(".", 1)[-1] in wanted}


def _adapter_parameters(shapes: _Shapes, peft_config) -> int:
    """LoRA's A `(r, in)` and B `(out, r)` of each adapted layer, `r` from `rank_pattern`
    where a pattern matches, and a full trainable copy of each of `modules_to_save`."""
    total = 0
    patterns = getattr(peft_config, "rank_pattern", None) or {}
    for name in _targets(shapes, peft_config):
        inputs, outputs = shapes.linear[name]
        rank = next(
            (r for pattern, r in patterns.items() if re.search(rf"(^|\.){pattern}$", name)),
            peft_config.r,
        )
        total += rank * (inputs + outputs)
        if getattr(peft_config, "use_dora", False):
            total += outputs  # the magnitude vector
    for name in getattr(peft_config, "modules_to_save", None) or []:
        for full, (inputs, outputs) in shapes.linear.items():
            if full == name or full.endswith("." + name):
                total += inputs * outputs
    return total


def _activation_values_per_token(shapes: _Shapes, peft_config) -> int:
    """Values one decoder layer keeps per token for the backward pass (`ACTIVATION_WIDTHS`),
    plus LoRA's `r`-wide intermediate of each adapted layer."""
    widths = ACTIVATION_WIDTHS
    values = (
        widths["hidden"] * shapes.hidden
        + widths["intermediate"] * shapes.intermediate
        + widths["query"] * shapes.query_width
        + widths["key_value"] * shapes.kv_width
    )
    if peft_config is not None:
        values += peft_config.r * len(_targets(shapes, peft_config)) // shapes.layers
    return values


def _default_chunk_tokens(vocab: int) -> int:
    from .logprobs import default_chunk_tokens

    return default_chunk_tokens(vocab)


def _device_total_bytes(device_type: str) -> int:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info()[1]
    return meminfo_bytes("MemTotal")


def meminfo_bytes(key: str) -> int:
    """A field of /proc/meminfo (`MemTotal`, `MemAvailable`) in bytes; 0 where there is none."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def free_bytes(device="cuda") -> int:
    """Memory free for the run on `device`: CUDA's free memory (`torch.cuda.mem_get_info`), or
    the CPU's available memory (`MemAvailable`)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return meminfo_bytes("MemAvailable")


def _advice(phase: str, args, peft_config, rows: int) -> str:
    micro = args.per_device_train_batch_size
    colocated = args.use_vllm and args.vllm_mode == "colocate"
    if colocated and (phase == "sampling" or not args.vllm_enable_sleep_mode):
        sleep = "" if args.vllm_enable_sleep_mode else " or set vllm_enable_sleep_mode=True"
        return (
            f"lower vllm_gpu_memory_utilization (now {args.vllm_gpu_memory_utilization}), the "
            f"engine's share of the device{sleep}"
        )
    if phase == "sampling":
        return (
            f"lower the generation batch ({rows} completions: per_device_train_batch_size="
            f"{micro} x steps_per_generation={args.steps_per_generation}) or "
            f"max_completion_length ({args.max_completion_length})"
        )
    if phase == "backward":
        if not args.gradient_checkpointing:
            return "set gradient_checkpointing=True"
        return (
            f"lower per_device_train_batch_size (now {micro}; raise gradient_accumulation_steps "
            f"to keep the batch) or max_completion_length ({args.max_completion_length})"
        )
    if phase == "logprobs":
        return (
            "lower logprob_chunk_tokens, or per_device_train_batch_size "
            f"(now {micro}; raise gradient_accumulation_steps to keep the batch)"
        )
    if args.beta > 0 and peft_config is None:
        return "train with LoRA (peft_config; its reference needs no copy) or set beta=0"
    if peft_config is None:
        return "train with LoRA (peft_config) instead of every weight, or load in bf16"
    return "a smaller model, or load it in bf16 (bf16=True)"


def check_fits(plan: MemoryPlan, free: int, ignore: bool = False) -> None:
    """Raises a `ValueError` naming the peak phase and the settings to change when `plan`'s
    peak exceeds `free` bytes; with `ignore`, logs that instead."""
    if plan.peak_bytes <= free:
        return
    message = (
        f"This run will not fit: its memory plan peaks at {plan.peak_bytes / GIB:.2f} GiB in the "
        f"{plan.peak_phase} phase, and the {plan.device} has {free / GIB:.2f} GiB free. To fit, "
        f"{plan.advice}.\n{plan.table()}\n"
        "The plan is a prediction from the model's config; --ignore_memory_plan runs anyway."
    )
    if not ignore:
        raise ValueError(message)
    logger.warning("%s (ignored: --ignore_memory_plan)", message)


def longest_prompt(tokenizer, prompts: list, tools=None, chat_template_kwargs=None) -> int:
    """Tokens of the longest of `prompts` as the trainer renders them (chat template, generation
    prompt, the `tools`' schemas), for a plan of the prompts a run will see."""
    from .generation.prompts import PromptEncoder, is_conversational

    encoder = PromptEncoder(tokenizer, chat_template_kwargs=chat_template_kwargs)
    texts = [encoder.render(prompt, tools) for prompt in prompts]
    special = not is_conversational(prompts[0])
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=special)["input_ids"])


def recipe_plan(
    training_args,
    model_args,
    model,
    device,
    device_bytes: int | None = None,
    prompt_tokens: int | None = None,
):
    """The plan of a recipe's run: `model` (its path, or config) with the recipe's LoRA
    (`trl.get_peft_config(model_args)`) and dtype (`model_args.dtype`), and prompts of
    `prompt_tokens` (the dataset's longest, when known) within `max_prompt_length`."""
    import copy

    from trl import get_peft_config

    training_args = copy.copy(training_args)  # what the run will see, for the plan alone
    if model_args.dtype not in (None, "auto"):  # the recipe loads the model in this dtype
        training_args.model_init_kwargs = {
            **(training_args.model_init_kwargs or {}),
            "dtype": model_args.dtype,
        }
    if prompt_tokens is not None:
        limit = training_args.max_prompt_length
        training_args.max_prompt_length = min(prompt_tokens, limit or prompt_tokens)
    peft_config = get_peft_config(model_args)
    return plan_memory(training_args, model, peft_config, device, device_bytes=device_bytes)


def recipe_memory_plan(
    script_args, training_args, model_args, model_path: str, tokenizer, train_dataset, tools=None
) -> bool:
    """The recipe's memory step, before any weights load: the plan (`recipe_plan`) of the
    training prompts as `tokenizer` renders them. With `--plan` it is printed and True is
    returned (the recipe stops); otherwise a plan that exceeds the device's free memory stops
    the run (`check_fits`) unless `--ignore_memory_plan`. False: go on."""
    device = training_args.device
    prompt_tokens = longest_prompt(
        tokenizer, train_dataset["prompt"], tools, training_args.chat_template_kwargs
    )
    plan = recipe_plan(training_args, model_args, model_path, device, prompt_tokens=prompt_tokens)
    if script_args.plan:
        print(plan.table(), flush=True)
        return True
    check_fits(plan, free_bytes(device), ignore=script_args.ignore_memory_plan)
    return False
