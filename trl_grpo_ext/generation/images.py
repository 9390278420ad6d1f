"""Images in prompts: where a row's images come from, and how the processor's multimodal fields
ride along with each completion, from generation to the loss.

A dataset gives images as TRL 1.16 takes them: an `images` column (a list per row) or an `image`
column (one per row), injected into the conversational prompt's first user message as
`{"type": "image"}` parts (TRL's `prepare_multimodal_messages`), or image parts that already hold
their image (`{"type": "image", "image": <PIL.Image>}`). `processing_class` is then the model's
processor, which expands each image placeholder into the model's image tokens and returns the
multimodal fields (`pixel_values`, `image_sizes`, `image_grid_thw`, `token_type_ids`, ...).

The processor returns those fields flattened over the images of the whole batch. Here they are
split per sample, as TRL's `_get_per_token_logps_and_entropies` slices them, and stored one row
per completion, so that every slice of rows (micro-batches, the chunks of the old and reference
log-probs, checkpoints) carries exactly its own images:

- a per-image field (first dimension: one entry per image; `pixel_values` of a model with
  `image_grid_thw`: one entry per patch) becomes `(N, M, ...)`, zero-padded to the most entries
  M of a row, with the row's entry count in `<name>:count` `(N,)`;
- a per-token field (`token_type_ids`, `mm_token_type_ids`) stays `(N, P)`, aligned with the
  left-padded prompt ids.

Images that tools return in multi-turn rollouts (`multi_turn.ToolLoop`) join their rollout's
row after its prompt's images, in the order they came: their entries are appended to the
per-image fields, and a per-token field gets its values over the completion's positions (the
tool results' image tokens) in `<name>:completion` `(N, T)`; without one, the completion's
positions are 0.

`model_inputs` turns rows of that layout back into the keyword arguments of the model's forward.
"""

from __future__ import annotations

import torch

IMAGE_COLUMNS = ("images", "image")
PER_TOKEN_FIELDS = ("token_type_ids", "mm_token_type_ids")
COUNT = ":count"  # suffix of the entry counts of a per-image field
COMPLETION = ":completion"  # suffix of a per-token field's values over the completion


def is_processor(processing_class) -> bool:
    """Whether `processing_class` is a multimodal processor (a `ProcessorMixin`) rather than a
    tokenizer."""
    from transformers import ProcessorMixin

    return isinstance(processing_class, ProcessorMixin)


