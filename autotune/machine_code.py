"""Machine code read for the cost model: how many instructions sit at each depth of loops, in
NVIDIA's SASS (nvdisasm's listing) and in RDNA code (the listing of ACO, RADV's compiler).

A loop in machine code is a backward branch: the instructions from its target to the branch run
once per trip. What the compiler unrolled is already repeated in the code, so each instruction
runs as often as the loops around it that remain, which the interpreter counts at the use's
sizes (`work.Work.loop_runs`). The padding after the last instruction (a branch to itself and
NOPs, to align the code) never runs and is not counted.
"""

from __future__ import annotations

import re

# nvdisasm's lines: "/*0c40*/  @!P0 BRA 0x1980 ;"
_SASS = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")


def sass_loop_depths(text: str) -> list[int]:
    """Per loop depth (0: outside every loop), the instructions of an nvdisasm listing."""
    code = []  # (address, opcode, branch target or None)
    for m in _SASS.finditer(text):
        address, op = int(m.group(1), 16), m.group(2)
        target = _TARGET.search(m.group(3)) if op.split(".")[0] in ("BRA", "BRX", "JMP") else None
        code.append((address, op, int(target.group(1), 16) if target else None))
    while code and (code[-1][1] == "NOP" or code[-1][2] == code[-1][0]):
        code.pop()
    loops = [(target, address) for address, _, target in code if target is not None and target <= address]
    return _by_depth([(address, 1) for address, _, _ in code], loops)


def _by_depth(places: list[tuple[int, int]], loops: list[tuple[int, int]]) -> list[int]:
    """Instructions per loop depth, from (place, instructions there) and the loops' (first,
    last) places: an instruction's depth is the number of loops around its place."""
    depths: list[int] = []
    for place, n in places:
        d = sum(lo <= place <= hi for lo, hi in loops)
        depths.extend([0] * (d + 1 - len(depths)))
        depths[d] += n
    return depths or [0]


# ACO's listing: a block's name on a line of its own ("BB3"), its instructions indented by a tab,
# branches naming their target block ("s_branch block:BB1"); blocks are laid out in order, each
# loop's blocks together, so a branch back to an earlier block closes a loop
_BLOCK = re.compile(r"^BB(\d+)$")
_BRANCH_TO = re.compile(r"block:BB(\d+)")


def aco_loop_depths(text: str) -> list[int]:
    """Per loop depth (0: outside every loop), the instructions of an ACO listing."""
    order, block, counts, loops = {}, None, {}, []
    for line in text.splitlines():
        m = _BLOCK.match(line.strip())
        if m and not line.startswith("\t"):
            block = int(m.group(1))
            order[block] = len(order)
            counts[block] = 0
        elif line.startswith("\t") and block is not None:
            counts[block] += 1
            target = _BRANCH_TO.search(line)
            if target and int(target.group(1)) in order and order[int(target.group(1))] <= order[block]:
                loops.append((order[int(target.group(1))], order[block]))
    return _by_depth([(order[b], n) for b, n in counts.items()], loops)
