"""Builders shared by the multi-turn tests: a tool-calling chat template on the tiny tokenizer,
tools, an engine that writes scripted turns, and, for the tests with real engines, a tiny model
overfit to write a fixed three-turn conversation with tool calls and the checks that what it
samples is what is trained on."""

import contextlib
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
    Records each call's contexts. With `logps`, returns log-probs -0.1, -0.2, ... per position
    (made up: not a policy's, so a trainer would weigh them by the off-policy correction); by
    default none, as an engine sampling with the trainer's own weights (`own_weights` False:
    nothing to publish)."""

    own_weights, version = False, None

    def __init__(self, script, logps: bool = False):
        self.script, self.prompts, self.logps = script, [], logps

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
        logps = logps if self.logps else None
        padded = prompt_ids.repeat_interleave(repeats, 0)
        return padded, prompt_mask.repeat_interleave(repeats, 0), ids, logps

    def publish(self, version):
        pass

    def publish_later(self, version):
        return lambda: None

    def close(self):
        pass


# A fixed three-turn conversation with `add`: the model calls it twice, then answers.
TOOL_PROMPT = [{"role": "user", "content": "Add 2 and 3, then add 4."}]
TOOL_TURNS = [call("add", a=2, b=3), call("add", a=5, b=4), "It is 9."]
TOOL_RESULTS = ["5", "9"]  # what `add` returns for the two calls


@contextlib.contextmanager
def one_thread():
    """torch on one CPU thread meanwhile: for the tiny model more threads only wait on each
    other, up to 20 times slower on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def chain_conversation(rounds: int = 2) -> tuple[list[dict], list[str], list[str]]:
    """A conversation of `rounds` calls of `add` in a row, each on the last one's result, then
    the answer: `(prompt, turns, results)`. `rounds=2` is the fixed conversation (`TOOL_PROMPT`,
    `TOOL_TURNS`, `TOOL_RESULTS`): 2 + 3 = 5, 5 + 4 = 9, "It is 9."."""
    numbers = list(range(2, rounds + 3))  # 2, 3, 4, ...
    text = f"Add {numbers[0]} and {numbers[1]}" + "".join(f", then add {n}" for n in numbers[2:])
    turns, results, total = [], [], numbers[0]
    for number in numbers[1:]:
        turns.append(call("add", a=total, b=number))
        total += number
        results.append(str(total))
    return [{"role": "user", "content": text + "."}], [*turns, f"It is {total}."], results


def tool_conversation(
    tokenizer, tools, rounds: int = 2
) -> tuple[list[int], list[int], list[list[int]]]:
    """The tokens of the fixed conversation (`chain_conversation(rounds)`; by default the
    three-turn one), as the multi-turn loop builds them: the prompt rendered with `tools` by the
    chat template, then each turn (its text and eos) with the tool results' tokens
    (`ToolCallFormat.result_ids`) between the turns.

    Returns `(prompt_ids, completion_ids, pieces)`: `pieces` is the completion cut into turn,
    result, turn, ..., result, turn."""
    from trl_grpo_ext.generation.multi_turn import ToolCallFormat
    from trl_grpo_ext.generation.prompts import PromptEncoder

    prompt, turns, results = chain_conversation(rounds)
    format = ToolCallFormat(tokenizer)
    encoder = PromptEncoder(tokenizer, chat_template=format.chat_template)
    prompt_ids = encoder.encode([prompt], [tools])[0][0].tolist()
    pieces = [encode(tokenizer, turns[0])]
    for result, turn in zip(results, turns[1:]):
        pieces.append(format.result_ids([{"role": "tool", "name": "add", "content": result}]))
        pieces.append(encode(tokenizer, turn))
    return prompt_ids, [token for piece in pieces for token in piece], pieces


