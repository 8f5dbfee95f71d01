# SPDX-License-Identifier: Apache-2.0
"""What recovery trains, and the delta: attach, merge, save, apply, refuse a wrong base."""

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from vllm_hysparse.recovery import __main__ as cli
from vllm_hysparse.recovery import init
from vllm_hysparse.recovery.lora import (
    GATES,
    LoRALinear,
    apply_delta,
    attach_lora,
    base_digest,
    converted_linears,
    converted_mlps,
    delta_state,
    resume_from_delta,
)
from vllm_hysparse.reference.modeling_hysparse import HySparseFullAttention
from vllm_hysparse.reference.modeling_hysparse2 import SelfFullAttention

RANK, ALPHA = 4, 8.0


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _digest(path):
    """The base digest of the converted checkpoint at `path`, from a fresh copy of it."""
    base = _load(path)
    return base_digest(base, converted_linears(base))


def _randomise_trainable(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
def test_attach_starts_as_the_converted_model_and_trains_only_converted_layers(checkpoints, arch):
    model = _load(checkpoints[arch])
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
    params = attach_lora(model, RANK, ALPHA)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, before, atol=0, rtol=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {id(p) for p in params} == {id(p) for p in model.parameters() if p.requires_grad}
    for i, layer in enumerate(model.model.layers):
        attn, prefix = layer.self_attn, f"model.layers.{i}."
        mine = {n for n in trainable if n.startswith(prefix)}
        if isinstance(attn, (HySparseFullAttention, SelfFullAttention)):
            assert not mine, f"layer {i} is the teacher's own layer and must stay frozen"
            continue
        linears = [n for n, c in attn.named_children() if isinstance(c, LoRALinear)]
        assert linears and all(not isinstance(c, torch.nn.Linear) for _, c in attn.named_children())
        expected = {f"{prefix}self_attn.{n}.lora_{ab}" for n in linears for ab in "AB"}
        expected |= {f"{prefix}self_attn.{n}" for n, _ in attn.named_parameters()
                     if n.endswith(("sinks", "bridge_norm.weight"))}
        assert mine == expected
    assert not any("mlp" in n or "embed" in n or "layernorm" in n for n in trainable)


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
def test_delta_rebuilds_the_trained_model(checkpoints, arch, tmp_path):
    """apply(base, delta) has base + (alpha / r) B @ A in every wrapped weight, computed here by hand."""
    trained = _load(checkpoints[arch])
    attach_lora(trained, RANK, ALPHA)
    _randomise_trainable(trained, int(torch.randint(1 << 30, ())))
    tensors, meta = delta_state(trained, _digest(checkpoints[arch]))
    base_sd = _load(checkpoints[arch]).state_dict()
    rebuilt = _load(checkpoints[arch])
    apply_delta(rebuilt, tensors, meta)
    checked = 0
    for name, value in rebuilt.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if f"{module}.lora_A" in tensors and name.endswith(".weight"):
            a, b = tensors[f"{module}.lora_A"], tensors[f"{module}.lora_B"]
            torch.testing.assert_close(value, base_sd[name] + ALPHA / RANK * b @ a)
            checked += 1
        elif name in tensors:
            torch.testing.assert_close(value, tensors[name])
        else:
            torch.testing.assert_close(value, base_sd[name], atol=0, rtol=0)
    assert checked == sum(k.endswith("lora_A") for k in tensors) > 0
    ids = torch.randint(0, trained.config.vocab_size, (1, 80))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids, use_cache=False).logits, trained(ids, use_cache=False).logits,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
