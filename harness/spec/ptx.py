"""Reading compiled PTX: what a test can check of a kernel's structure without a GPU."""

from __future__ import annotations


def spin_barriers(ptx: str) -> int | None:
    """``bar.sync`` instructions inside the loops that re-read a volatile global load (a program
    waiting for other programs' posts: Triton's and Gluon's wide-row backward). 0 where each warp
    waits on its own copy of what it polls, as those kernels need (a barrier there means the loop's
    exit test is a reduction across warps, which may leave them on different iterations); None
    where the kernel polls nothing. Each wait is a first read, then a loop from the next label to
    the branch back to it."""
    lines = ptx.splitlines()
    polls = [i for i, line in enumerate(lines) if "ld.volatile.global" in line]
    if not polls:
        return None
    count, seen = 0, set()
    for first in polls:
        head = next((i for i in range(first, len(lines)) if lines[i].startswith("$L__BB")), None)
        if head is None or head in seen:
            continue
        seen.add(head)
        back = next(iter(_back_edges(lines, head, predicated=False)), None)
        if back is not None:
            count += sum("bar.sync" in line for line in lines[head:back])
    return count


def poll_loops(ptx: str) -> list[int]:
    """The volatile global loads inside each loop that re-reads one (a wait for other programs'
    posts, found as ``spin_barriers`` finds them), one count per loop: a wait that polls two planes
    of slots in each round is one loop of 2, where waiting for one plane and then the other is two
    loops of 1."""
    lines = ptx.splitlines()
    loops, seen = [], set()
    for first in (i for i, line in enumerate(lines) if "ld.volatile.global" in line):
        head = next((i for i in range(first, len(lines)) if lines[i].startswith("$L__BB")), None)
        if head is None or head in seen:
            continue
        seen.add(head)
        back = next(iter(_back_edges(lines, head)), None)
        if back is not None:
            loops.append(sum("ld.volatile.global" in line for line in lines[head:back]))
    return loops


def atomic_waits(ptx: str) -> int:
    """Loops that re-read global memory with an atomic add and post nothing (no atomic exchange in
    them): a program waiting for other programs' posts where there is no volatile load to poll
    with (Helion's wide-row backward). Each loop runs from a label to the last branch back to it."""
    lines = ptx.splitlines()
    count = 0
    for head, line in enumerate(lines):
        if not line.startswith("$L__BB"):
            continue
        back = _back_edges(lines, head)
        if not back:
            continue
        body = lines[head : back[-1]]
        if any("atom.global" in b and ".add." in b for b in body) and not any(".exch." in b for b in body):
            count += 1
    return count


def _back_edges(lines: list[str], head: int, predicated: bool = True) -> list[int]:
    """The lines after ``head`` (a label's line) that branch to its label, in order; with
    ``predicated`` False only unconditional ones (a line that starts with ``bra``)."""
    target = lines[head].split(":")[0] + ";"
    return [
        i
        for i in range(head + 1, len(lines))
        if (("bra" in lines[i]) if predicated else lines[i].strip().startswith("bra")) and lines[i].rstrip().endswith(target)
    ]