def overfit_on_tool_conversation(
    model, tokenizer, tools, steps=100, learning_rate=3e-3, rounds: int = 2
):
    """Trains `model` in place, with plain supervised AdamW steps, to write the assistant turns of
    the fixed conversation (`tool_conversation`, of `rounds` calls) given its context: the tool
    results and the prompt carry no loss. Returns the last loss (mean negative log-likelihood per
    token)."""
    prompt_ids, completion_ids, pieces = tool_conversation(tokenizer, tools, rounds)
    input_ids = torch.tensor([prompt_ids + completion_ids])  # (1, L)
    labels = input_ids.clone()
    labels[0, : len(prompt_ids)] = -100
    start = len(prompt_ids)
    for index, piece in enumerate(pieces):
        if index % 2:  # a tool result
            labels[0, start : start + len(piece)] = -100
        start += len(piece)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    with one_thread():
        for _ in range(steps):
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    return loss.item()


def message_count(completions, **kwargs):
    """A reward: the number of messages of each multi-turn completion."""
    return [float(len(messages)) for messages in completions]


def tool_calling_model(steps: int = 100):
    """The tiny model (head size 32, which vLLM's CPU build can also run) overfit to the fixed
    conversation, and the tokenizer with Qwen3's chat template. Fails when the last loss is not
    near 0: the model would not reliably write the turns."""
    from trl_grpo_ext.tiny import build_tiny_model

    tokenizer = qwen3_tokenizer()
    model = build_tiny_model(tokenizer, seed=0, num_attention_heads=2, num_key_value_heads=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        loss = overfit_on_tool_conversation(model, tokenizer, [add], steps=steps)
    assert loss < 0.05, f"the tiny model did not learn the conversation (loss {loss:.3f})"
    return model, tokenizer


def tool_calling_adapter(model, steps: int = 100, learning_rate: float = 1e-2):
    """`model` with a LoRA adapter (rank 8, every linear layer) overfit to the fixed
    conversation, as a `PeftModel` whose adapter is trainable: a vLLM server serving `model`
    samples the conversation once the trainer has published this adapter. Fails when the last
    loss is not near 0."""
    from peft import get_peft_model
    from trainer_helpers import lora_config

    peft_model = get_peft_model(model, lora_config(r=8))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        loss = overfit_on_tool_conversation(
            peft_model, qwen3_tokenizer(), [add], steps=steps, learning_rate=learning_rate
        )
    assert loss < 0.05, f"the adapter did not learn the conversation (loss {loss:.3f})"
    return peft_model


def record_generations(engine, eos_token_ids: list[int]) -> list[dict]:
    """Wraps `engine.generate` (on the instance) to record each call's contexts (the prompts
    without padding) and what it sampled: per row, its tokens up to and including the first of
    `eos_token_ids`, and their log-probs (None when the engine returns none)."""
    calls, generate = [], engine.generate

    def recording(prompt_ids, prompt_mask, generation_config, seed=None):
        output = generate(prompt_ids, prompt_mask, generation_config, seed)
        _, _, completion_ids, logps = output
        turns, turn_logps = [], []
        for row, ids in enumerate(completion_ids.tolist()):
            length = next(
                (i + 1 for i, token in enumerate(ids) if token in eos_token_ids), len(ids)
            )
            turns.append(ids[:length])
            turn_logps.append(None if logps is None else logps[row, :length].tolist())
        contexts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]
        calls.append(dict(contexts=contexts, turns=turns, logps=turn_logps))
        return output

    engine.generate = recording
    return calls