def test_mlp_lora_adapts_the_converted_layers_mlps_and_the_delta_rebuilds_them(checkpoints, arch):
    """`mlp=True`: the MLPs after the converted attention layers get LoRA too, and no other MLP; the model starts
    as the converted one; apply(base, delta) adds B @ A to exactly those weights; the base digest (attention only)
    is the converted checkpoint's, so a delta that had no MLP factors can go on with them (they start at zero)."""
    trained = _load(checkpoints[arch])
    ids = torch.randint(0, trained.config.vocab_size, (1, 80))
    with torch.no_grad():
        before = trained(ids, use_cache=False).logits
    attach_lora(trained, RANK, ALPHA, mlp=True)
    with torch.no_grad():
        torch.testing.assert_close(trained(ids, use_cache=False).logits, before, atol=0, rtol=0)
    mlps = converted_mlps(trained)
    assert mlps and len(mlps) < trained.config.num_hidden_layers
    wrapped = {f"model.layers.{i}.mlp" for i, layer in enumerate(trained.model.layers)
               if any(isinstance(c, LoRALinear) for c in layer.mlp.children())}
    assert wrapped == set(mlps)
    _randomise_trainable(trained, int(torch.randint(1 << 30, ())))
    tensors, meta = delta_state(trained, _digest(checkpoints[arch]))
    assert sum(k.startswith(tuple(mlps)) and k.endswith("lora_A") for k in tensors) == 3 * len(mlps)
    base_sd = _load(checkpoints[arch]).state_dict()
    rebuilt = _load(checkpoints[arch])
    apply_delta(rebuilt, tensors, meta)
    for path in mlps:
        for name in ("gate_proj", "up_proj", "down_proj"):
            a, b = tensors[f"{path}.{name}.lora_A"], tensors[f"{path}.{name}.lora_B"]
            torch.testing.assert_close(rebuilt.state_dict()[f"{path}.{name}.weight"],
                                       base_sd[f"{path}.{name}.weight"] + ALPHA / RANK * b @ a)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids, use_cache=False).logits, trained(ids, use_cache=False).logits,
                                   atol=1e-4, rtol=1e-4)
    # An attention-only delta resumed with mlp=True: its factors loaded, the MLP's at zero (same model).
    plain = _load(checkpoints[arch])
    attach_lora(plain, RANK, ALPHA)
    _randomise_trainable(plain, 7)
    tensors, meta = delta_state(plain, _digest(checkpoints[arch]))
    resumed = _load(checkpoints[arch])
    resume_from_delta(resumed, tensors, meta, mlp=True)
    assert set(converted_mlps(resumed)) == set(mlps)
    with torch.no_grad():
        torch.testing.assert_close(resumed(ids, use_cache=False).logits, plain(ids, use_cache=False).logits,
                                   atol=1e-5, rtol=1e-5)


def _write_delta(model, path, digest):
    tensors, meta = delta_state(model, digest)
    path.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / cli.DELTA_FILE), metadata=meta)
    return tensors, meta


@pytest.fixture
def hysparse_delta(checkpoints, tmp_path):
    model = _load(checkpoints["hysparse"])
    attach_lora(model, RANK, ALPHA)
    _randomise_trainable(model, 3)
    return _write_delta(model, tmp_path / "delta", _digest(checkpoints["hysparse"]))


def _run_apply(capsys, *argv):
    capsys.readouterr()  # drop what building the inputs printed (loading bars before main() turns them off)
    rc = cli.main(["apply", *map(str, argv)])
    return rc, capsys.readouterr().err


def test_apply_cli_writes_a_loadable_checkpoint(checkpoints, hysparse_delta, tmp_path, capsys):
    rc, err = _run_apply(capsys, "--base", checkpoints["hysparse"], "--delta", tmp_path / "delta",
                         "--out", tmp_path / "out")
    assert rc == 0, err
    model = _load(tmp_path / "out")
    name = next(k for k in hysparse_delta[0] if k.endswith("sinks"))
    torch.testing.assert_close(dict(model.named_parameters())[name], hysparse_delta[0][name])


def _perturbed_base(src, dst):
    model = _load(src)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] += 1e-3
    model.save_pretrained(dst)
    return dst


