"""Math datasets for GRPO, as `datasets.Dataset`s with a `prompt` and an `answer` column.

Every loader returns the same two columns (plus `question`, the raw problem text): `prompt` is a
list of chat messages (an optional system message asking for reasoning and a boxed answer, then
the problem as the user message), `answer` the reference final answer as a string that
`math_verify` can parse. Sources:

- `gsm8k`: `openai/gsm8k` (`main`), the answer after `####` in the reference solution;
- `math`: a MATH training split (`DigitalLearningGmbH/MATH-lighteval` by default) for training,
  `HuggingFaceH4/MATH-500` for evaluation; the answer is the last `\\boxed{}` of the solution
  where no `answer` column exists;
- a local `.jsonl`/`.json`/`.parquet`/`.csv` file with configurable question and answer columns;
- `synthetic`: arithmetic generated in code, offline and seeded, with a difficulty setting, a
  held-out split that never shares a problem with the training split, and optionally a
  validation split carved out of the training problems (for choosing hyperparameters without
  looking at the held-out split).

`load_vision_math_dataset` adds images: a problem, its picture (an `image` column, TRL's format)
and the answer, from a Hub dataset such as `lmms-lab/multimodal-open-r1-8k-verified`, a local
file, or `tiny_colors` (the synthetic task of `tiny_vlm_task.py`, offline).
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass

from datasets import Dataset, concatenate_datasets, load_dataset

SYSTEM_PROMPT = (
    "You are a careful math solver. Think through the problem step by step, then give the final "
    "answer on its own at the end as \\boxed{answer}."
)

# Hub datasets known by a short name: (path, config, train split, evaluation split, question
# column, answer column). MATH has no single Hub repo with both splits, hence two entries.
HUB_DATASETS = {
    "gsm8k": ("openai/gsm8k", "main", "train", "test", "question", "answer"),
    "openai/gsm8k": ("openai/gsm8k", "main", "train", "test", "question", "answer"),
    "math": (
        "DigitalLearningGmbH/MATH-lighteval",
        "default",
        "train",
        "test",
        "problem",
        "solution",
    ),
    "math500": ("HuggingFaceH4/MATH-500", "default", "test", "test", "problem", "answer"),
    "HuggingFaceH4/MATH-500": (
        "HuggingFaceH4/MATH-500",
        "default",
        "test",
        "test",
        "problem",
        "answer",
    ),
}
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


# ---------------------------------------------------------------------------- answers


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None
    when there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    index = text.index("{", start) + 1
    depth = 1
    for position in range(index, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[index:position]
    return None


def extract_reference_answer(solution: str) -> str:
    """The final answer of a reference solution: after `####` (GSM8K), else the last
    `\\boxed{}` (MATH), else the text itself stripped."""
    if "####" in solution:
        return solution.rsplit("####", 1)[1].strip().replace(",", "")
    boxed = last_boxed(solution)
    return boxed.strip() if boxed is not None else solution.strip()


# ---------------------------------------------------------------------------- prompts


def make_prompt(question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict]:
    """Chat messages for one problem: the system prompt (unless empty or None), then the user."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": question}]


def with_examples(dataset: Dataset, examples: list[dict]) -> Dataset:
    """`dataset` with `examples` (messages: a worked example, for instance) put in each prompt
    after its system message, before the question."""

    def insert(row):
        prompt = row["prompt"]
        head = 1 if prompt and prompt[0]["role"] == "system" else 0
        return {"prompt": prompt[:head] + examples + prompt[head:]}

    return dataset.map(insert)


