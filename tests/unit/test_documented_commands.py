"""Every `hpcddp ...` command line the documentation quotes parses with the CLI's own parser.

Where commands are quoted: README.md and docs/ (code blocks and inline code), the job scripts
in jobs/ (jobs/slurm/*.sbatch and jobs/mpirun/*.sh, comments included; the rendered ones are
generated from hpcddp/launch/templates.py, and tests/unit/test_templates.py keeps them equal,
so the templates' text is checked through them), and each subcommand's own --help text.
Parse only: nothing runs. A documented command that the parser refuses (an unknown option, a
missing argument, a bad choice) fails here with its file and line.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import pathlib
import re
import shlex

import pytest

from hpcddp.cli import COMMANDS, build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
                  *(ROOT / "jobs").rglob("*.sbatch"), *(ROOT / "jobs").rglob("*.sh")])
_START = re.compile(r"(?<![\w./-])hpcddp\s+(?=\S)")
_STOP = set("|;&<>()")
_FENCE = re.compile(r"^\s*```")
_SHELL_LIST = re.compile(r"^\$(@|\*|\{\w+\[[@*]\]\})$")


def _code_lines(path: pathlib.Path):
    """(line number, text) of each piece of code: markdown code blocks and inline spans;
    every line of a shell script. Backslash continuations are joined."""
    lines = path.read_text().splitlines()
    markdown = path.suffix == ".md"
    fenced, pending, first = False, "", 0
    for number, line in enumerate(lines, 1):
        if markdown and _FENCE.match(line):
            fenced = not fenced
            continue
        if markdown and not fenced:
            for span in re.findall(r"`([^`]+)`", line):
                yield number, span
            continue
        text = line.lstrip()
        if text.startswith("#"):
            text = text.lstrip("#")
        if pending:
            text = pending + " " + text
        else:
            first = number
        if text.endswith("\\"):
            pending = text[:-1]
            continue
        pending = ""
        yield first, text


def commands_in(text: str) -> list[list[str]]:
    """The argument lists after each `hpcddp` of TEXT that names a subcommand or an option."""
    found = []
    for match in _START.finditer(text):
        rest = text[match.end():].split("`")[0]
        try:
            lex = shlex.shlex(rest, posix=True, punctuation_chars=True)
            lex.whitespace_split = True
            lex.commenters = "#"
            tokens = list(lex)
        except ValueError:        # an unbalanced quote in prose: the plain words
            tokens = rest.split()
        argv = []
        for token in tokens:
            if set(token) <= _STOP:
                break
            if token in ("...", "…") or token.startswith("[") and token.endswith("]") \
                    or _SHELL_LIST.match(token):
                continue   # placeholders, and "${ARGS[@]}" (zero or more words)
            argv.append(token)
        if any(token.endswith(":") for token in argv):
            continue       # a message quoted in prose ("hpcddp demo --staged: DDP training")
        if argv and (argv[0] in COMMANDS or argv[0].startswith("-")):
            found.append(argv)
    return found


def refusal(argv: list[str]) -> str | None:
    """None when the CLI's parser accepts ARGV, else what it said."""
    if len(argv) == 1 and argv[0] in COMMANDS:
        return None   # the command's name, as prose quotes it (`hpcddp submit`)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue() else str(exc)
    return None


def _quoted():
    for path in SOURCES:
        for number, text in _code_lines(path):
            for argv in commands_in(text):
                yield f"{path.relative_to(ROOT)}:{number}", argv
    for name, (module, _) in COMMANDS.items():
        description = getattr(importlib.import_module(module), "DESCRIPTION", "")
        for number, line in enumerate(description.splitlines(), 1):
            for argv in commands_in(line):
                yield f"hpcddp {name} --help:{number}", argv


QUOTED = list(_quoted())


def test_the_documentation_quotes_many_commands():
    assert len(QUOTED) > 100
    assert {argv[0] for _, argv in QUOTED} >= set(COMMANDS)


def test_every_quoted_command_parses():
    bad = [f"{where}: hpcddp {shlex.join(argv)}\n    -> {why}"
           for where, argv in QUOTED if (why := refusal(argv)) is not None]
    assert not bad, "documented commands the CLI refuses:\n" + "\n".join(bad)


@pytest.mark.parametrize("text, ok", [
    ("hpcddp submit cpu-mpi --script train.py --time 2:00:00", False),
    ("hpcddp submit cpu-mpi --time 2:00:00 train.py --epochs 10", True),
    ('"${SRUN[@]}" hpcddp run "$SCRIPT" "${ARGS[@]}"', True),
    ("mpirun -n 2 hpcddp info | grep 'repeat calls'", True),
    ("hpcddp pack ./images out --labels sideways", False),
    ("hpcddp nosuchcommand --x", None),      # not a subcommand: prose, not a command line
])
def test_the_check_itself(text, ok):
    found = commands_in(text)
    if ok is None:
        assert found == []
        return
    assert len(found) == 1
    assert (refusal(found[0]) is None) == ok
