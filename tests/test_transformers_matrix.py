"""The settings a user combines, walked as a matrix: every pair of values of two settings of
the generation path and around it (how rollouts are made, asynchronous rollouts, the generation
batch, iterations, the reference model, dynamic sampling, evaluation during training, LoRA,
gradient checkpointing, truncated completions, logged completions, the loss, the rewards'
scaling, sampling settings, importance sampling's level, a streaming dataset, the precision)
meets in at least one cell, and each cell trains two steps on a tiny model under a deadline. A
cell passes when the run ends, with finite losses, rewards logged at the steps that sampled,
evaluation metrics where asked, the base weights frozen under LoRA, no thread or process left
running, and what `save_model` writes loading back as the model trained; a hang fails it at the
deadline with the stack of every thread. Each cell also runs three steps and resumes from its first checkpoint: the same
weights and metrics as the run straight through. The combinations the configuration refuses
are checked for a message that says what to change."""

import copy
import itertools
import math
import multiprocessing
import random
import sys
import tempfile
import threading
import weakref

import pytest
import torch
from agent_helpers import TOOL_PROMPT, add, needs_trl_1_16, one_thread, tool_calling_model
from datasets import Dataset
from deadline import deadline
from peft import PeftModel
from PIL import Image
from tqdm import tqdm
from trainer_helpers import make_trainer
from transformers.utils import logging as hf_logging

from trl_grpo_ext.tiny import tiny_model_and_tokenizer
from trl_grpo_ext.tiny_vlm import tiny_vlm_and_processor
from trl_grpo_ext.tiny_vlm_task import COLORS

DIMENSIONS = {
    # plain prompts; chat messages; chat with a tool the model calls; an environment's tool;
    # TRL's rollout_func; chat messages with an image each (a vision-language model)
    "rollouts": ["plain", "chat", "tools", "environment", "rollout_func", "images"],
    "max_staleness": [None, 1],  # synchronous, or a worker sampling one step ahead
    # one micro-batch per step; two accumulated; a generation batch buffered over two steps
    "batching": ["one", "accumulate", "buffer"],
    "num_iterations": [1, 2],
    "beta": [0.0, 0.04],
    "dynamic_sampling": [False, True],
    "evaluate": [False, True],
    "peft": [True, False],
    "gradient_checkpointing": [False, True],
    "mask_truncated_completions": [False, True],
    "log_completions": [False, True],
    "loss_type": ["dapo", "grpo"],
    "scale_rewards": ["group", "batch"],
    # temperature 1 unfiltered; top-k and top-p; a stop string; a static KV cache
    "sampling": ["plain", "filtered", "stop", "static_cache"],
    "importance_sampling_level": ["token", "sequence"],
    "dataset": ["rows", "stream"],  # a Dataset, or a streaming one (datasets.IterableDataset)
    # float32; bf16 mixed precision (autocast), which a GPU trains in by default; and that with
    # the weights in bf16, as `dtype="auto"` loads most checkpoints of the Hub
    "precision": ["fp32", "bf16", "bf16_weights"],
}
SAMPLING = {
    "plain": {},
    "filtered": {"temperature": 0.8, "top_k": 20, "top_p": 0.9},
    "stop": {"generation_kwargs": {"stop": ["1"]}},  # TRL's (vLLM's) name
    "static_cache": {"cache_implementation": "static"},
}
BATCHING = {
    "one": {"per_device_train_batch_size": 8},
    "accumulate": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    "buffer": {"per_device_train_batch_size": 4, "steps_per_generation": 2},
}
# Pairs of values the configuration refuses together, with a pattern of what it says.
REFUSED = {
    (("max_staleness", 1), ("num_iterations", 2)): (
        r"Asynchronous rollouts \(max_staleness\) need .* set num_iterations=1"
    ),
    (("max_staleness", 1), ("batching", "buffer")): (
        r"Asynchronous rollouts \(max_staleness\) need .* leave steps_per_generation"
    ),
    (("rollouts", "rollout_func"), ("max_staleness", 1)): (
        r"rollout_func samples in the training process: unset max_staleness"
    ),
}
DEADLINE_SECONDS = 120
DTYPES = {"fp32": torch.float32, "bf16": torch.float32, "bf16_weights": torch.bfloat16}


