# SPDX-License-Identifier: Apache-2.0
"""A conversion plan measured on data (`recovery.plan`): the full-layer search is exact, coverage and recall
match a direct computation, a layer made an exact copy of another is found, and the converter reads the plan."""

import itertools
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_hysparse.recovery import plan
from vllm_hysparse.recovery.init import Calibration
from vllm_hysparse.reference import ops
from vllm_hysparse.reference.layers import RotaryEmbedding
from vllm_hysparse.tools import convert

SEED = 4321
# Small enough for the 96-token windows of the fixtures: blocks of 8, top-3, windows 8..32.
SMALL = ["--tokens", "192", "--seq-len", "96", "--windows", "8,16,32", "--min-window", "8"]
HYSPARSE_SMALL = ["--block-size", "8", "--topk-blocks", "3"]


def _load(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _windows(n, vocab, seed, t=96):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, t), generator=gen) for _ in range(n)]


def _brute_cost(cost, full):
    """Each sparse layer pays for the nearest full layer before it, written out."""
    return sum(float(cost[max(f for f in full if f < l), l]) for l in range(cost.shape[0]) if l not in full)


@pytest.mark.parametrize("n,count,required", [(9, 3, [0, 8]), (9, 4, [0]), (7, 2, [0, 6]), (10, 5, [0, 4, 9])])
def test_full_layer_search_is_optimal_against_brute_force(n, count, required):
    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED + n + count)
    cost = torch.rand(n, n, generator=gen, dtype=torch.float64)
    got, total = plan.best_full_layers(cost, count, required)
    assert len(got) == count and set(required) <= set(got), got
    assert total == pytest.approx(_brute_cost(cost, got))
    sets = [[0, *rest] for rest in itertools.combinations(range(1, n), count - 1) if set(required) <= {0, *rest}]
    best = min(sets, key=lambda f: _brute_cost(cost, f))
    assert total == pytest.approx(_brute_cost(cost, best), abs=1e-12)
    assert got == best  # ties have probability 0 on random costs
    assert plan.plan_cost(cost, got) == pytest.approx(total)


