"""Run one command and report what it cost: wall seconds, peak RSS of the process tree (ru_maxrss of the
largest child, Linux) and, sampled, the command's peak anonymous and file-backed RSS, and bytes written under a
folder (links counted as links, not their targets).

  python3 scripts/measure.py --label zero-copy-export --written OUTDIR --json results.jsonl -- CMD ...

Used for the full-size build footprint (docs/benchmarks.md); each stage runs in its own process so one
stage's peak memory does not hide another's."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def written_bytes(folder: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(folder):  # os.walk does not follow links to folders
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            total += os.lstat(os.path.join(root, name)).st_size
    return total


def sample_rss(proc, interval: float = 0.2) -> dict:
    """Wait for `proc`, sampling its RSS split every `interval` s: the peak of anonymous memory (the process's
    own) and of file-backed pages (memory maps; the kernel can reclaim them), in GB. Child processes of `proc`
    are not sampled (ru_maxrss covers them)."""
    import re

    peak = {"anon": 0, "file": 0}
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            text = status.read_text()
        except OSError:
            break
        for key, field in (("anon", "RssAnon"), ("file", "RssFile")):
            m = re.search(field + r":\s+(\d+)", text)
            if m:
                peak[key] = max(peak[key], int(m.group(1)))
        time.sleep(interval)
    proc.wait()
    return {f"peak_{k}_gb": round(v / 1024 / 1024, 2) for k, v in peak.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--written", type=Path, help="folder whose bytes the command writes")
    ap.add_argument("--json", type=Path, help="append one JSON line with the result")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    split = sample_rss(proc)
    rc = proc.returncode
    seconds = time.perf_counter() - t0
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 / 1024
    row = {"label": args.label, "rc": rc, "seconds": round(seconds, 1), "peak_rss_gb": round(peak_gb, 2), **split,
           "written_gb": round(written_bytes(args.written) / 1e9, 3) if args.written and args.written.exists() else None,
           "cmd": " ".join(cmd)}
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
