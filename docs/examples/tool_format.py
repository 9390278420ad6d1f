"""A tool format for a model whose chat template has none: a chat template that renders tools,
tool calls and tool results, and a `response_template` that parses the calls the model writes.

The format here is ChatML (the tiny model's) with calls written as `<call>{json}</call>`. Checked
with TRL's own tests of a template (`supports_tool_calling`, `is_chat_template_prefix_preserving`)
and by parsing a turn the way the trainer does.
"""

from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

from trl_grpo_ext.generation.multi_turn import ToolCallFormat
from trl_grpo_ext.tiny import build_tiny_tokenizer

tokenizer = build_tiny_tokenizer()  # ChatML, with no tool format

# --8<-- [start:format]
# 1. A chat template that renders the tools' schemas, an assistant's `tool_calls` and `tool`
#    messages, and renders each message the same whatever follows it (prefix-preserving).
tokenizer.chat_template = """
{%- if tools %}<|im_start|>system
You may call these tools. To call one, write <call>{"name": ..., "arguments": {...}}</call>.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] -%}
<call>{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}</call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# 2. A response template (transformers' response parsing) that reads an assistant turn back into
#    a message: each <call>...</call> is parsed as JSON into one entry of `tool_calls`, the text
#    up to <|im_end|> is the content.
tokenizer.response_template = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<call>",
            "close": "</call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

# 3. Check both before training: the trainer runs the same checks and parses turns this way.
assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
turn = tokenizer('<call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</call><|im_end|>')
message = tokenizer.parse_response(turn["input_ids"], prefix="<|im_start|>assistant\n")
print(message["tool_calls"])
# [{'type': 'function', 'function': {'name': 'multiply', 'arguments': {'a': 6, 'b': 7}}}]
tokenizer.save_pretrained("my-tokenizer")  # both are saved with the tokenizer
# --8<-- [end:format]

call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
assert message["tool_calls"] == [call]
# The trainer accepts it, keeps this template, and appends a result as these tokens:
format = ToolCallFormat(tokenizer)
assert format.chat_template is None  # prefix-preserving: not replaced
result = format.result_ids([{"role": "tool", "name": "multiply", "content": "42"}])
assert tokenizer.decode(result) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
