"""Tool-call formats for models whose chat template has none.

`code_block_format` is the format of tool-integrated reasoning (ToRA, Qwen2.5-Math's TIR): the
model writes Python in a Markdown code block, the code runs, and its output comes back in an
`output` block. Small chat models write Markdown code blocks unprompted, where they cannot write a
JSON tool call (`docs/agents.md`, "Calls as code blocks").
"""

from __future__ import annotations

# ChatML (<|im_start|>role ... <|im_end|>), as SmolLM2, Qwen and the tiny model write it. A call
# of the code tool is a ```python block; a call of any other tool is rendered as JSON, so the
# template can render every conversation, but only code blocks are read back as calls. A result
# is a user turn holding an ```output block.
_CHAT_TEMPLATE = """
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{{ message.content or "" }}
{%- for call in message.tool_calls or [] %}
{%- if loop.first and message.content %}
{% endif %}
{%- if call.function.name == "TOOL" %}```LANGUAGE
{{ call.function.arguments.ARGUMENT }}
```
{%- else %}<tool_call>{{ {"name": call.function.name, "arguments": call.function.arguments} \
| tojson }}</tool_call>
{%- endif %}
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
```output
{{ message.content }}
```<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def code_block_format(
    tokenizer, tool: str = "run_python", argument: str = "code", language="python"
):
    """Gives a ChatML tokenizer (`<|im_start|>`/`<|im_end|>`: SmolLM2, Qwen, the tiny model) the
    code-block tool format, and returns it.

    The model calls the tool by writing a code block, such as
    ```` ```python\\nprint(123 * 45)\\n``` ````; the block is a call of `tool` with the code as
    its `argument` (`run_python(code=...)`), and the result comes back as a user turn holding
    ```` ```output\\n5535\\n``` ````. Sets `tokenizer.chat_template`, which renders these calls
    and results, and `tokenizer.response_template`, which reads the code blocks of a turn back
    as `tool_calls`; both are saved with the tokenizer. The template does not list the tools'
    schemas: describe the tool in the system prompt, or better, show it in a worked example.

    Args:
        tokenizer: a tokenizer whose special tokens are ChatML's.
        tool (`str`, defaults to `"run_python"`): the tool a code block calls.
        argument (`str`, defaults to `"code"`): its argument that takes the code.
        language (`str`, defaults to `"python"`): the code block's language tag.
    """
    if "<|im_start|>" not in tokenizer.get_vocab() or tokenizer.eos_token != "<|im_end|>":
        raise ValueError(
            "code_block_format renders ChatML (<|im_start|>, <|im_end|> as eos); this tokenizer's "
            f"eos is {tokenizer.eos_token!r}. Use a template of the model's own tokens "
            "(docs/agents.md, 'Models without a tool format')."
        )
    tokenizer.chat_template = (
        _CHAT_TEMPLATE.replace("TOOL", tool)
        .replace("ARGUMENT", argument)
        .replace("LANGUAGE", language)
    )
    tokenizer.response_template = {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "tool_calls": {
                "open_pattern": rf"\n?```{language}\n",
                "close_pattern": r"\n```",
                "repeats": True,
                "content": "text",
                "transform": {
                    "type": "function",
                    "function": {"name": tool, "arguments": {argument: "{content}"}},
                },
            },
            "content": {
                "close_pattern": r"<\|im_end\|>\s*",
                "content": "text",
                "repeats": True,
                "join": "\n",
            },
        },
    }
    return tokenizer
