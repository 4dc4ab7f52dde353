#!/usr/bin/env python3
"""The loops of a kernel's SASS, with their sizes and instruction mix.

    tessera-nvrtc-check --module attention --cubin-dir /tmp/c sm_90
    cuobjdump -sass -fun fa_mma_f16_d256 /tmp/c/attention.sm_90a.cubin | python3 tools/sass_loops.py

A loop is a backward branch and the instructions between its target and it (nested loops are
listed each on their own). For each: its address range, its static instruction count and its
most frequent opcodes. The size of a hot loop is the first thing to look at when a kernel issues
far more instructions than its arithmetic needs (an inlined slow path per element, a loop larger
than the instruction cache). cuobjdump comes with the `nvidia-cuda-cuobjdump` wheel.
"""

import re
import sys
from collections import Counter

INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(0x[0-9a-f]+)")


def opcode(text: str) -> str:
    """The opcode of one instruction, without its predicate and modifiers."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def backward_branches(ins):
    """(first, last) indices into `ins`, (address, text) pairs in address order, of every loop:
    a branch to an instruction of the listing before it, and that target. Shared with
    tools/ncu_stalls.py."""
    at = {addr: i for i, (addr, _) in enumerate(ins)}
    for i, (addr, text) in enumerate(ins):
        m = BRANCH.search(text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in at:
            yield at[int(m.group(1), 16)], i


def loops(lines):
    """(start, end, instructions) of every backward branch in a cuobjdump listing."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(INSTR.match, lines) if m]
    for first, last in backward_branches(ins):
        yield ins[first][0], ins[last][0], ins[first : last + 1]


def main() -> int:
    lines = sys.stdin.read().splitlines()
    total = sum(1 for line in lines if INSTR.match(line))
    print(f"{total} instructions")
    for start, end, body in loops(lines):
        mix = Counter(opcode(text) for _, text in body).most_common(10)
        print(f"{start:#07x}-{end:#07x} {len(body):6d}  " + " ".join(f"{op}:{n}" for op, n in mix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
