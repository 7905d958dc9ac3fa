"""The documentation's commands run as shown.

A page's runnable commands are its ```` ```bash ```` blocks; commands that cannot run here (real models on an
accelerator, several hosts, installs) are in ```` ```shell ```` (or `text`) blocks, shown but not run. A
```` ```{code-block} LANG ```` block with a `:caption: FILE` option is a file the page asks the reader to write: it
is written to FILE before the blocks after it run. Each page runs in a fresh temporary folder holding links to
the checkout's configs/, tests/ (its data), posttrain/ and benchmarks/, with every bash block in order and under
`set -euo pipefail`, so a page's later commands may use what its earlier ones wrote.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
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


def run_block(body: str, folder: Path, env: dict) -> tuple[int, str]:
    """Runs one bash block in `folder` as a process group of its own: (exit code, output; -1 after a timeout).

    The output goes to a file, not a pipe, so the block ends when bash exits: a background server it started and did
    not stop (its `stop_server` skipped after a failed command) cannot hold the test until the timeout (it held the
    pipe before). A block that fails, or still runs after `BLOCK_TIMEOUT_S`, has every process of its group sent
    SIGABRT (with PYTHONFAULTHANDLER each Python process prints every thread's stack to its stderr: a server's goes to
    its log) and then killed; the output then ends with the tails of the folder's *.log files."""
    def no_core_files():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGABRT's default action would write them

    with tempfile.TemporaryFile("w+", errors="replace") as out:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", body], cwd=folder, stdout=out,
                                stderr=subprocess.STDOUT, env=dict(env, PYTHONFAULTHANDLER="1"), text=True,
                                start_new_session=True, preexec_fn=no_core_files)
        try:
            code = proc.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = -1
        with contextlib.suppress(ProcessLookupError):  # the group's processes: the block's, and what it left behind
            if code:
                os.killpg(proc.pid, signal.SIGABRT)
                time.sleep(3.0)  # time to print the stacks
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        out.seek(0)
        output = out.read()
    if code:
        logs = "".join(f"\n--- {log.name} (its end) ---\n{log.read_text(errors='replace')[-6000:]}"
                       for log in sorted(folder.glob("*.log")))
        why = f"still running after {BLOCK_TIMEOUT_S} s" if code == -1 else f"exit {code}"
        output += f"\n[{why}: the stacks of its processes dumped to their stderr, then killed]{logs}"
    return code, output


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


_SERVER = 'python -c "import time, os; open(\'pid\', \'w\').write(str(os.getpid())); time.sleep(600)" 2> server.log &\n'


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (within 5 s: a killed process may take a moment to be reaped)."""
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("case", ["fails", "hangs"])
def test_a_failed_or_hung_block_reports_its_stacks_and_leaves_nothing_running(case, tmp_path, monkeypatch):
    """A block that starts a background "server" and fails before stopping it fails at once (before, the server held
    the output pipe: the test waited for the timeout), and one that hangs fails at the timeout; either way with its
    output, the server's stack (faulthandler's, from its log), and the server killed."""
    monkeypatch.setattr(sys.modules[__name__], "BLOCK_TIMEOUT_S", 5)
    body = _SERVER + "while [ ! -s pid ]; do sleep 0.1; done\necho the client ran\n" + (
        "false\n" if case == "fails" else "sleep 600\n") + "kill %1\n"
    t0 = time.monotonic()
    code, output = run_block(body, tmp_path, dict(os.environ))
    assert time.monotonic() - t0 < 60 and "the client ran" in output
    assert (code, "exit 1" in output, "still running after 5 s" in output) == (
        (1, True, False) if case == "fails" else (-1, False, True))
    assert "--- server.log (its end) ---" in output and "line 1 in <module>" in output  # faulthandler's dump
    assert _gone(int((tmp_path / "pid").read_text()))


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
        code, output = run_block(body, tmp_path, env)
        assert code == 0, f"{page}: this block failed (exit {code}):\n{body}\n{output[-12000:]}"
