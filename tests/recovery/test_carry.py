# SPDX-License-Identifier: Apache-2.0
"""`recovery carry`: a trained HySparse delta moved onto a base converted with more full layers."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tests.recovery_utils import PLANS
from vllm_hysparse.recovery import __main__ as cli
from vllm_hysparse.recovery.lora import attach_lora, base_digest, converted_linears, delta_state
from vllm_hysparse.tools import convert

RANK, ALPHA = 4, 8.0


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _plan(full_layers: str, window: str = "16") -> list[str]:
    plan = list(PLANS["hysparse"])
    plan[plan.index("--full-layers") + 1] = full_layers
    plan[plan.index("--swa-window") + 1] = window
    return plan


@pytest.fixture
def trained(checkpoints, tmp_path, fixed_seed):
    """A delta of random trained tensors on the fixture's HySparse base (full layers 0 and 3), with its
    base_config.json, and the recovered model it makes."""
    base = checkpoints["hysparse"]
    model = _load(base)
    digest = base_digest(model, converted_linears(model))
    attach_lora(model, RANK, ALPHA)
    gen = torch.Generator().manual_seed(fixed_seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    tensors, meta = delta_state(model, digest)
    delta = tmp_path / "delta"
    delta.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(delta / cli.DELTA_FILE), metadata=meta)
    shutil.copyfile(base / "config.json", delta / cli.BASE_CONFIG)
    assert cli.main(["apply", "--base", str(base), "--delta", str(delta), "--out", str(tmp_path / "recovered")]) == 0
    return delta, tensors, _load(tmp_path / "recovered")


def _convert(checkpoints, dst, full_layers, window="16"):
    argv = ["--src", str(checkpoints["teacher"]), "--dst", str(dst), "--arch", "hysparse", *_plan(full_layers, window)]
    assert convert.main(argv) == 0
    return dst


@pytest.mark.parametrize("promote,moved", [("2", {}), ("4", {"5": [3, 4]}), ("1,2", {})])
def test_carry_keeps_every_trained_tensor_and_makes_promoted_layers_the_teachers(checkpoints, trained, tmp_path,
                                                                                  capsys, promote, moved):
    delta, tensors, recovered = trained
    full = sorted({0, 3, *map(int, promote.split(","))})
    new_base = _convert(checkpoints, tmp_path / "base", ",".join(map(str, full)))
    capsys.readouterr()
    rc = cli.main(["carry", "--delta", str(delta), "--base", str(new_base), "--out", str(tmp_path / "carried")])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "carried" / cli.REPORT_FILE).read_text())["carry"]
    assert report["promoted"] == [int(i) for i in promote.split(",")]
    assert report["oracle_moved"] == moved
    assert (("reading a new oracle" in out) == bool(moved)), out
    assert json.loads((tmp_path / "carried" / cli.BASE_CONFIG).read_text()) == json.loads(
        (new_base / "config.json").read_text())
    assert cli.main(["apply", "--base", str(new_base), "--delta", str(tmp_path / "carried"),
                     "--out", str(tmp_path / "carried-recovered")]) == 0
    carried = dict(_load(tmp_path / "carried-recovered").named_parameters())
    teacher = dict(_load(checkpoints["teacher"]).named_parameters())
    old = dict(recovered.named_parameters())
    promoted = [f"model.layers.{i}.self_attn." for i in report["promoted"]]
    compared = 0
    for name, value in carried.items():
        if name.startswith(tuple(promoted)):  # the teacher's own attention, untouched by the delta
            torch.testing.assert_close(value, teacher[name], atol=0, rtol=0)
        else:  # as trained: the old recovered model's tensor
            torch.testing.assert_close(value, old[name], atol=0, rtol=0)
        compared += 1
    assert compared == len(carried)
    names = {k.split(".self_attn.")[0] for k in tensors}
    print(f"promoted {report['promoted']}: {compared} tensors compared, {len(names)} adapted layers in the delta")


@pytest.mark.parametrize("case", ["demoted", "other window", "hysparse2 base"])
def test_carry_refuses_a_base_it_cannot_take_with_one_line(checkpoints, trained, tmp_path, capsys, case):
    delta = trained[0]
    if case == "demoted":
        base = _convert(checkpoints, tmp_path / "base", "0,2")  # layer 3 full in the delta's base, sparse here
        match = "full in the delta's base and sparse"
    elif case == "other window":
        base = _convert(checkpoints, tmp_path / "base", "0,2,3", window="32")
        match = "swa_window"
    else:
        base, match = checkpoints["hysparse2"], "HySparse deltas and bases only"
    capsys.readouterr()
    rc = cli.main(["carry", "--delta", str(delta), "--base", str(base), "--out", str(tmp_path / "carried")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and match in err, err
    assert not (tmp_path / "carried").exists()
    assert not list(tmp_path.glob(".carried*"))
