# SPDX-License-Identifier: Apache-2.0
"""What recovery trains, and the delta it writes: LoRA on converted attention layers, sinks, bridge norms.

Conversion keeps some attention layers exactly as the teacher had them
(HySparse full layers, the HySparse2 self-decoder full layer) and builds the
others from the teacher's tensors: those are the layers recovery adapts.
Each of their linear projections gets a low-rank update `W + s * B @ A`
(`s = alpha / rank`); their sinks and bridge norms are trained in full. MLPs,
norms elsewhere and embeddings stay frozen, so the trained state is small
(a few MB in bf16 for SmolLM2) and is stored as a delta against the converted
checkpoint: `apply_delta` rebuilds the recovered model from it. With `full_rank` the
projections conversion had to guess (`FULL_RANK_LINEARS`) are trained and stored whole.
When training started from a stage-0 initialisation (`recovery.init`), the
delta carries its record too, so that it still applies to the converted
checkpoint: the initialisation is redone from the record, not refitted.
"""

import hashlib
import math

import torch
from torch import nn

from vllm_hysparse.recovery.folds import INIT_PREFIX, Record, apply_init, check_init
from vllm_hysparse.reference.modeling_hysparse import HySparseSparseAttention
from vllm_hysparse.reference.modeling_hysparse2 import CrossFullAttention, CrossSparseAttention, SlidingAttention

# Attention layers that conversion builds (rather than copies) from the teacher.
CONVERTED_ATTENTION = (HySparseSparseAttention, SlidingAttention, CrossFullAttention, CrossSparseAttention)
# Parameters of those layers trained in full: a few hundred numbers per layer.
FULL_PARAMS = ("sinks", "bridge_norm.weight")
# Projections that `attach_lora(full_rank=True)` trains in full instead of through LoRA: the ones conversion
# had to guess (HySparse's SWA-branch K/V and gates; HySparse2's bridged K/V and gates), as SwiftKV trains its
# bridged K/V. SmolLM2-135M: about 0.2M parameters per HySparse sparse layer. A gate is trained whole only
# when it is headwise (H rows): an elementwise gate is as large as q_proj, and gets LoRA like it.
FULL_RANK_LINEARS = {
    HySparseSparseAttention: ("swa_k_proj", "swa_v_proj", "sparse_gate_proj", "swa_gate_proj"),
    SlidingAttention: ("gate_proj",),
    CrossFullAttention: ("k_proj", "v_proj"),
    CrossSparseAttention: ("gate_proj",),
}
GATES = ("sparse_gate_proj", "swa_gate_proj", "gate_proj")
# /2: the digest covers every linear of the converted layers, taken before the optional stage-0 record is
# applied. /1 (digest over the LoRA-wrapped linears, no record) is still read.
DELTA_FORMAT, DELTA_FORMAT_V1 = "hysparse-recovery-delta/2", "hysparse-recovery-delta/1"


