"""The generated reference (docs/_ext/posttrain_reference.py): every command and every config key is on its page,
with the meaning written in its config class's docstring (`key: meaning` lines, the project's convention)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "_ext"))

import posttrain_reference as ref

from posttrain.cli.main import SUBCOMMANDS, build_parser


@dataclasses.dataclass
class _Inner:
    """An inner section.

    depth: how deep, on
      two lines.
    """

    depth: int = 1


@dataclasses.dataclass
class _Base:
    """A base.

    shared: from the base's docstring.
    """

    shared: str = ""


@dataclasses.dataclass
class _Toy(_Base):
    """A toy config: prose that mentions `lr` is not a key line.

    a, b: both described by one line.
    `quoted`: a key in backticks.
    lr x steps: a product of two keys.
    not_a_field: ignored.
    """

    a: int = 0
    b: float | None = None
    quoted: bool = True
    lr: float = 1e-3
    steps: int = 2
    undocumented: list[str] = dataclasses.field(default_factory=list)
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    items: list[_Inner] = dataclasses.field(default_factory=lambda: [_Inner(2)])


def test_key_lines_of_a_class_and_its_bases_are_the_descriptions():
    d = ref.descriptions(_Toy)
    assert d == {"a": "both described by one line.", "b": "both described by one line.",
                 "quoted": "a key in backticks.", "lr": "a product of two keys.", "steps": "a product of two keys.",
                 "shared": "from the base's docstring."}
    keys = {k.key: k for k in ref.walk(_Toy, _Toy())}
    assert list(keys) == ["shared", "a", "b", "quoted", "lr", "steps", "undocumented", "inner", "inner.depth",
                          "items", "items[].depth"]
    assert keys["inner.depth"].description == "how deep, on two lines."
    assert keys["inner"].section and keys["inner"].description == "An inner section."
    assert keys["undocumented"].description is None and keys["undocumented"].type == "list[str]"
    assert (keys["b"].type, keys["b"].default) == ("float | None", "null")
    assert keys["items"].default == "[{depth: 2}]" and keys["shared"].declared_in is _Base


def test_every_key_of_every_command_is_on_its_page():
    for command in ref.ROOTS:
        page = ref.config_page(command)
        found = ref.keys(command)
        assert len(found) > 40
        missing = [k.key for k in found if f"`{k.key}`" not in page]
        assert missing == [], f"{command}: {missing}"
    assert "`rollout.sandbox.backend`" in ref.config_page("rl") and "`teacher.top_k`" in ref.config_page("distill")


def test_the_cli_page_holds_every_command_and_its_options():
    page = ref.cli_page()
    commands = ref.subparsers(build_parser())
    assert set(commands) == set(SUBCOMMANDS)
    for name, parser in commands.items():
        section = page.split(f"## `posttrain {name}`")[1].split("\n## ")[0]
        for action in parser._actions:
            assert all(flag in section for flag in action.option_strings), (name, action.option_strings)


MISSING = ref.missing_keys()


def test_every_config_key_has_a_description():
    """Every key of every command's config has a `key: meaning` line in the docstring of the class declaring it."""
    assert MISSING == [], f"{len(MISSING)} keys have no description:\n" + "\n".join(
        f"{file} {cls}.{key}" for file, cls, key in MISSING)
