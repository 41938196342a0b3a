"""How every subcommand refuses: one line on stderr, one prefix, exit status 2."""
from __future__ import annotations

import re
import sys

#: Exit status for input the command refuses (argparse's own).
USAGE = 2


def one_prefix(command: str, text: str) -> str:
    """``text`` without the library's own ``command:`` prefixes (``"stage: lock: stage: x"``
    -> ``"lock: x"``), so that ``hpcddp COMMAND: ...`` says it once."""
    pattern = re.compile(rf"(^|: ){re.escape(command)}: ")
    while True:
        shorter = pattern.sub(r"\1", str(text))
        if shorter == text:
            return shorter
        text = shorter


def refuse(command: str, text, *, status: int = USAGE, prefix: str = "") -> int:
    """Print ``[prefix]hpcddp COMMAND: TEXT`` on stderr; return ``status`` (2)."""
    print(f"{prefix}hpcddp {command}: {one_prefix(command, str(text))}", file=sys.stderr,
          flush=True)
    return status