def check_chat_template(tokenizer, system_prompt: str | None = SYSTEM_PROMPT) -> str:
    """Renders one prompt and refuses a template that opens a `<think>` block in it.

    Some templates (Qwen3 with thinking enabled, DeepSeek-R1 distills) end the generation prompt
    with `<think>\\n`: the completion then starts inside a think block that it never opened, and
    a format reward that looks for the whole block fails on every sample. Returns the rendered
    prompt.
    """
    rendered = tokenizer.apply_chat_template(
        make_prompt("What is 1 + 1?", system_prompt), tokenize=False, add_generation_prompt=True
    )
    tail = rendered[rendered.rfind("What is 1 + 1?") :]
    opened = tail.count("<think>") - tail.count("</think>")
    if opened > 0:
        raise ValueError(
            "The chat template pre-fills an open <think> tag at the start of the completion, "
            "which breaks the format reward. Use a template without it (for Qwen3, pass "
            "enable_thinking=False, or a tokenizer whose template leaves thinking to the model)."
        )
    return rendered


def to_prompt_dataset(
    dataset: Dataset,
    question_column: str,
    answer_column: str,
    system_prompt: str | None = SYSTEM_PROMPT,
    extract_answer: bool = True,
) -> Dataset:
    """Maps any dataset with a question and an answer column to `question`, `prompt`, `answer`."""
    for column in (question_column, answer_column):
        if column not in dataset.column_names:
            raise ValueError(
                f"Column {column!r} not found; the dataset has {dataset.column_names}. Set "
                "dataset_question_column / dataset_answer_column to the right names."
            )

    def convert(row):
        answer = str(row[answer_column])
        return {
            "question": row[question_column],
            "prompt": make_prompt(row[question_column], system_prompt),
            "answer": extract_reference_answer(answer) if extract_answer else answer.strip(),
        }

    return dataset.map(convert, remove_columns=dataset.column_names)


# ---------------------------------------------------------------------------- synthetic


@dataclass(frozen=True)
class Difficulty:
    """Operand digits and operations of one synthetic difficulty level."""

    digits: int
    operations: str
    multiplier_digits: int = 1  # digits of the second factor of a product
    worded: bool = False  # two-step problems in words (WORDED) instead of "What is a + b?"


# Level -> problems. Levels 1-2 fit the tiny model of the offline default; the rest are for
# real models on a CPU smoke run; levels 6 (products of up to 3 by up to 2 digits) and 7 (the same
# products in two-step problems worded four ways) are for a model with a Python tool, which small
# models cannot multiply without.
DIFFICULTIES = {
    1: Difficulty(digits=1, operations="+"),
    2: Difficulty(digits=2, operations="+"),
    3: Difficulty(digits=2, operations="+-"),
    4: Difficulty(digits=3, operations="+-"),
    5: Difficulty(digits=2, operations="+-*"),
    6: Difficulty(digits=3, operations="*", multiplier_digits=2),
    7: Difficulty(digits=3, operations="*", multiplier_digits=2, worded=True),
}

# The questions of a worded level, each with its answer, for a, c of 3 digits (100-999), b of 2
# (10-99) and d of 1 (2-9).
WORDED = (
    ("Multiply {a} by {b}, then add {c}.", lambda a, b, c, d: a * b + c),
    ("Multiply {a} by {b}, then take away {c}.", lambda a, b, c, d: a * b - c),
    ("What is the product of {a} and {b}?", lambda a, b, c, d: a * b),
    ("What is {a} * {b} minus {c} * {d}?", lambda a, b, c, d: a * b - c * d),
)
HELD_OUT_PERCENT = 20
SPLITS = ("train", "validation", "test")


def synthetic_split(question: str, validation_percent: int = 0) -> str:
    """The split of a synthetic problem, from a hash of its text into 100 buckets, so it is the
    same for every seed, size and process: buckets [0, 20) are `test`, the next
    `validation_percent` buckets `validation` (taken from the training problems), the rest
    `train`. With `validation_percent=0` there is no validation split and train keeps them."""
    digest = hashlib.sha256(question.encode()).digest()
    bucket = int.from_bytes(digest[:4], "big") % 100
    if bucket < HELD_OUT_PERCENT:
        return "test"
    return "validation" if bucket < HELD_OUT_PERCENT + validation_percent else "train"


