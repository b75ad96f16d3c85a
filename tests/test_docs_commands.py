"""Every `moectl` command line in the docs' code blocks (docs/commands.md, README.md) parses: its
command exists, every option it names is one of that command's (hidden ones included), and
`--help` after the line's own arguments exits 0, so a renamed or removed option fails here."""

from __future__ import annotations

import re
import shlex

import pytest
import typer.main
from typer.testing import CliRunner

from moectl.cli.main import app
from tests.paths import REPO

DOCS = ("docs/commands.md", "README.md")
FENCE = re.compile(r"^```(?:sh|bash)?\n(.*?)^```", re.M | re.S)


def command_lines(text: str) -> list[str]:
    """The `moectl ...` lines of a Markdown file's code blocks, continuations joined, comments and
    redirections dropped."""
    lines = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["moectl"]:
                lines.append(line.strip())
    return lines


def argv_of(line: str) -> list[str]:
    """The line as arguments: optional groups (`[--token T]`) kept without their brackets,
    alternatives' bars and everything from a redirection on dropped."""
    words = []
    for word in shlex.split(line, comments=True)[1:]:
        if word in (">", ">>", "|"):
            if word != "|":
                break
            continue
        words.append(word.strip("[]"))
    return [w for w in words if w]


def is_group(command) -> bool:
    return hasattr(command, "commands")  # typer's click (vendored from 0.29 on) or click's own


def resolve(argv: list[str]):
    """The command path at the head of argv and the click command it names."""
    command = typer.main.get_command(app)
    path = []
    for word in argv:
        if not is_group(command) or word not in command.commands:
            break
        command = command.commands[word]
        path.append(word)
    return path, command


def options_of(command) -> set[str]:
    """Every option name the command takes, hidden ones included."""
    return {name for p in command.params if p.param_type_name == "option" for name in (*p.opts, *p.secondary_opts)}


LINES = [(doc, line) for doc in DOCS for line in command_lines((REPO / doc).read_text())]


def test_the_docs_have_commands():
    assert len([1 for doc, _ in LINES if doc == "docs/commands.md"]) >= 40
    assert 5 <= len([1 for doc, _ in LINES if doc == "README.md"]) <= 12


@pytest.mark.parametrize(("doc", "line"), LINES, ids=[f"{doc}:{line[:60]}" for doc, line in LINES])
def test_every_documented_command_parses(doc, line):
    argv = argv_of(line)
    path, command = resolve(argv)
    rest = argv[len(path):]
    assert not is_group(command) or not rest or (rest[0].startswith("-") and command.invoke_without_command), \
        f"{doc}: {line!r}: no command {rest[0]!r} under `moectl {' '.join(path)}`"
    known = options_of(command)
    named = {w.split("=", 1)[0] for w in rest if w.startswith("-") and len(w) > 1 and not w[1].isdigit()}
    assert named <= known, f"{doc}: {line!r}: `moectl {' '.join(path)}` has no {sorted(named - known)}"
    result = CliRunner().invoke(app, [*argv, "--help"])
    assert result.exit_code == 0, f"{doc}: {line!r}: {result.output.strip().splitlines()[-1:]}"


def test_a_removed_option_fails_the_check():
    """The check itself: an option the command lacks, or a command that does not exist, is caught."""
    path, command = resolve(argv_of("moectl trace report run.trace --no-such-flag"))
    assert path == ["trace", "report"] and "--no-such-flag" not in options_of(command)
    assert "--json" in options_of(command)
    assert CliRunner().invoke(app, ["trace", "report", "run.trace", "--no-such-flag", "--help"]).exit_code != 0
    assert resolve(["trace", "no-such-command"])[0] == ["trace"]
    assert CliRunner().invoke(app, ["trace", "no-such-command", "--help"]).exit_code != 0
