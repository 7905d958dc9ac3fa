"""The documentation's commands run as shown.

A page's runnable commands are its ```` ```bash ```` blocks; commands that cannot run here (real models on an
accelerator, several hosts, installs) are in ```` ```shell ```` (or `text`) blocks, shown but not run. A
```` ```{code-block} LANG ```` block with a `:caption: FILE` option is a file the page asks the reader to write: it
is written to FILE before the blocks after it run. Each page runs in a fresh temporary folder holding links to
the checkout's configs/, tests/ (its data), posttrain/ and benchmarks/, with every bash block in order and under
`set -euo pipefail`, so a page's later commands may use what its earlier ones wrote.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
LINKED = ("configs", "tests", "posttrain", "benchmarks")
BLOCK_TIMEOUT_S = 900

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(.*)$")


def blocks(text: str) -> list[tuple[str, str, str | None]]:
    """`(language, body, caption)` of each fenced block of a MyST page, in order; the language of
    ```` ```{code-block} LANG ```` is LANG, and its leading `:option:` lines are not part of the body."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(2), m.group(3).strip()
        body, i = [], i + 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and not lines[i].strip().strip(fence[0])):
            body.append(lines[i])
            i += 1
        i += 1
        caption = None
        directive = re.match(r"\{code-block\}\s*(\S*)", info)
        lang = directive.group(1) if directive else (info.split() or [""])[0]
        if directive:
            while body and re.match(r"^:\w[\w-]*:", body[0]):
                key, _, value = body.pop(0)[1:].partition(":")
                caption = value.strip() if key == "caption" else caption
        out.append((lang, "\n".join(body) + "\n", caption))
    return out


def runnable(text: str) -> list[tuple[str, str, str | None]]:
    """The blocks a page's test uses: bash blocks and files with a caption."""
    return [b for b in blocks(text) if b[0] == "bash" or b[2]]


def pages_with_commands() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts and "generated" not in p.parts
                  and any(lang == "bash" for lang, _, _ in blocks(p.read_text())))


def test_blocks_are_read_as_the_reader_sees_them():
    page = """# t
```bash
posttrain sft a.yaml
```
````markdown
```bash
not run
```
````
```shell
posttrain rl big.yaml
```
```{code-block} python
:caption: my_reward.py
:linenos:
def f(prompts, completions, **fields):
    return [0.0] * len(completions)
```
"""
    assert runnable(page) == [("bash", "posttrain sft a.yaml\n", None),
                              ("python", "def f(prompts, completions, **fields):\n    return [0.0] * len(completions)\n",
                               "my_reward.py")]
    assert [b[0] for b in blocks(page)] == ["bash", "markdown", "shell", "python"]


def test_every_tutorial_and_how_to_with_commands_has_runnable_ones():
    """A tutorial shows commands a reader can run on a laptop: at least one bash block each (the index pages
    excepted); a how-to without one says it runs nothing here (its commands need hardware this CI lacks)."""
    found = {p.relative_to(DOCS).as_posix() for p in pages_with_commands()}
    tutorials = {p.relative_to(DOCS).as_posix() for p in (DOCS / "tutorials").glob("*.md") if p.stem != "index"}
    assert tutorials and tutorials <= found, sorted(tutorials - found)
    assert "getting-started.md" in found


@pytest.mark.slow
@pytest.mark.parametrize("page", [p.relative_to(DOCS).as_posix() for p in pages_with_commands()])
def test_page_commands_run(page, tmp_path, compile_cache):
    """Every runnable block of `page`, in order, in a fresh folder (the session's compilation cache shared: the pages
    run the same smoke configs, whose programs compile once)."""
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name)
    env = dict(os.environ, **compile_cache,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for lang, body, caption in runnable((DOCS / page).read_text()):
        if caption:
            (tmp_path / caption).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / caption).write_text(body)
            continue
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env, text=True, check=False,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=BLOCK_TIMEOUT_S)
        assert out.returncode == 0, f"{page}: this block failed (exit {out.returncode}):\n{body}\n{out.stdout[-4000:]}"
