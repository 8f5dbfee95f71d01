# SPDX-License-Identifier: Apache-2.0
"""Servers shared by the entrypoint tests: one `vllm serve` per architecture (tests/conftest.py `shared_server`).

The hostile-input barrage and the edge-value sweep ask the same thing of a
server (answer 4xx or succeed, keep serving), so they share it: a start costs
20-60 s. Every server is tiny, eager, capped at `MAX_LEN` tokens and behind an
API key; HySparse2's runs with early exit on, as `vllm serve` does by default.
"""

import pytest

from tests.entrypoints.serve_utils import API_KEY, MAX_LEN

CKPT_SEED = 41


@pytest.fixture(scope="package")
def tiny_server(shared_server):
    """`tiny_server(arch)` -> a healthy `Server` for "hysparse" or "hysparse2" (tests/conftest.py `shared_server`)."""
    return lambda arch: shared_server(arch, "--enforce-eager", "--max-model-len", str(MAX_LEN), seed=CKPT_SEED,
                                      api_key=API_KEY)
