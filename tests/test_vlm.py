"""Vision-language GRPO (issue 28): the tiny VLM built in code, the errors that keep a dataset
with images from training on its text alone, and images through the transformers engine."""

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from trl_grpo_ext.tiny_vlm import IMAGE_TOKEN, build_tiny_vlm, tiny_vlm_and_processor

RED, BLUE = (255, 0, 0), (0, 0, 255)


def image(color, size=(20, 30)):
    return Image.new("RGB", size, color)


def image_prompt(text="Which color?"):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def test_tiny_vlm_round_trips_through_auto_classes(tmp_path):
    """Saved to a folder, model and processor load as a user loads a Hub VLM, and compute the
    same logits as the objects built in memory."""
    model, processor = tiny_vlm_and_processor(seed=0)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded_processor = AutoProcessor.from_pretrained(tmp_path)
    loaded_model = AutoModelForImageTextToText.from_pretrained(tmp_path)
    assert type(loaded_processor).__name__ == "LlavaProcessor"
    assert type(loaded_model).__name__ == "LlavaForConditionalGeneration"
    text = loaded_processor.apply_chat_template(
        image_prompt(), tokenize=False, add_generation_prompt=True
    )
    assert text == f"<|im_start|>user\n{IMAGE_TOKEN}Which color?<|im_end|>\n<|im_start|>assistant\n"
    inputs = loaded_processor(text=[text], images=[[image(RED)]], return_tensors="pt")
    # One `<image>` becomes one token per 8x8 patch of the 16x16 crop.
    assert (inputs["input_ids"] == loaded_processor.image_token_id).sum() == 4
    assert inputs["pixel_values"].shape == (1, 3, 16, 16)
    with torch.no_grad():
        expected = model(**processor(text=[text], images=[[image(RED)]], return_tensors="pt"))
        assert torch.equal(loaded_model(**inputs).logits, expected.logits)
    assert loaded_model.config.image_token_id == loaded_processor.image_token_id


def test_tiny_vlm_sees_the_image_and_is_deterministic():
    """Two colors give two different next-token distributions (the vision tower feeds the
    language model), and the same seed builds the same weights."""
    model, processor = tiny_vlm_and_processor(seed=0)
    text = processor.apply_chat_template(image_prompt(), tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text, text], images=[[image(RED)], [image(BLUE)]], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1]
    assert not torch.allclose(logits[0], logits[1])
    same = build_tiny_vlm(processor, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] <= inputs["input_ids"].shape[1] + 3
