"""List the compiled Triton kernels' global memory instructions, narrow scalar ones first.

Triton vectorizes a load or store only where it can prove the addresses' alignment and the
mask's constancy; a runtime offset it cannot see through (a group's first column, say) turns a
16-byte store into sixteen single-byte ones. Run on the GPU machine after the kernels have been
compiled (tests, a benchmark); it reads the PTX in the Triton cache.

Usage: ``python scripts/ptx_census.py [CACHE_DIR ...]`` (default ``$TRITON_CACHE_DIR`` or
``~/.triton/cache``). Prints per kernel variant: narrow stores (``st.global.b8``/``b16``), narrow
loads, vector accesses (``.v2``/``.v4``), the kernel's name and its cache directory.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import sys


def census(path: str):
    text = open(path).read()
    name = re.search(r"\.entry (\w+)", text)
    ops = collections.Counter(m.group(1) for m in re.finditer(r"\b((?:ld|st)\.global(?:\.\w+)*)", text))

    def count(kind, narrow):
        return sum(n for op, n in ops.items() if op.startswith(kind) and ".v" not in op
                   and bool(re.search(r"\.b(8|16)$", op)) == narrow)

    vector = sum(n for op, n in ops.items() if ".v" in op)
    return count("st.", True), count("ld.", True), vector, name.group(1) if name else os.path.basename(path)


def main(argv) -> int:
    dirs = argv or [os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))]
    rows = sorted({(*census(p), os.path.dirname(p)) for d in dirs for p in glob.glob(f"{d}/**/*.ptx", recursive=True)},
                  reverse=True)
    for narrow_st, narrow_ld, vector, name, where in rows:
        print(f"narrow st {narrow_st:4d}  narrow ld {narrow_ld:4d}  vector {vector:4d}  {name}  ({where})")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
