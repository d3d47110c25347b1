#!/usr/bin/env python3
"""What one target decode costs by how its rows are laid out over sequences: the cost model
behind slots (is verifying N sequences' blocks in one batch nearly free, or N times one?).

    python bench/verify_rows.py            # the 142M f16 bench target, one thread

Each layout decodes on top of 100 cached rows per sequence (8 sequences, non-unified KV as
llama-server -np 8 uses), then removes its rows; median of 5.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.bindings.context import Context  # noqa: E402
from pyllama_spec.bindings.model import Model
from pyllama_spec.devtools import tiny

LAYOUTS = {"8 rows of 1 sequence": (1, 8), "1 row of each of 8": (8, 1), "64 rows of 1 sequence": (1, 64),
           "8 rows of each of 8": (8, 8)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    files = tiny.make_bench_set(native_build.cache_root() / "tiny-models")
    model = Model(files.target)
    ctx = Context(model, n_ctx=2048 * 8, n_batch=512, n_ubatch=512, n_seq_max=8, n_threads=args.threads)
    batch = ctx.shared_token_batch()
    for seq in range(8):
        batch.clear()
        batch.add_tokens(np.arange(100, dtype=np.int32) % 200 + 10, np.arange(100, dtype=np.int32), outputs=False,
                         seq_id=seq)
        ctx.decode(batch)
    print("| layout | rows | ms (min / median / max) | ms a row |")
    print("|---|---|---|---|")
    for name, (n_seq, n_rows) in LAYOUTS.items():
        times = []
        for _ in range(args.repeats):
            batch.clear()
            for seq in range(n_seq):
                batch.add_tokens(np.full(n_rows, 33, np.int32), np.arange(100, 100 + n_rows, dtype=np.int32),
                                 outputs=True, seq_id=seq)
            t = time.perf_counter()
            ctx.decode(batch)
            times.append((time.perf_counter() - t) * 1e3)
            for seq in range(n_seq):
                ctx.memory.remove(seq, 100, -1)
        med = statistics.median(times)
        print(f"| {name} | {n_seq * n_rows} | {min(times):.1f} / {med:.1f} / {max(times):.1f} | "
              f"{med / (n_seq * n_rows):.2f} |")
    ctx.close()
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
