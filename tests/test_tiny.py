import torch
from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer

from trl_grpo_ext.tiny import build_tiny_model, tiny_model_and_tokenizer

TEXTS = ["What is 2+3?", "  spaces\tand\nnewlines  ", "unicode: é ü 数学 \\frac{1}{2}"]


def test_tokenizer_conventions(tiny_tokenizer):
    assert tiny_tokenizer.pad_token_id != tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.padding_side == "left"
    for text in TEXTS:
        ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tiny_tokenizer.decode(ids) == text
    # A lone UTF-8 continuation byte decodes to the replacement character, as with real BPE.
    lone_byte = tiny_tokenizer("é", add_special_tokens=False)["input_ids"][1:]
    assert tiny_tokenizer.decode(lone_byte) == "\ufffd"


def test_chat_template_is_chatml_and_ends_on_eos(tiny_tokenizer):
    messages = [{"role": "user", "content": "2+2?"}]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    full = messages + [{"role": "assistant", "content": "4"}]
    ids = tiny_tokenizer.apply_chat_template(full, tokenize=False)
    assert ids.endswith("4<|im_end|>\n")


def test_left_padding(tiny_tokenizer):
    batch = tiny_tokenizer(["a", "abc"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 0].item() == tiny_tokenizer.pad_token_id
    assert batch["attention_mask"].tolist() == [[0, 0, 1], [1, 1, 1]]


def test_model_is_deterministic_from_seed():
    first, second = build_tiny_model(seed=3), build_tiny_model(seed=3)
    other = build_tiny_model(seed=4)
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters()))


def test_round_trip_through_folder(tiny_model_dir):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    loaded_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    loaded_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert loaded_model.config.model_type == "qwen3"
    for text in TEXTS:
        expected = tokenizer(text)["input_ids"]
        assert loaded_tokenizer(text)["input_ids"] == expected
        assert processor(text)["input_ids"] == expected
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    assert loaded_tokenizer.padding_side == "left"
    input_ids = torch.tensor([tokenizer(TEXTS[2])["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, loaded_model(input_ids).logits)
    assert loaded_model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_generation_stops_at_eos(tiny_tokenizer):
    model = build_tiny_model(tiny_tokenizer, seed=0)
    prompt = tiny_tokenizer(["1+1="], return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] <= prompt["input_ids"].shape[1] + 5
