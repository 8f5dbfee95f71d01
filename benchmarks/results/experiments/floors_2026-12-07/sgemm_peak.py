"""This machine's float32 matmul rate (torch's CPU GEMM, 2 threads and 1), the yardstick of the FLOP floors in
`../floors_2026-12-07.md`.

    python sgemm_peak.py
"""
import time

import torch


def gflops(n: int, threads: int, reps: int = 10) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 / ((time.perf_counter() - t) / reps) / 1e9


if __name__ == "__main__":
    for n in (1024, 2048):
        print(f"{n} x {n} float32 matmul, 2 threads: {gflops(n, 2):.1f} GFLOP/s")
    print(f"2048 x 2048 float32 matmul, 1 thread: {gflops(2048, 1, 5):.1f} GFLOP/s")
