# SPDX-License-Identifier: Apache-2.0
"""Rules for every pytest process of the suite.

* `HYSPARSE_STRICT_SKIPS=1` (set by `.ci/run`): a skip is a failure, except the
  bf16 cases that the Triton CPU interpreter computes wrongly (`ALLOWED_SKIPS`,
  listed in the README). A CI machine without AVX-512 (FP8 KV engine tests),
  `ptxas` (the sm_90 AOT builds) or a C++ compiler then fails instead of
  passing with less tested. One exception, never silent: the FP8 KV engine
  tests may skip where this conftest's own CPU check finds neither AVX-512 nor
  AMX (vLLM cannot store FP8 there); they are listed at the end of the run.
* Engine starts are counted (`tests.vllm_utils.ENGINE_STARTS`: `make_llm`, every
  `vllm serve` subprocess) and printed at the end of the run.
* `TRITON_INTERPRET` belongs to the kernel process alone (`tests/kernels/conftest.py`
  sets it): a session that would run other tests with it set is refused.
"""

import collections
import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

STRICT_SKIPS_ENV = "HYSPARSE_STRICT_SKIPS"
# (file, test function): the only skips allowed under HYSPARSE_STRICT_SKIPS=1, on a machine without a GPU
ALLOWED_SKIPS = {
    ("tests/kernels/test_block_sparse.py", "test_kernel_bf16"),
    ("tests/kernels/test_token_sparse.py", "test_kernel_bf16"),
    ("tests/kernels/test_oracle.py", "test_oracle_attention_bf16"),
    ("tests/kernels/test_token_oracle.py", "test_token_oracle_attention_bf16"),
}


# Skips that the machine's hardware forces: allowed under HYSPARSE_STRICT_SKIPS=1 only where a check of the
# hardware, made here and not by the test, confirms the lack, and then listed by name in the run's summary.
HARDWARE_SKIP = "[hardware] "  # the prefix of such a skip's reason


def _hardware_lacks(reason: str) -> bool:
    from tests.vllm_utils import FP8_SKIP_REASON, fp8_supported_here

    return reason.startswith(HARDWARE_SKIP + FP8_SKIP_REASON) and not fp8_supported_here()


HARDWARE_SKIPPED: list[str] = []


def strict_skips() -> bool:
    return os.environ.get(STRICT_SKIPS_ENV, "0") not in ("", "0")


def _allowed(nodeid: str) -> bool:
    path, _, name = nodeid.partition("::")
    return (path, name.split("[", 1)[0]) in ALLOWED_SKIPS


