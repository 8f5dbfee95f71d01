# SPDX-License-Identifier: Apache-2.0
"""The PIC segment store, fingerprints, key re-rotation and PIC metrics, without an engine."""

import json

import pytest
import torch

from vllm_hysparse.metrics import PagesPerQueryStats, _Collector, read_totals
from vllm_hysparse.pic.rotation import rotate_by
from vllm_hysparse.pic.store import SegmentStore, model_fingerprint, segment_key


def kv(rows: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"layer": (torch.randn(rows, 2, 8, generator=gen), torch.randn(rows, 2, 8, generator=gen), 0)}


ENTRY_BYTES = 2 * 10 * 2 * 8 * 4  # K and V of 10 rows, 2 groups, dim 8, float32


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("VLLM_HYSPARSE_PIC_PUBLIC_MB", str(2.5 * ENTRY_BYTES / 2**20))  # room for two entries
    return SegmentStore()


def test_lru_eviction_skips_pinned_entries(store):
    for i in range(2):
        store.insert("public", f"k{i}", [i] * 10, kv(10, i), req_id=f"r{i}")
    store.release("r0")
    store.release("r1")
    assert store.lookup("public", "k0", [0] * 10, "r2") is not None  # k0 used again: k1 is now the LRU entry
    store.release("r2")
    store.insert("public", "k2", [2] * 10, kv(10, 2), req_id="r3")  # over budget: evicts the LRU k1
    assert store.lookup("public", "k1", [1] * 10, "r9") is None
    assert store.lookup("public", "k0", [0] * 10, "r9") is not None
    pool = store.pools["public"]
    assert pool.evictions == 1 and pool.nbytes == 2 * ENTRY_BYTES


def test_pinned_entries_outlive_the_budget_until_released(store):
    for i in range(4):
        store.insert("public", f"k{i}", [i] * 10, kv(10, i), req_id="r")
    pool = store.pools["public"]
    assert len(pool.entries) == 4 and pool.evictions == 0 and store.in_use() == 4
    store.release("r")
    assert len(pool.entries) == 2 and pool.nbytes <= pool.budget and store.in_use() == 0


def test_a_hit_rechecks_the_token_ids(store):
    store.insert("public", "k", [1, 2, 3], kv(3, 0), req_id="r")
    assert store.lookup("public", "k", [1, 2, 4], "s") is None  # same key, other tokens: a collision is a miss
    assert store.lookup("public", "k", [1, 2, 3], "s") is not None


def test_pools_are_separate(store):
    store.insert("private", "k", [1], kv(1, 0), req_id="r")
    assert store.lookup("public", "k", [1], "s") is None
    stats = store.stats()
    assert stats["private_entries"] == 1 and stats["public_entries"] == 0


def test_keys_depend_on_content_fingerprint_and_salt():
    base = segment_key([1, 2, 3], "fp")
    assert base == segment_key((1, 2, 3), "fp")
    assert len({base, segment_key([1, 2, 4], "fp"), segment_key([1, 2, 3], "fp2"),
                segment_key([1, 2, 3], "fp", salt="tenant")}) == 4


def test_fingerprint_changes_with_config_and_weights():
    from vllm_hysparse.tools.make_checkpoint import build_config

    config = build_config("hysparse", "tiny")
    model = torch.nn.Linear(4, 4)
    fp = model_fingerprint(model, config, torch.float32)
    assert fp == model_fingerprint(model, config, torch.float32)
    assert fp != model_fingerprint(model, config, torch.bfloat16)
    changed = build_config("hysparse", "tiny", {"sparse_topk_blocks": config.sparse_topk_blocks + 1})
    assert fp != model_fingerprint(model, changed, torch.float32)
    rope = build_config("hysparse", "tiny", {"rope_theta": 5000.0})
    assert fp != model_fingerprint(model, rope, torch.float32)
    with torch.no_grad():
        model.weight[1, 2] += 1e-3
    assert fp != model_fingerprint(model, config, torch.float32)


@pytest.mark.parametrize("neox,rotary_dim,scaling", [(True, 64, None), (False, 64, None), (True, 32, None),
                                                     (True, 64, {"rope_type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 256})])
def test_rotating_a_stored_key_equals_the_key_at_the_new_position(neox, rotary_dim, scaling):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = {"rope_type": "default", "rope_theta": 10000.0, "rope_dim": rotary_dim}
    if scaling:
        params = {**scaling, "rope_theta": 10000.0}
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=1024, is_neox_style=neox, rope_parameters=params)
    gen = torch.Generator().manual_seed(rotary_dim)
    raw = torch.randn(20, 3 * 64, generator=gen)
    local = torch.arange(20)
    start = int(torch.randint(1, 500, (), generator=gen))

    def rope_at(pos):  # vLLM's own rotation, on a copy (its CPU op works in place)
        q, _ = rope.forward_native(pos, raw.clone(), None)
        return q

    moved = rotate_by(rope, rope_at(local), torch.full((20,), start))
    torch.testing.assert_close(moved, rope_at(local + start), atol=2e-5, rtol=1e-5)
    assert not torch.allclose(moved, rope_at(local), atol=1e-3)  # the test can fail: rotation moved it


def test_pic_metrics_reach_the_collector(tmp_path, monkeypatch):
    monkeypatch.setenv("HYSPARSE_METRICS_DIR", str(tmp_path))
    stats = PagesPerQueryStats()
    stats.set_pic({"segments_hit": 3, "segments_cold": 2, "tokens_reused": 900, "tokens_recomputed": 70,
                   "public_bytes": 4096, "public_entries": 2, "public_evictions": 1, "private_bytes": 0,
                   "private_entries": 0, "private_evictions": 0, "in_use": 1})
    stats.publish()
    assert json.loads(next(tmp_path.glob("worker-*.json")).read_text())["pic_tokens_reused"] == 900
    assert read_totals(tmp_path)["pic_segments_hit"] == 3
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in _Collector(str(tmp_path)).collect() for s in family.samples}
    assert samples[("vllm:hysparse_pic_segments_hit_total", ())] == 3
    assert samples[("vllm:hysparse_pic_tokens_reused_total", ())] == 900
    assert samples[("vllm:hysparse_pic_store_bytes", (("pool", "public"),))] == 4096
    assert samples[("vllm:hysparse_pic_evictions_total", (("pool", "public"),))] == 1
    assert samples[("vllm:hysparse_pic_in_use", ())] == 1