def is_held_out(question: str) -> bool:
    """Whether a synthetic problem belongs to the held-out split (`test`): train never contains
    a test problem."""
    return synthetic_split(question) == "test"


def synthetic_problem(rng: random.Random, difficulty: int) -> tuple[str, str]:
    """One `(question, answer)`; subtraction keeps the result non-negative, except in the
    worded "a * b minus c * d"."""
    level = DIFFICULTIES[difficulty]
    if level.worded:
        template, value = rng.choice(WORDED)
        a, b, c, d = (
            rng.randint(100, 999),
            rng.randint(10, 99),
            rng.randint(100, 999),
            rng.randint(2, 9),
        )
        return template.format(a=a, b=b, c=c, d=d), str(value(a, b, c, d))
    high = 10**level.digits - 1
    operation = rng.choice(level.operations)
    a, b = rng.randint(0, high), rng.randint(0, high)
    if operation == "*":
        b = rng.randint(0, 10**level.multiplier_digits - 1)
    if operation == "-" and b > a:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[operation]
    return f"What is {a} {operation} {b}?", str(value)


def synthetic_rows(
    num_rows: int,
    *,
    split: str = "train",
    difficulty: int = 2,
    seed: int = 0,
    unique: bool = True,
    validation_percent: int = 0,
) -> list[dict]:
    """`num_rows` problems `{"question", "answer"}` of one split ("train", "validation" or
    "test"; see `synthetic_split`).

    Test and validation rows are distinct; train rows are distinct too when `unique` (set it
    False to draw more rows than there are problems).
    """
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty={difficulty} is unknown; use one of {list(DIFFICULTIES)}.")
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {SPLITS}.")
    if split == "validation" and validation_percent <= 0:
        raise ValueError("The validation split needs validation_percent > 0.")
    if not 0 <= validation_percent <= 100 - HELD_OUT_PERCENT:
        raise ValueError(f"validation_percent={validation_percent} is not in [0, 80].")
    # Separate streams per split, so the test set does not depend on the size of the train set.
    rng = random.Random(f"{seed}-{split}-{difficulty}")
    distinct = unique or split != "train"
    rows, seen = [], set()
    for _ in range(num_rows * 1000):
        question, answer = synthetic_problem(rng, difficulty)
        if synthetic_split(question, validation_percent) != split or (
            distinct and question in seen
        ):
            continue
        seen.add(question)
        rows.append({"question": question, "answer": answer})
        if len(rows) == num_rows:
            return rows
    raise ValueError(
        f"Only {len(rows)} distinct {split} problems at difficulty {difficulty}; ask for fewer "
        "rows or a higher difficulty."
    )


def synthetic_dataset(
    num_rows: int,
    *,
    split: str = "train",
    difficulty: int = 2,
    seed: int = 0,
    system_prompt: str | None = SYSTEM_PROMPT,
    unique: bool = True,
    validation_percent: int = 0,
) -> Dataset:
    rows = synthetic_rows(
        num_rows,
        split=split,
        difficulty=difficulty,
        seed=seed,
        unique=unique,
        validation_percent=validation_percent,
    )
    return Dataset.from_list(
        [{**row, "prompt": make_prompt(row["question"], system_prompt)} for row in rows]
    )


# ---------------------------------------------------------------------------- loaders


