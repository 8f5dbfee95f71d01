# SPDX-License-Identifier: Apache-2.0
"""`tools.quantize`'s command line: its output goes through a temporary directory, an existing one is replaced only
with `--force`, and bad arguments get one line. (The FP8 checkpoint itself, served: tests/models/test_quantised.py.)
"""

import json

import pytest
from safetensors.torch import load_file

from vllm_hysparse.tools.make_checkpoint import write_checkpoint
from vllm_hysparse.tools.quantize import FP8, main
from vllm_hysparse.tools.staging import temporary_names


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("float") / "tiny", "hysparse", "tiny", seed=3)


def _snapshot(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_existing_dst_needs_force_and_is_replaced_whole(src, tmp_path, capsys):
    dst = tmp_path / "fp8"
    dst.mkdir()
    (dst / "model-00001-of-00002.safetensors").write_bytes(b"stale shard of an older checkpoint")
    before = _snapshot(dst)
    assert main(["--src", str(src), "--dst", str(dst)]) == 2
    assert "exists and is not empty; pass --force to replace it" in _one_error_line(capsys)
    assert _snapshot(dst) == before  # untouched

    assert main(["--src", str(src), "--dst", str(dst), "--force"]) == 0
    names = sorted(p.name for p in dst.iterdir())
    assert "model-00001-of-00002.safetensors" not in names and "model.safetensors" in names, names
    assert not temporary_names(dst)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    weights = load_file(dst / "model.safetensors")
    fp8 = [n for n, t in weights.items() if t.dtype == FP8]
    assert fp8 and all(f"{n}_scale" in weights for n in fp8), sorted(weights)


@pytest.mark.parametrize("case", ["same_dir", "no_config", "dst_is_a_file"])
def test_bad_arguments_get_one_line(src, tmp_path, capsys, case):
    dst = tmp_path / "out"
    argv = {"same_dir": ["--src", str(src), "--dst", str(src)],
            "no_config": ["--src", str(tmp_path), "--dst", str(dst)],
            "dst_is_a_file": ["--src", str(src), "--dst", str(dst), "--force"]}[case]
    if case == "dst_is_a_file":
        dst.write_text("not a checkpoint")
    before = _snapshot(src)
    assert main(argv) == 2
    want = {"same_dir": "--dst must differ from --src", "no_config": "no config.json",
            "dst_is_a_file": "exists and is not a directory"}[case]
    assert want in _one_error_line(capsys)
    assert _snapshot(src) == before
    assert not temporary_names(dst) and not temporary_names(src)