def text_tokenizer(processing_class):
    """The tokenizer of a processor, or the tokenizer itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def has_image_parts(prompt) -> bool:
    """Whether a conversational prompt has `{"type": "image"}` content parts."""
    if not isinstance(prompt, list):
        return False
    return any(
        isinstance(part, dict) and part.get("type") == "image"
        for message in prompt
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


def row_images(row: dict) -> list | None:
    """The images of a dataset row's `images` or `image` column; None without either (or when
    it holds none)."""
    if row.get("images") is not None:
        images = list(row["images"])
        return images or None
    if row.get("image") is not None:
        return [row["image"]]
    return None


def dataset_has_images(dataset, first: dict | None) -> bool:
    """Whether a dataset carries images: an `image` or `images` column, or image parts in its
    first row's prompt (`first`, as `prompts.check_prompt_dataset` read it; its keys are the
    columns of a stream whose columns are unknown)."""
    columns = getattr(dataset, "column_names", None) or list(first or [])
    if any(column in columns for column in IMAGE_COLUMNS):
        return True
    return first is not None and has_image_parts(first.get("prompt"))


def rows_have_images(rows: list[dict]) -> bool:
    return any(row_images(row) or has_image_parts(row.get("prompt")) for row in rows)


def prompt_with_images(row: dict) -> tuple[list, list]:
    """The row's prompt with its images in its messages, and those images in order.

    The images of an `image`/`images` column go into the first user message, before its text,
    as TRL does; image parts that hold their image are kept."""
    from trl.data_utils import prepare_multimodal_messages

    from .prompts import is_conversational

    prompt = row["prompt"]
    if not is_conversational(prompt):
        raise ValueError(
            "Prompts with images must be conversational (lists of messages), so that the "
            "processor's chat template places the image tokens; got a plain string. Give the "
            'prompt as [{"role": "user", "content": ...}] and the images in an "image" or '
            '"images" column (TRL\'s format), not a prompt rendered with the chat template.'
        )
    prompt = prepare_multimodal_messages(prompt, images=row_images(row))
    images = [
        part["image"]
        for message in prompt
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]
    if any(image is None for image in images):
        raise ValueError(
            'A prompt has a {"type": "image"} part without its image and the row has no '
            '"image" or "images" column to fill it: put the image in the part '
            '({"type": "image", "image": <PIL.Image>}) or in an "images" column.'
        )
    return prompt, images


def encode_with_images(encoder, rows: list[dict], group: int = 1, prompts=None, functions=None):
    """The one seam between a batch of rows and its images: each row's prompt (or `prompts`,
    one per row) with its images in its messages, rendered and tokenised by the processor
    (`encoder.encode_with_images`, with each prompt's tool `functions`), and its fields split
    per sample. Returns `(prompts, prompt_ids, prompt_mask, fields, per_completion)`: `fields` as
    the processor returned them (what `generate` takes), `per_completion` one row per completion
    (each prompt's `group` times, `per_sample`)."""
    if prompts is not None:
        rows = [{**row, "prompt": prompt} for row, prompt in zip(rows, prompts)]
    prepared = [prompt_with_images(row) for row in rows]
    prompts, images = [p for p, _ in prepared], [i for _, i in prepared]
    prompt_ids, prompt_mask, fields = encoder.encode_with_images(prompts, images, functions)
    counts = [len(i) for i in images]
    per_completion = per_sample(fields, counts, prompt_ids.shape[1], group)
    return prompts, prompt_ids, prompt_mask, fields, per_completion


ROLLOUT_FUNC_WITH_IMAGES = (
    "rollout_func does not receive images yet: its prompts would reach it without the "
    "dataset's images, and the trainer would train on their text alone. Drop rollout_func to "
    "sample with the trainer's transformers engine, or drop the images from the dataset."
)


TOOL_IMAGES_NEED_A_PROCESSOR = (
    "A tool or environment returned an image ({'type': 'image'} content part), but "
    "processing_class is a tokenizer, which cannot give the model images: the image would "
    "reach it as text alone. Pass the model's processor as processing_class "
    "(AutoProcessor.from_pretrained(model_id)) with a vision-language model, or return text "
    "(for example a description of the image) from the tool."
)


def images_unsupported(use_vllm: bool, engine=None) -> str | None:
    """Why images cannot be sampled with these settings (a path not yet covered would sample
    from the text alone), or None when they can: the transformers engine, single- or multi-turn,
    in the training process or the asynchronous rollout worker's."""
    if use_vllm:
        what = "use_vllm=True (vLLM does not receive the images yet)"
    elif engine is not None and not getattr(engine, "takes_images", False):
        what = f"the {type(engine).__name__} engine (it does not take images)"
    else:
        return None
    return (
        f"The dataset has images, which {what} would drop: the model would train on the "
        "text alone. Images are supported with the transformers engine (max_staleness and "
        "tools included): unset that setting, or drop the images from the dataset."
    )


def refuse_images(engine, image_inputs) -> None:
    """What an engine that does not take images yet does when given some: an error, never
    sampling from the prompts' text alone."""
    if image_inputs:
        raise ValueError(
            f"{type(engine).__name__} does not take images yet: it would sample from the "
            "prompts' text alone. Images are supported with the transformers engine "
            "(use_vllm=False)."
        )


def digest(fields: dict[str, torch.Tensor] | None) -> str | None:
    """A fingerprint of the processor's fields of a batch (None without images): a batch sampled
    for other images is not the one asked for, even with the same prompt tokens."""
    if not fields:
        return None
    import hashlib

    hashed = hashlib.sha256()
    for name in sorted(fields):
        value = fields[name].detach().cpu().contiguous()
        hashed.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        hashed.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return hashed.hexdigest()


def image_token_id(processor, model=None) -> int | None:
    """The token that stands for image features, never to be sampled."""
    token_id = getattr(processor, "image_token_id", None)
    if token_id is None and model is not None:
        token_id = getattr(model.config, "image_token_id", None)
    return token_id


def per_sample(
    fields: dict[str, torch.Tensor],
    num_images: list[int],
    prompt_length: int,
    group_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The processor's fields for B prompts (flattened over their images) as one row per
    completion: each prompt's row repeated `group_size` times (the layout of the module
    docstring).

    Args:
        fields (`dict[str, torch.Tensor]`): the processor's output but `input_ids` and
            `attention_mask`.
        num_images (`list[int]`): images of each of the B prompts.
        prompt_length (`int`): P, the width of the left-padded prompt ids.
    """
    batch = len(num_images)
    images_per_prompt = torch.tensor(num_images)
    counts_by_field = {}
    for name, value in fields.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"The processor returned {name!r} as {type(value).__name__}, not a tensor; "
                "images need return_tensors='pt' fields that can be split per sample."
            )
        if name in PER_TOKEN_FIELDS:
            if value.shape[:2] != (batch, prompt_length):
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)}, expected ({batch}, {prompt_length})."
                )
            continue
        if name == "pixel_values" and "image_grid_thw" in fields:
            # One row of pixel_values per patch: the patches of image i are grid_thw[i].prod().
            patches = fields["image_grid_thw"].prod(dim=-1)  # (images,)
            counts = torch.stack([part.sum() for part in patches.split(num_images)])
        elif value.shape[0] == sum(num_images):
            counts = images_per_prompt
        else:
            raise ValueError(
                f"The processor returned {name!r} of shape {tuple(value.shape)} for {batch} "
                f"prompts with {sum(num_images)} images; this version cannot tell which entries "
                "belong to which prompt. Please report the model; images of LLaVA-, Qwen2-VL- "
                "and Gemma-3-style processors are supported."
            )
        counts_by_field[name] = counts.reshape(batch).long()
    rows = {}
    for name, value in fields.items():
        if name in PER_TOKEN_FIELDS:
            rows[name] = value
            continue
        counts = counts_by_field[name]
        width = int(counts.max()) if batch else 0
        padded = value.new_zeros((batch, width, *value.shape[1:]))  # (B, M, ...)
        for index, part in enumerate(value.split(counts.tolist())):
            padded[index, : len(part)] = part
        rows[name] = padded
        rows[name + COUNT] = counts
    return {name: value.repeat_interleave(group_size, dim=0) for name, value in rows.items()}


def is_per_image(name: str) -> bool:
    """Whether a field of the per-sample layout holds entries per image (not a per-token field,
    nor the counts or completion values of one)."""
    return name not in PER_TOKEN_FIELDS and not name.endswith((COUNT, COMPLETION))


def model_inputs(rows: dict[str, torch.Tensor], completion_length: int = 0) -> dict:
    """The forward pass's keyword arguments from rows of the per-sample layout: per-image fields
    concatenated over the rows' own entries (in row order, as the processor returned them);
    per-token fields extended over `completion_length` completion positions with their
    `:completion` values (tool results' images), zeros without them."""
    inputs = {}
    for name, value in rows.items():
        if name.endswith((COUNT, COMPLETION)):
            continue
        if name in PER_TOKEN_FIELDS:
            completion = value.new_zeros((value.shape[0], completion_length))
            if name + COMPLETION in rows:
                given = rows[name + COMPLETION][:, :completion_length]
                completion[:, : given.shape[1]] = given
            inputs[name] = torch.cat([value, completion], dim=1)  # (n, P + T)
            continue
        counts = rows[name + COUNT].tolist()
        entries = [value[row, :count] for row, count in enumerate(counts)]
        if sum(counts):
            inputs[name] = torch.cat(entries)  # (entries of these rows, ...)
    return inputs


def entries_of(rows: dict[str, torch.Tensor] | None, index: int) -> dict[str, torch.Tensor]:
    """Row `index`'s own entries of each per-image field (its images', in order); empty for
    None."""
    if rows is None:
        return {}
    return {
        name: value[index, : int(rows[name + COUNT][index])]
        for name, value in rows.items()
        if is_per_image(name)
    }


def stack_entries(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-image fields of rows given as each row's own entries (`entries_of`), in the padded
    layout with counts; a row without a field has 0 of its entries."""
    names = list(dict.fromkeys(name for row in entries for name in row))
    stacked = {}
    for name in names:
        pieces = [row.get(name) for row in entries]
        sample = next(piece for piece in pieces if piece is not None)
        counts = torch.tensor([0 if piece is None else len(piece) for piece in pieces])
        padded = sample.new_zeros((len(entries), int(counts.max()), *sample.shape[1:]))
        for index, piece in enumerate(pieces):
            if piece is not None:
                padded[index, : len(piece)] = piece
        stacked[name], stacked[name + COUNT] = padded, counts
    return stacked


def flat_entries(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The per-image fields of these rows concatenated in row order, as the processor returns
    them for a batch (what `generate` takes)."""
    names = list(dict.fromkeys(name for row in entries for name in row))
    return {name: torch.cat([row[name] for row in entries if name in row]) for name in names}


def select_rows(rows: dict[str, torch.Tensor] | None, index: torch.Tensor):
    """The given rows of the per-sample layout (None stays None)."""
    if rows is None:
        return None
    return {name: value[index.to(value.device)] for name, value in rows.items()}


def concat_rows(
    parts: list[dict | None],
    prompt_widths: list[int],
    prompt_width: int,
    sizes: list[int] | None = None,
):
    """Rows of several rollouts joined: per-image fields zero-padded to the most entries,
    per-token fields left-padded to the joined prompts' width (their completion values
    right-padded). None when no part has images. A part without a field (`sizes` gives its row
    count) has none of its entries, or zeros; without `sizes` every part must have them all."""
    present = [part for part in parts if part is not None]
    if not present:
        return None
    names = list(dict.fromkeys(name for part in present for name in part))
    joined = {}
    for name in names:
        sample = next(part[name] for part in present if name in part)
        pieces = []
        for index, (part, width) in enumerate(zip(parts, prompt_widths)):
            value = None if part is None else part.get(name)
            if value is None and sizes is None:
                raise ValueError(
                    "Rollouts with and without images cannot be joined; sample them together."
                )
            if value is None:
                value = _absent(name, sample, sizes[index], width)
            if name in PER_TOKEN_FIELDS:
                value = torch.cat([value.new_zeros((len(value), prompt_width - width)), value], 1)
            pieces.append(value)
        if not name.endswith(COUNT) and name not in PER_TOKEN_FIELDS:
            most = max(piece.shape[1] for piece in pieces)
            pieces = [
                torch.cat(
                    [piece, piece.new_zeros((len(piece), most - piece.shape[1], *piece.shape[2:]))],
                    1,
                )
                for piece in pieces
            ]
        joined[name] = torch.cat(pieces)
    return joined


def _absent(name: str, sample: torch.Tensor, rows: int, prompt_width: int) -> torch.Tensor:
    """The values of field `name` for `rows` rows without images (`sample`: another part's)."""
    if name.endswith(COUNT):
        return sample.new_zeros((rows,))
    if name in PER_TOKEN_FIELDS:
        return sample.new_zeros((rows, prompt_width))
    return sample.new_zeros((rows, 0, *sample.shape[2:]))  # no entries, no completion values
