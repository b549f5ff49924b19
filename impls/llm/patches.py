"""Unified diffs of one file: make one (``make_patch``) and apply one (``apply_patch``), in pure Python.

The fixes to a generated kernel are stored as unified diffs against ``raw.py`` (each against the
version left by the fixes before it) and applied in memory when the kernel is loaded, so the
verbatim first output stays on disk untouched and both versions stay runnable. Applying is strict:
every context and removed line must match exactly where the hunk header says (no fuzz, no offset
search), because a patch that lands somewhere else than where it was written is a different fix.

Lines are split on "\\n" only (``str.splitlines`` also splits on form feeds and other separators,
which would put a patch and its file out of step); a last line without a newline is marked with
``\\ No newline at end of file`` exactly as diff(1) does, so any text round-trips.
"""

from __future__ import annotations

import difflib
import re

NO_NEWLINE = "\\ No newline at end of file"
_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A patch that is malformed or does not apply to the text it is applied to."""


def split_lines(text: str) -> list[str]:
    """The lines of ``text``, each keeping its "\\n" (the last one may have none)."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def make_patch(old: str, new: str, filename: str = "raw.py", header: str = "") -> str:
    """The unified diff turning ``old`` into ``new`` (3 lines of context). ``header`` (e.g. the
    reason for the fix) goes first as '# ...' lines, which patch(1) and ``apply_patch`` skip."""
    out = [f"# {line}\n" for line in header.splitlines()]
    for line in difflib.unified_diff(split_lines(old), split_lines(new), f"a/{filename}", f"b/{filename}", n=3):
        if line.endswith("\n"):
            out.append(line)
        else:  # the file's last line has no newline: say so, as diff(1) does
            out.append(line + "\n" + NO_NEWLINE + "\n")
    return "".join(out)


def _hunks(patch: str, what: str) -> list[tuple[int, int, list[tuple[str, str]]]]:
    """Parse ``patch`` into (old_start, old_len, [(tag, line), ...]) per hunk; tag is ' ', '-' or '+'."""
    lines = split_lines(patch)
    i = 0
    while i < len(lines) and not lines[i].startswith("@@"):  # headers: '# reason', '---', '+++', 'diff', ...
        i += 1
    if i == len(lines):
        raise PatchError(f"{what}: no hunk ('@@ -a,b +c,d @@') found")
    hunks = []
    while i < len(lines):
        header = _HUNK_HEADER.match(lines[i])
        if not header:
            if lines[i].strip() == "":  # trailing blank lines after the last hunk
                i += 1
                continue
            raise PatchError(f"{what}: expected a hunk header at patch line {i + 1}, found {lines[i]!r}")
        old_start, new_start = int(header[1]), int(header[3])
        old_len = 1 if header[2] is None else int(header[2])
        new_len = 1 if header[4] is None else int(header[4])
        i += 1
        body: list[tuple[str, str]] = []
        old_seen = new_seen = 0
        # The header's counts say where the hunk ends (a removed line may itself start with '--').
        while old_seen < old_len or new_seen < new_len or (i < len(lines) and lines[i].startswith("\\")):
            if i >= len(lines):
                raise PatchError(f"{what}: hunk at old line {old_start} ends early (header says -{old_len} +{new_len})")
            line = lines[i]
            tag, text = line[:1], line[1:]
            if tag == "\\":  # '\ No newline at end of file' applies to the line before it
                if not body:
                    raise PatchError(f"{what}: '{line.strip()}' at patch line {i + 1} follows no line")
                prev_tag, prev_text = body[-1]
                body[-1] = (prev_tag, prev_text.removesuffix("\n"))
            elif tag in (" ", "-", "+") or line == "\n":
                if line == "\n":  # an empty context line whose leading space an editor stripped
                    tag, text = " ", "\n"
                body.append((tag, text))
                old_seen += tag in " -"
                new_seen += tag in " +"
            else:
                raise PatchError(f"{what}: unexpected line {i + 1} in a hunk: {line!r}")
            i += 1
        if old_seen != old_len or new_seen != new_len:
            raise PatchError(
                f"{what}: hunk at old line {old_start} has -{old_seen} +{new_seen} lines, "
                f"its header says -{old_len} +{new_len}"
            )
        del new_start  # where the hunk lands in the new file follows from the old side
        hunks.append((old_start, old_len, body))
    return hunks


def apply_patch(text: str, patch: str, what: str = "patch") -> str:
    """``text`` with the unified diff ``patch`` applied; PatchError (naming ``what``) if it does not apply."""
    src = split_lines(text)
    out: list[str] = []
    pos = 0  # index in src of the first line not yet copied or consumed
    for old_start, old_len, body in _hunks(patch, what):
        # '@@ -5,0 ...' inserts after line 5; '@@ -5,3 ...' replaces from line 5 on (1-based)
        start = old_start if old_len == 0 else old_start - 1
        if start < pos or start > len(src):
            raise PatchError(f"{what}: hunk at old line {old_start} is out of order or past the end ({len(src)} lines)")
        out.extend(src[pos:start])
        pos = start
        for tag, line in body:
            if tag == "+":
                out.append(line)
                continue
            found = src[pos] if pos < len(src) else None
            if found != line:
                raise PatchError(
                    f"{what}: does not apply at line {pos + 1}: expected {line!r}, found {found!r} "
                    "(was it made against another version of the file?)"
                )
            if tag == " ":
                out.append(found)
            pos += 1
    out.extend(src[pos:])
    return "".join(out)
