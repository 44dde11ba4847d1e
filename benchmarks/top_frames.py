"""Where the CPU went: the top frames of a py-spy profile, as JSON.

    py-spy record --subprocesses --format raw -o profile.txt -- python benchmarks/ledger_throughput.py --json
    python benchmarks/top_frames.py profile.txt --top 15

py-spy's raw format is one line per distinct stack, frames separated by ";"
(outermost first), then a space and the number of samples. "self" counts a
frame when it is the innermost (the CPU was in it); "inclusive" when it is
anywhere on the stack (the CPU was in it or in what it called). Idle samples
(a thread waiting in select, epoll or a lock) are left out, so shares are of
the CPU used, not of the wall time. --only keeps stacks that contain a frame
matching it (a process, a function), --without leaves out those that do.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter

# Innermost frames that are waiting, not working: the event loop's select, a
# lock, psycopg's wait for the server's answer (its C poll shows as this frame),
# and a thread pool's worker waiting for work (its queue's C get shows as it).
_IDLE_FRAME = re.compile(r"^\s*(select|poll|epoll_wait|wait|acquire|sleep|recv_into|run_forever)\b|"
                         r"\((selectors|threading|queue)\.py|^Connection\.wait \(psycopg/|"
                         r"^_worker \(concurrent/futures/thread\.py")
_PROCESS_FRAME = re.compile(r'^process \d+:|^ ')  # py-spy's per-process root (its command line can hold ";")


def read_stacks(path: str, only: str | None, without: str | None) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack_text, _, count = line.rpartition(" ")
            frames = [f for f in stack_text.split(";") if not _PROCESS_FRAME.search(f)]
            if not frames or (only and not any(only in f for f in frames)) or (without and any(without in f for f in frames)):
                continue
            stacks.append((frames, int(count)))
    return stacks


def is_idle(frames: list[str]) -> bool:
    return bool(_IDLE_FRAME.search(frames[-1]))


def short(frame: str) -> str:
    """`name (path/to/module.py:line)` without the line, with the path shortened to the package."""
    frame = re.sub(r":\d+\)$", ")", frame)
    return re.sub(r"\(.*?/((?:site-packages|lib/python3\.\d+)/)?([^/]+/[^/]+\.py)\)$", r"(\2)", frame)


def top_frames(stacks: list[tuple[list[str], int]], top: int) -> dict:
    busy = [(frames, n) for frames, n in stacks if not is_idle(frames)]
    total = sum(n for _, n in busy) or 1
    self_counts, inclusive_counts = Counter(), Counter()
    for frames, n in busy:
        named = [short(f) for f in frames]
        self_counts[named[-1]] += n
        for frame in set(named):
            inclusive_counts[frame] += n
    return {
        "busy_samples": total,
        "idle_samples": sum(n for _, n in stacks) - total,
        "self_share": [[frame, round(n / total, 3)] for frame, n in self_counts.most_common(top)],
        "inclusive_share": [[frame, round(n / total, 3)] for frame, n in inclusive_counts.most_common(top)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", help="py-spy --format raw output")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--only", help="keep only stacks with a frame containing this text")
    parser.add_argument("--without", help="leave out stacks with a frame containing this text (start-up: _find_and_load)")
    args = parser.parse_args()
    print(json.dumps(top_frames(read_stacks(args.profile, args.only, args.without), args.top), indent=1))


if __name__ == "__main__":
    main()
