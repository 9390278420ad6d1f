"""The tiny model learns to use a tool with GRPO, through the trainer's multi-turn path.

Task: a `Counter` environment starts at 0 and has one tool, `move(steps)`; the prompt names a
counter and the move to make, e.g. "Counter kqz: -2.", and the environment's reward is 1 when the
counter ends at the target (-2, -1, +1 or +2). The rollout is the model's call, the tool's result
and a short answer, sampled by the transformers engine and parsed by TRL's Qwen3 parser.

1. A warm-up SFT teaches the call *format* only: in its examples the argument is drawn uniformly
   at random, independent of the prompt, so the warm model calls `move` every time but picks the
   wrong move three times in four (greedy held-out success about 25%).
2. GRPO (LoRA) with the environment's reward must teach it *which* move to make.
3. Greedy success on 40 held-out prompts (10 counter names never trained on, times 4 moves) is
   measured before and after, through the trainer's own generation path.

Measured (seeds 0, 1, 2): 25% before and 100% after, each time; the test takes about 60 s on
2 shared CPU cores.

Three choices keep it that fast and robust:
- The tiny tokenizer is byte-level, so Qwen3's tool instructions and the tool's JSON schema would
  be ~300 tokens the tiny model must read past. Here the template's fixed strings (and the schema
  line of `move`) are single added tokens, as a real BPE tokenizer keeps them short: the prompt
  is ~30 tokens and the call ~9. The cue tokens (`+`, `-`, the digit) occur nowhere else in the
  prompt (the counter names are consonants), so one attention head can find them.
- Every step's 4 prompts are one counter name with its 4 targets (`shuffle_dataset=False` over
  a dataset shuffled in such blocks): a step whose prompts all wanted the same move would reward
  that move unconditionally, and a run could collapse onto it.
- `beta=0.2`: without the KL to the warm model, a run (seed 0) learned the sign first and then
  always wrote the same size, so no group differed in size any more and success stayed at 50%.
"""

import itertools
import json
import random

import torch
from agent_helpers import needs_trl_1_16, one_thread, qwen3_tokenizer
from datasets import Dataset
from tokenizers import AddedToken
from trainer_helpers import lora_config
from transformers.utils import get_json_schema

from trl_grpo_ext import GroupRelativeConfig, GroupRelativeTrainer
from trl_grpo_ext.generation.multi_turn import ToolCallFormat
from trl_grpo_ext.generation.prompts import PromptEncoder
from trl_grpo_ext.generation.sampling import sampling_config
from trl_grpo_ext.tiny import build_tiny_model

pytestmark = needs_trl_1_16

SEED = 0
MOVES = {-2: "-2", -1: "-1", 1: "+1", 2: "+2"}  # target -> how the prompt writes it
NO_THINKING = {"enable_thinking": False}


class Counter:
    """A counter at 0 that the model must bring to the row's `target` with `move`."""

    def reset(self, target, **row):
        self.value, self.target = 0, target

    def move(self, steps: int) -> str:
        """Moves the counter.

        Args:
            steps: How far; negative moves it down.
        """
        self.value += steps
        return str(self.value)

    def get_reward(self) -> float:
        return float(self.value == self.target)


def compact_qwen3_tokenizer():
    """The tiny tokenizer with Qwen3's chat template and the template's fixed strings (the tool
    instructions, the call's JSON frame, the tags, role names) and the schema line of
    `Counter.move` added as tokens of their own."""
    tokenizer = qwen3_tokenizer()
    intro, outro = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    )
    pieces = [
        intro,
        outro,
        json.dumps(get_json_schema(Counter().move)),
        '<tool_call>\n{"name": "',
        '", "arguments": ',
        "}\n</tool_call>",
        "<tool_response>\n",
        "\n</tool_response>",
        "<think>\n\n</think>\n\n",
        "system\n",
        "user\n",
        "assistant\n",
        "move",
        '{"steps": ',
    ]
    tokenizer.add_tokens([AddedToken(piece, normalized=False) for piece in pieces])
    return tokenizer


def counter_rows(names: list[str], rng: random.Random) -> list[dict]:
    """For each counter name, one row per target, in blocks of 4 (targets shuffled in a block)."""
    rows = []
    for name in names:
        targets = list(MOVES)
        rng.shuffle(targets)
        for target in targets:
            content = f"Counter {name}: {MOVES[target]}."
            rows.append({"prompt": [{"role": "user", "content": content}], "target": target})
    return rows


