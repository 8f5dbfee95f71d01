# SPDX-License-Identifier: Apache-2.0
"""`vllm_hysparse.vllm_glue` owns every touch of vLLM internals (no engine starts here).

* Outside the glue package, no module of the plugin patches vLLM, swaps its
  classes, writes its tables or reads the private state the glue wraps: the
  source (strings and comments left out) is searched for the patterns below,
  and assignments onto names imported from vLLM are found in its syntax tree.
* `register()` refuses a vLLM older than the tested one in one line and warns
  once, naming the touch points, about an untested newer one.
* Every touch point in `TOUCH_POINTS` names a glue function that exists and a
  vLLM file and attribute that the installed vLLM has.
"""

import ast
import importlib
import io
import logging
import re
import tokenize
from pathlib import Path

import pytest

import vllm_hysparse
from vllm_hysparse import vllm_glue

PACKAGE = Path(vllm_hysparse.__file__).parent
GLUE = PACKAGE / "vllm_glue"

# pattern -> what it touches; searched in code only (docstrings, strings and comments blanked).
FORBIDDEN = {
    r"\bInputProcessor\b": "vLLM's input processor",
    r"vllm\.forward_context\b|\b(get|set|override)_forward_context\b|\bForwardContext\b": "vLLM's forward context",
    r"\bstatic_forward_context\b|\bno_compile_layers\b": "the runner's table of attention layers",
    r"\bbatch_descriptor\b": "the forward context's batch descriptor",
    r"__class__\s*=(?!=)": "swapping an object's class",
    r"\bMODELS_CONFIG_MAP\b": "vLLM's per-architecture config hooks table",
    r"\bregister_backend\b|\bAttentionBackendEnum\b": "vLLM's attention backend registry",
    r"\bdo_kv_cache_update\b(?!\s*\()|\bpic_original_kv_update\b": "wrapping a layer's KV cache write",
    r"\.kv_cache\s*=(?!=)": "swapping a layer's KV cache",
    r"\bCommonAttentionMetadata\s*\(": "building attention metadata by hand",
    r"\battn_groups\b|\bbuild_metadata\b|input_batch\.block_table\b|\bget_device_tensor\b":
        "the runner's metadata builders and block tables",
    r"\bKVSharingFastPrefillMetadata\b|\bget_attention_context\b": "reading the forward context's metadata",
    r"\.intermediate_tensors\s*=(?!=)": "the runner's pipeline receive buffers",
    r"\b_bookkeeping_sync\b|\bdiscard_request_mask\b|\b[gs]et_offset\b": "the runner's sampling bookkeeping",
    r"\.worker_cls\s*=(?!=)|\b(disable|enable)_envs_cache\b": "engine configuration behind vLLM's back",
    r"\binit_entrypoints_middleware\b|vllm\.entrypoints\.launchers\b|\bsys\.modules\b": "the API server launcher",
    r"\bverify_token\b|\bcreate_error_response\b|\.engine_client\b": "the API server's private state and helpers",
}


def _code_lines(source: str) -> list[str]:
    """`source`'s lines with every string and comment blanked (newlines kept), so docs may name what code may not."""
    rows = [list(line) for line in source.splitlines(keepends=True)]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        (first, start), (last, end) = tok.start, tok.end
        for r in range(first, last + 1):
            row = rows[r - 1]
            for c in range(start if r == first else 0, end if r == last else len(row)):
                if row[c] != "\n":
                    row[c] = " "
    return ["".join(row) for row in rows]


def _vllm_names(tree: ast.AST) -> set[str]:
    """Names bound to something imported from vLLM anywhere in the module (function-local imports included)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "vllm")
    return names


def _base_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _vllm_assignments(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each assignment (or setattr / delattr) onto an attribute of a name imported from vLLM."""
    names = _vllm_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and node.args and _base_name(node.args[0]) in names):
            found.append((node.lineno, f"{node.func.id} on vLLM's {_base_name(node.args[0])}"))
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and _base_name(t) in names:
                    found.append((node.lineno, f"assignment onto vLLM's {_base_name(t)}"))
                    break
    return found


