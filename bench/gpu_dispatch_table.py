"""Writes attnkit's GPU dispatch table (attnkit/_gpu_table_data.py) from GPU bench JSONs.

    python bench/gpu_dispatch_table.py bench/out/gpu/bench-cuda.json [more.json ...] [--out PATH]

Each JSON is the output of ``python -m attnkit bench --device cuda`` (attnkit[triton] and
attnkit[cuda] timed on the same inputs in the same run, the meta naming the device's compute
capability and the ATTNKIT_* switches in force).  For every unmasked softmax case with N = M
where both backends ran and agreed with the baseline, the faster becomes an entry
(attnkit._gpu_table.entries_from_bench); entries already in the table for the same (capability,
dtype, head dim, causal, mode, N, ATTNKIT_CUDA_SM90) are replaced, the others kept.  Prints the
table of what was measured (ms of each backend, the pick).
"""
from __future__ import annotations

import argparse
import json
import pprint
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pytorch_ext._gpu_table import entries_from_bench  # noqa: E402  (attnkit's package dir)

HEADER = '''"""Measured GPU dispatch entries (attnkit/_gpu_table.py says what they mean).

Written by ``python bench/gpu_dispatch_table.py BENCH_JSON...``; do not edit by hand.
"""

'''
KEY = ("family", "capability", "dtype", "head_dim", "causal", "mode", "n", "cuda_env")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="GPU bench JSON files")
    ap.add_argument("--out", default=str(ROOT / "pytorch_ext" / "_gpu_table_data.py"))
    args = ap.parse_args(argv)
    new = []
    for path in args.json:
        data = json.loads(Path(path).read_text())
        new += entries_from_bench(data.get("cases", []), data.get("meta", {}))
    namespace: dict = {}
    out = Path(args.out)
    if out.exists():
        exec(compile(out.read_text(), str(out), "exec"), namespace)  # the current table (data only)
    replaced = {tuple(e[k] for k in KEY) for e in new}
    kept = [e for e in namespace.get("ENTRIES", []) if tuple(e.get(k, "") for k in KEY) not in replaced]
    entries = sorted(kept + new, key=lambda e: tuple(str(e.get(k, "")) for k in KEY))
    out.write_text(HEADER + "ENTRIES: list[dict] = " + pprint.pformat(entries, width=110, sort_dicts=False) + "\n")
    print(f"{len(new)} measured entries from {len(args.json)} file(s); {len(kept)} kept; {len(entries)} in {out}")
    for e in new:
        times = ", ".join(f"{b} {t:.3f} ms" for b, t in e["ms"].items())
        print(f"  sm{e['capability']} {e['dtype']} D{e['head_dim']} {'causal' if e['causal'] else 'full'} "
              f"{e['mode']} N{e['n']} SM90={e['cuda_env'] or '-'}: {times} -> {e['backend']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
