# SPDX-License-Identifier: Apache-2.0
"""The recovery tests' fixtures (`tests/recovery_utils.py`), their seeds in failure reports, two threads each."""

import pytest
import torch

from tests.recovery_utils import SEED, checkpoints, fixed_seed  # noqa: F401  (fixtures)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seeds = [v for k, v in item.user_properties if k == "seed"]
    if report.failed and seeds:
        report.sections.append(("seed", f"this test drew from torch.manual_seed({seeds[0]}) "
                                        f"(HYSPARSE_RECOVERY_SEED={SEED}; set it to draw others)"))


@pytest.fixture(autouse=True)
def _two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, before))
    yield
    torch.set_num_threads(before)
