#!/usr/bin/env python3
"""Where a kernel's warps wait, from Nsight Compute's per-instruction stall samples.

    ncu --section SourceCounters ... -o rep <command>
    ncu -i rep.ncu-rep --page source --print-source sass --csv > rep.sass.csv
    python3 tools/ncu_stalls.py rep.sass.csv [--top 12]

For each kernel in the file: its stall samples by reason (the `stall_*` columns summed over its
instructions, as shares of all samples), the instructions that hold the most samples, each with
its two largest reasons, and its loops (found as tools/sass_loops.py finds them; nested loops each
listed) with their shares of the samples and of the executed instructions, so that a kernel's
time splits into its phases: the loop a tile, the code each warp runs once. `tools/ncu-op.sh`
runs the whole sequence for one test-ops perf case on the GPU machine. Stall sampling says where warps waited, not why a kernel is slow: read it next
to the issue-slot and memory figures of `--page details`.
"""

import argparse
import csv
import sys
from collections import defaultdict

from sass_loops import backward_branches


def sections(rows):
    """(kernel name, header, data rows) for each kernel of the CSV; a file of one kernel may have
    no "Kernel Name" line."""
    name, header, data = "kernel", None, []
    for row in rows:
        if not row:
            continue
        if row[0].strip().strip('"') == "Kernel Name":
            if header is not None:
                yield name, header, data
            name = row[1] if len(row) > 1 else "kernel"
            header, data = None, []
        elif header is None:
            if "Source" in row:
                header = row
        else:
            data.append(row)
    if header is not None:
        yield name, header, data


def number(text):
    try:
        return float(text.replace(",", "")) if text.strip() else 0.0
    except ValueError:
        return 0.0


def report(name, header, data, top):
    col = {h: i for i, h in enumerate(header)}
    total_col = next((i for h, i in col.items() if h.startswith("Warp Stall Sampling (All")), None)
    executed = col.get("Instructions Executed")
    stalls = [(h, i) for h, i in col.items() if h.startswith("stall_")]
    src = col["Source"]
    addr = next((i for h, i in col.items() if "Address" in h), None)
    if total_col is None and not stalls:
        sys.exit(f"{name}: no stall-sampling columns (profile with --section SourceCounters)")
    by_reason = defaultdict(float)
    lines = []
    for row in data:
        if len(row) < len(header):
            continue
        per = {h[len("stall_"):]: number(row[i]) for h, i in stalls}
        samples = number(row[total_col]) if total_col is not None else sum(per.values())
        for r, v in per.items():
            by_reason[r] += v
        ran = number(row[executed]) if executed is not None else 0.0
        lines.append((samples, row[addr] if addr is not None else "", row[src].strip(), per, ran))
    total = sum(line[0] for line in lines) or 1.0
    print(f"## {name}: {total:.0f} samples over {len(lines)} instructions")
    reasons = sorted(by_reason.items(), key=lambda kv: -kv[1])
    print("stall reasons: " + ", ".join(f"{r} {100 * v / total:.1f}%" for r, v in reasons[:10] if v > 0))
    print(f"| share | address | instruction | top reasons |")
    print("| ---: | --- | --- | --- |")
    for samples, a, text, per, _ in sorted(lines, key=lambda x: -x[0])[:top]:
        best = sorted(per.items(), key=lambda kv: -kv[1])[:2]
        why = ", ".join(f"{r} {100 * v / max(samples, 1):.0f}%" for r, v in best if v > 0)
        print(f"| {100 * samples / total:.1f}% | {a} | `{text[:70]}` | {why} |")
    print()
    loops(lines, total)


def loops(lines, total, least=0.02):
    """The kernel's loops holding at least `least` of its samples: offsets from the kernel's first
    instruction, static size, shares of the samples and of the executed instructions."""
    try:
        at = [int(a, 16) for _, a, *_ in lines]
    except ValueError:
        return
    if not at:
        return
    ran_total = sum(line[4] for line in lines) or 1.0
    found = []
    for first, last in backward_branches([(a, line[2]) for a, line in zip(at, lines)]):
        inside = lines[first : last + 1]
        samples, ran = sum(x[0] for x in inside), sum(x[4] for x in inside)
        if samples >= least * total:
            found.append((at[first] - at[0], at[last] - at[0], len(inside), samples, ran))
    if not found:
        return
    print("| loop (offsets) | instructions | samples | executed |")
    print("| --- | ---: | ---: | ---: |")
    for lo, hi, n, samples, ran in sorted(found):
        print(f"| {lo:#x}-{hi:#x} | {n} | {100 * samples / total:.1f}% | {100 * ran / ran_total:.1f}% |")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    ap.add_argument("--top", type=int, default=12, help="instructions to list per kernel")
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        found = False
        for name, header, data in sections(csv.reader(f)):
            found = True
            report(name, header, data, args.top)
    if not found:
        sys.exit(f"{args.csv}: no SASS source table (was it written with --page source --csv?)")


if __name__ == "__main__":
    main()
