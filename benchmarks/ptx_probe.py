"""The Hopper kernels' PTX on the CPU machine: what ptxas does with it, without device time.

Mosaic GPU writes a kernel's PTX on the GPU machine (`MOSAIC_GPU_DUMP_PTX=1
MOSAIC_GPU_DUMP_TO=dir`, as `gpu_round.sh fifteenth` does); this machine's CUDA 13 `ptxas`
gives the same resource report as the device's, and triton's `nvdisasm` the SASS.  Session 36
found this way what made the alternating MLA decode 2.5x slower (RESULTS.md, MLA decode):

    python benchmarks/ptx_probe.py report  K.ptx         # registers, spills, C75xx notes
    python benchmarks/ptx_probe.py scan    K.ptx         # instructions touching in-flight accumulators
    python benchmarks/ptx_probe.py waits   K.ptx         # which commit group's partial wait trips C7514
    python benchmarks/ptx_probe.py rederive K.ptx OUT.ptx  # hoisted wgmma descriptors re-derived at each use
    python benchmarks/ptx_probe.py sass    K.ptx         # the SASS's wgmma / barrier / spill skeleton

`scan` follows the control flow: a wgmma's accumulator registers are in flight from its issue
to the `wgmma.wait_group` that retires its group (groups retire in order).  `waits` inserts a
`wgmma.wait_group 0` after one commit group at a time and reports which insertions silence
C7514 (the rest of the kernel unchanged).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict

PTXAS = os.environ.get("PTXAS", "/usr/local/cuda-13.0/bin/ptxas")
NVDISASM = os.environ.get("NVDISASM", "/tmp/tritonpkg/triton/backends/nvidia/bin/nvdisasm")
_ACC = re.compile(r"wgmma\.mma_async[^{]*\{([^}]*)\}")
_REG = re.compile(r"%r\d+\b")
_MAX_GROUPS = 8  # groups the scan tells apart; older ones fold into one (the kernels wait long before)


def ptxas(ptx: str, cubin: str = os.devnull) -> str:
    """ptxas -v's report for sm_90a (stderr)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        return subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", cubin], capture_output=True,
                              text=True, check=False).stderr
    finally:
        os.unlink(f.name)


def summary(report: str) -> dict:
    """{registers, spill_stores_b, spill_loads_b, notes: the C75xx lines}."""
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return dict(registers=int(regs[1]) if regs else None, spill_stores_b=int(spills[1]) if spills else None,
                spill_loads_b=int(spills[2]) if spills else None,
                notes=sorted({m[0] for m in re.finditer(r"\(C75\d\d\)[^\n]*", report)}))


def _blocks(lines: list[str]):
    """Basic blocks of the PTX body: [(line number, instruction)], and successor lists."""
    blocks, cur, labels = [], [], {}
    for n, line in enumerate(lines, 1):
        t = line.strip()
        if m := re.match(r"^(\$L__\w+):", t):
            if cur:
                blocks.append(cur)
            labels[m[1]], cur = len(blocks), [(n, t)]
            continue
        if not t or t.startswith(("//", ".loc")):
            continue
        cur.append((n, t))
        if re.search(r"\bbra(\.uni)?\s", t) or t.startswith("ret"):
            blocks.append(cur)
            cur = []
    if cur:
        blocks.append(cur)
    succ = defaultdict(list)
    for i, b in enumerate(blocks):
        last = b[-1][1]
        target = re.search(r"bra(?:\.uni)?\s+(\$L__\w+)", last)
        if target and target[1] in labels:
            succ[i].append(labels[target[1]])
        if not (target and not last.startswith("@")) and not last.startswith("ret") and i + 1 < len(blocks):
            succ[i].append(i + 1)
    return blocks, succ


def scan(ptx: str) -> list[tuple[int, str]]:
    """(line, instruction) of every non-wgmma instruction that names a register of a wgmma group
    that may still be in flight there, over every path (groups as sets, merged by position from
    the newest)."""
    blocks, succ = _blocks(ptx.split("\n"))

    def step(block, state, hits):
        groups, open_ = list(state[0]), set(state[1])
        for n, t in block:
            if "wgmma.mma_async" in t:
                open_ |= set(_REG.findall(_ACC.search(t)[1]))
            elif "wgmma.commit_group" in t:
                groups.append(frozenset(open_))
                open_ = set()
                if len(groups) > _MAX_GROUPS:  # a loop that commits without waiting: the oldest fold
                    groups = [groups[0] | groups[1], *groups[2:]]  # together (kept as long as any is)
            elif "wgmma.wait_group" in t:
                keep = int(re.search(r"wait_group\.sync\.aligned\s+(\d+)", t)[1])
                groups = groups[len(groups) - keep:] if keep else []
            elif hits is not None:
                live = set().union(*groups, open_)
                if any(r in live for r in _REG.findall(t)):
                    hits.append((n, t))
        return tuple(groups), frozenset(open_)

    def merge(a, b):
        k = max(len(a[0]), len(b[0]))
        pad = lambda g: (frozenset(),) * (k - len(g)) + g
        return tuple(x | y for x, y in zip(pad(a[0]), pad(b[0]))), a[1] | b[1]

    state_in, work = {0: ((), frozenset())}, [0]
    while work:
        i = work.pop()
        out = step(blocks[i], state_in[i], None)
        for s in succ[i]:
            new = out if s not in state_in else merge(state_in[s], out)
            if new != state_in.get(s):
                state_in[s] = new
                work.append(s)
    hits: list = []
    for i in sorted(state_in):
        step(blocks[i], state_in[i], hits)
    return hits