class LoRALinear(nn.Module):
    """`base(x) + s * (x @ A.T) @ B.T` with A `[r, in]` (random), B `[out, r]` (zero): starts as `base`."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base, self.scaling = base, alpha / rank
        base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=base.weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t() * self.scaling

    def merged(self) -> nn.Linear:
        with torch.no_grad():
            self.base.weight += self.scaling * (self.lora_B @ self.lora_A)
        return self.base


def converted_attention(model) -> dict[str, nn.Module]:
    """`{module path: attention}` of the layers recovery adapts, in layer order."""
    return {f"model.layers.{i}.self_attn": layer.self_attn for i, layer in enumerate(model.model.layers)
            if isinstance(layer.self_attn, CONVERTED_ATTENTION)}


def converted_mlps(model) -> dict[str, nn.Module]:
    """`{module path: MLP}` of the decoder layers whose attention is converted, in layer order: `attach_lora(mlp=
    True)` adapts their linears too, so the MLP after a lossy attention layer can compensate for it. (An MoE block
    has no linear children of its own and gets nothing.)"""
    return {f"model.layers.{i}.mlp": layer.mlp for i, layer in enumerate(model.model.layers)
            if isinstance(layer.self_attn, CONVERTED_ATTENTION)}


def _adapted(model) -> dict[str, nn.Module]:
    """Every module whose linear children may carry LoRA: converted attention layers, then their MLPs."""
    return {**converted_attention(model), **converted_mlps(model)}


def attach_lora(model, rank: int, alpha: float, full_rank: bool = False, lora_only: bool = False,
                mlp: bool = False) -> list[nn.Parameter]:
    """Freeze `model`, wrap every linear of its converted attention layers; returns the trainable parameters.

    `full_rank`: the projections of `FULL_RANK_LINEARS` are trained in full (weight and bias) instead.
    `lora_only`: the sinks and bridge norms stay frozen too, so the delta is LoRA factors alone (`peft_adapter`).
    `mlp`: the linears of those layers' MLPs get LoRA as well (`converted_mlps`).
    """
    if rank < 1:
        raise ValueError(f"--rank must be >= 1 (got {rank})")
    if lora_only and full_rank:
        raise ValueError("--lora-only and --full-rank: a LoRA-only delta trains no projection whole")
    model.requires_grad_(False)
    trainable = []
    for attn in converted_attention(model).values():
        full = FULL_RANK_LINEARS.get(type(attn), ()) if full_rank else ()
        for name, child in list(attn.named_children()):
            whole = isinstance(child, nn.Linear) and name in full and (
                name not in GATES or child.out_features == attn.config.num_attention_heads)
            if whole:
                child.requires_grad_(True)
                trainable += list(child.parameters())
            elif isinstance(child, nn.Linear):
                lora = LoRALinear(child, rank, alpha)
                setattr(attn, name, lora)
                trainable += [lora.lora_A, lora.lora_B]
        for name, param in attn.named_parameters():
            if name.endswith(FULL_PARAMS) and not lora_only:
                param.requires_grad_(True)
                trainable.append(param)
    for block in converted_mlps(model).values() if mlp else ():
        for name, child in list(block.named_children()):
            if isinstance(child, nn.Linear):
                lora = LoRALinear(child, rank, alpha)
                setattr(block, name, lora)
                trainable += [lora.lora_A, lora.lora_B]
    return trainable


def merge_lora(model) -> None:
    """Fold every LoRA update into its base weight and put the plain linear back (in place)."""
    for module in _adapted(model).values():
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, name, child.merged())


def _lora_modules(model) -> dict[str, LoRALinear]:
    return {f"{path}.{name}": child for path, module in _adapted(model).items()
            for name, child in module.named_children() if isinstance(child, LoRALinear)}


def mlp_linears(model) -> list[str]:
    """Module paths of the linears of `converted_mlps` (wrapped or not): a delta may carry LoRA factors for them,
    and the base digest leaves them out (they are the teacher's, copied)."""
    return [f"{path}.{name}" for path, block in converted_mlps(model).items()
            for name, child in block.named_children() if isinstance(child, (nn.Linear, LoRALinear))]


def converted_linears(model) -> list[str]:
    """Module paths of every linear projection of the converted attention layers (wrapped or not)."""
    return [f"{path}.{name}" for path, attn in converted_attention(model).items()
            for name, child in attn.named_children() if isinstance(child, (nn.Linear, LoRALinear))]


def base_digest(model, names: list[str]) -> str:
    """sha256 of the base weights a delta's LoRA factors apply to (so a delta refuses a different base)."""
    sd, h = model.state_dict(), hashlib.sha256()
    for name in sorted(names):
        w = sd.get(f"{name}.weight", sd.get(f"{name}.base.weight"))
        h.update(name.encode())
        h.update(w.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def delta_state(model, digest: str, init_record: Record | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a model with LoRA attached: factors, full parameters, the stage-0 record it
    started from, rank, and `digest`: `base_digest(converted, converted_linears(converted))` of the base."""
    loras = _lora_modules(model)
    if not loras:
        raise ValueError("the model has no LoRA attached")
    tensors = {}
    for path, lora in loras.items():
        tensors[f"{path}.lora_A"], tensors[f"{path}.lora_B"] = lora.lora_A.detach(), lora.lora_B.detach()
    for path, attn in converted_attention(model).items():
        for name, param in attn.named_parameters():
            # sinks and bridge norms (unless frozen), and the projections trained at full rank (stored whole, not as
            # a change)
            if param.requires_grad and not name.endswith((".lora_A", ".lora_B")):
                tensors[f"{path}.{name}"] = param.detach()
    tensors.update(init_record or {})
    first = next(iter(loras.values()))
    meta = {"format": DELTA_FORMAT, "rank": str(first.lora_A.shape[0]),
            "alpha": str(first.scaling * first.lora_A.shape[0]), "base_digest": digest,
            "model_type": model.config.model_type}
    return tensors, meta


def _parts(tensors: dict[str, torch.Tensor]) -> tuple[Record, list[str], dict[str, torch.Tensor]]:
    """A delta's (stage-0 record, module paths with LoRA factors, parameters stored whole)."""
    record = {k: v for k, v in tensors.items() if k.startswith(INIT_PREFIX)}
    paths = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith((".lora_A", ".lora_B"))})
    full = {k: v for k, v in tensors.items() if not k.endswith((".lora_A", ".lora_B")) and k not in record}
    return record, paths, full


def check_delta(model, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Raise a one-line ValueError unless the delta fits `model`'s layout: format, model type, every tensor
    naming a converted layer's parameter of the right shape, LoRA factors that fit, a stage-0 record that fits.
    The weights themselves are not compared (`apply_delta` checks the digest)."""
    fmt = meta.get("format")
    if fmt not in (DELTA_FORMAT, DELTA_FORMAT_V1):
        raise ValueError(f"not a recovery delta (format {fmt!r}, expected {DELTA_FORMAT!r})")
    if meta.get("model_type") != model.config.model_type:
        raise ValueError(f"the delta is for a {meta.get('model_type')} model, the base is {model.config.model_type}")
    rank = int(meta["rank"])
    params = dict(model.named_parameters())
    record, paths, full = _parts(tensors)
    missing = [k for k in [f"{p}.weight" for p in paths] + list(full) if k not in params]
    if missing:
        raise ValueError(f"the delta names {missing[0]}, which the base model does not have")
    linears = set(converted_linears(model)) | set(mlp_linears(model))
    layers = tuple(f"{p}." for p in converted_attention(model))
    foreign = [p for p in paths if p not in linears] + [k for k in full if not k.startswith(layers)]
    if foreign:
        raise ValueError(f"the delta names {foreign[0]}, which is not in a converted layer of the base model")
    for p in paths:
        a, b, w = tensors.get(f"{p}.lora_A"), tensors.get(f"{p}.lora_B"), params[f"{p}.weight"]
        if a is None or b is None or a.shape != (rank, w.shape[1]) or b.shape != (w.shape[0], rank):
            shapes = [tuple(t.shape) if t is not None else None for t in (b, a)]
            raise ValueError(f"{p}: LoRA factors {shapes[0]} @ {shapes[1]} do not fit {tuple(w.shape)}")
    for name, value in full.items():
        if value.shape != params[name].shape:
            raise ValueError(f"{name}: delta shape {tuple(value.shape)} != base {tuple(params[name].shape)}")
    check_init(model, record)


def check_base(model, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """`check_delta`, then that `model`'s base weights are the ones the delta was trained on (its digest)."""
    check_delta(model, tensors, meta)
    _, paths, _ = _parts(tensors)
    names = paths if meta["format"] == DELTA_FORMAT_V1 else converted_linears(model)
    if base_digest(model, names) != meta.get("base_digest"):
        raise ValueError("the delta was trained on a different base checkpoint (base weights digest differs)")


def resume_from_delta(model, tensors: dict[str, torch.Tensor], meta: dict[str, str], full_rank: bool = False,
                      lora_only: bool = False, mlp: bool = False) -> tuple[list[nn.Parameter], Record]:
    """Put the converted `model` where a delta's training ended, to train on: the delta's stage-0 record
    applied, LoRA attached at the delta's rank and alpha with its factors loaded, its whole parameters copied
    (in place). Returns (trainable parameters, the record), as `attach_lora` and `initialise` would; the
    delta must fit and belong to this base (`check_base`); `full_rank`, `lora_only` and `mlp` are the run's
    settings. `mlp` may add MLP LoRA to a delta that had none: those factors start at zero."""
    check_base(model, tensors, meta)
    record, paths, full = _parts(tensors)
    apply_init(model, record)
    trainable = attach_lora(model, int(meta["rank"]), float(meta["alpha"]), full_rank=full_rank, lora_only=lora_only,
                            mlp=mlp)
    loras = _lora_modules(model)
    new = set(loras) - set(paths)
    if not set(paths) <= set(loras) or not new <= set(mlp_linears(model)):
        raise ValueError(f"the delta has LoRA factors on {len(paths)} projections, this run would train "
                         f"{len(loras)}: resume with the --full-rank and --mlp-lora settings of the delta's run")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p, lora in loras.items():
            if p in new:
                continue
            lora.lora_A.copy_(tensors[f"{p}.lora_A"].to(lora.lora_A.dtype))
            lora.lora_B.copy_(tensors[f"{p}.lora_B"].to(lora.lora_B.dtype))
        for name, value in full.items():
            params[name].copy_(value.to(params[name].dtype))
    return trainable, record


def apply_delta(model, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Apply a delta to the converted `model` (in place): its stage-0 record, then the LoRA updates, then
    its full parameters. The delta must fit (`check_delta`) and the base weights must be the ones it was
    trained on; otherwise nothing changes."""
    check_base(model, tensors, meta)
    rank, alpha = int(meta["rank"]), float(meta["alpha"])
    params = dict(model.named_parameters())
    record, paths, full = _parts(tensors)
    apply_init(model, record)
    with torch.no_grad():
        for p in paths:
            a, b, w = tensors[f"{p}.lora_A"].float(), tensors[f"{p}.lora_B"].float(), params[f"{p}.weight"]
            w += (alpha / rank * (b @ a)).to(w.dtype)
        for name, value in full.items():
            params[name].copy_(value.to(params[name].dtype))


PEFT_PREFIX = "base_model.model."  # PEFT's key prefix for a causal LM's modules


def peft_adapter(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict]:
    """A LoRA-only delta as a PEFT adapter: (`adapter_model.safetensors` tensors, `adapter_config.json`).

    Keys become `base_model.model.<module>.lora_{A,B}.weight` and the config names the rank, alpha and the target
    modules by their last name, as PEFT writes them. A delta that also carries a stage-0 record or tensors trained
    whole has no PEFT form (vLLM's adapters add `B A` to projections, nothing else): one-line ValueError.
    """
    if meta.get("format") != DELTA_FORMAT:
        raise ValueError(f"not a recovery delta of format {DELTA_FORMAT!r} (got {meta.get('format')!r})")
    record, paths, full = _parts(tensors)
    if record or full:
        what = [f"a stage-0 record ({len(record)} tensors)"] * bool(record) + \
            [f"{len(full)} tensors trained whole (e.g. {next(iter(full))})"] * bool(full)
        raise ValueError(f"the delta carries {' and '.join(what)}, which a PEFT adapter cannot hold: serve the "
                         f"checkpoint `recovery apply` writes, or train with --lora-only")
    factors = {f"{PEFT_PREFIX}{p}.lora_{x}.weight": tensors[f"{p}.lora_{x}"].contiguous() for p in paths for x in "AB"}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(meta["rank"]),
              "lora_alpha": float(meta["alpha"]), "target_modules": sorted({p.rsplit(".", 1)[1] for p in paths}),
              "bias": "none", "lora_dropout": 0.0}
    return factors, config
