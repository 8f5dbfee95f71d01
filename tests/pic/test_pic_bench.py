# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/pic_bench.py --quick` end to end: the JSON has every field, with sane values (no timing asserts)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Benchmark tier: minutes of load on a shared machine; `bash scripts/test.sh --bench` runs it (not CI).
pytestmark = pytest.mark.bench

REPO = Path(__file__).resolve().parents[2]
SUMMARY_FIELDS = [
    "ttft_warm_pic_s", "ttft_prefix_cache_s", "ttft_full_recompute_s", "ttft_cold_pic_s", "ttft_plain_prefill_s",
    "warm_speedup_vs_prefix_cache", "warm_speedup_vs_full_recompute", "cold_over_plain", "ttft_warm_pic_by_seam_s",
    "prefix_cached_tokens_median", "tokens_reused", "tokens_recomputed", "counters", "store_bytes", "store_entries",
    "store_evictions", "targets", "warm_tokens_recomputed_by_seam",
]


def test_pic_bench_quick(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "pic_bench.py"), "--quick", "--out-dir",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("pic_bench_*_quick.json")
    result = json.loads(path.read_text())
    assert path.with_suffix(".md").exists() and path.with_suffix(".png").exists()
    assert not result["failures"]
    assert len(result["loadavg_start"]) == 3 and len(result["loadavg_end"]) == 3
    cfg = result["config"]
    assert set(result["archs"]) == {"hysparse", "hysparse2"}
    for arch, res in result["archs"].items():
        s = res["summary"]
        for field in SUMMARY_FIELDS:
            assert s.get(field) is not None, (arch, field)
        for key in ("ttft_warm_pic_s", "ttft_prefix_cache_s", "ttft_full_recompute_s", "ttft_cold_pic_s",
                    "ttft_plain_prefill_s"):
            assert 0 < s[key] < 120, (arch, key, s[key])
        assert set(s["ttft_warm_pic_by_seam_s"]) == {str(w) for w in cfg["seams"]}
        assert all(v > 0 for v in s["ttft_warm_pic_by_seam_s"].values())
        # the segment store did the work: documents reused, every pool and cold document stored once
        assert s["tokens_reused"] > 0 and s["tokens_recomputed"] > 0
        assert s["counters"]["tokens_reused"] == s["tokens_reused"]
        assert s["counters"]["segments_hit"] > 0
        assert s["store_entries"] == cfg["pool"] + cfg["cold"] * cfg["docs"]
        assert s["store_bytes"] > 0 and s["store_evictions"] == 0
        assert s["warm_segments_cold"] == 0 and s["cold_segments_hit"] == 0
        # vLLM's prefix cache helped only the prefix-caching requests
        assert s["salted_cache_hits"] == 0
        assert s["prefix_cached_tokens_median"] >= 0
        # a wider seam recomputes more rows; seam 0 recomputes prefix and query only
        rec = [s["warm_tokens_recomputed_by_seam"][str(w)] for w in sorted(cfg["seams"])]
        assert rec == sorted(rec) and rec[0] == cfg["system_len"] + cfg["query_len"]
        for t in s["targets"].values():
            assert isinstance(t["met"], bool) and t["value"] > 0