def trips_c7514(ptx: str) -> bool:
    return "C7514" in ptxas(ptx)


def waits(ptx: str) -> list[tuple[int, bool]]:
    """For each `wgmma.commit_group` line: whether a `wgmma.wait_group 0` right after it (alone)
    silences C7514."""
    lines = ptx.split("\n")
    commits = [i for i, t in enumerate(lines) if "wgmma.commit_group" in t]
    out = []
    for c in commits:
        patched = lines[:c + 1] + ["\twgmma.wait_group.sync.aligned 0;"] + lines[c + 1:]
        out.append((c + 1, not trips_c7514("\n".join(patched))))
    return out


def rederive(ptx: str, min_distance: int = 40) -> tuple[str, int]:
    """Every wgmma descriptor operand defined as `add.s64` / `or.b64` of a register and a constant
    more than `min_distance` lines before its use (hoisted) defined again right before the
    wgmma, into a fresh register -> (PTX, operands re-derived): what ptxas does when the
    descriptors are computed in the loop (`mla_decode_hopper`'s descriptors="in_loop")."""
    lines = ptx.split("\n")
    defs = {}
    for n, t in enumerate(lines):
        if m := re.match(r"\s*(add\.s64|or\.b64)\s+(%rd\d+),\s*(%rd\d+),\s*(-?\d+);", t):
            defs[m[2]] = (n, m[1], m[3], m[4])
    next_rd = int(re.search(r"\.reg \.b64\s+%rd<(\d+)>", ptx)[1])
    out, count = [], 0
    for n, t in enumerate(lines):
        if "wgmma.mma_async" in t and (m := re.search(r"\},\s*(%rd\d+),\s*(%rd\d+)", t)):
            for reg in (m[1], m[2]):
                d = defs.get(reg)
                if d and n - d[0] > min_distance:
                    fresh = f"%rd{next_rd}"
                    next_rd += 1
                    out.append(f"\t{d[1]} \t{fresh}, {d[2]}, {d[3]};")
                    t = t.replace(reg, fresh, 1)
                    count += 1
        out.append(t)
    text = re.sub(r"\.reg \.b64\s+%rd<\d+>;", f".reg .b64 \t%rd<{next_rd}>;", "\n".join(out), count=1)
    return text, count


def sass_skeleton(ptx: str) -> list[str]:
    """The SASS's wgmma, wgmma waits, mbarrier, named-barrier, shared-memory store and
    local-memory (spill) instructions in order, runs of one kind folded."""
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        ptxas(ptx, cubin)
        sass = subprocess.run([NVDISASM, "-c", cubin], capture_output=True, text=True, check=False).stdout
    keep = re.compile(r"\b(HGMMA\S*|WARPGROUP\.\S+|SYNCS\.\S+|BAR\.\S+|STSM\S*|STS\S*|LDS\S*|STL\S*|LDL\S*|"
                      r"MUFU\.\S+|BRA)\b")
    out, last, run = [], None, 0
    for line in sass.split("\n"):
        if m := keep.search(line):
            kind = m[1]
            if kind == last:
                run += 1
                continue
            if last is not None:
                out.append(f"{last} x{run}" if run > 1 else last)
            last, run = kind, 1
    if last is not None:
        out.append(f"{last} x{run}" if run > 1 else last)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("report", "scan", "waits", "rederive", "sass"))
    ap.add_argument("ptx")
    ap.add_argument("out", nargs="?", help="rederive: where the edited PTX goes")
    args = ap.parse_args(argv)
    ptx = open(args.ptx).read()
    if args.what == "report":
        print(summary(ptxas(ptx)))
    elif args.what == "scan":
        hits = scan(ptx)
        for n, t in hits[:40]:
            print(f"{n}: {t[:120]}")
        print(f"{len(hits)} instructions touch a possibly in-flight accumulator")
    elif args.what == "waits":
        print("C7514 as dumped:", trips_c7514(ptx))
        for line, fixes in waits(ptx):
            print(f"wait_group 0 after the commit at line {line}: {'silences' if fixes else 'keeps'} C7514")
    elif args.what == "rederive":
        text, count = rederive(ptx)
        open(args.out or args.ptx.replace(".ptx", ".rederived.ptx"), "w").write(text)
        print(f"{count} descriptor operands re-derived;", summary(ptxas(text)))
    else:
        print("\n".join(sass_skeleton(ptx)))


if __name__ == "__main__":
    sys.exit(main())