def _skip_reason(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and strict_skips() and not _allowed(item.nodeid):
        reason = _skip_reason(report)
        if _hardware_lacks(reason):
            return  # stays a skip; listed by pytest_runtest_logreport (in the xdist controller too)
        report.outcome = "failed"
        report.longrepr = f"skipped under {STRICT_SKIPS_ENV}=1 (not an allowed skip): {reason}"


def pytest_runtest_logreport(report):
    """Runs where the run is reported (the xdist controller, or the only process): list the hardware skips."""
    if report.skipped and not hasattr(report, "wasxfail") and _skip_reason(report).startswith(HARDWARE_SKIP):
        HARDWARE_SKIPPED.append(f"{report.nodeid}: {_skip_reason(report)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and strict_skips():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"module skipped under {STRICT_SKIPS_ENV}=1: {reason}"


# Seconds per test file in the last measured CI run (scripts/test_durations.py writes it); a file not in it counts
# as this many seconds.
DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_FILE_SECONDS = 60


def longest_files_first(items: list) -> None:
    """Reorders `items` in place: whole files, longest first (stable within a file). pytest-xdist's loadfile
    scheduler hands files out in collection order (scripts/test.sh turns its own reordering off), so the long files
    start first and the short ones fill the gaps at the end."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)

    def key(item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        return -seconds.get(path, UNKNOWN_FILE_SECONDS), first[path]

    items.sort(key=key)


def pytest_collection_modifyitems(config, items):
    longest_files_first(items)
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    others = sorted({i.nodeid.split("::", 1)[0] for i in items if not i.nodeid.startswith("tests/kernels/")})
    if others:
        raise pytest.UsageError(
            f"TRITON_INTERPRET is set (tests/kernels/conftest.py sets it for its process) but this session also "
            f"runs {len(others)} other test file(s), e.g. {others[0]}: run tests/kernels in a pytest process of "
            f"its own (scripts/test.sh does)")


# `--dist loadfile` (scripts/test.sh) keeps a test file on one pytest-xdist worker, so its module-scoped engines and
# servers start once and its tests keep their order. Files that share a package-scoped server must share a worker
# too, or each worker starts its own: file -> the group that runs on one worker, in collection order.
XDIST_FILE_GROUPS = {
    "tests/entrypoints/test_edge_values.py": "tiny_server",  # tests/entrypoints/conftest.py, tiny_server
    "tests/entrypoints/test_hostile.py": "tiny_server",
    # the files that ask `shared_engine` for the canonical engines
    "tests/models/test_hysparse.py": "shared_engine",
    "tests/models/test_hysparse2.py": "shared_engine",
    "tests/models/test_hot_path.py": "shared_engine",
    "tests/pic/test_engine.py": "shared_engine",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """loadfile scheduling with `XDIST_FILE_GROUPS` (xdist's own `loadgroup` renames node ids, which pytest 9
    no longer lets a plugin do, so its groups are silently ignored)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return XDIST_FILE_GROUPS.get(path, path)

    return GroupedFileScheduling(config, log)


_popen_init = subprocess.Popen.__init__


def _counting_popen_init(self, *args, **kwargs):
    """Counts `vllm serve` subprocesses (any test's own Popen or `serve_utils.serve`), then starts it."""
    cmd = args[0] if args else kwargs.get("args", "")
    argv = [str(a) for a in cmd] if isinstance(cmd, (list, tuple)) else str(cmd).split()
    if len(argv) > 1 and os.path.basename(argv[0]) == "vllm" and argv[1] == "serve":
        from tests.vllm_utils import ENGINE_STARTS

        ENGINE_STARTS["serve"] += 1
    _popen_init(self, *args, **kwargs)


def pytest_configure(config):
    subprocess.Popen.__init__ = _counting_popen_init


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init


# Engine starts under pytest-xdist: each worker sends its counts with its results, the controller adds them up.
WORKER_ENGINE_STARTS: collections.Counter = collections.Counter()
WORKER_START_SECONDS: collections.Counter = collections.Counter()  # "file kind" -> seconds to ready
WORKER_START_COUNTS: collections.Counter = collections.Counter()
SHARED_ENGINE_REUSES = [0]  # times a test file got `shared_engine`'s engine without a start, over the workers


def pytest_sessionfinish(session):
    import sys

    utils = sys.modules.get("tests.vllm_utils")
    if hasattr(session.config, "workeroutput") and utils is not None:
        session.config.workeroutput["engine_starts"] = dict(utils.ENGINE_STARTS)
        session.config.workeroutput["shared_engine_reuses"] = utils.POOL.hits
        session.config.workeroutput["engine_start_seconds"] = dict(utils.ENGINE_START_SECONDS)
        session.config.workeroutput["engine_start_counts"] = dict(utils.ENGINE_START_COUNTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    out = getattr(node, "workeroutput", {})
    WORKER_ENGINE_STARTS.update(out.get("engine_starts", {}))
    WORKER_START_SECONDS.update(out.get("engine_start_seconds", {}))
    WORKER_START_COUNTS.update(out.get("engine_start_counts", {}))
    SHARED_ENGINE_REUSES[0] += out.get("shared_engine_reuses", 0)


def pytest_terminal_summary(terminalreporter):
    import sys

    if HARDWARE_SKIPPED:
        terminalreporter.write_line(f"{len(HARDWARE_SKIPPED)} tests skipped because this machine lacks the hardware "
                                    f"(checked by tests/conftest.py):")
        for line in HARDWARE_SKIPPED:
            terminalreporter.write_line(f"  {line}")

    utils = sys.modules.get("tests.vllm_utils")
    starts = WORKER_ENGINE_STARTS + (utils.ENGINE_STARTS if utils is not None else collections.Counter())
    if starts:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(starts.items()))
        where = "this run's xdist workers" if WORKER_ENGINE_STARTS else "this process"
        terminalreporter.write_line(f"engine starts in {where}: {sum(starts.values())} ({counts})")
    reuses = SHARED_ENGINE_REUSES[0] + (utils.POOL.hits if utils is not None else 0)
    if reuses:
        terminalreporter.write_line(f"shared engines handed out again without a start (shared_engine): {reuses}")
    seconds = WORKER_START_SECONDS + (utils.ENGINE_START_SECONDS if utils is not None else collections.Counter())
    n = WORKER_START_COUNTS + (utils.ENGINE_START_COUNTS if utils is not None else collections.Counter())
    if seconds:
        terminalreporter.write_line(f"seconds to a ready engine, by test file ({sum(seconds.values()):.0f} s in all; "
                                    f"`vllm serve` started by a test's own Popen is not timed):")
        for row, s in seconds.most_common():
            terminalreporter.write_line(f"  {s:7.1f} s  {n[row]:3d} x  {row}")


# The canonical tiny checkpoint of each architecture (`tiny_model(arch)`) and the engine the files that test the
# plain engine path share (`shared_engine(arch)`): 64-token steps, so prompts over 64 tokens prefill in chunks
# beside the decodes of the others.
CANONICAL_SEED = 5
CANONICAL_ENGINE = dict(enforce_eager=True, block_size=32, max_num_batched_tokens=64, max_num_seqs=16,
                        disable_log_stats=False)


def _key(overrides: dict | None) -> str:
    return json.dumps(overrides or {}, sort_keys=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(arch, seed=CANONICAL_SEED, overrides=None)` -> (checkpoint dir, its HF reference model in float32,
    eval mode): the `tiny` preset (with config `overrides`) written once per session (per xdist worker), and
    loaded once, for every test file that uses it."""
    cache: dict[tuple[str, int, str], tuple] = {}

    def get(arch: str, seed: int = CANONICAL_SEED, overrides: dict | None = None):
        key = arch, seed, _key(overrides)
        if key not in cache:
            import torch
            from transformers import AutoModelForCausalLM

            import vllm_hysparse  # noqa: F401  (registers the configs with transformers)
            from vllm_hysparse.tools.make_checkpoint import write_checkpoint

            ckpt = write_checkpoint(tmp_path_factory.mktemp(f"{arch}-seed{seed}") / "tiny", arch, "tiny", seed=seed,
                                    overrides=overrides)
            cache[key] = ckpt, AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        return cache[key]

    return get


@pytest.fixture(scope="session")
def shared_engine(tiny_model):
    """`shared_engine(arch, seed=CANONICAL_SEED, overrides=None, **engine_args)` -> (LLM, checkpoint dir, HF
    reference): the engine for `tiny_model(arch, seed, overrides)` with `CANONICAL_ENGINE` updated by
    `engine_args`, shared with every test file of this process that asks for the same key
    (`tests.vllm_utils.EnginePool`: one engine at a time, started when first asked for)."""
    from tests.vllm_utils import POOL

    def get(arch: str, seed: int = CANONICAL_SEED, overrides: dict | None = None, **engine_args):
        ckpt, reference = tiny_model(arch, seed, overrides)
        args = {**CANONICAL_ENGINE, **engine_args}
        key = (arch, seed, _key(overrides), json.dumps(args, sort_keys=True, default=str))
        return POOL.get(key, ckpt, **args), ckpt, reference

    yield get
    POOL.release()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    """`shared_server(arch, *serve_args, seed=CANONICAL_SEED, api_key=None)` -> a healthy `serve_utils.Server` of
    the tiny `arch` checkpoint, keyed by (arch, seed, serve arguments, API key): started when first asked for,
    shared by every test file of this process that asks for the same key, stopped at the end of the session. A
    server that died before a test asks for it fails that test with the server's death report."""
    from tests.entrypoints.serve_utils import serve

    servers: dict[tuple, object] = {}
    with contextlib.ExitStack() as stack:
        def get(arch: str, *serve_args: str, seed: int = CANONICAL_SEED, api_key: str | None = None):
            key = (arch, seed, serve_args, api_key)
            if key not in servers:
                from vllm_hysparse.tools.make_checkpoint import write_checkpoint

                root = tmp_path_factory.mktemp(f"served-{arch}")
                ckpt = write_checkpoint(root / "tiny", arch, "tiny", seed=seed)
                servers[key] = stack.enter_context(serve(ckpt, root / "serve.log", *serve_args, api_key=api_key))
            if (death := servers[key].death()) is not None:
                pytest.fail(f"the shared {arch} server is gone before this test: {death}", pytrace=False)
            return servers[key]

        yield get
