"""Reference pages generated from the code at build time, so they cannot drift from it:

- ```{config-reference}``` : every field of every section of `hvd_rl.config.TrainConfig`, with its
  type, default, the comment beside it in config.py, and what `validate()` refuses (found by
  handing validate() probe values: out-of-range numbers, an unknown choice, an empty list) plus
  the combinations it refuses (`hvd_rl.combinations`);
- ```{cli-reference}``` : `hvd-rl --help` and every subcommand's help, from the argparse parser.
"""
from __future__ import annotations

import dataclasses
import io
import re
import tokenize
import typing

from docutils.parsers.rst import Directive
from docutils.statemachine import StringList


def field_comments(cls: type) -> dict[str, str]:
    """The comments of each field in the class body: the lines just above it and the one beside it."""
    import inspect

    source = inspect.getsource(cls)
    comments: dict[str, str] = {}
    pending: list[str] = []
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines = source.splitlines()
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            pending.append(text)
            continue
        match = re.match(r"\s+([a-z_][a-z0-9_]*)\s*:", line)
        if match and not stripped.startswith(("def ", "@", "return")):
            beside = [t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT and t.start[0] == number]
            # a comment continued on the next lines, indented under the first ("#   ...")
            following = []
            for extra in lines[number:]:
                if re.match(r"\s+#\s{2,}", extra):
                    following.append(extra.strip().lstrip("#").strip())
                else:
                    break
            comments[match.group(1)] = " ".join(pending + beside + following).strip()
        if not stripped.startswith("#"):
            pending = []
    return comments


def _probes(kind: typing.Any) -> list[typing.Any]:
    if kind is bool:
        return []
    if kind is int:
        return [-1, 0, 1, 2]
    if kind is float:
        return [-1.0, 0.0, 1.0, 2.0]
    if kind is str:
        return ["no-such-value", ""]
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return [[], [""], ["a b!"]] if item is str else [[], [0], [-1]]
    return []


def refusals(section: str | None, name: str, kind: typing.Any) -> list[str]:
    """What validate() says when this one field takes each probe value (the rest at defaults)."""
    from hvd_rl.config import ConfigError, TrainConfig, validate

    qualified = f"{section}.{name}" if section else name
    said: list[str] = []
    for probe in _probes(kind):
        cfg = TrainConfig()
        target = getattr(cfg, section) if section else cfg
        setattr(target, name, probe)
        try:
            validate(cfg)
        except ConfigError as exc:
            text = str(exc).split(": ", 1)[1] if ": " in str(exc) else str(exc)
            for problem in text.split("; "):
                if qualified in problem:
                    problem = re.sub(r",? got .*$", "", problem).strip()
                    if problem not in said:
                        said.append(problem)
    return said


def _type_name(kind: typing.Any) -> str:
    return getattr(kind, "__name__", None) if typing.get_origin(kind) is None else str(kind).replace("typing.", "")


def _escape(text: str) -> str:
    """A code comment as Markdown text: nothing in it may become a link, emphasis or HTML."""
    return re.sub(r"([\\`*_\[\]<>|])", r"\\\1", text.replace("\n", " "))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_markdown() -> list[str]:
    from hvd_rl import combinations
    from hvd_rl.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    top = [f for f in dataclasses.fields(TrainConfig) if not dataclasses.is_dataclass(hints[f.name])]
    sections = [f for f in dataclasses.fields(TrainConfig) if dataclasses.is_dataclass(hints[f.name])]
    out: list[str] = []

    def table(cls: type, section: str | None, fields: list) -> None:
        notes = field_comments(cls)
        class_hints = typing.get_type_hints(cls)
        defaults = cls() if section else TrainConfig()
        out.extend(["| field | type | default | meaning | refused |", "|---|---|---|---|---|"])
        for f in fields:
            kind = class_hints[f.name]
            qualified = f"{section}.{f.name}" if section else f.name
            default = repr(getattr(defaults, f.name))
            rules = "<br>".join(f"`{r.replace('`', chr(39))}`" for r in refusals(section, f.name, kind)) or "—"
            out.append(f"| `{qualified}` | `{_type_name(kind)}` | `{_cell(default)}` | {_escape(notes.get(f.name, ''))} | "
                       f"{_cell(rules)} |")
        out.append("")

    out += ["## Top level", ""]
    table(TrainConfig, None, top)
    for section in sections:
        cls = hints[section.name]
        doc = (cls.__doc__ or "").strip()
        out += [f"## `[{section.name}]`", ""]
        if doc and not doc.startswith(cls.__name__ + "("):
            out += [doc, ""]
        table(cls, section.name, dataclasses.fields(cls))
    out += ["## Options that do not combine", "",
            "Pairs `validate()` refuses before any rank starts (one line, exit 2 on every rank); every other pair "
            "runs in `tests/test_option_matrix.py`.", "", *combinations.markdown_table().splitlines(), ""]
    return out


def cli_markdown() -> list[str]:
    import argparse

    from hvd_rl.cli import build_parser

    parser = build_parser()
    out = ["## `hvd-rl`", "", "```text", parser.format_help().rstrip(), "```", ""]

    def walk(p: argparse.ArgumentParser, prefix: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out.extend([f"## `{prefix} {name}`", "", "```text", sub.format_help().rstrip(), "```", ""])
                    walk(sub, f"{prefix} {name}")

    walk(parser, "hvd-rl")
    return out


class _MarkdownDirective(Directive):
    has_content = False

    def lines(self) -> list[str]:
        raise NotImplementedError

    def run(self):
        from docutils import nodes

        container = nodes.container()
        self.state.nested_parse(StringList(self.lines(), source="generated"), self.content_offset, container,
                                match_titles=True)
        return container.children


class ConfigReference(_MarkdownDirective):
    def lines(self) -> list[str]:
        return config_markdown()


class CliReference(_MarkdownDirective):
    def lines(self) -> list[str]:
        return cli_markdown()


def setup(app):
    app.add_directive("config-reference", ConfigReference)
    app.add_directive("cli-reference", CliReference)
    # the pages change whenever the code does
    app.connect("env-get-outdated", lambda app, env, added, changed, removed:
                [d for d in env.found_docs if d.endswith(("reference/config", "reference/cli"))])
    return {"parallel_read_safe": True, "version": "1"}