def load_math_dataset(
    name: str,
    split: str = "train",
    *,
    config: str | None = None,
    question_column: str | None = None,
    answer_column: str | None = None,
    system_prompt: str | None = SYSTEM_PROMPT,
    num_rows: int | None = None,
    seed: int = 0,
    difficulty: int = 2,
    validation_percent: int = 0,
) -> Dataset:
    """Loads a math dataset by short name, Hub id or local file, as `question/prompt/answer`.

    Args:
        name (`str`): "gsm8k", "math", "math500", "synthetic", a Hub id, or a path to a
            `.jsonl`/`.json`/`.parquet`/`.csv` file.
        split (`str`, *optional*, defaults to "train"): "train" or "test" for the short names
            (mapped to each dataset's own split names), any split name for a Hub id; ignored
            for a local file.
        question_column, answer_column (`str`, *optional*): the columns to read; default to the
            dataset's known columns, or "question"/"answer".
        num_rows (`int`, *optional*): keep the first `num_rows` rows (required for "synthetic").
        seed, difficulty: for "synthetic".
        validation_percent (`int`, *optional*, defaults to 0): for "synthetic", the share of
            problems (in percent of all problems) moved from the training split to a
            "validation" split, which `split="validation"` loads.
    """
    if name == "synthetic":
        if num_rows is None:
            raise ValueError("The synthetic dataset needs num_rows.")
        return synthetic_dataset(
            num_rows,
            split=split,
            difficulty=difficulty,
            seed=seed,
            system_prompt=system_prompt,
            unique=split != "train",
            validation_percent=validation_percent,
        )
    extension = os.path.splitext(name)[1].lower()
    if extension in LOCAL_FORMATS and os.path.exists(name):
        dataset = load_dataset(LOCAL_FORMATS[extension], data_files=name, split="train")
        default_question, default_answer = "question", "answer"
    elif name in HUB_DATASETS:
        path, default_config, train_split, test_split, default_question, default_answer = (
            HUB_DATASETS[name]
        )
        hub_split = {"train": train_split, "test": test_split}.get(split, split)
        dataset = load_dataset(path, config or default_config, split=hub_split)
    elif extension in LOCAL_FORMATS:
        raise FileNotFoundError(f"Dataset file {name} does not exist.")
    else:
        dataset = load_dataset(name, config, split=split)
        default_question, default_answer = "question", "answer"
    question_column = question_column or _first_present(
        dataset.column_names, default_question, ("question", "problem")
    )
    answer_column = answer_column or _first_present(
        dataset.column_names, default_answer, ("answer", "solution")
    )
    if num_rows is not None:
        dataset = dataset.select(range(min(num_rows, len(dataset))))
    return to_prompt_dataset(dataset, question_column, answer_column, system_prompt)


def dataset_hub_id(name: str) -> str | None:
    """The Hub id behind a dataset name ("gsm8k" -> "openai/gsm8k"), None for "synthetic" and
    local files: what a model card lists under `datasets`."""
    if name in HUB_DATASETS:
        return HUB_DATASETS[name][0]
    if name == "synthetic" or os.path.splitext(name)[1].lower() in LOCAL_FORMATS:
        return None
    return name if "/" in name else None


def _first_present(columns: list[str], preferred: str, fallbacks: tuple[str, ...]) -> str:
    for column in (preferred, *fallbacks):
        if column in columns:
            return column
    return preferred


# ---------------------------------------------------------------------------- images

VISION_MATH_DATASET = "lmms-lab/multimodal-open-r1-8k-verified"
TINY_COLORS = "tiny_colors"


