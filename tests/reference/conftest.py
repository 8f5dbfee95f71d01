# SPDX-License-Identifier: Apache-2.0
import pytest
import torch

from tests.recovery_utils import checkpoints  # noqa: F401  (the recovery tests' tiny teacher and students)


@pytest.fixture(autouse=True)
def _single_thread():
    """The reference tests use tiny tensors: one intra-op thread is faster, and on a
    shared 2-core machine it avoids OpenMP spin-waiting (runs went from ~9 s to
    ~75 s under load with the default thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
