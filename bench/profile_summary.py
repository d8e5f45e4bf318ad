"""Summarize a py-spy ``--format raw`` profile: where a process spent its samples.

Runs on the developer's machine over the file ``bench/serving.py --profile-service``
or ``bench/speculation.py --profile-modes`` wrote. Each line of the file is
``frame;frame;...;leaf count``, outermost frame first (with ``--threads``, the thread
is the first frame, after the process's with ``--subprocesses``). Prints the share of
samples per thread, the functions with the most samples on top of the stack
(self), and those present anywhere in the stack (inclusive).

    python -m bench.profile_summary profile/service.collapsed.txt --top 25
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    """``(frames outermost first, samples)`` per line."""
    stacks = []
    for line in path.read_text(errors="replace").splitlines():
        head, _, count = line.rpartition(" ")
        if head and count.isdigit():
            stacks.append((head.split(";"), int(count)))
    return stacks


def thread_of(frames: list[str]) -> str:
    """The sampled thread, named with its process when py-spy followed subprocesses
    (``--subprocesses`` nests each child's stack under ``process <pid>:"<cmd>"`` frames):
    the innermost process frame and the thread frame after it."""
    process = max((i for i, f in enumerate(frames) if f.startswith("process ")), default=None)
    if process is None:
        return frames[0]
    name = frames[process].split(":", 1)[-1].strip('"')[:60]
    thread = frames[process + 1] if process + 1 < len(frames) else "?"
    return f"{name} / {thread}"


def summarize(stacks: list[tuple[list[str], int]], top: int) -> str:
    total = sum(count for _, count in stacks) or 1
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for frames, count in stacks:
        threads[thread_of(frames)] += count
        own[frames[-1]] += count
        for frame in set(frames[1:]):
            inclusive[frame] += count
    lines = [f"{total} samples"]
    for title, counter in (("threads", threads), ("self", own), ("inclusive", inclusive)):
        lines.append(f"\n{title}:")
        lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in counter.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=25)
    opts = parser.parse_args()
    print(summarize(read_stacks(opts.path), opts.top))


if __name__ == "__main__":
    main()