def pairs(cell: dict) -> set:
    return {((a, cell[a]), (b, cell[b])) for a, b in itertools.combinations(cell, 2)}


def refusal(cell: dict) -> str | None:
    """What the configuration says of a cell it refuses (a pattern of its message), or None."""
    refused = pairs(cell) & REFUSED.keys()
    return REFUSED[min(refused)] if refused else None


def pairwise(dimensions: dict, seed: int = 0, candidates: int = 200) -> list[dict]:
    """Accepted cells in which every pair of values of two dimensions occurs at least once,
    but the refused pairs: greedily, of `candidates` random accepted cells made to hold the
    first pair not yet covered, the one that covers the most pairs not yet covered."""
    names = list(dimensions)
    uncovered = {
        ((a, x), (b, y))
        for a, b in itertools.combinations(names, 2)
        for x in dimensions[a]
        for y in dimensions[b]
    } - REFUSED.keys()
    rng = random.Random(seed)
    cells = []
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=repr)
        options = []
        for _ in range(candidates):
            cell = {name: rng.choice(dimensions[name]) for name in names} | {a: x, b: y}
            if refusal(cell) is None:
                options.append(cell)
        best = max(options, key=lambda cell: len(pairs(cell) & uncovered))
        uncovered -= pairs(best)
        cells.append(best)
    return cells


CELLS = pairwise(DIMENSIONS)


def cell_id(cell: dict) -> str:
    return "-".join(f"{name}={value}" for name, value in cell.items())


def test_the_cells_cover_every_pair_of_settings_but_those_refused():
    covered = set().union(*map(pairs, CELLS))
    for a, b in itertools.combinations(DIMENSIONS, 2):
        for x, y in itertools.product(DIMENSIONS[a], DIMENSIONS[b]):
            assert (((a, x), (b, y)) in covered) != (((a, x), (b, y)) in REFUSED), (a, x, b, y)
    assert all(refusal(cell) is None for cell in CELLS)
    assert len(CELLS) < 40  # of the 1,769,472 cells of the full product


@pytest.mark.parametrize("refused", list(REFUSED), ids=repr)
def test_a_refused_cell_says_what_to_change(refused, tmp_path):
    accepted = {"max_staleness": 1, "num_iterations": 1, "batching": "one", "rollouts": "plain"}
    cell = {**CELLS[0], **accepted, **dict(refused)}
    assert refusal(cell) == REFUSED[refused]
    with pytest.raises(ValueError, match=REFUSED[refused]):
        build(cell, tmp_path, tool_model=None)


@pytest.fixture(scope="module")
def tool_model():
    return tool_calling_model()


def text(completion) -> str:
    """A completion's text: itself, or its messages' contents (conversational prompts)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion)


def odd_first_character(completions, **kwargs):
    """1.0 when the completion's first character has an odd code point."""
    return [float(ord(text(c)[0]) % 2) if text(c) else 0.0 for c in completions]


def varied_length(completions, **kwargs):
    """A reward that differs within a group: the completion's length in characters, mod 3."""
    return [float(len(text(completion)) % 3) for completion in completions]


def random_rollouts(prompts, trainer):
    """TRL's rollout_func contract: token ids sampled outside the trainer (random here, of
    random lengths, ending with eos), no log-probs, and a field the reward reads."""
    rng = random.Random(len(trainer.state.log_history) + 7 * trainer.state.global_step)
    eos = trainer.processing_class.eos_token_id
    completions = [
        [rng.randrange(10, 200) for _ in range(rng.randrange(1, 4))] + [eos] for _ in prompts
    ]
    return {
        "prompt_ids": [[5, 6, 7]] * len(prompts),
        "completion_ids": completions,
        "logprobs": None,
        "score": [float(rng.random() < 0.5) for _ in prompts],
    }


def from_score(completions, score, **kwargs):
    return score


class Adder:
    """An environment whose tool is `add`, which the tool-calling model calls; its reward is
    the number of calls."""

    def reset(self, **row):
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


