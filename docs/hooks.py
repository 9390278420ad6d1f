"""MkDocs hook: the table of `GroupRelativeConfig`'s own fields, from their `metadata["help"]`.

A page that contains the line `<!-- config-fields -->` gets, in its place, one row per field
that `GroupRelativeConfig` declares (not the inherited `TrainingArguments` fields): name, type,
default and help, read from the dataclass at build time, so the table cannot go stale.
"""

from __future__ import annotations

import dataclasses

MARKER = "<!-- config-fields -->"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    # a pipe inside a code span does not split a table cell (and a backslash would show)
    return "`" + str(text).replace("\n", " ") + "`"


def config_fields_table() -> str:
    from trl_grpo_ext.config import GroupRelativeConfig

    own = GroupRelativeConfig.__dict__.get("__annotations__", {})
    rows = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for field in dataclasses.fields(GroupRelativeConfig):
        if field.name not in own:
            continue
        if field.default is not dataclasses.MISSING:
            default = repr(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            default = repr(field.default_factory())
        else:
            default = "required"
        help_text = field.metadata.get("help", "")
        rows.append(
            f"| `{field.name}` | {_code(field.type)} | {_code(default)} | {_cell(help_text)} |"
        )
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, config_fields_table())