RESULT_TEXT = (
    "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


def interleaved(turns, results) -> tuple[list, list[int]]:
    """The completion of three sampled turns with two tool results between them, and its tool
    mask (1 on the turns' tokens, 0 on the results')."""
    ids = turns[0] + results[0] + turns[1] + results[1] + turns[2]
    mask = [[1] * len(turn) for turn in turns]
    hidden = [[0] * len(result) for result in results]
    return ids, mask[0] + hidden[0] + mask[1] + hidden[1] + mask[2]


def assert_trained_on_sampled_turns(trainer, rows, engine_logps: bool = False):
    """Samples a batch of `rows` through the trainer's real engine and checks token-in,
    token-out on the fixed conversation (`overfit_on_tool_conversation`): each rollout is the
    three sampled turns with the two rendered tool results between them, the tool mask is 0
    exactly on the results, and the micro-batches of a generation batch hold the same ids.
    `engine_logps`: the engine returns log-probs, which must be the rollout's behaviour
    log-probs (finite where sampled, 0 on the results)."""
    tokenizer = trainer.processing_class
    prompt_ids, _, _ = tool_conversation(tokenizer, [add])
    # the results' tokens, written out by hand: a user turn, as Qwen3's template renders them
    results = [
        tokenizer(RESULT_TEXT.format(result), add_special_tokens=False)["input_ids"]
        for result in TOOL_RESULTS
    ]
    calls = record_generations(trainer.rollouts.engine, trainer.rollouts.eos_token_ids)
    rollout = trainer.generate_rollouts(rows)
    size = len(rows) * trainer.args.num_generations
    assert len(calls) == 3  # one call per turn, every rollout in each
    assert rollout.tool_calls.tolist() == [2] * size
    assert rollout.tool_failures.tolist() == [0] * size
    for i in range(size):
        turns = [call["turns"][i] for call in calls]
        # the model wrote the conversation it was trained on (so the tools did run)
        assert [tokenizer.decode(turn) for turn in turns] == [t + "<|im_end|>" for t in TOOL_TURNS]
        messages = rollout.completions[i]
        roles = ["assistant", "tool", "assistant", "tool", "assistant"]
        assert [message["role"] for message in messages] == roles
        assert [message["content"] for message in messages[1::2]] == TOOL_RESULTS
        arguments = [m["tool_calls"][0]["function"]["arguments"] for m in messages[:4:2]]
        assert arguments == [{"a": 2, "b": 3}, {"a": 5, "b": 4}]
        # token-in: each turn continued from exactly the prompt and everything before it
        assert calls[0]["contexts"][i] == prompt_ids
        assert calls[1]["contexts"][i] == prompt_ids + turns[0] + results[0]
        assert calls[2]["contexts"][i] == prompt_ids + turns[0] + results[0] + turns[1] + results[1]
        # token-out: the completion is what was sampled, with the results between the turns
        expected, tool_mask = interleaved(turns, results)
        length = int(rollout.completion_mask[i].sum())
        assert rollout.completion_ids[i, :length].tolist() == expected
        assert rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist() == prompt_ids
        assert rollout.tool_mask[i, :length].tolist() == tool_mask
        if engine_logps:
            logps = rollout.behaviour_logps[i, :length]
            sampled = torch.tensor(tool_mask, dtype=torch.bool)
            assert logps[~sampled].eq(0).all()
            assert torch.isfinite(logps[sampled]).all()
            recorded = [call["logps"][i] for call in calls]
            assert logps[sampled].tolist() == recorded[0] + recorded[1] + recorded[2]

    # a generation batch of the training loop: its micro-batches hold what this sampling drew
    calls.clear()
    batches = trainer._make_generation_batch(rows)
    assert len(calls) == 3
    i = 0
    for batch in batches:
        width = batch["completion_ids"].shape[1]
        for row in range(len(batch["input_ids"])):
            expected, tool_mask = interleaved([call["turns"][i] for call in calls], results)
            length = len(expected)
            prompt = batch["input_ids"][row, :-width][batch["attention_mask"][row, :-width].bool()]
            assert prompt.tolist() == prompt_ids
            assert batch["input_ids"][row, -width:][:length].tolist() == expected
            assert batch["attention_mask"][row, -width:].tolist() == [1] * length + [0] * (
                width - length
            )  # the results are read
            trained = batch["completion_mask"][row].tolist()
            assert trained == tool_mask + [0] * (width - length)  # but get no gradient
            if engine_logps:
                logps = [call["logps"][i] for call in calls]
                behaviour = batch["behaviour_logps"][row, :length]
                sampled = torch.tensor(tool_mask, dtype=torch.bool)
                assert behaviour[sampled].tolist() == logps[0] + logps[1] + logps[2]
                assert behaviour[~sampled].eq(0).all()
            i += 1
    assert i == size


def script_trl(trainer, turn) -> None:
    """Makes `trl.GRPOTrainer` write the scripted turns that `ScriptedEngine` writes here:
    `turn(context_text)` is the text of the next turn (eos added), log-probs 0."""
    tokenizer = trainer.processing_class

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, **kwargs):
        completions = [encode(tokenizer, turn(tokenizer.decode(ids))) for ids in prompt_ids]
        return completions, [[0.0] * len(ids) for ids in completions]

    trainer._generate_single_turn = single_turn
