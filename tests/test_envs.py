# SPDX-License-Identifier: Apache-2.0
"""`vllm_hysparse/envs.py` lists every environment variable the plugin reads or sets, and the docs show them all.

The code is read as text (its string constants, by AST), not run: a variable read anywhere in `vllm_hysparse/`
or `csrc_triton/` under our prefixes must be in the list, and every listed variable must be read or set by the
module the list names and have a row in docs/serving.md's table.
"""

import ast
import importlib.util
import re
from pathlib import Path

from vllm_hysparse import envs

ROOT = Path(__file__).resolve().parents[1]
OURS = re.compile(r"^(VLLM_HYSPARSE\w*|HYSPARSE_\w+)$")
NAMES = {v.name for v in envs.ENV_VARS}


def _string_constants(path: Path) -> set[str]:
    """Every string constant of the file, less the names listed in `__all__` (names, not variables)."""
    tree = ast.parse(path.read_text())
    exported = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                for c in ast.walk(node.value)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in exported}


def _package_files() -> list[Path]:
    return [p for d in ("vllm_hysparse", "csrc_triton") for p in sorted((ROOT / d).rglob("*.py"))
            if p.name != "envs.py"]


def test_every_variable_of_ours_in_the_code_is_listed():
    found = {}
    for path in _package_files():
        for value in _string_constants(path):
            if OURS.match(value):
                found.setdefault(value, path.relative_to(ROOT))
    assert found, "no variable found: the scan is broken"
    unlisted = {name: str(where) for name, where in found.items() if name not in NAMES}
    assert not unlisted, f"read in the code but missing from vllm_hysparse/envs.py: {unlisted}"
    print(f"\n{len(found)} of our variables found in the code, all {len(NAMES)} listed ones checked")


def test_every_listed_variable_is_used_where_the_list_says():
    for var in envs.ENV_VARS:
        spec = importlib.util.find_spec(var.where)
        assert spec is not None and spec.origin, var
        source = Path(spec.origin).read_text()
        # Through the list (`envs.<NAME>`) or, in the kernel package that cannot import ours, by its name.
        attr = next(k for k, v in vars(envs).items() if v is var)
        assert f"envs.{attr}" in source or var.name in _string_constants(Path(spec.origin)), \
            f"{var.name}: not read in {var.where}"


def test_kernel_package_names_the_same_variable():
    from csrc_triton import cpu_ext

    assert cpu_ext.CPU_EXT_ENV == envs.CPU_EXT.name


def test_docs_table_has_every_variable():
    docs = (ROOT / "docs" / "serving.md").read_text()
    table = docs[docs.index("## Environment variables"):]
    table = table[:table.index("\n## ", 1)]
    rows = set(re.findall(r"^\| `(\w+)`", table, re.M))
    assert rows == NAMES, (f"missing from docs/serving.md: {sorted(NAMES - rows)}; "
                           f"not in vllm_hysparse/envs.py: {sorted(rows - NAMES)}")
