"""Sums Nsight Compute's per-instruction source counters (profile_lines.sh) by line and function
of frame.cu.

usage: profile_lines.py SASS_CSV CUBIN_SASS FRAME_CU
SASS_CSV is `ncu --page source --print-source sass --csv`, CUBIN_SASS `nvdisasm -g -c` of the
profiled cubin (its line table), FRAME_CU the source the cubin was compiled from. Prints, per
function (by the line it starts on), its share of the warp-state samples and of the executed
instructions with its three main stall reasons, then the 25 lines with most samples.
"""

import collections
import csv
import re
import sys


def line_table(disassembly):
    """Offset of each instruction -> the source line it came from."""
    lines, current = {}, None
    for text in open(disassembly):
        found = re.search(r'//## File ".*?", line (\d+)', text)
        if found:
            current = int(found.group(1))
            continue
        offset = re.match(r"\s*/\*([0-9a-f]{4,})\*/", text)
        if offset and current is not None:
            lines[int(offset.group(1), 16)] = current
    return lines


def functions(source):
    """(first line, name) of every function defined at the start of a line."""
    starts = []
    for number, text in enumerate(source, 1):
        if re.match(r"^(__device__|__global__|extern)", text):
            name = re.search(r"(\w+)\(", text)
            starts.append((number, name.group(1) if name else text[:30]))
    return starts


def owner(starts, line):
    name = "(outside functions)"
    for first, candidate in starts:
        if first > line:
            break
        name = candidate
    return name


def share(counter):
    """The three largest entries as percentages of the counter's total."""
    total = sum(counter.values()) or 1.0
    return ", ".join(f"{k} {v / total * 100:.0f}%" for k, v in counter.most_common(3) if v)


def main():
    rows = [r for r in csv.reader(open(sys.argv[1])) if r]
    header_at = next(i for i, r in enumerate(rows) if "Address" in r)
    header, body = rows[header_at], rows[header_at + 1 :]
    col = {name: i for i, name in enumerate(header)}
    stall_cols = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    lines = line_table(sys.argv[2])
    source = open(sys.argv[3]).read().split("\n")
    starts = functions(source)
    base = int(body[0][col["Address"]], 16)

    def number(row, name):
        try:
            return float(row[col[name]] or 0)
        except ValueError:
            return 0.0

    samples = collections.Counter()
    executed = collections.Counter()
    reasons = collections.defaultdict(collections.Counter)
    for row in body:
        line = lines.get(int(row[col["Address"]], 16) - base, 0)
        samples[line] += number(row, "Warp Stall Sampling (All Samples)")
        executed[line] += number(row, "Instructions Executed")
        for name in stall_cols:
            reasons[line][name[len("stall_") :]] += number(row, name)
    total_samples = sum(samples.values()) or 1.0
    total_executed = sum(executed.values()) or 1.0

    by_function = collections.defaultdict(lambda: [0.0, 0.0, collections.Counter()])
    for line in samples:
        f = by_function[owner(starts, line)]
        f[0] += samples[line]
        f[1] += executed[line]
        f[2].update(reasons[line])
    print(f"{'function':24s} {'samples':>8s} {'instr.':>8s}  main stall reasons")
    for name, (s, e, r) in sorted(by_function.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"{name:24s} {s / total_samples * 100:7.1f}% {e / total_executed * 100:7.1f}%  {share(r)}")
    print(f"\n{'line':>5s} {'samples':>8s}  main stall reasons | source")
    for line, s in samples.most_common(25):
        text = source[line - 1].strip()[:60] if 0 < line <= len(source) else ""
        print(f"{line:5d} {s / total_samples * 100:7.1f}%  {share(reasons[line])} | {text}")


if __name__ == "__main__":
    main()
