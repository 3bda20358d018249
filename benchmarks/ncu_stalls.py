"""Where a kernel's warps stall, per SASS instruction, from an Nsight Compute source page.

Nsight Compute samples each warp's state at intervals; its source page (``ncu -i REPORT
--page source --print-source sass --csv``) holds, per SASS instruction, the samples taken
there ("Warp Stall Sampling (All Samples)") and their split by reason (``stall_barrier``,
``stall_long_sb``, ``stall_wait``, ...). This prints the kernel's samples by reason, then the
instructions with the most samples, each with its leading reasons, so a stall is tied to the
instruction (a named barrier, an mbarrier wait, a WGMMA wait) rather than read from the
kernel-wide averages:

  ncu --clock-control none --launch-skip 3 --launch-count 1 -k regex:GluGemm --set full \
      --import-source no -f -o /tmp/fc1 python benchmarks/ncu_target.py --shape Q --forward
  ncu -i /tmp/fc1.ncu-rep --page source --print-source sass --csv > /tmp/fc1.csv
  python benchmarks/ncu_stalls.py /tmp/fc1.csv [--top 30]

``--ranges main=0x2380-0x2c80,epi=0x2c80-0x8000`` adds, per range of instruction offsets (from
the kernel's first instruction, as the top list prints them), the samples, the warp
instructions executed and the opcodes that executed most: two kernels' mainloops or epilogues
compared by instruction count (how the FC1 epilogue's bf16 round trips were found: kernel
README, section 15).
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from dataclasses import dataclass

_SAMPLES = "Warp Stall Sampling (All Samples)"
_EXECUTED = "Instructions Executed"
_REASON = "stall_"


@dataclass(frozen=True)
class Instruction:
    address: str
    source: str
    samples: float
    reasons: dict[str, float]  # stall reason (no "stall_" prefix) -> samples
    executed: float = 0.0  # warp-level instructions executed ("Instructions Executed")

    @property
    def opcode(self) -> str:
        """The opcode without its modifiers or predicate: "HGMMA", "F2F", "BAR"."""
        words = [w for w in self.source.split() if not w.startswith("@")]
        return words[0].split(".")[0] if words else ""

    def leading(self, n: int = 3) -> list[tuple[str, float]]:
        return sorted(((k, v) for k, v in self.reasons.items() if v), key=lambda kv: -kv[1])[:n]


def _number(text: str) -> float:
    text = text.replace(",", "").strip()
    return float(text) if text else 0.0


def read_source_page(lines) -> list[Instruction]:
    """The instructions of a source-page CSV (any lines before its header row are skipped:
    ncu writes the kernel's name first). Reasons are the all-samples ``stall_*`` columns (not
    their "(Not Issued)" twins)."""
    rows = list(csv.reader(lines))
    head = next((i for i, r in enumerate(rows) if _SAMPLES in r), None)
    if head is None:
        raise ValueError(f"no {_SAMPLES!r} column: not an ncu source page (--page source --csv)")
    header = rows[head]
    at = {name: i for i, name in enumerate(header)}
    reasons = [n for n in header if n.startswith(_REASON) and "(" not in n]
    out = []
    for row in rows[head + 1:]:
        if len(row) != len(header):
            continue
        try:
            samples = _number(row[at[_SAMPLES]])
            split = {n[len(_REASON):]: _number(row[at[n]]) for n in reasons}
            executed = _number(row[at[_EXECUTED]]) if _EXECUTED in at else 0.0
        except ValueError:
            continue
        out.append(Instruction(row[at.get("Address", 0)], row[at.get("Source", 1)], samples,
                               split, executed))
    return out


def _offsets(instructions: list[Instruction]) -> list[int]:
    """Each instruction's byte offset from the kernel's first (addresses differ per run)."""
    base = int(instructions[0].address, 16) if instructions else 0
    return [int(i.address, 16) - base for i in instructions]


def parse_ranges(text: str) -> list[tuple[str, int, int]]:
    """``name=START-END,...`` (hex or decimal offsets, END exclusive) -> [(name, start, end)]."""
    out = []
    for item in filter(None, text.split(",")):
        name, _, span = item.partition("=")
        start, _, end = span.partition("-")
        try:
            out.append((name.strip(), int(start, 0), int(end, 0)))
        except ValueError:
            raise ValueError(f"--ranges: expected name=START-END, got {item!r}") from None
    return out


def by_range(instructions: list[Instruction], ranges, top_ops: int = 8) -> str:
    """Per offset range: samples (share of the kernel's), warp instructions executed and the
    ``top_ops`` opcodes that executed most."""
    total = sum(i.samples for i in instructions) or 1.0
    offsets = _offsets(instructions)
    lines = []
    for name, start, end in ranges:
        inside = [i for i, off in zip(instructions, offsets) if start <= off < end]
        ops: Counter = Counter()
        for ins in inside:
            ops[ins.opcode] += ins.executed
        samples = sum(i.samples for i in inside)
        executed = sum(i.executed for i in inside)
        top = ", ".join(f"{op} {n:.0f}" for op, n in ops.most_common(top_ops) if n)
        lines.append(f"  {name:10s} +{start:#x}-+{end:#x}: {samples:8.0f} samples "
                     f"({samples / total:5.1%}), {executed:12.0f} warp instructions; {top}")
    return "\n".join(["instructions by range:"] + lines)


def summary(instructions: list[Instruction], top: int) -> str:
    """The samples by reason over the kernel, then the ``top`` instructions by samples."""
    total = sum(i.samples for i in instructions) or 1.0
    by_reason: Counter = Counter()
    for ins in instructions:
        by_reason.update(ins.reasons)
    lines = [f"{len(instructions)} instructions, {total:.0f} samples; by reason:"]
    lines += [f"  {name:22s} {value:9.0f} {value / total:6.1%}"
              for name, value in by_reason.most_common() if value]
    lines.append(f"top {top} instructions (offset from the kernel's first):")
    offset = dict(zip(map(id, instructions), _offsets(instructions)))
    for ins in sorted(instructions, key=lambda i: -i.samples)[:top]:
        lead = ", ".join(f"{k} {v / max(ins.samples, 1):.0%}" for k, v in ins.leading())
        lines.append(f"  {ins.samples:8.0f} {ins.samples / total:6.1%}  "
                     f"+{offset[id(ins)]:#07x}  {ins.source.strip()[:60]:60s}  {lead}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="ncu -i REPORT --page source --print-source sass --csv > FILE")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--ranges", default="",
                   help="name=START-END,...: instruction offsets to account per range")
    args = p.parse_args()
    with open(args.csv, newline="") as fh:
        instructions = read_source_page(fh)
    print(summary(instructions, args.top))
    if args.ranges:
        print(by_range(instructions, parse_ranges(args.ranges)))


if __name__ == "__main__":
    main()
