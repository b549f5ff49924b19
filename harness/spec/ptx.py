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
        label = lines[head].split(":")[0]
        back = next(
            (
                i
                for i in range(head, len(lines))
                if lines[i].strip().startswith("bra") and lines[i].rstrip().endswith(label + ";")
            ),
            None,
        )
        if back is not None:
            count += sum("bar.sync" in line for line in lines[head:back])
    return count
