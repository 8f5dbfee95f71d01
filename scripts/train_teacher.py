# SPDX-License-Identifier: Apache-2.0
"""Train a small dense Llama teacher on the Python standard library's sources (offline, CPU).

    python scripts/train_teacher.py --out DIR [--size tiny|small] [--force]

A thin wrapper around `vllm_hysparse.tools.train_teacher` (see `--help`).
"""

import sys

from vllm_hysparse.tools.train_teacher import main

if __name__ == "__main__":
    sys.exit(main())