def torch_compilers(thread) -> bool:
    """Whether `thread` is one that torch's compiler leaves running (where `generate` compiles
    the decoding steps: a static cache on a GPU): a worker of its pool of compile threads, or
    tqdm's monitor with no bar to watch but the one the compiler leaves open. Neither holds
    anything of the run's."""
    if thread.name == "tqdm_monitor":
        return all(bar.desc == "Inductor Compilation" for bar in list(tqdm._instances))
    # a ThreadPoolExecutor's worker holds a weak reference to its executor, first of its args
    async_compile = sys.modules.get("torch._inductor.async_compile")
    args = getattr(thread, "_args", ())
    return (
        async_compile is not None
        and bool(args)
        and isinstance(args[0], weakref.ref)
        and args[0]() is async_compile.AsyncCompile.pool()
    )


def loaded_in_bf16(model):
    """`model` saved and loaded with `from_pretrained(dtype=torch.bfloat16)`, as a checkpoint of
    the Hub loads (its rotary frequencies stay float32, which `model.to(dtype)` would round)."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # tqdm's monitor thread would outlive the thread check
    try:
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            loaded = type(model).from_pretrained(folder, dtype=torch.bfloat16)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    loaded.name_or_path = loaded.config._name_or_path = model.name_or_path  # not the folder
    return loaded


def base_model(cell: dict, tool_model):
    """The model a cell trains and its processing class, fresh."""
    if cell["rollouts"] in ("tools", "environment"):
        model, processing_class = (copy.deepcopy(part) for part in tool_model)
    elif cell["rollouts"] == "images":
        model, processing_class = tiny_vlm_and_processor(seed=0, initializer_range=0.2)
    else:
        model, processing_class = tiny_model_and_tokenizer(seed=0, initializer_range=0.2)
    if cell["precision"] == "bf16_weights":
        model = loaded_in_bf16(model)
    return model, processing_class


def build(cell: dict, output_dir, tool_model):
    config = dict(
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        max_staleness=cell["max_staleness"],
        num_iterations=cell["num_iterations"],
        beta=cell["beta"],
        dynamic_sampling=cell["dynamic_sampling"],
        max_resample_rounds=1,
        gradient_checkpointing=cell["gradient_checkpointing"],
        mask_truncated_completions=cell["mask_truncated_completions"],
        log_completions=cell["log_completions"],
        loss_type=cell["loss_type"],
        scale_rewards=cell["scale_rewards"],
        importance_sampling_level=cell["importance_sampling_level"],
        bf16=cell["precision"] != "fp32",
        **BATCHING[cell["batching"]],
        **SAMPLING[cell["sampling"]],
    )
    kind = cell["rollouts"]
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]
    model, tokenizer = base_model(cell, tool_model)
    rewards = [odd_first_character, varied_length]
    if kind == "chat":
        rows = [{"prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]
    elif kind in ("tools", "environment"):
        rows = [{"prompt": TOOL_PROMPT}] * 4
        rewards = [varied_length]
        config.update(max_completion_length=96, max_prompt_length=None)
        config.update(tools=[add]) if kind == "tools" else config.update(environment_factory=Adder)
    elif kind == "images":
        rows = [
            {"prompt": [{"role": "user", "content": "Which color?"}], "image": image}
            for image in (Image.new("RGB", (20, 30), color) for color in COLORS.values())
        ] * 2
        rewards = [odd_first_character]
    elif kind == "rollout_func":
        rewards = [from_score]
        config.update(rollout_func=random_rollouts)
    if cell["evaluate"]:
        config.update(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8)
    dataset = Dataset.from_list(rows)
    trainer = make_trainer(
        output_dir,
        model=model,
        tokenizer=tokenizer,
        reward_funcs=rewards,
        dataset=dataset.to_iterable_dataset() if cell["dataset"] == "stream" else dataset,
        peft=cell["peft"],
        eval_dataset=(
            (dataset.to_iterable_dataset() if cell["dataset"] == "stream" else dataset)
            if cell["evaluate"]
            else None
        ),
        **config,
    )
    return trainer


@needs_trl_1_16
@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_a_cell_of_settings_trains(cell, tmp_path, tool_model):
    threads_before = set(threading.enumerate())
    with one_thread(), deadline(DEADLINE_SECONDS, "the cell"):
        trainer = build(cell, tmp_path, tool_model)
        base = {
            name: parameter.detach().clone()
            for name, parameter in trainer.model.named_parameters()
            if not parameter.requires_grad
        }
        trainer.train()

    assert trainer.state.global_step == 2
    logs = trainer.state.log_history
    steps = [entry for entry in logs if "loss" in entry and "eval_loss" not in entry]
    assert len(steps) == 2 and all(math.isfinite(entry["loss"]) for entry in steps)
    # Rewards are logged at the steps that sampled (as TRL does): the first step always does;
    # a buffered generation batch or a second iteration trains on earlier samples.
    sampled = [entry for entry in steps if "reward" in entry]
    assert steps[0] in sampled and all("completions/mean_length" in entry for entry in sampled)
    evaluations = [entry for entry in logs if "eval_reward" in entry]
    assert len(evaluations) == (2 if cell["evaluate"] else 0)
    if cell["rollouts"] in ("tools", "environment"):
        assert steps[0]["tools/call_frequency"] > 0  # the model called the tool
    if cell["rollouts"] == "environment":
        assert "rewards/Adder/mean" in steps[0]
    if cell["peft"]:
        assert base, "LoRA left no frozen base weights"
        frozen = dict(trainer.model.named_parameters())
        assert all(torch.equal(frozen[name], value) for name, value in base.items())
    left = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    # The standard library's one server of file descriptors passed between processes (torch
    # shares tensors with the rollout worker that way) stays for the life of the process.
    left = [t for t in left if not t.name.endswith("(_serve)") and not torch_compilers(t)]
    assert not left, f"threads still running after train(): {left}"
    assert not multiprocessing.active_children()  # the rollout worker is gone

    # What save_model writes loads back as the model trained: the full weights, or the base
    # model and the adapter.
    trainer.save_model(str(tmp_path / "final"))
    if cell["peft"]:
        saved = PeftModel.from_pretrained(base_model(cell, tool_model)[0], tmp_path / "final")
    else:
        saved = type(trainer.model).from_pretrained(
            tmp_path / "final", dtype=DTYPES[cell["precision"]]
        )
    device = trainer.model.device  # the GPU, where there is one
    tokens = torch.tensor([[5, 6, 7, 8, 9]], device=device)
    # Under bf16, accelerate runs the trained model's forward in autocast: the saved one too.
    bf16 = cell["precision"] != "fp32"
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        expected = trainer.model.eval()(input_ids=tokens).logits.float()
        saved = saved.to(device).eval()
        torch.testing.assert_close(saved(input_ids=tokens).logits.float(), expected)


def step_logs(trainer) -> list[dict]:
    return [e for e in trainer.state.log_history if "loss" in e and "eval_loss" not in e]


@needs_trl_1_16
@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_a_cell_resumed_from_its_first_checkpoint_continues_the_same_run(
    cell, tmp_path, tool_model
):
    """Three steps straight, and the same run resumed from the checkpoint of step 1: the same
    weights and logged metrics (docs/async.md, "Resuming"). The documented exception: tools or
    environments with asynchronous rollouts sample their batches in flight again, with a
    warning that says so."""
    kept = dict(max_steps=3, log_completions=False)  # the printed table is not saved
    with one_thread(), deadline(2 * DEADLINE_SECONDS, "the cell"):
        straight = build(cell, tmp_path / "straight", tool_model)
        straight.args.__dict__.update(kept, save_strategy="steps", save_steps=1)
        straight.train()
        resumed = build(cell, tmp_path / "resumed", tool_model)
        resumed.args.__dict__.update(kept)
        checkpoint = str(tmp_path / "straight" / "checkpoint-1")
        if cell["rollouts"] in ("tools", "environment") and cell["max_staleness"]:
            with pytest.warns(UserWarning, match="multi-turn batches in flight"):
                resumed.train(resume_from_checkpoint=checkpoint)
            return
        resumed.train(resume_from_checkpoint=checkpoint)

    assert resumed.state.global_step == 3
    ignored = {"step_time", "train_runtime"}  # wall-clock times

    def metrics(entry):
        # NaN (a statistic of no token) as a string, so that it equals itself
        return {
            k: "nan" if isinstance(v, float) and math.isnan(v) else v
            for k, v in entry.items()
            if k not in ignored and "per_second" not in k
        }

    assert [metrics(e) for e in step_logs(resumed)] == [metrics(e) for e in step_logs(straight)]
    weights = dict(straight.model.named_parameters())
    for name, value in resumed.model.named_parameters():
        assert torch.equal(value, weights[name]), name