def learn_the_call_format(model, tokenizer, rows, rng, steps=60, batch_size=16, lr=3e-3):
    """Warm-up SFT (full fine-tuning, AdamW): a call of `move` with a *random* move, its result,
    then "OK". The tool results and prompts carry no loss. Returns the last loss."""
    format = ToolCallFormat(tokenizer, NO_THINKING)
    encoder = PromptEncoder(tokenizer, None, NO_THINKING, format.chat_template)
    move = Counter().move

    def turn(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def example(row):
        steps = rng.choice(list(MOVES))  # independent of the prompt: the format, not the choice
        prompt = encoder.encode([row["prompt"]], [[move]])[0][0].tolist()
        call = json.dumps({"name": "move", "arguments": {"steps": steps}})
        call = turn(f"<tool_call>\n{call}\n</tool_call>")
        result = format.result_ids([{"role": "tool", "name": "move", "content": str(steps)}])
        answer = turn("OK")
        labels = [-100] * len(prompt) + call + [-100] * len(result) + answer
        return prompt + call + result + answer, labels

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        examples = [example(rng.choice(rows)) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in examples)
        pad = [width - len(ids) for ids, _ in examples]
        input_ids = torch.tensor(
            [ids + [tokenizer.pad_token_id] * p for (ids, _), p in zip(examples, pad)]
        )  # (B, L)
        labels = torch.tensor([labels + [-100] * p for (_, labels), p in zip(examples, pad)])
        mask = torch.tensor([[1] * (width - p) + [0] * p for p in pad])
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return loss.item()


def greedy_success(trainer, rows) -> tuple[float, float]:
    """Greedy rollouts of `rows` through the trainer's generation path (engine, tool loop,
    environments): the fraction whose counter reached its target, and the calls per rollout."""
    producer = trainer.rollouts
    sampling = producer.sampling
    producer.sampling = sampling_config(
        max_new_tokens=trainer.args.max_completion_length,
        eos_token_id=producer.eos_token_ids,
        pad_token_id=trainer.processing_class.pad_token_id,
        greedy=True,
    )
    try:
        rollout = trainer.generate_rollouts(rows)
    finally:
        producer.sampling = sampling
    rewards = [environment.get_reward() for environment in rollout.environments]
    return sum(rewards) / len(rows), rollout.tool_calls.float().mean().item()


def run(tmp_path, seed: int = SEED) -> dict:
    """Warm-up, held-out success, GRPO, held-out success again."""
    rng = random.Random(seed)
    names = ["".join(letters) for letters in itertools.product("bcdfghjklmnpqrstvwxz", repeat=3)]
    rng.shuffle(names)
    train_rows, held_out = counter_rows(names[:100], rng), counter_rows(names[100:110], rng)

    tokenizer = compact_qwen3_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, initializer_range=0.2)
    with one_thread():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            warm_loss = learn_the_call_format(model, tokenizer, train_rows, rng)
        args = GroupRelativeConfig(
            output_dir=str(tmp_path),
            num_generations=8,
            per_device_train_batch_size=32,  # 4 prompts: one counter name, its 4 targets
            shuffle_dataset=False,
            max_steps=100,
            learning_rate=5e-3,
            beta=0.2,  # the KL to the warm model keeps both choices (sign, size) explored
            max_completion_length=32,
            max_prompt_length=None,
            max_tool_calling_iterations=1,
            chat_template_kwargs=NO_THINKING,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=seed,
        )
        trainer = GroupRelativeTrainer(
            model=model,
            reward_funcs=None,
            args=args,
            train_dataset=Dataset.from_list(train_rows),
            processing_class=tokenizer,
            environment_factory=Counter,
            peft_config=lora_config(),
        )
        before, calls_before = greedy_success(trainer, held_out)
        trainer.train()
        after, calls_after = greedy_success(trainer, held_out)
    return dict(
        warm_loss=warm_loss,
        before=before,
        after=after,
        calls_before=calls_before,
        calls_after=calls_after,
        held_out=held_out,
        train_rows=train_rows,
        rewards=[log["reward"] for log in trainer.state.log_history if "reward" in log],
    )


def test_the_tiny_model_learns_which_move_to_make_on_held_out_counters(tmp_path):
    result = run(tmp_path)
    trained = {row["prompt"][0]["content"] for row in result["train_rows"]}
    assert not trained & {row["prompt"][0]["content"] for row in result["held_out"]}
    assert len(result["held_out"]) == 40
    # the warm model writes the call every time (the format), but its choice is at chance
    assert result["calls_before"] == 1.0
    assert result["before"] <= 0.40, result
    # GRPO taught the choice, on counters it never saw, and the format held
    assert result["after"] >= result["before"] + 0.30, result
    assert result["calls_after"] == 1.0
