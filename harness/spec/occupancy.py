"""How many programs (CTAs) of a compiled Triton or Gluon kernel one SM holds at once, from the
binary's registers and shared memory: what a grid whose programs wait for each other (the backward's
exchanging slices) must not exceed, since a program that is not resident cannot post what its
resident siblings wait for. The limits are those of sm_80 to sm_90."""

from __future__ import annotations

WARP = 32
THREADS_PER_SM = 2048
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256
SHARED_PER_SM = 228 * 1024  # bytes of shared memory per SM (Hopper), 1 KB of it reserved per program
PROGRAMS_PER_SM = 32


def resident_programs(num_warps: int, registers: int, shared: int) -> int:
    """Programs of ``num_warps`` warps, ``registers`` per thread and ``shared`` bytes of shared
    memory that one SM holds at once: the least of the threads', registers' (allocated per warp in
    units of 256), shared memory's and the 32-program limits."""
    per_warp = -(-max(registers, 1) * WARP // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = REGISTERS_PER_SM // (per_warp * num_warps)
    by_threads = THREADS_PER_SM // (num_warps * WARP)
    by_shared = SHARED_PER_SM // (shared + 1024)
    return max(1, min(by_registers, by_threads, by_shared, PROGRAMS_PER_SM))


def exchange_groups(blocks: int, slices: int, sms: int) -> int:
    """Row groups of a grid of groups x ``slices`` programs that wait for each other, one program per
    SM (every sibling resident whatever the binary): as many as the SMs hold, at most one per row
    block (of ``blocks``), at least one; 0 where a row's slices outnumber the SMs, so that no grid
    of them may wait."""
    if slices > sms:
        return 0
    return max(1, min(blocks, sms // slices))


def held(compiled, num_warps: int) -> int:
    """``resident_programs`` of a compiled kernel (``CompiledKernel``: its ``n_regs`` once loaded)."""
    compiled._init_handles()
    return resident_programs(num_warps, compiled.n_regs, compiled.metadata.shared)
