# SPDX-License-Identifier: Apache-2.0
"""Prefill FLOPs tables of dense, HySparse and HySparse2 (computed, not measured): `--help` for the counting rules.

    python benchmarks/prefill_flops.py                 # `small` at 512/2048/4096 and the paper layouts at 1M
    python benchmarks/prefill_flops.py --lens 1024 32768

The counting lives in `vllm_hysparse/tools/prefill_flops.py`, which `benchmarks/serve_bench.py` imports too.
"""

from vllm_hysparse.tools.prefill_flops import main

if __name__ == "__main__":
    main()
