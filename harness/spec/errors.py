"""How an error is told: one line, without terminal escape codes (CuTe DSL's compiler errors carry
them, and a report is not a terminal); on the command line, a usage error of one line."""

from __future__ import annotations

import argparse
import re

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain_text(text: str) -> str:
    """``text`` without terminal escape codes."""
    return _ANSI.sub("", text)


def describe_error(e: BaseException, limit: int = 400) -> str:
    """'ExceptionType: first line of the message': how a failed point is recorded in a report."""
    lines = plain_text(str(e)).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:limit]


class UsageError(ValueError):
    """Bad input on the command line: one line on stderr and exit status 2, never a traceback."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2) like every other bad input."""

    def error(self, message):
        command = self.prog.removeprefix("normbench").strip()
        raise UsageError(f"{command}: {message}" if command else message)
