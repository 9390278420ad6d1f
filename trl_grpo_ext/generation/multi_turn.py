"""Multi-turn rollouts: the model calls tools, the results come back as tokens, it samples again.

One rollout is a prompt followed by turns: the engine samples until end of turn; when the turn
holds tool calls (parsed from the model's own chat-template format by transformers'
`parse_response` with TRL's response templates), the tools run, their results are rendered by the
chat template as a `tool` message and appended as tokens, and the engine continues from
prompt + everything so far. The conversation is never re-tokenised: the ids trained on are the
ids the engine sampled, with the tool results' ids between them (token-in, token-out).

Every completion carries a tool mask: 1 on the model's own tokens, 0 on the tool results', which
get no gradient and take part in no ratio or KL (TRL's `tool_mask`). `max_completion_length`
counts both: a tool result that would not fit ends the rollout before it (its messages are
dropped, as in TRL), and the last turn is cut at the budget.

A tool result may hold images (content parts, TRL's convention): with a vision-language model's
processor, the processor renders and tokenises it, expanding its image placeholders, and the
rollout carries those images into every later turn and into training (`turn_images.py`).

Nothing here imports the tools package or the trainer: the caller hands over, for each rollout,
its tools (an object with `functions`, what the chat template renders) and a runner that runs the
calls of a whole batch (`run(calls) -> results`; each rollout's in the order the model wrote them,
where and how concurrently is the runner's: `tools.ToolRunner`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from .images import PER_TOKEN_FIELDS, TOOL_IMAGES_NEED_A_PROCESSOR, has_image_parts
from .rollout import CompletionEnds, left_padded
from .turn_images import TurnImages

MIN_TRL = "1.16"  # the TRL whose tool-calling contract and response templates this follows


class ToolCallFormat:
    """How a model's chat template writes tool calls and renders tool results.

    Sets TRL's response template for the known chat templates (Qwen2.5, Qwen3, Llama 3.1/3.2 and
    others: `trl.chat_template_utils.add_response_schema`) when the tokenizer has none; a template
    that is not prefix-preserving is replaced by TRL's training template, so that a tool result
    appended as tokens is what the template would render.

    With a vision-language model's `processor`, its chat template is the one checked and
    rendered with (as TRL renders with the processor), and tool results with images are
    rendered and tokenised by the processor (`result_tokens`).

    Args:
        tokenizer: the policy's tokenizer; its chat template must render tool calls and results.
        chat_template_kwargs (`dict`, *optional*): extra arguments of `apply_chat_template`.
        processor (*optional*): the model's multimodal processor.
    """

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None, processor=None):
        import trl
        from packaging.version import Version
        from trl import chat_template_utils as utils

        if Version(trl.__version__) < Version(MIN_TRL):
            raise ImportError(
                f"Tools and environments need trl>={MIN_TRL} (its tool-call response templates and "
                f"parse_response); trl {trl.__version__} is installed. Run "
                f"pip install 'trl>={MIN_TRL}'."
            )

        self.tokenizer, self.processor = tokenizer, processor
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        templated = processor if processor is not None else tokenizer
        if not utils.supports_tool_calling(templated):
            raise ValueError(
                "Tools were given, but the tokenizer's chat template cannot render a tool call and "
                "its result (user -> assistant with tool_calls -> tool). Use the tokenizer of a "
                "model trained for tool calling (Qwen2.5, Qwen3, Llama 3.1+), or set "
                "tokenizer.chat_template to a template that renders `tool_calls` and `tool` "
                "messages (docs/agents.md, 'Models without a tool format')."
            )
        has_parser = any(
            getattr(tokenizer, name, None) is not None
            for name in ("response_template", "response_schema")
        )
        if not has_parser:
            try:
                utils.add_response_schema(templated)
            except ValueError as error:
                raise ValueError(
                    "Tools were given, but the tokenizer's chat template is not one whose tool-call "
                    "format is known (Qwen2.5, Qwen3, Llama 3.1/3.2, ...), so calls cannot be parsed "
                    "from what the model writes. Set tokenizer.response_template (transformers' "
                    "response parsing; docs/agents.md, 'Models without a tool format') before "
                    "building the trainer."
                ) from error
        self.chat_template = None if processor is None else processor.chat_template
        if not utils.is_chat_template_prefix_preserving(templated):
            self.chat_template = utils.get_training_chat_template(templated)
        self._parse = utils.parse_response
        self._render = dict(
            tokenize=True,
            return_dict=False,
            chat_template=self.chat_template,
            **self.chat_template_kwargs,
        )
        self._stand_ins: dict[tuple, list[int]] = {}  # (tool name, by processor) -> tokens

    def parse(self, ids: list[int], prefix: list[int], tools) -> dict:
        """The assistant message of one turn, with its `tool_calls` when it made any (malformed
        calls come back as plain text, as in TRL)."""
        return self._parse(self.tokenizer, ids, prefix=prefix, tools=tools)

    def result_tokens(self, tool_messages: list[dict]) -> tuple[list[int], dict | None]:
        """`result_ids` of these tool results, and the processor's fields of their images
        (`pixel_values`, ...; per-token fields over the returned ids), None without images.

        Results with images are rendered after the stand-in call by the processor's chat
        template and tokenised by the processor, which expands each image placeholder into the
        model's image tokens, as TRL does."""
        if not has_image_parts(tool_messages):
            return self.result_ids(tool_messages), None
        if self.processor is None:
            raise ValueError(TOOL_IMAGES_NEED_A_PROCESSOR)
        from trl.data_utils import prepare_multimodal_messages

        name = tool_messages[0]["name"]
        before = self._stand_in_ids(name, by_processor=True)
        encoded = self.processor.apply_chat_template(
            prepare_multimodal_messages(_stand_in(name) + tool_messages),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            chat_template=self.chat_template,
            **self.chat_template_kwargs,
        )
        after = encoded["input_ids"][0].tolist()
        if after[: len(before)] != before:
            raise ValueError(
                "The processor renders an assistant's tool call differently once a tool result "
                "with an image follows it, so the result cannot be appended as tokens. Use a "
                "prefix-preserving chat template."
            )
        fields = {}
        for key, value in encoded.items():
            if key in ("input_ids", "attention_mask"):
                continue
            fields[key] = value[0, len(before) :] if key in PER_TOKEN_FIELDS else value
        return after[len(before) :], fields

    def result_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens the chat template puts after an assistant's tool call for these tool
        results, up to the next assistant header: what the engine continues from.

        Rendered once with a stand-in call and once with the results; the difference is the
        results' tokens. The stand-in turn is cut after its last eos, where the sampled turn ends
        (Qwen3 renders a newline after `<|im_end|>`, which then belongs to the results).
        """
        messages = _stand_in(tool_messages[0]["name"])
        after = self.tokenizer.apply_chat_template(
            messages + tool_messages, add_generation_prompt=True, **self._render
        )
        before = self._stand_in_ids(tool_messages[0]["name"])
        if after[: len(before)] != before:
            raise ValueError(
                "The chat template renders an assistant's tool call differently once a tool result "
                "follows it, so results cannot be appended as tokens. Use a prefix-preserving "
                "chat template."
            )
        return after[len(before) :]

    def _stand_in_ids(self, name: str, by_processor: bool = False) -> list[int]:
        """The tokens of the stand-in conversation up to the end of its call turn (the last
        eos), rendered once per tool name, by the tokenizer or (`by_processor`, for results
        with images) by the processor, as TRL renders it."""
        key = (name, by_processor)
        if key not in self._stand_ins:
            if by_processor:
                from trl.data_utils import prepare_multimodal_messages

                ids = self.processor.apply_chat_template(
                    prepare_multimodal_messages(_stand_in(name)),
                    add_generation_prompt=False,
                    tokenize=True,
                    return_dict=False,
                    chat_template=self.chat_template,
                    **self.chat_template_kwargs,
                )[0]
            else:
                ids = self.tokenizer.apply_chat_template(
                    _stand_in(name), add_generation_prompt=False, **self._render
                )
            eos = [i for i, token in enumerate(ids) if token == self.tokenizer.eos_token_id]
            self._stand_ins[key] = ids[: eos[-1] + 1] if eos else ids
        return self._stand_ins[key]


def _stand_in(name: str) -> list[dict]:
    """A user message and an assistant turn calling the tool `name` (TRL renders results after
    one, since some templates derive the result's header from the call)."""
    call = [{"type": "function", "function": {"name": name, "arguments": {}}}]
    return [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": call},
    ]


@dataclass
class Turns:
    """The completions of a batch of multi-turn rollouts, one entry per rollout.

    Attributes:
        completion_ids (`list[list[int]]`): every turn's tokens and the tool results' between them.
        tool_mask (`list[list[int]]`): 1 on tokens the model sampled, 0 on tool-result tokens.
        logps (`list[list[float]]`, *optional*): the engine's log-probs of the sampled tokens,
            0.0 on tool-result tokens; None when the engine returns none.
        completions (`list[list[dict]]`): the messages: assistant turns (with `tool_calls`) and
            `tool` results.
        calls (`list[int]`): tool calls each rollout made; `failures` of them came back as
            errors.
        ended (`list[bool]`): whether each rollout's last turn ended (eos or a stop string);
            False: truncated.
        image_inputs (`dict[str, torch.Tensor]`, *optional*): each rollout's image fields, its
            prompt's images then its tool results', in the per-sample layout of `images.py`;
            None without images.
    """

    completion_ids: list[list[int]]
    tool_mask: list[list[int]]
    logps: list[list[float]] | None
    completions: list[list[dict]]
    calls: list[int]
    failures: list[int]
    ended: list[bool]
    image_inputs: dict | None = None


class ToolLoop:
    """Continues sampled completions through tool calls until none is left.

    Args:
        format ([`ToolCallFormat`]): parses calls and renders results.
        runner: runs a batch of calls (`tools.ToolRunner`): `run(calls)` with, per
            rollout, a list of `(tools, tool_call)` pairs, returns per rollout a list of results
            (`.message()` is the `tool` message, `.failed` an error result).
        eos_token_ids (`list[int]`): the tokens that end a turn.
        stop_strings (`list[str]`, *optional*): strings that end a turn too
            (`rollout.CompletionEnds`, the rule every path applies).
        pad_token_id (`int`): pads prompts handed to the engine.
        max_completion_length (`int`): the budget of every turn and tool result together.
        max_model_len (`int`): the engine's longest sequence; a result that would reach it is
            dropped like one past the budget.
        max_iterations (`int`, *optional*): tool rounds at most (`max_tool_calling_iterations`).
    """

    def __init__(
        self,
        format: ToolCallFormat,
        runner,
        *,
        eos_token_ids: list[int],
        stop_strings: list[str] | None = None,
        pad_token_id: int,
        max_completion_length: int,
        max_model_len: int,
        max_iterations: int | None = None,
    ):
        self.format, self.runner = format, runner
        self.eos_token_ids, self.pad_token_id = eos_token_ids, pad_token_id
        self.stop_strings = stop_strings
        self.max_completion_length, self.max_model_len = max_completion_length, max_model_len
        self.max_iterations = max_iterations

    def with_own_tokenizer(self) -> ToolLoop:
        """A copy that parses and renders with a copy of the tokenizer, for another thread: a
        fast tokenizer changes its padding settings on each call, so two threads sharing one
        (the trainer encoding prompts, the rollout worker rendering tool results) could see each
        other's settings or collide ("Already borrowed")."""
        format = copy.copy(self.format)
        format.tokenizer = copy.deepcopy(self.format.tokenizer)
        if format.processor is not None:
            format.processor = copy.deepcopy(format.processor)
        loop = copy.copy(self)
        loop.format = format
        return loop

    def run(
        self, engine, generation_config, seed, prompt_ids, prompt_mask, tools, image_inputs=None
    ) -> Turns:
        """Samples one batch of rollouts, each one completion of its own prompt, through all
        their tool rounds.

        Args:
            engine: samples (`generate(prompt_ids, prompt_mask, config, seed)`).
            generation_config: the sampling settings; one completion per prompt is sampled.
            seed (`int`, *optional*): the engine's seed for the first turn; round k uses
                `seed + k` (None: transformers, seeded by the caller).
            prompt_ids, prompt_mask (`torch.Tensor`): left-padded prompts, `(N, P)`, rendered
                with each rollout's tools.
            tools (`list`): each rollout's tools (`.functions` is what the template rendered).
            image_inputs (`dict`, *optional*): the prompts' image fields, one row per rollout
                (`images.per_sample`); the engine then takes `image_inputs` too.
        """
        config = copy.deepcopy(generation_config)
        config.num_return_sequences = 1  # every rollout continues its own history
        ends = CompletionEnds.of(self.eos_token_ids, self.stop_strings, self.format.tokenizer)
        images = TurnImages(image_inputs, prompt_mask)
        prompt_width = prompt_ids.shape[1]
        seen = images.prompt_inputs()
        _, _, completion_ids, logps = engine.generate(
            prompt_ids, prompt_mask, config, seed, **_with(seen)
        )
        prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]
        turns = self._first_turns(*ends.cut(completion_ids, logps), prompt_ids, tools)
        active = [
            i for i, messages in enumerate(turns.completions) if messages[-1].get("tool_calls")
        ]
        rounds = 0
        while active and (self.max_iterations is None or rounds < self.max_iterations):
            rounds += 1
            continuing, contexts = self._add_tool_results(turns, active, tools, prompt_ids, images)
            if not continuing:
                break
            room = max(
                self.max_completion_length - len(turns.completion_ids[i]) for i in continuing
            )
            config.max_new_tokens = room
            prompt, mask = left_padded(contexts, self.pad_token_id)
            lengths = [len(prompt_ids[i]) for i in continuing]
            seen = images.generation_inputs(continuing, contexts, lengths)
            _, _, new_ids, new_logps = engine.generate(
                prompt, mask, config, None if seed is None else seed + rounds, **_with(seen)
            )
            active = self._add_turns(
                turns, continuing, contexts, *ends.cut(new_ids, new_logps), tools
            )
        lengths = [len(ids) for ids in turns.completion_ids]
        turns.image_inputs = images.rows(lengths, prompt_width)
        return turns

    def _first_turns(self, ids, logps, ended, prompt_ids, tools) -> Turns:
        """The rollouts after their first turn (`ids`, `logps` and `ended` cut at their ends)."""
        return Turns(
            completion_ids=ids,
            tool_mask=[[1] * len(row) for row in ids],
            logps=logps,
            completions=[
                [self.format.parse(row, prompt, tool.functions)]
                for row, prompt, tool in zip(ids, prompt_ids, tools)
            ],
            calls=[0] * len(ids),
            failures=[0] * len(ids),
            ended=ended,
        )

    def _add_tool_results(self, turns, active, tools, prompt_ids, images):
        """Runs the calls of the last turn of the rollouts `active` and appends their results.

        Returns the rollouts that continue (their results fit, with room for one more token)
        and each one's context: its prompt and all its turns and results so far."""
        results = self.runner.run(
            [[(tools[i], call) for call in turns.completions[i][-1]["tool_calls"]] for i in active]
        )
        continuing, contexts = [], []
        for i, calls in zip(active, results):
            turns.calls[i] += len(calls)
            turns.failures[i] += sum(result.failed for result in calls)
            messages = [result.message() for result in calls]
            suffix, fields = self.format.result_tokens(messages)
            length = len(turns.completion_ids[i]) + len(suffix)
            # No room for the results and at least one token after them: the rollout ends at
            # its call. It never ends on a result, which reward functions would read as the
            # model's last message (TRL keeps results that fill the budget exactly and cuts
            # the next turn to nothing), and no engine is asked for 0 new tokens.
            if length >= self.max_completion_length:
                continue
            if len(prompt_ids[i]) + length >= self.max_model_len:
                continue
            if fields is not None:  # the images reach every later turn and training
                images.add(i, len(turns.completion_ids[i]), fields)
            turns.completions[i].extend(messages)
            turns.completion_ids[i] += suffix
            turns.tool_mask[i] += [0] * len(suffix)
            if turns.logps is not None:
                turns.logps[i] += [0.0] * len(suffix)
            continuing.append(i)
            contexts.append(prompt_ids[i] + turns.completion_ids[i])
        return continuing, contexts

    def _add_turns(self, turns, continuing, contexts, new_ids, new_logps, new_ended, tools):
        """Appends the turns sampled after the contexts of the rollouts `continuing`, cut at
        the budget; returns the rollouts whose new turn calls tools."""
        active = []
        for row, i in enumerate(continuing):
            left = self.max_completion_length - len(turns.completion_ids[i])
            sampled = new_ids[row][:left]
            turns.ended[i] = new_ended[row] and len(new_ids[row]) <= left
            turns.completion_ids[i] += sampled
            turns.tool_mask[i] += [1] * len(sampled)
            if turns.logps is not None:
                turns.logps[i] += new_logps[row][:left]
            if not sampled:
                continue
            message = self.format.parse(sampled, contexts[row], tools[i].functions)
            turns.completions[i].append(message)
            if message.get("tool_calls"):
                active.append(i)
        return active


def _with(image_inputs) -> dict:
    """`generate`'s keyword for these image fields: none without images, so that an engine
    that takes none is called as before."""
    return {} if image_inputs is None else {"image_inputs": image_inputs}