def scan(path: Path, root: Path) -> list[str]:
    """`file:line: what (code)` for every touch of vLLM internals in one source file."""
    source = path.read_text()
    rel = path.relative_to(root.parent)
    hits = []
    for number, line in enumerate(_code_lines(source), 1):
        for pattern, what in FORBIDDEN.items():
            if re.search(pattern, line):
                hits.append(f"{rel}:{number}: {what} ({line.strip()})")
    for number, what in _vllm_assignments(ast.parse(source)):
        hits.append(f"{rel}:{number}: {what} ({source.splitlines()[number - 1].strip()})")
    return hits


def test_no_vllm_internals_outside_the_glue_package():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if GLUE not in p.parents]
    assert len(files) > 40, "the package was not found where expected"
    hits = [hit for path in files for hit in scan(path, PACKAGE)]
    assert not hits, "touches of vLLM internals outside vllm_hysparse/vllm_glue/ (move them there):\n" + "\n".join(hits)


def test_the_scan_finds_touches_and_ignores_their_names_in_docs(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    bad = pkg / "bad.py"
    bad.write_text(
        '"""Docs may name InputProcessor.process_inputs and runner.__class__ = X."""\n'
        "from vllm.v1.engine.input_processor import InputProcessor\n"
        "from vllm.config import ParallelConfig as PC\n"
        "# a comment may say get_forward_context()\n"
        "def f(runner, mixin):\n"
        "    runner.__class__ = mixin\n"
        "    PC.worker_cls_default = 'x'\n"
        "    setattr(PC, 'y', 1)\n"
        "    text = 'MODELS_CONFIG_MAP'\n")
    hits = scan(bad, pkg)
    assert [h.split(":")[1] for h in hits] == ["2", "6", "7", "8"], hits
    assert all(h.startswith("pkg/bad.py:") for h in hits)


def test_every_touch_point_names_a_glue_function():
    assert len({tp.name for tp in vllm_glue.TOUCH_POINTS}) == len(vllm_glue.TOUCH_POINTS)
    for tp in vllm_glue.TOUCH_POINTS:
        module, _, function = tp.name.partition(".")
        assert callable(getattr(importlib.import_module(f"vllm_hysparse.vllm_glue.{module}"), function)), tp.name
        assert tp.vllm_file and not tp.vllm_file.startswith(("/", "vllm/")) and tp.does, tp


def test_every_touch_point_exists_in_the_installed_vllm():
    assert vllm_glue.missing_touch_points() == []


@pytest.fixture
def warnings_logged(monkeypatch):
    """Warnings the plugin logs during the test; the once-per-process flag starts unset."""
    monkeypatch.setattr(vllm_glue, "_WARNED", False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log = logging.getLogger("vllm.hysparse")
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)


def test_the_tested_vllm_registers_without_a_word(warnings_logged):
    import vllm

    assert vllm_glue._minor(vllm.__version__) in vllm_glue.TESTED_MINORS
    vllm_hysparse.register()
    assert [r.getMessage() for r in warnings_logged] == []


def test_an_untested_vllm_is_warned_about_once_naming_the_touch_points(warnings_logged, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    vllm_hysparse.register()
    vllm_hysparse.register()
    assert len(warnings_logged) == 1, [r.getMessage() for r in warnings_logged]
    message = warnings_logged[0].getMessage()
    assert "\n" not in message and "0.33.1" in message and "0.32.x" in message
    for tp in vllm_glue.TOUCH_POINTS:
        assert tp.name in message


def test_a_vllm_known_to_break_is_refused_in_one_line(warnings_logged, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(RuntimeError) as info:
        vllm_hysparse.register()
    message = str(info.value)
    assert "\n" not in message and "0.31.0" in message and "0.32.x" in message
    assert warnings_logged == []


@pytest.mark.parametrize(("version", "minor"), [("0.32.0", (0, 32)), ("0.32.1rc1.dev4+gabc", (0, 32)),
                                                ("1.0.0", (1, 0)), ("dev", None)])
def test_version_numbers(version, minor):
    assert vllm_glue._minor(version) == minor
