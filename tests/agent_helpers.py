"""Builders shared by the multi-turn tests: a tool-calling chat template on the tiny tokenizer,
tools, and an engine that writes scripted turns."""

import json
import os

import pytest
import torch
import trl
from packaging.version import Version

from trl_grpo_ext.tiny import build_tiny_tokenizer

# Tools need TRL 1.16's response templates (`trl_grpo_ext.generation.multi_turn.MIN_TRL`).
needs_trl_1_16 = pytest.mark.skipif(
    Version(trl.__version__) < Version("1.16"),
    reason=f"tools need trl>=1.16, found {trl.__version__} (tested by test_tools_need_trl_1_16)",
)

QWEN3 = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3.jinja")


def qwen3_tokenizer(tokenizer=None):
    """The tiny byte-level tokenizer (or `tokenizer`) with Qwen3's chat template, which renders
    tools and tool calls (`<tool_call>` JSON) and whose call format TRL knows."""
    tokenizer = tokenizer or build_tiny_tokenizer()
    with open(QWEN3, encoding="utf-8") as file:
        tokenizer.chat_template = file.read()
    return tokenizer


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def call(name, **arguments) -> str:
    """A tool call as Qwen3 writes it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def encode(tokenizer, text) -> list[int]:
    """The tokens of one turn: `text`, then eos."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


class ScriptedEngine:
    """An engine (`generate(prompt_ids, prompt_mask, config, seed)`) that writes scripted turns.

    `script` is a list whose k-th entry is the k-th call's turn (token ids, for every row, or a
    list of them, one per row), or a function from a row's context (token ids) to its turn.
    Records each call's contexts; returns log-probs -0.1, -0.2, ... per position."""

    def __init__(self, script):
        self.script, self.prompts = script, []

    def generate(self, prompt_ids, prompt_mask, generation_config, seed=None):
        contexts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        self.prompts.append(contexts)
        repeats = generation_config.num_return_sequences or 1
        contexts = [c for c in contexts for _ in range(repeats)]
        if callable(self.script):
            rows = [self.script(context) for context in contexts]
        else:
            turn = self.script[len(self.prompts) - 1]
            rows = turn if isinstance(turn[0], list) else [turn] * len(contexts)
        width = max(len(r) for r in rows) + 2  # sampled padding after eos, as engines return
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        logps = -torch.arange(1, width + 1, dtype=torch.float).repeat(len(rows), 1) / 10
        padded = prompt_ids.repeat_interleave(repeats, 0)
        return padded, prompt_mask.repeat_interleave(repeats, 0), ids, logps

    def close(self):
        pass
