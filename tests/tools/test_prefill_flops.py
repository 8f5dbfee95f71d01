# SPDX-License-Identifier: Apache-2.0
"""The prefill FLOPs count against a row-by-row recount of the `small` layouts' attention (random prompt lengths
and chunk sizes from a printed seed), and the CPU path's count against the model's: they differ by the token
oracle's second scoring of HySparse2's prefill rows in chunks past `ONE_PASS_MAX_KEYS` keys, and by nothing else."""

import random

import pytest

from vllm_hysparse.tools.prefill_flops import (
    F,
    ONE_PASS_MAX_KEYS,
    S,
    SERVE_CHUNK,
    W,
    config_flops,
    prefill_flops,
    small_layouts,
)

SEED = random.randrange(1 << 30)


@pytest.fixture(scope="module")
def layouts():
    return small_layouts()


@pytest.fixture(scope="module")
def lens():
    print(f"prefill_flops seed {SEED}")
    rng = random.Random(SEED)
    return [1, rng.randrange(2, 200), rng.randrange(900, 1300), rng.randrange(3000, 5000), rng.randrange(6000, 9000)]


@pytest.fixture(scope="module")
def chunks():
    rng = random.Random(SEED + 1)
    return [SERVE_CHUNK, rng.randrange(100, 1000), rng.randrange(3000, 5000), 1 << 20]


def attention_recount(lay, n, *, early_exit=True, cpu=False, chunk=SERVE_CHUNK):
    """Attention FLOPs by walking each layer's query rows, t = 0 .. n - 1, and the keys each sees; on the CPU
    path, a HySparse2 cross full layer's prefill row is scored again when its chunk's last row sees more than
    ONE_PASS_MAX_KEYS keys."""
    per_key = 2 * lay.heads * (lay.qk_dim + lay.v_dim)
    total = 0
    for i, kind in enumerate(lay.layer_types):
        cross = lay.kind == "hysparse2" and i >= lay.num_self
        rows = [n - 1] if cross and early_exit else range(n)
        for t in rows:
            seen = t + 1
            if lay.kind == "dense" or kind == F:
                total += seen * per_key
                chunk_end = min(n, (t // chunk + 1) * chunk)  # keys the chunk's last row sees
                if cross and cpu and not early_exit and chunk_end > ONE_PASS_MAX_KEYS:  # R: scored again
                    total += seen * 2 * lay.heads * lay.qk_dim
            elif lay.kind == "hysparse":  # global branch over the top-k blocks, SWA branch over the window
                total += (min(seen, lay.topk_blocks * lay.block_size) + min(seen, lay.swa_window)) * per_key
            elif kind == S:
                total += min(seen, lay.topk_tokens + lay.recent_window) * per_key
            else:
                assert kind == W
                total += min(seen, lay.swa_window) * per_key
    return total


@pytest.mark.parametrize("config", ["dense", "hysparse", "hysparse2", "hysparse2-noexit"])
@pytest.mark.parametrize("path", ["model", "cpu"])
def test_attention_matches_a_row_by_row_recount(layouts, lens, config, path):
    arch = "hysparse2" if config.startswith("hysparse2") else config
    for n in lens:
        got = config_flops(layouts, config, n, path)["attention"]
        want = attention_recount(layouts[arch], n, early_exit=config != "hysparse2-noexit", cpu=path == "cpu")
        assert got == want, (config, path, n)


def test_chunked_prefill_recount(layouts, lens, chunks):
    lay = layouts["hysparse2"]
    for n in lens:
        for chunk in chunks:
            got = prefill_flops(lay, n, early_exit=False, path="cpu", chunk=chunk)["attention"]
            assert got == attention_recount(lay, n, early_exit=False, cpu=True, chunk=chunk), (n, chunk)


def test_one_pass_bound_is_the_kernels():
    from csrc_triton.token_oracle.batched import ONE_PASS_MAX_KEYS as kernels

    assert ONE_PASS_MAX_KEYS == kernels


def test_cpu_path_adds_only_the_token_oracles_second_scoring(layouts, lens):
    n = lens[-1]
    assert n > ONE_PASS_MAX_KEYS + SERVE_CHUNK
    for config in ("dense", "hysparse", "hysparse2"):
        assert config_flops(layouts, config, n, "cpu") == config_flops(layouts, config, n, "model"), config
    lay = layouts["hysparse2"]
    model = prefill_flops(lay, n, early_exit=False)
    cpu = prefill_flops(lay, n, early_exit=False, path="cpu")
    cross_full = sum(1 for kind in lay.layer_types[lay.num_self:] if kind == F)
    assert cross_full >= 1
    # chunks of 2,048: those ending at 2,048 and 4,096 keys take one pass, every later row is scored again
    again = n * (n + 1) // 2 - 4096 * 4097 // 2
    assert cpu["attention"] - model["attention"] == cross_full * again * 2 * lay.heads * lay.qk_dim
    short = 4096  # a prompt of at most ONE_PASS_MAX_KEYS tokens: one pass everywhere
    assert prefill_flops(lay, short, early_exit=False, path="cpu") == prefill_flops(lay, short, early_exit=False)
    assert {k: v for k, v in cpu.items() if k not in ("attention", "total")} == \
        {k: v for k, v in model.items() if k not in ("attention", "total")}


def test_unknown_path_is_refused(layouts):
    with pytest.raises(ValueError, match="path"):
        prefill_flops(layouts["dense"], 8, path="gpu")
    with pytest.raises(ValueError, match="chunk"):
        prefill_flops(layouts["dense"], 8, chunk=0)
