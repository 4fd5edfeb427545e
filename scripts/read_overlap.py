"""A package weights file (2.1 GB: 100 bf16 tensors, written by core/packages.save_constants) read to the CPU by
the read_constants of git revision REV and by this checkout's, twice each (the first read of each is cold). The
record carries both digests (sha256 for revisions before tree_sha256). Run: python3 scripts/read_overlap.py REV"""

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fluxtrt.core import packages as new
from fluxtrt.fileio import sha256_file


def old_module(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:fluxtrt/core/packages.py"], capture_output=True, text=True,
                         check=True).stdout
    path = Path(new.__file__).with_name("_packages_at_rev.py")  # beside the new one: its relative imports resolve
    path.write_text(src)
    try:
        spec = importlib.util.spec_from_file_location("fluxtrt.core._packages_at_rev", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        path.unlink()


def main():
    old = old_module(sys.argv[1])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "w.constants.safetensors"
        rec = new.save_constants({f"w{i}": torch.randn(2560, 4096).to(torch.bfloat16) for i in range(100)}, path)
        rec["sha256"] = sha256_file(path)
        for name, mod in ((sys.argv[1], old), ("this checkout", new), (sys.argv[1], old), ("this checkout", new)):
            t0 = time.perf_counter()
            mod.read_constants(path, rec, "cpu", "w")
            print(json.dumps({"implementation": name, "read_s": round(time.perf_counter() - t0, 2),
                              "bytes": rec["bytes"]}), flush=True)


if __name__ == "__main__":
    main()
