"""The bound oracle and block-sparse calls with one and two threads, alternated (6 rounds of 20 calls)."""
import statistics

import torch
from shapes import decode_step, timed

oracle, sparse, ids = decode_step()
print("distinct selected blocks per KV group:", [len(set(ids[:, g].flatten().tolist())) for g in range(ids.shape[1])])
for label, fn in (("oracle", oracle), ("block_sparse", sparse)):
    res = {1: [], 2: []}
    for _ in range(6):
        for n in (1, 2):
            torch.set_num_threads(n)
            res[n].append(timed(fn))
    print(label, {n: round(statistics.median(x), 2) for n, x in res.items()})
