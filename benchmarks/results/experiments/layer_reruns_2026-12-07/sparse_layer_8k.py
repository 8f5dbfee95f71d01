"""`attention_micro.hysparse_layers` on one 2,048-row prefill chunk at 8k, three times in one process (9 cold calls
each): the sparse layer's rows again, to tell an outlier from a change. Run from the repository root:

    python benchmarks/results/experiments/layer_reruns_2026-12-07/sparse_layer_8k.py
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import attention_micro as am  # noqa: E402

for _ in range(3):
    for name, ms in am.hysparse_layers(1, 8192, 9, q_len=2048).items():
        print(f"{ms:7.2f}  {name}")
    print(flush=True)
