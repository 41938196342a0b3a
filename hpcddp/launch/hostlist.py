"""Slurm hostlist expansion (placeholder; the full parser is issue 2)."""


def expand_hostlist(text: str) -> list[str]:
    return [h for h in text.split(",") if h]