@pytest.mark.parametrize("case", ["other base", "other arch", "no delta", "truncated", "bad shape", "unknown name"])
def test_apply_refuses_bad_input_with_one_line_and_writes_nothing(checkpoints, hysparse_delta, tmp_path, capsys,
                                                                  case):
    tensors, meta = hysparse_delta
    base, delta = checkpoints["hysparse"], tmp_path / "delta"
    if case == "other base":
        base = _perturbed_base(base, tmp_path / "perturbed")
    elif case == "other arch":
        base = checkpoints["hysparse2"]
    elif case == "no delta":
        delta = tmp_path / "absent"
    elif case == "truncated":
        data = (delta / cli.DELTA_FILE).read_bytes()
        (delta / cli.DELTA_FILE).write_bytes(data[: len(data) // 2])
    else:
        bad = dict(tensors)
        key = next(k for k in bad if k.endswith("lora_A"))
        if case == "bad shape":
            bad[key] = bad[key][:, :-1].contiguous()
        else:
            bad[key.replace("layers.1", "layers.0")] = bad.pop(key)
            bad[key.replace("layers.1", "layers.0").replace("lora_A", "lora_B")] = bad.pop(
                key.replace("lora_A", "lora_B"))
        save_file(bad, str(delta / cli.DELTA_FILE), metadata=meta)
    rc, err = _run_apply(capsys, "--base", base, "--delta", delta, "--out", tmp_path / "out")
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
def test_full_rank_trains_the_guessed_projections_whole_and_the_delta_rebuilds_them(checkpoints, arch):
    """`full_rank`: the projections of FULL_RANK_LINEARS stay plain linears, trained and stored whole; the rest
    is LoRA as before; apply(base, delta) reproduces the trained model."""
    from vllm_hysparse.recovery.lora import FULL_RANK_LINEARS

    trained = _load(checkpoints[arch])
    ids = torch.randint(0, trained.config.vocab_size, (1, 80))
    with torch.no_grad():
        before = trained(ids, use_cache=False).logits
    params = attach_lora(trained, RANK, ALPHA, full_rank=True)
    with torch.no_grad():
        torch.testing.assert_close(trained(ids, use_cache=False).logits, before, atol=0, rtol=0)
    # Gates only when headwise: an elementwise gate (this conversion's) is as large as q_proj and gets LoRA.
    whole = {f"model.layers.{i}.self_attn.{n}.weight" for i, layer in enumerate(trained.model.layers)
             for n in FULL_RANK_LINEARS.get(type(layer.self_attn), ())
             if n not in GATES or getattr(layer.self_attn, n).weight.shape[0] == trained.config.num_attention_heads}
    assert whole, "this converted model has no projection to train whole"
    named = dict(trained.named_parameters())
    assert {id(named[n]) for n in whole} <= {id(p) for p in params}
    for name in whole:  # not wrapped
        module = trained.get_submodule(name.rsplit(".", 1)[0])
        assert type(module) is torch.nn.Linear and module.weight.requires_grad, name
    _randomise_trainable(trained, 5)
    tensors, meta = delta_state(trained, _digest(checkpoints[arch]))
    assert whole <= set(tensors)
    rebuilt = _load(checkpoints[arch])
    apply_delta(rebuilt, tensors, meta)
    for name in whole:
        torch.testing.assert_close(dict(rebuilt.named_parameters())[name], named[name], atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids, use_cache=False).logits, trained(ids, use_cache=False).logits,
                                   atol=1e-4, rtol=1e-4)


def _calibration(vocab, seed, n=2, t=96):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, t), generator=gen) for _ in range(n)]


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
def test_delta_carries_stage0_and_applies_to_the_converted_checkpoint(checkpoints, arch, fixed_seed):
    """Training from stage 0: the delta holds its record, and apply(converted, delta) rebuilds the trained model,
    init included; the record alone rebuilds the initialised model, with every fitted tensor moved."""
    print(f"seed {fixed_seed}")
    teacher, trained = _load(checkpoints["teacher"]), _load(checkpoints[arch])
    converted_sd = {k: v.clone() for k, v in trained.state_dict().items()}
    digest = base_digest(trained, converted_linears(trained))
    _, record = init.initialise(teacher, trained, _calibration(teacher.config.vocab_size, fixed_seed))
    assert record and all(k.startswith(init.INIT_PREFIX) for k in record)
    initialised_sd = {k: v.clone() for k, v in trained.state_dict().items()}
    # The record alone, on a fresh copy of the converted checkpoint, gives the initialised model exactly.
    fresh = _load(checkpoints[arch])
    init.apply_init(fresh, record)
    moved = [k for k, v in fresh.state_dict().items() if not torch.equal(v, converted_sd[k])]
    assert moved, "stage 0 changed nothing"
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, initialised_sd[k], atol=0, rtol=0, msg=k)
    attach_lora(trained, RANK, ALPHA, full_rank=True)
    _randomise_trainable(trained, fixed_seed)
    tensors, meta = delta_state(trained, digest, record)
    rebuilt = _load(checkpoints[arch])
    apply_delta(rebuilt, tensors, meta)
    ids = torch.randint(0, trained.config.vocab_size, (1, 80))
    with torch.no_grad():
        got, want = rebuilt(ids, use_cache=False).logits, trained(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    print(f"{arch}: stage 0 moved {len(moved)} tensors; rebuilt logits max |diff| {float((got - want).abs().max()):.2e}")
    # The same delta on the initialised checkpoint (not its base) is refused: the digest is the converted one's.
    other = _load(checkpoints[arch])
    other.load_state_dict(initialised_sd)
    with pytest.raises(ValueError, match="different base checkpoint"):
        apply_delta(other, tensors, meta)


def test_a_stage0_record_that_does_not_fit_is_refused_with_one_line(checkpoints):
    model = _load(checkpoints["hysparse"])
    layer = model.config.num_hidden_layers
    with pytest.raises(ValueError, match=f"model.layers.{layer}.self_attn, which the model does not have"):
        init.apply_init(model, {init.init_key(layer, "q_maps"): torch.zeros(1, 2, 2)})
    sparse = next(iter(model.config.oracle_layer))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    h, hidden = model.config.num_attention_heads, model.config.hidden_size
    good = {init.init_key(sparse, "sparse_gate_proj.headwise"): torch.ones(h, hidden)}
    with pytest.raises(ValueError, match=r"swa_gate_proj.headwise is \(3, 5\), the layer needs"):
        init.apply_init(model, {**good, init.init_key(sparse, "swa_gate_proj.headwise"): torch.zeros(3, 5)})
    with pytest.raises(ValueError, match="head_order .* is not a permutation"):
        init.apply_init(model, {init.init_key(sparse, "q_maps"): torch.zeros(h, *[model.config.head_dim] * 2),
                                init.init_key(sparse, "o_maps"): torch.zeros(h, *[model.config.head_dim] * 2),
                                init.init_key(sparse, "head_order"): torch.zeros(h, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"has \['q_maps'\] without \['head_order', 'o_maps'\]"):
        init.apply_init(model, {init.init_key(sparse, "q_maps"): torch.zeros(h, *[model.config.head_dim] * 2)})
    # the record is checked whole before anything moves: the fitting gate above was not applied
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="not a stage-0 initialisation tensor"):
        init.apply_init(model, {init.init_key(sparse, "mlp.weight"): torch.zeros(1)})


def test_a_stage0_record_replays_as_written_by_hand(checkpoints, fixed_seed):
    """apply_init against the record's meaning, computed here head by head: new head i is old head order[i]
    with its q rows times q_maps[order[i]] and o columns times o_maps[order[i]]; new SWA group j is old group
    kv_order[j] times its maps; sinks follow their heads; headwise gates are repeated over Dv."""
    print(f"seed {fixed_seed}")
    gen = torch.Generator().manual_seed(fixed_seed)
    model = _load(checkpoints["hysparse"])
    cfg = model.config
    layer = next(iter(cfg.oracle_layer))
    attn = model.model.layers[layer].self_attn
    h, g, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dv = attn.o_proj.in_features // h
    old = {n: p.detach().clone() for n, p in attn.named_parameters()}
    rec = {"q_maps": torch.randn(h, d, d, generator=gen), "o_maps": torch.randn(h, dv, dv, generator=gen),
           "swa_k_maps": torch.randn(g, d, d, generator=gen), "swa_v_maps": torch.randn(g, dv, dv, generator=gen),
           "head_order": torch.randperm(h, generator=gen), "kv_order": torch.randperm(g, generator=gen),
           "sparse_gate_proj.headwise": torch.randn(h, cfg.hidden_size, generator=gen)}
    init.apply_init(model, {init.init_key(layer, k): v for k, v in rec.items()})
    new = dict(attn.named_parameters())
    order, kv_order = rec["head_order"].tolist(), rec["kv_order"].tolist()
    for i, src in enumerate(order):
        torch.testing.assert_close(new["q_proj.weight"][i * d:(i + 1) * d],
                                   rec["q_maps"][src] @ old["q_proj.weight"][src * d:(src + 1) * d])
        torch.testing.assert_close(new["o_proj.weight"][:, i * dv:(i + 1) * dv],
                                   old["o_proj.weight"][:, src * dv:(src + 1) * dv] @ rec["o_maps"][src])
        for sinks in ("sparse_sinks", "swa_sinks"):
            if sinks in old:
                assert new[sinks][i] == old[sinks][src]
    for j, src in enumerate(kv_order):
        for name, dd in (("swa_k", d), ("swa_v", dv)):
            torch.testing.assert_close(new[f"{name}_proj.weight"][j * dd:(j + 1) * dd],
                                       rec[f"{name}_maps"][src] @ old[f"{name}_proj.weight"][src * dd:(src + 1) * dd])
    rows = new["sparse_gate_proj.weight"].shape[0] // h
    for i in range(h):
        assert torch.equal(new["sparse_gate_proj.weight"][i * rows:(i + 1) * rows],
                           rec["sparse_gate_proj.headwise"][i].expand(rows, -1))
    # the SWA gate was not in the record: only moved with its heads
    torch.testing.assert_close(new["swa_gate_proj.weight"].view(h, rows, -1),
                               old["swa_gate_proj.weight"].view(h, rows, -1)[order], atol=0, rtol=0)
