# SPDX-License-Identifier: Apache-2.0
"""`python -m vllm_hysparse.tools.convert`: the converter's command line (see the package docstring).

`prog` keeps the usage line the module `convert.py` printed before the converter became a package.
"""

import sys

from vllm_hysparse.tools.convert import main

sys.exit(main(prog="convert.py"))
