# SPDX-License-Identifier: Apache-2.0
"""Servers shared by the entrypoint tests: one `vllm serve` per architecture for the package.

The hostile-input barrage and the edge-value sweep ask the same thing of a
server (answer 4xx or succeed, keep serving), so they share it: a start costs
20-60 s. Every server is tiny, eager, capped at `MAX_LEN` tokens and behind an
API key; HySparse2's runs with early exit on, as `vllm serve` does by default.
"""

import contextlib

import pytest

from tests.entrypoints.serve_utils import API_KEY, MAX_LEN, serve
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

CKPT_SEED = 41


@pytest.fixture(scope="package")
def tiny_server(tmp_path_factory):
    """`tiny_server(arch)` -> a healthy `Server` for "hysparse" or "hysparse2", started once for the package."""
    servers = {}
    with contextlib.ExitStack() as stack:
        def get(arch: str):
            if arch not in servers:
                root = tmp_path_factory.mktemp(f"served-{arch}")
                ckpt = write_checkpoint(root / "tiny", arch, "tiny", seed=CKPT_SEED)
                servers[arch] = stack.enter_context(serve(
                    ckpt, root / "serve.log", "--enforce-eager", "--max-model-len", str(MAX_LEN), api_key=API_KEY))
            if (death := servers[arch].death()) is not None:
                pytest.fail(f"the shared {arch} server is gone before this test: {death}", pytrace=False)
            return servers[arch]

        yield get
