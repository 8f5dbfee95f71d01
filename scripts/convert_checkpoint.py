# SPDX-License-Identifier: Apache-2.0
"""Convert a dense Llama / Qwen2 / Qwen3 / Mistral checkpoint into HySparse or HySparse2.

    python scripts/convert_checkpoint.py --src DIR --dst DIR --arch hysparse|hysparse2 [--dry-run]
    python scripts/convert_checkpoint.py --src model.gguf --dst DIR --arch hysparse   # imported to a temp dir first

A thin wrapper around `vllm_hysparse.tools.convert` (see `--help`).
"""

import sys

from vllm_hysparse.tools.convert import main

if __name__ == "__main__":
    sys.exit(main())
