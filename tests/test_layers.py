# SPDX-License-Identifier: Apache-2.0
"""The package's layers, checked on its import statements (every one, at any depth, lazy ones included).

Serving code (models, attention, PIC, the vLLM glue) may use the reference math and the configs; the reference,
validation, recovery and the offline tools never reach up into serving code, and the reference and validation
never into recovery. The one client-side exception: the demo client builds PIC request bodies with
`pic.client`, which reads only `pic.layout`: neither loads vLLM (`test_client_side_pic_modules_are_light`).
"""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_hysparse"
SERVING = {"models", "attention", "pic", "vllm_glue", "compat"}
# layer -> the layers of the package it must not import
FORBIDDEN = {
    "configs": SERVING | {"reference", "recovery", "tools", "validate", "metrics"},
    "reference": SERVING | {"recovery", "tools", "validate"},
    "validate": SERVING | {"recovery", "tools"},
    "recovery": SERVING | {"validate"},
    "tools": SERVING,
    "metrics": SERVING | {"reference", "recovery", "tools", "validate"},
}
# (importing module, imported module): the allowed crossings of a forbidden arrow
ALLOWED = {("vllm_hysparse.tools.demo_client", "vllm_hysparse.pic.client")}
CLIENT_SIDE = ("vllm_hysparse.pic.client", "vllm_hysparse.pic.layout")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.split(".")[0] == "vllm_hysparse"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _module(path)
        for dst in sorted(_imports(path)):
            if _layer(dst) in FORBIDDEN.get(_layer(src), ()) and (src, dst) not in ALLOWED:
                bad.append(f"{src} imports {dst}")
    return bad


def test_no_layer_imports_upward():
    files = list(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    bad = upward_imports()
    assert not bad, f"{len(bad)} upward import(s) in {len(files)} files:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule can fail: a copy of `reference/` with one import of the PIC layout is caught."""
    import shutil

    copy = tmp_path / "vllm_hysparse"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "reference" / "pic.py"
    target.write_text(target.read_text() + "\nfrom vllm_hysparse.pic.layout import PICLayout  # noqa\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    assert upward_imports() == ["vllm_hysparse.reference.pic imports vllm_hysparse.pic.layout"]


def test_client_side_pic_modules_are_light():
    """The modules the offline tools may use from `pic/` load without vLLM."""
    code = (f"import sys; import {', '.join(CLIENT_SIDE)}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')); sys.exit('vllm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stdout + done.stderr
