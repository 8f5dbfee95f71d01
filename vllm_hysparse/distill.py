# SPDX-License-Identifier: Apache-2.0
"""The old entry point of KL distillation, kept so that existing command lines and imports work.

    python -m vllm_hysparse.distill ARGS   is   python -m vllm_hysparse.recovery distill ARGS

The code is `vllm_hysparse.recovery.distill`; its names are re-exported here.
"""

import sys

from vllm_hysparse.recovery.distill import HeldOut, distill, kl_divergence, save, split_windows  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    from vllm_hysparse.recovery.__main__ import main as recovery_main

    return recovery_main(["distill", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
