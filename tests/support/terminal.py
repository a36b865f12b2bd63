"""`muonforge` run as a person runs it: the console script's entry point in a real pseudo-terminal
(pexpect), stdout and stderr both on that terminal, read back as the lines it shows."""

from __future__ import annotations

import io
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pexpect

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 200  # wide enough that no line of interest wraps
TOKENS = re.compile(
    r"\x1b\[(?P<params>[0-9;?]*)(?P<command>[A-Za-z])"  # CSI: cursor, erase, colours, ...
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]"  # OSC (hyperlinks), charsets
    r"|\r|\n|(?P<text>[^\x1b\r\n]+)"
)


def environment(url: str | None = None, key: str | None = None, **extra: str) -> dict[str, str]:
    """This environment without any MUONFORGE_ setting, this checkout's code first, and the
    given server and key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUONFORGE_")}
    env.update(PYTHONPATH=str(ROOT), TERM="xterm-256color", COLUMNS=str(WIDTH))
    env.pop("NO_COLOR", None)
    if url:
        env["MUONFORGE_API_URL"] = url
    if key:
        env["MUONFORGE_API_KEY"] = key
    return env | extra


def spawn(*args: object, env: dict[str, str], cwd: Path = ROOT, timeout: float = 30) -> pexpect.spawn:
    """``muonforge ARGS`` started in a pseudo-terminal (the console script runs ``main()`` of
    ``muonforge.cli``, as ``python -m muonforge.cli`` does)."""
    command = ["-m", "muonforge.cli", *map(str, args)]
    child = pexpect.spawn(sys.executable, command, env=env, cwd=str(cwd), dimensions=(50, WIDTH), timeout=timeout)
    child.logfile_read = io.BytesIO()  # everything it shows, whatever expect() consumed
    return child


@dataclass
class Screen:
    status: int | None  # the exit status (None: killed by a signal)
    raw: str  # every byte the terminal received, escape codes included
    lines: list[str]  # the lines it shows: escape codes gone, each as its last redraw left it

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def shown(raw: str) -> list[str]:
    """The lines a terminal shows after ``raw``: text written where the cursor is, carriage
    returns, line feeds, cursor up and line erasures followed (a progress bar redraws its line,
    a transient one erases itself), colours and other escape codes dropped; blank lines left out."""
    rows: list[list[str]] = [[]]
    row = col = 0
    for match in TOKENS.finditer(raw):
        params, command, text = match.group("params"), match.group("command"), match.group("text")
        if command:
            count = int(params) if params.isdigit() else 1
            if command == "A":
                row = max(0, row - count)
            elif command == "K":
                rows[row] = rows[row][:col] if params in ("", "0") else [] if params == "2" else rows[row]
            elif command == "G":
                col = count - 1
        elif match.group() == "\r":
            col = 0
        elif match.group() == "\n":
            row += 1
            rows += [[] for _ in range(row + 1 - len(rows))]
        elif text:
            line = rows[row] + [" "] * max(0, col - len(rows[row]))
            line[col : col + len(text)] = text
            rows[row], col = line, col + len(text)
    return [text for line in rows if (text := "".join(line).rstrip())]


def finish(child: pexpect.spawn, timeout: float = 30) -> Screen:
    """Wait for ``child`` to exit; what it showed, and its status."""
    child.expect(pexpect.EOF, timeout=timeout)
    child.close()
    return screen(child)


def screen(child: pexpect.spawn) -> Screen:
    """What ``child`` has shown so far."""
    raw = child.logfile_read.getvalue().decode(errors="replace")
    return Screen(child.exitstatus, raw, shown(raw))


def run(*args: object, env: dict[str, str], cwd: Path = ROOT, timeout: float = 30) -> Screen:
    """``muonforge ARGS`` in a pseudo-terminal, to its end."""
    return finish(spawn(*args, env=env, cwd=cwd, timeout=timeout), timeout)


def assert_one_error(screen: Screen, status: int, line: str) -> None:
    """The command showed exactly ``line`` (and nothing else), no traceback, and exited ``status``."""
    assert "Traceback" not in screen.raw, screen.raw
    assert screen.lines == [line], screen.lines
    assert screen.status == status, (screen.status, screen.lines)
