# SPDX-License-Identifier: Apache-2.0
"""sm_90 AOT kernel builds: print one resource row per built kernel at the end of the run."""


def pytest_terminal_summary(terminalreporter):
    from tests.kernels_aot.sm90 import RESULTS

    if not RESULTS:
        return
    cols = ("kind", "shape", "kernel", "config", "regs", "spill_stores", "spill_loads", "shared")
    heads = ("kind", "shape", "kernel", "config", "regs", "spill st", "spill ld", "shared B")
    widths = [max(len(h), *(len(str(r[c])) for r in RESULTS)) for c, h in zip(cols, heads)]
    terminalreporter.section("sm_90 kernel resources (ptxas; Triton shared memory)")
    terminalreporter.write_line("  ".join(h.ljust(w) for h, w in zip(heads, widths)))
    for r in RESULTS:
        terminalreporter.write_line("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))