def test_coverage_and_recall_match_a_direct_computation():
    """On random q/k: dense attention over one-hot values gives each key's probability; sum it over the
    blocks another layer's oracle selects, row by row."""
    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED)
    t, h, g, d, b, k = 40, 4, 2, 8, 8, 2
    q_f, q_l = (3 * torch.randn(1, t, h, d, generator=gen) for _ in range(2))
    k_f, k_l = (torch.randn(1, t, g, d, generator=gen) for _ in range(2))
    scale = d**-0.5
    nb = -(-t // b)
    ids_f, ids_l = (ops.oracle_block_topk(q, kk, scale, b, k)[0] for q, kk in ((q_f, k_f), (q_l, k_l)))
    p = ops.sink_softmax(ops.attention_logits(q_l, k_l, scale), None)
    got_cov, rows = plan.coverage(plan.block_mass(p, b)[0], ops.ids_to_mask(ids_f, nb))
    got_rec, groups = plan.recall(ops.ids_to_mask(ids_f, nb), ops.ids_to_mask(ids_l, nb))
    v = torch.eye(t).view(1, t, 1, t).expand(1, t, g, t)
    probs = ops.dense_attention(q_l, k_l, v, scale)[0]  # [T, H, T]: row t, head h -> probability of each key
    cov = rec = 0.0
    for row in range(t):
        for head in range(h):
            chosen = set(ids_f[row, head // (h // g)].tolist()) - {-1}
            cov += sum(float(probs[row, head, j]) for j in range(row + 1) if j // b in chosen)
        for group in range(g):
            used, own = set(ids_f[row, group].tolist()) - {-1}, set(ids_l[row, group].tolist()) - {-1}
            rec += len(used & own) / len(own)
    assert rows == t * h and groups == t * g
    assert got_cov / rows == pytest.approx(cov / (t * h), abs=1e-6)
    assert got_rec / groups == pytest.approx(rec / (t * g), abs=1e-9)
    assert got_rec / groups < 1  # the two selections differ: the check can fail


def test_window_is_the_smallest_reaching_the_median_mass():
    """Hand-made masses: alone, the median reaches 0.9 at 512; with the first token counted, at 128; never below
    --min-window, which is also the choice when nothing reaches."""
    print(f"seed {SEED}")
    stats = plan.AttentionStats()
    masses = {1: (0.5, 0.80, 0.86, 0.95), 2: (0.4, 0.82, 0.88, 0.91), 3: (0.1, 0.2, 0.3, 0.4), 4: (0.99,) * 4}
    stats.window_mass = {layer: dict(zip(plan.WINDOWS, m)) for layer, m in masses.items()}
    stats.first_mass = {1: 0.1, 2: 0.09, 3: 0.0, 4: 0.0}
    layers = [1, 2, 3]
    for count_first, want in ((False, 512), (True, 128)):
        summary = plan.window_summary(stats, layers, plan.Settings(count_first_token=count_first), "test")
        assert summary["chosen"] == want and summary["threshold_reached"], summary
        assert (summary["chosen_counting_window_alone"], summary["chosen_counting_first_token"]) == (512, 128)
    low = plan.Settings(count_first_token=True, min_window=64)
    assert plan.window_summary(stats, layers, low, "t")["chosen"] == 128
    assert plan.window_summary(stats, [4], low, "t")["chosen"] == 64
    assert plan.window_summary(stats, [4], plan.Settings(), "t")["chosen"] == 128  # never below the default
    summary = plan.window_summary(stats, [3], plan.Settings(), "t")
    assert (summary["chosen"], summary["threshold_reached"]) == (128, False)
    with pytest.raises(ValueError, match="--min-window 1024"):
        plan.window_summary(stats, layers, plan.Settings(min_window=1024), "t")


def test_teacher_statistics_match_the_teachers_own_attention(checkpoints):
    """Coverage, recall and window mass from the plan's q/k path equal those from the teacher's eager attention
    probabilities (independent of our RoPE and projections); the oracle there is Eq. 3 on probabilities:
    exp(u - lse) is the block's largest probability."""
    print(f"seed {SEED}")
    teacher = _load(checkpoints["teacher"])
    eager = _load(checkpoints["teacher"], attn_implementation="eager")
    config = convert.plan_conversion(checkpoints["teacher"], "hysparse").config
    rope = RotaryEmbedding(config.head_dim, config.rope_parameters, config)
    windows = _windows(1, teacher.config.vocab_size, SEED)
    b, k, wins = 8, 3, (8, 16)
    calib = Calibration.collect(teacher, windows)
    n = teacher.config.num_hidden_layers
    stats = plan.attention_statistics(teacher, calib, rope, list(range(n)), windows=wins, block_size=b, topk_blocks=k)
    cov, rec = plan.selection_matrices(stats, n)
    with torch.no_grad():
        probs = [a[0] for a in eager(windows[0], output_attentions=True).attentions]  # [H, T, T] each
    h, t = probs[0].shape[:2]
    g, nb = teacher.config.num_key_value_heads, -(-t // b)
    vis = ops.visible_blocks(t, t, b)
    sel = []
    for p in probs:
        block_max = torch.nn.functional.pad(p, (0, nb * b - t)).view(h, t, nb, b).amax(-1)
        r = block_max.view(g, h // g, t, nb).amax(1)  # [G, T, NB]
        sel.append(ops.ids_to_mask(ops.select_topk(r, vis[None], k), nb).transpose(0, 1))  # [T, G, NB]
    for l in range(n):
        keys_in = torch.arange(t) // b
        for f in range(l + 1):
            on = sel[f].repeat_interleave(h // g, 1).permute(1, 0, 2)[..., keys_in]  # [H, T, T]
            assert float(cov[f, l]) == pytest.approx(float((probs[l] * on).sum()) / (h * t), abs=2e-5), (f, l)
            want = ((sel[f] & sel[l]).sum(-1) / sel[l].sum(-1)).mean()
            assert float(rec[f, l]) == pytest.approx(float(want), abs=1e-6), (f, l)
        rows = probs[l][:, max(wins):]  # every window full and without the first token
        for w in wins:
            inside = ops.window_mask(t, t, w)[max(wins):]
            assert stats.window_mass[l][w] == pytest.approx(float((rows * inside).sum()) / rows[..., 0].numel(),
                                                            abs=2e-5)
        assert stats.first_mass[l] == pytest.approx(float(rows[..., 0].mean()), abs=2e-6)
    assert float(rec[0, n - 1]) < 1


# --------------------------------------------------------------------------- constructed teachers


def _edited_teacher(src, dst, zero: list[int], copies: dict[int, int]):
    """A copy of the teacher whose layers `zero` add nothing to the residual stream (o_proj, down_proj = 0) and
    whose layer `dst_layer` has layer `copies[dst_layer]`'s input norm and q/k/v: with the layers between zeroed,
    its q/k/v are then exactly the source layer's."""
    shutil.copytree(src, dst)
    model = _load(src)
    layers = model.model.layers
    with torch.no_grad():
        for i in zero:
            layers[i].self_attn.o_proj.weight.zero_()
            layers[i].mlp.down_proj.weight.zero_()
        for to, frm in copies.items():
            layers[to].input_layernorm.load_state_dict(layers[frm].input_layernorm.state_dict())
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(layers[to].self_attn, name).load_state_dict(getattr(layers[frm].self_attn, name).state_dict())
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def planned(checkpoints, tmp_path_factory):
    """{arch: (teacher dir, plan file)}: plans measured through the CLI on teachers built so that one choice is
    exact. HySparse: layers 2 and 3 add nothing and layers 3, 4 get layer 2's q/k/v, so full layer 2 predicts
    both exactly. HySparse2 (self-decoder 0..2, cross full layer 3): layer 2 adds nothing, so the stream entering
    layer 3 is the one entering layer 2, which predicts layer 3's K/V exactly."""
    root = tmp_path_factory.mktemp("plan")
    tok = AutoTokenizer.from_pretrained(checkpoints["teacher"])
    gen = torch.Generator().manual_seed(SEED)
    text = root / "calib.txt"
    text.write_text(tok.decode(torch.randint(0, len(tok), (1200,), generator=gen).tolist()))
    built = {"hysparse": ([2, 3], {3: 2, 4: 2}), "hysparse2": ([2], {})}
    out = {}
    for arch, (zero, copies) in built.items():
        teacher = _edited_teacher(checkpoints["teacher"], root / f"teacher-{arch}", zero, copies)
        extra = HYSPARSE_SMALL if arch == "hysparse" else []
        assert plan.main(["--teacher", str(teacher), "--arch", arch, "--out", str(root / f"{arch}.json"),
                          "--calibrate", str(text), *SMALL, *extra]) == 0
        out[arch] = (teacher, root / f"{arch}.json")
    return out


def test_hysparse_plan_picks_the_layer_that_predicts_its_followers(planned):
    print(f"seed {SEED}")
    report = json.loads(planned["hysparse"][1].read_text())
    pairs, opts = report["pairs"], report["options"]
    for l in (3, 4):
        assert pairs["recall"][2][l] == 1.0
        assert pairs["coverage"][2][l] == pytest.approx(pairs["coverage"][l][l], abs=1e-6)
        assert pairs["k_error"][2][l] < 1e-4 and pairs["v_error"][2][l] < 1e-4
    # Not so from an unrelated layer.
    assert pairs["k_error"][0][3] > 0.05 and pairs["recall"][0][3] < 1
    assert report["default_options"]["full_layers"] == [0, 4, 5]
    assert opts["full_layers"] == [0, 2, 5], opts
    obj = report["objective"]
    assert obj["chosen"] < obj["default"]
    assert obj["chosen"] == pytest.approx(sum(r["chosen"]["cost"] for r in report["layers"]
                                              if r["chosen"]["kind"] == "sparse"), abs=1e-4)
    assert opts["block_size"] == 8 and opts["topk_blocks"] == 3
    assert report["command"].startswith("python -m vllm_hysparse.recovery.plan --teacher ")
    # The window: the smallest candidate whose median mass reaches the threshold (or the largest).
    win = report["window"]
    reached = [int(w) for w, m in win["median_mass"].items() if m >= win["threshold"]]
    assert opts["swa_window"] == win["chosen"] == (min(reached) if reached else 8)
    reached = [int(w) for w, m in win["median_mass_with_first_token"].items() if m >= win["threshold"]]
    assert win["chosen_counting_first_token"] == (min(reached) if reached else 8)
    for w, m in win["median_mass"].items():
        assert m < win["median_mass_with_first_token"][w]
    trade = {(r["window"], r["context"]): r["ratio_to_dense"] for r in win["kv_bytes"]}
    assert trade[8, 2048] < trade[32, 2048] < 1  # a wider window costs KV memory


def test_hysparse2_plan_bridges_from_the_layer_whose_stream_is_the_cross_layers(planned):
    print(f"seed {SEED}")
    report = json.loads(planned["hysparse2"][1].read_text())
    opts, default = report["options"], report["default_options"]
    assert default["bridge_sources"] == [1] and default["self_full_layers"] == [1]
    assert opts["bridge_sources"] == [2] and opts["self_full_layers"] == [2], opts
    by_source = {b["source"]: b for b in report["bridges"]}
    assert by_source[2]["k_error"]["3"] < 1e-3 and by_source[2]["v_error"]["3"] < 1e-3
    assert min(by_source[s]["cost"] for s in (0, 1)) > 0.01
    assert report["objective"]["chosen"] < report["objective"]["default"]


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
def test_convert_plan_writes_the_chosen_layers_and_command_line_options_win(planned, arch, tmp_path):
    teacher, plan_file = planned[arch]
    opts = json.loads(plan_file.read_text())["options"]
    assert convert.main(["--src", str(teacher), "--dst", str(tmp_path / "a"), "--arch", arch,
                         "--plan", str(plan_file)]) == 0
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    full = [i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention"]
    assert cfg["swa_window"] == opts["swa_window"] != 128
    if arch == "hysparse":
        assert full == opts["full_layers"]
        assert (cfg["sparse_block_size"], cfg["sparse_topk_blocks"]) == (8, 3)
        override, want_full = ["--full-layers", "0,1,5"], [0, 1, 5]
    else:
        assert full == opts["self_full_layers"] + opts["cross_full_layers"]
        assert cfg["bridge_sources"] == opts["bridge_sources"]
        # --self-full-layers drops the plan's bridge sources (they must be self full layers): the default follows.
        override, want_full = ["--self-full-layers", "0"], [0, 3]
    assert convert.main(["--src", str(teacher), "--dst", str(tmp_path / "b"), "--arch", arch,
                         "--plan", str(plan_file), "--swa-window", "24", *override]) == 0
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert [i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention"] == want_full
    assert cfg["swa_window"] == 24
    if arch == "hysparse2":
        assert cfg["bridge_sources"] == [0]
    # Without --plan the fixed pattern stays the default.
    assert convert.main(["--src", str(teacher), "--dst", str(tmp_path / "c"), "--arch", arch]) == 0
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    default = json.loads(plan_file.read_text())["default_options"]
    assert cfg["swa_window"] == 128
    assert [i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention"] == (
        default["full_layers"] if arch == "hysparse" else default["self_full_layers"] + default["cross_full_layers"])


def _one_error_line(capsys, *fragments):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in err[0], err[0]


def test_bad_plans_are_one_line_errors(planned, tmp_path, capsys):
    teacher, plan_file = planned["hysparse"]
    report = json.loads(plan_file.read_text())

    def run(path, arch="hysparse"):
        return convert.main(["--src", str(teacher), "--dst", str(tmp_path / "out"), "--arch", arch,
                             "--plan", str(path)])

    def edited(name, **changes):
        path = tmp_path / name
        path.write_text(json.dumps({**report, **changes}))
        return path

    capsys.readouterr()
    cases = [
        (tmp_path / "missing.json", "hysparse", ("no such file",)),
        (plan_file, "hysparse2", ("plan for --arch hysparse", "not hysparse2")),
        (edited("outside.json", options={**report["options"], "full_layers": [0, 2, 6]}), "hysparse",
         ("full_layers", "[6]", "outside")),
        (edited("depth.json", num_hidden_layers=12), "hysparse", ("12 layers", "--src has 6")),
        (edited("unknown.json", options={**report["options"], "sliding_window": 4}), "hysparse",
         ("unknown option", "sliding_window")),
        (edited("empty.json", options=None), "hysparse", ("no \"options\"",)),
    ]
    for path, arch, fragments in cases:
        assert run(path, arch) == 2, path
        _one_error_line(capsys, *fragments)
        assert not (tmp_path / "out").exists()
    (tmp_path / "garbled.json").write_text("{not json")
    assert run(tmp_path / "garbled.json") == 2
    _one_error_line(capsys, "unreadable")


def test_plan_cli_errors_are_one_line(checkpoints, tmp_path, capsys):
    base = ["--teacher", str(checkpoints["teacher"]), "--out", str(tmp_path / "p.json")]
    capsys.readouterr()
    assert plan.main([*base, "--arch", "hysparse", "--tokens", "50", "--seq-len", "96"]) == 2
    _one_error_line(capsys, "--tokens 50")
    nowhere = ["--teacher", str(tmp_path / "nowhere"), "--arch", "hysparse", "--out", str(tmp_path / "p.json")]
    assert plan.main(nowhere) == 2
    _one_error_line(capsys, "no config.json")
    assert plan.main([*base, "--arch", "hysparse", "--calibrate", str(tmp_path / "missing.txt")]) == 2
    _one_error_line(capsys, "missing.txt")
    assert plan.main([*base, "--arch", "hysparse", "--num-self-layers", "3"]) == 2
    _one_error_line(capsys, "--num-self-layers and --cross-full-layers apply to --arch hysparse2 only")
    assert plan.main([*base, "--arch", "hysparse2", "--cross-full-layers", "1"]) == 2
    _one_error_line(capsys, "cross-full-layers")
    assert plan.main([*base, "--arch", "hysparse2", "--num-self-layers", "99"]) == 2
    _one_error_line(capsys, "--num-self-layers must be in")
    assert not (tmp_path / "p.json").exists()


def test_hysparse2_plan_at_another_split(checkpoints, tmp_path):
    """`--num-self-layers`: the split is given, the bridge source is still measured, among the new self layers."""
    out = tmp_path / "p.json"
    assert plan.main(["--teacher", str(checkpoints["teacher"]), "--arch", "hysparse2", "--out", str(out),
                      "--num-self-layers", "4", *SMALL]) == 0
    report = json.loads(out.read_text())
    opts = report["options"]
    assert opts["num_self_layers"] == 4 and opts["cross_full_layers"] == [4], opts
    assert sorted(b["source"] for b in report["bridges"]) == [0, 1, 2, 3]
    best = min(report["bridges"], key=lambda b: b["cost"])["source"]
    assert opts["bridge_sources"] == [best] and opts["self_full_layers"] == [best]
    assert report["command"].endswith("--min-window 8") and "--num-self-layers 4" in report["command"]
    assert plan.main(["--teacher", str(checkpoints["teacher"]), "--arch", "hysparse2", "--out", str(out),
                      "--num-self-layers", "3", "--cross-full-layers", "3,5", *SMALL]) == 0
    report = json.loads(out.read_text())
    assert report["options"]["cross_full_layers"] == [3, 5] and len(report["options"]["bridge_sources"]) == 2
    assert all(set(b["k_error"]) == {"3", "5"} for b in report["bridges"])
