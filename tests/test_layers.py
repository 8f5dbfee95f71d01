# SPDX-License-Identifier: Apache-2.0
"""The package's layers and its import cycles, checked on its import statements (every one, at any depth, lazy
ones included).

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
OFFLINE = {"tools", "recovery", "validate"}
# layer -> the layers of the package it must not import
FORBIDDEN = {
    # what a server runs never imports the offline tools (the benchmark harness binds sockets, for one)
    **{layer: OFFLINE for layer in SERVING},
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


def module_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (any depth, lazy imports included). `from pkg import sub` is an
    import of `pkg.sub` alone, as Python resolves it once `pkg` is importing."""
    modules = {_module(p): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                deps |= subs | ({node.module} & modules.keys() if len(subs) < len(node.names) else set())
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names} & modules.keys()
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, out = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


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


def test_no_import_cycles():
    graph = module_graph(PACKAGE)
    assert len(graph) > 50
    found = cycles(graph)
    assert not found, f"{len(found)} import cycle(s): " + "; ".join(" <-> ".join(c) for c in found)


def test_cycle_check_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


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