def load_vision_math_dataset(
    name: str = VISION_MATH_DATASET,
    split: str = "train",
    *,
    config: str | None = None,
    image_column: str = "image",
    question_column: str | None = None,
    answer_column: str | None = None,
    system_prompt: str | None = SYSTEM_PROMPT,
    num_rows: int | None = None,
    max_image_side: int | None = None,
    seed: int = 0,
) -> Dataset:
    """Loads problems with an image each as `question`, `prompt`, `image` and `answer`.

    The prompt is text (the system prompt, then the problem); the image stays in its own
    `image` column, which the trainer puts into the user message as TRL does.

    Args:
        name (`str`, *optional*, defaults to `"lmms-lab/multimodal-open-r1-8k-verified"`): a
            Hub id, a local `.jsonl`/`.json`/`.parquet`/`.csv` file, or `"tiny_colors"` (the
            offline color task of `tiny_vlm_task.py`, whose `train` split alternates the colors
            and whose other splits are held-out pictures).
        image_column (`str`, *optional*, defaults to `"image"`): the column of the images (one
            per row), or of lists of images (`"images"`).
        question_column, answer_column (`str`, *optional*): default to the first present of
            question/problem and answer/solution. The answer is the reference's last
            `\\boxed{}` or `<answer>` block when it has one, else its text.
        num_rows (`int`, *optional*): keep the first `num_rows` rows (required for tiny_colors).
        max_image_side (`int`, *optional*): scale larger images down (aspect kept) so that their
            longer side is this many pixels: image tokens count toward the sequence length.
    """
    if name == TINY_COLORS:
        from .tiny_vlm_task import color_dataset

        if num_rows is None:
            raise ValueError("The tiny_colors dataset needs num_rows (num_train_samples).")
        return color_dataset(num_rows, split=split, seed=seed, system_prompt=system_prompt)
    extension = os.path.splitext(name)[1].lower()
    if extension in LOCAL_FORMATS:
        if not os.path.exists(name):
            raise FileNotFoundError(f"Dataset file {name} does not exist.")
        dataset = load_dataset(LOCAL_FORMATS[extension], data_files=name, split="train")
    else:
        dataset = load_dataset(name, config, split=split)
    if image_column not in dataset.column_names:
        raise ValueError(
            f"The dataset {name!r} has no image column {image_column!r}; its columns are "
            f"{dataset.column_names}. Set dataset_image_column to the column that holds the "
            "images, or, for problems without images, train a text model with recipes/math.py."
        )
    question_column = question_column or _first_present(
        dataset.column_names, "question", ("problem",)
    )
    answer_column = answer_column or _first_present(dataset.column_names, "answer", ("solution",))
    if num_rows is not None:
        dataset = dataset.select(range(min(num_rows, len(dataset))))
    images = dataset.select_columns([image_column])
    dataset = to_prompt_dataset(
        dataset.map(lambda row: {answer_column: _answer_block(str(row[answer_column]))}),
        question_column,
        answer_column,
        system_prompt,
    )

    def prepare(row):
        value = row[image_column]
        if isinstance(value, list):
            return {image_column: [_fit_image(image, max_image_side) for image in value]}
        return {image_column: _fit_image(value, max_image_side)}

    return concatenate_datasets([dataset, images.map(prepare)], axis=1)


def split_held_out(dataset: Dataset, num_rows: int, seed: int = 0) -> tuple[Dataset, Dataset]:
    """`(train, held_out)`: `num_rows` rows drawn with `seed` set aside, for a dataset that has
    a training split only (as TRL's VLM example does with `train_test_split`)."""
    if not 0 < num_rows < len(dataset):
        raise ValueError(
            f"Cannot hold out {num_rows} of the dataset's {len(dataset)} rows: set "
            "num_eval_samples below the number of rows, or name a test split "
            "(dataset_test_split)."
        )
    parts = dataset.train_test_split(test_size=num_rows, seed=seed)
    return parts["train"], parts["test"]


def _answer_block(solution: str) -> str:
    """The inside of the last `<answer>...</answer>` of a reference solution, else the text."""
    if "</answer>" in solution:
        return solution.rsplit("</answer>", 1)[0].rsplit("<answer>", 1)[-1]
    return solution


def _fit_image(image, max_side: int | None):
    """The image in RGB, scaled down to `max_side` pixels on its longer side when larger."""
    if image is None:
        raise ValueError("A row of the dataset has no image (None): drop such rows first.")
    if isinstance(image, str):  # a path, as a local .jsonl file gives it
        from PIL import Image

        image = Image.open(image)
    image = image.convert("RGB") if image.mode != "RGB" else image
    if max_side and max(image.size) > max_side:
        image = image.copy()
        image.thumbnail((max_side, max_side))
    return image
