#!/usr/bin/env python3
"""A model step's kernels, from Nsight Compute's per-launch durations.

    ncu --metrics gpu__time_duration.sum --csv --page raw --print-units base <command> > run.csv
    python3 tools/ncu_step.py run.csv [--boundary REGEX] [--steps N] [--launches]

The CSV has a row per kernel launch, in launch order. A step ends after each run of launches
whose kernel names match BOUNDARY (the sampler's kernels by default, which end a decode step);
the last N complete
steps are summed per kernel name: launches a step, us a step, share of the kernels' time, and the
mean launch; `--launches` then lists the last step's launches in order with their grids and block
sizes (which of a kernel's launches is which product). `tools/ncu-step.sh` runs the whole sequence on the GPU machine and sets the sum
beside the step time of the same bench with CUDA graphs.
"""

import argparse
import csv
import re
import sys
from collections import defaultdict


def launches(path):
    """(kernel name, ns, grid, block) of every launch in the file, in order. ncu's raw page may
    hold other lines (its log, the program's own output) before the header."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r and "gpu__time_duration.sum" in r), None)
    if head is None:
        sys.exit(f"{path}: no ncu raw CSV header (Kernel Name, gpu__time_duration.sum)")
    col = {h: i for i, h in enumerate(rows[head])}
    name, dur = col["Kernel Name"], col["gpu__time_duration.sum"]
    grid, block = col.get("Grid Size"), col.get("Block Size")
    cell = lambda r, c: r[c] if c is not None and c < len(r) else "?"  # noqa: E731
    out = []
    for r in rows[head + 1 :]:
        if len(r) <= max(name, dur):
            continue
        try:
            ns = float(r[dur].replace(",", ""))
        except ValueError:
            continue  # the units row, or a launch ncu could not time
        out.append((r[name], ns, cell(r, grid), cell(r, block)))
    return out


def steps(runs, boundary):
    """The launches split after each run of consecutive launches whose names match `boundary`
    (the sampler's few kernels end a step together); the part after the last such run (an
    incomplete step) is dropped."""
    pattern = re.compile(boundary)
    out, cur = [], []
    for i, run in enumerate(runs):
        k = run[0]  # (name, ns, grid, block)
        cur.append(run)
        last_of_run = pattern.search(k) and (i + 1 == len(runs) or not pattern.search(runs[i + 1][0]))
        if last_of_run:
            out.append(cur)
            cur = []
    return out


def short(kernel):
    """The kernel's name without its argument list (ncu prints demangled signatures)."""
    return kernel.split("(")[0].strip()


def report(all_steps, n):
    last = all_steps[-n:]
    per = defaultdict(lambda: [0, 0.0])
    for step in last:
        for k, ns, *_ in step:
            per[short(k)][0] += 1
            per[short(k)][1] += ns
    total = sum(v[1] for v in per.values()) or 1.0
    print(f"{len(all_steps)} steps found; the last {len(last)}: {total / len(last) / 1e3:.1f} us of kernels a step, "
          f"{sum(len(s) for s in last) / len(last):.0f} launches a step")
    print("| kernel | launches a step | us a step | share | us a launch |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for k, (count, ns) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"| `{k}` | {count / len(last):.1f} | {ns / len(last) / 1e3:.1f} | {100 * ns / total:.1f}% | {ns / count / 1e3:.2f} |")


def list_launches(step):
    """The step's launches in order: kernel, grid, block, us."""
    print("| # | kernel | grid | block | us |")
    print("| ---: | --- | --- | --- | ---: |")
    for i, (k, ns, grid, block) in enumerate(step):
        print(f"| {i} | `{short(k)}` | {grid} | {block} | {ns / 1e3:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--boundary", default="sample", help="regex of the kernel that ends a step")
    ap.add_argument("--steps", type=int, default=2, help="complete steps to sum, from the last")
    ap.add_argument("--launches", action="store_true", help="also list the last step's launches")
    a = ap.parse_args()
    all_steps = steps(launches(a.csv), a.boundary)
    if not all_steps:
        sys.exit(f"{a.csv}: no launch matches --boundary {a.boundary!r}")
    report(all_steps, max(1, min(a.steps, len(all_steps))))
    if a.launches:
        print()
        list_launches(all_steps[-1])


if __name__ == "__main__":
    main()
