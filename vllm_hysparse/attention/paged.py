# SPDX-License-Identifier: Apache-2.0
"""Paged-cache helpers of the PyTorch attention path: per-request views of a vLLM batch.

vLLM packs a step's queries as `[num_tokens, heads, D]`; request r owns rows
`query_start_loc[r]:query_start_loc[r+1]`, which are the *last* rows of its
`seq_lens[r]` positions (chunked prefill and decode alike). Its keys live in
the paged cache at the blocks `block_table[r]`.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

# Queries of one request are scored in chunks of this many rows so the dense
# reference math never holds more than `rows x heads x seq_len` floats.
QUERY_CHUNK = 256


@dataclass
class RequestRows:
    """Query rows `[start, end)` of the batch, sitting at positions `[seq_len - (end - start), seq_len)`."""

    index: int
    start: int
    end: int
    seq_len: int


def iter_requests(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> Iterator[RequestRows]:
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        start, end = starts[r], min(starts[r + 1], num_tokens)
        if end > start:
            yield RequestRows(r, start, end, seq_len)


def row_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Absolute position `[num_tokens]` of every query row (host tensors in, host tensor out)."""
    out = torch.empty(num_tokens, dtype=torch.long)
    for rows in iter_requests(query_start_loc, seq_lens, num_tokens):
        out[rows.start:rows.end] = torch.arange(rows.seq_len - (rows.end - rows.start), rows.seq_len)
    return out


def iter_chunks(rows: RequestRows) -> Iterator[tuple[int, int, int]]:
    """(row start, row end, number of keys visible to the chunk) for each query chunk."""
    first_pos = rows.seq_len - (rows.end - rows.start)
    for s in range(rows.start, rows.end, QUERY_CHUNK):
        e = min(s + QUERY_CHUNK, rows.end)
        yield s, e, first_pos + (e - rows.start)


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's logical page view `[blocks, G, page, D_k + D_v]` -> key and value views `[blocks, G, page, D]`.

    Any physical layout works: only views and strides are used.
    """
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store `[T, G, D]` key/value at flat slots `block * page + offset` (negative slots are padding)."""
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    valid = slots >= 0
    blocks, offsets = slots[valid] // key_cache.shape[2], slots[valid] % key_cache.shape[2]
    key_cache[blocks, :, offsets] = key[:n][valid].to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value[:n][valid].to(value_cache.dtype)


def gather_request_kv(cache: torch.Tensor, block_table_row: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Keys (or values) of positions `[0, num_keys)`: `[blocks, G, block, D]` cache -> `[1, num_keys, G, D]`."""
    block_size = cache.shape[2]
    blocks = block_table_row[: -(-num_keys // block_size)].long()
    kv = cache[blocks].permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])
    return kv[:num_keys].unsqueeze(0)
