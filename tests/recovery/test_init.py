# SPDX-License-Identifier: Apache-2.0
"""Recovery stage 0 (`recovery.init`): the fits against a solver, the RoPE maps commute, the folds are exact,
and the initialised student is no worse than the copied one on held-out tokens."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from vllm_hysparse.recovery import __main__ as cli
from vllm_hysparse.recovery import init
from vllm_hysparse.recovery.train import HeldOut
from vllm_hysparse.reference.layers import RotaryEmbedding

SEED = 1234


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _windows(n, vocab, seed, t=96):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, t), generator=gen) for _ in range(n)]


@pytest.mark.parametrize("bias", [False, True])
def test_ridge_lstsq_matches_a_solver(bias):
    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(500, 24, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 5, 24, dtype=torch.float64)
    y = torch.randn(500, 7, generator=gen, dtype=torch.float64) + 3.0
    a = torch.cat([x, torch.ones(500, 1, dtype=torch.float64)], 1) if bias else x
    # Without ridge: ordinary least squares.
    w, b = init.ridge_lstsq(x, y, 0.0, bias=bias)
    ref = torch.linalg.lstsq(a, y).solution.T
    torch.testing.assert_close(w, ref[:, :24], atol=1e-9, rtol=1e-9)
    if bias:
        torch.testing.assert_close(b, ref[:, 24], atol=1e-9, rtol=1e-9)
    # With ridge: least squares on x stacked over sqrt(lam) I (bias unpenalised, so centred data).
    ridge = 0.3
    xc, yc = (x - x.mean(0), y - y.mean(0)) if bias else (x, y)
    lam = ridge * float((xc.T @ xc).diagonal().mean())
    aug_x = torch.cat([xc, lam**0.5 * torch.eye(24, dtype=torch.float64)])
    aug_y = torch.cat([yc, torch.zeros(24, 7, dtype=torch.float64)])
    w, b = init.ridge_lstsq(x, y, ridge, bias=bias)
    torch.testing.assert_close(w, torch.linalg.lstsq(aug_x, aug_y).solution.T, atol=1e-9, rtol=1e-9)


def test_rope_map_commutes_with_rope_and_recovers_a_known_map():
    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED)
    d, rotary = 16, 12  # 2 pass-through dims beyond the rotated ones
    rope = RotaryEmbedding(rotary, {"rope_type": "default", "rope_theta": 10000.0})
    k_src = torch.randn(400, d, generator=gen, dtype=torch.float64)
    truth_c = torch.complex(torch.randn(rotary // 2, generator=gen, dtype=torch.float64),
                            torch.randn(rotary // 2, generator=gen, dtype=torch.float64))
    zs = init.to_pairs(k_src, rotary) * truth_c
    rest_scale = torch.randn(d - rotary, generator=gen, dtype=torch.float64)
    k_dst = torch.cat([zs.real, zs.imag, k_src[:, rotary:] * rest_scale], 1)
    m = init.fit_rope_map(k_src, k_dst, rotary, ridge=0.0)
    torch.testing.assert_close(k_src @ m.T, k_dst, atol=1e-9, rtol=1e-9)
    # Rotate-then-map == map-then-rotate at random positions (RoPE in float32).
    x = torch.randn(1, 50, 1, d, generator=gen)
    pos = torch.randint(0, 5000, (50,), generator=gen)
    mf = m.float()
    torch.testing.assert_close(rope(x, pos) @ mf.T, rope(x @ mf.T, pos), atol=1e-4, rtol=1e-4)
    # A general matrix does not commute: the check can fail.
    dense = torch.randn(d, d, generator=gen)
    assert (rope(x, pos) @ dense.T - rope(x @ dense.T, pos)).abs().max() > 0.1


def test_folds_equal_applying_the_maps():
    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED)
    h, d, hidden = 3, 8, 20
    rope = RotaryEmbedding(d, {"rope_type": "default", "rope_theta": 10000.0})
    q_proj = torch.nn.Linear(hidden, h * d, bias=True)
    o_proj = torch.nn.Linear(h * d, hidden, bias=False)
    for p in (*q_proj.parameters(), o_proj.weight):
        p.data = torch.randn(p.shape, generator=gen)
    m = init.fit_rope_map(torch.randn(300, d, generator=gen, dtype=torch.float64),
                          torch.randn(300, d, generator=gen, dtype=torch.float64), d)
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    x = torch.randn(1, 30, hidden, generator=gen)
    k = torch.randn(1, 30, 1, d, generator=gen)
    o = torch.randn(30, h * d, generator=gen)
    pos = torch.arange(30) * 7
    before = init._split(q_proj(x), h)
    ref_o = o_proj(torch.cat([o[:, :d], o[:, d:2 * d] @ a.float().T, o[:, 2 * d:]], 1))
    init.fold_query_map(q_proj, 1, m)
    init.fold_value_map(o_proj, 1, a)
    after = init._split(q_proj(x), h)
    # Head 1's logits against keys k equal the old query's against mapped keys M k; heads 0 and 2 unchanged.
    lhs = (rope(after, pos)[:, :, 1:2] * rope(k, pos[:1].expand(30))).sum(-1)
    rhs = (rope(before, pos)[:, :, 1:2] * rope(k @ m.float().T, pos[:1].expand(30))).sum(-1)
    torch.testing.assert_close(lhs, rhs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after[:, :, [0, 2]], before[:, :, [0, 2]])
    torch.testing.assert_close(o_proj(o), ref_o, atol=1e-4, rtol=1e-4)


def test_head_assignment_is_optimal_under_capacity():
    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED)
    cost = torch.rand(6, 3, generator=gen, dtype=torch.float64)
    got = init.head_assignment(cost, 2)
    assert sorted(got) == [0, 0, 1, 1, 2, 2]
    import itertools
    best = min(set(itertools.permutations([0, 0, 1, 1, 2, 2])), key=lambda p: float(cost[range(6), list(p)].sum()))
    assert float(cost[range(6), got].sum()) == pytest.approx(float(cost[range(6), list(best)].sum()))
    order = init.slots_for(got, 2)
    assert [got[h] for h in order] == [0, 0, 1, 1, 2, 2]


def test_hysparse_kv_maps_and_head_moves_are_exact_folds(checkpoints):
    """With KV sharing off the global branch reads the layer's own K/V, where the maps, their inverses in
    the SWA projections and the head permutation cancel: the initialised student computes the converted one."""
    teacher, student = _load(checkpoints["teacher"]), _load(checkpoints["hysparse"])
    converted = _load(checkpoints["hysparse"])
    report, _ = init.initialise(teacher, student, _windows(2, teacher.config.vocab_size, SEED),
                             steps=("kv_maps",))
    assert all(e["kept"] for e in report["kv_maps"]), report
    # Something moved: the fit is not the identity.
    changed = [float((student.model.layers[e["layer"]].self_attn.q_proj.weight
                      - converted.model.layers[e["layer"]].self_attn.q_proj.weight).abs().max())
               for e in report["kv_maps"]]
    assert min(changed) > 1e-3, changed
    ids = _windows(1, teacher.config.vocab_size, SEED + 1)[0]
    for model in (student, converted):
        model.set_switches(kv_sharing=False)
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, converted(ids).logits, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
def test_initialisation_is_no_worse_than_copying_on_heldout_tokens(checkpoints, arch, tmp_path):
    teacher, converted = _load(checkpoints["teacher"]), _load(checkpoints[arch])
    vocab = teacher.config.vocab_size
    heldout = HeldOut.build(teacher, _windows(3, vocab, SEED + 7))
    before = heldout.evaluate(converted)
    text = tmp_path / "calib.txt"
    # Calibration through the CLI, on text the held-out windows never see.
    gen = torch.Generator().manual_seed(SEED)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(checkpoints[arch])
    text.write_text(tok.decode(torch.randint(0, vocab, (1200,), generator=gen).tolist()))
    assert cli.main(["init", "--teacher", str(checkpoints["teacher"]), "--student", str(checkpoints[arch]),
                     "--out", str(tmp_path / "init"), "--calibrate", str(text), "--tokens", "768",
                     "--seq-len", "96"]) == 0
    initialised = _load(tmp_path / "init")
    after = heldout.evaluate(initialised)
    if arch == "hysparse2":
        # The bridged K/V themselves, on the held-out windows: closer to the teacher layer's own than copying.
        from vllm_hysparse.recovery.local import teacher_activations
        for c, src in converted.config.bridge_source.items():
            errors = {}
            for name, model in (("copied", converted), ("fitted", initialised)):
                err = tot = 0.0
                for w in heldout.windows:
                    hidden = teacher_activations(teacher, w, []).hidden
                    with torch.no_grad():
                        k_t, v_t = init.teacher_kv(teacher, c, hidden[c], qk_normed=False)
                        attn = model.model.layers[c].self_attn
                        x = attn.bridge_norm(hidden[src])
                        k_s, v_s = attn.k_proj(x), attn.v_proj(x)
                    err += float((k_s - k_t.flatten(2)).pow(2).sum() + (v_s - v_t.flatten(2)).pow(2).sum())
                    tot += float(k_t.pow(2).sum() + v_t.pow(2).sum())
                errors[name] = err / tot
            print(f"bridge {src} -> {c}: held-out K/V relative error {errors['copied']:.4f} -> {errors['fitted']:.4f}")
            assert errors["fitted"] < errors["copied"]
    print(f"{arch}: held-out KL {before['heldout_kl']:.4f} -> {after['heldout_kl']:.4f}, "
          f"top-1 {before['heldout_top1']:.3f} -> {after['heldout_top1']:.3f}")
    assert after["heldout_kl"] < before["heldout_kl"]


def test_convert_calibrate_writes_the_initialised_checkpoint(checkpoints, tmp_path):
    """`convert --calibrate` equals `convert` then `recovery init` on the same text, and leaves a loadable checkpoint."""
    from safetensors.torch import load_file

    from vllm_hysparse.tools import convert

    vocab = _load(checkpoints["teacher"]).config.vocab_size
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(checkpoints["teacher"])
    gen = torch.Generator().manual_seed(SEED)
    text = tmp_path / "calib.txt"
    text.write_text(tok.decode(torch.randint(0, vocab, (900,), generator=gen).tolist()))
    plan = ["--full-layers", "0,3", "--block-size", "8", "--topk-blocks", "3", "--swa-window", "16"]
    assert convert.main(["--src", str(checkpoints["teacher"]), "--dst", str(tmp_path / "cal"), "--arch", "hysparse",
                         *plan, "--calibrate", str(text), "--calibrate-tokens", "384"]) == 0
    assert cli.main(["init", "--teacher", str(checkpoints["teacher"]), "--student", str(checkpoints["hysparse"]),
                     "--out", str(tmp_path / "init"), "--calibrate", str(text), "--tokens", "384",
                     "--seq-len", "384"]) == 0
    got, want = load_file(tmp_path / "cal" / "model.safetensors"), load_file(tmp_path / "init" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)
    converted = load_file(checkpoints["hysparse"] / "model.safetensors")
    moved = [n for n in want if not torch.equal(want[n], converted[n])]
    assert any("q_proj" in n for n in moved) and any("swa_v_proj" in n for n in moved), moved
    report = json.loads((tmp_path / "cal" / "init.json").read_text())
    # Gates move exactly where the report says they were kept.
    for entry in report["gates"]:
        name = f"model.layers.{entry['layer']}.self_attn.swa_gate_proj.weight"
        assert (name in moved) == entry["kept"], entry
    # A missing calibration file is one line and exit code 2, nothing written.
    assert convert.main(["--src", str(checkpoints["teacher"]), "--dst", str(tmp_path / "none"), "--arch", "hysparse",
                         "--calibrate", str(tmp_path / "missing.txt")]) == 2
    assert not (tmp_path / "none").exists()
