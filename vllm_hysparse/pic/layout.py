# SPDX-License-Identifier: Apache-2.0
"""A PIC request's segment layout (SPEC §4): parsing, validation and which prompt rows are recomputed.

A prompt is split into consecutive segments `s_0 .. s_n`: `s_0` the prefix,
`s_1 .. s_{n-1}` reusable segments, `s_n` the query. Rows of the prefix, the
first `w` rows (the seam) of every middle segment and every row of the query
are *recomputed* in context; the other rows of a middle segment are *spliced*
from the segment's isolated K/V.
"""

from dataclasses import dataclass
from itertools import accumulate

SEGMENTS_FIELD = "pic_segments"
SEAM_FIELD = "pic_seam_tokens"
DEFAULT_SEAM = 8
# Any seam at least as long as every segment recomputes everything, so larger values mean nothing more; the bound
# keeps absurd ones out of salts and the worker (vLLM itself refuses extra_args integers past 64 bits).
MAX_SEAM = 2**31 - 1
# Set by the frontend from the request's `cache_salt`: its segments go to the store's private pool under it.
POOL_SALT_FIELD = "pic_pool_salt"


class PICError(ValueError):
    """A bad PIC request field; the message names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class PICLayout:
    segments: tuple[int, ...]  # lengths in prompt tokens, the last one is the query
    seam: int  # `w`: recomputed leading tokens of every middle segment

    @property
    def starts(self) -> tuple[int, ...]:
        """Start position `a_i` of every segment."""
        return (0, *accumulate(self.segments))[:-1]

    @property
    def prompt_len(self) -> int:
        return sum(self.segments)

    def middle(self) -> list[tuple[int, int, int]]:
        """(segment index, start, length) of every reusable segment (neither prefix nor query)."""
        starts = self.starts
        return [(i, starts[i], self.segments[i]) for i in range(1, len(self.segments) - 1)]

    def spliced_span(self, i: int) -> tuple[int, int]:
        """Prompt positions `[lo, hi)` of segment `i` that are spliced (empty for prefix, query, short segments)."""
        if i == 0 or i == len(self.segments) - 1:
            return (0, 0)
        a, n = self.starts[i], self.segments[i]
        return (a + min(self.seam, n), a + n)

    def salt(self) -> str:
        """Prefix-cache salt: blocks of a PIC prompt hold spliced K/V, valid only for this exact layout."""
        return "pic:" + ",".join(map(str, self.segments)) + f";w={self.seam}"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_layout(extra_args: dict | None, prompt_len: int) -> PICLayout | None:
    """`SamplingParams.extra_args` -> the request's layout, or None for a plain request.

    Raises `PICError` naming the field for lengths that are not positive
    integers, fewer than 2 segments, lengths that do not sum to the prompt,
    or a seam that is not an integer from 0 to `MAX_SEAM`.
    """
    if not extra_args or SEGMENTS_FIELD not in extra_args:
        if extra_args and SEAM_FIELD in extra_args:
            raise PICError(SEAM_FIELD, f"given without {SEGMENTS_FIELD}")
        return None
    segments = extra_args[SEGMENTS_FIELD]
    if not isinstance(segments, (list, tuple)) or not all(_is_int(n) for n in segments):
        raise PICError(SEGMENTS_FIELD, f"must be a list of integers (got {segments!r:.200})")
    if len(segments) < 2:
        raise PICError(SEGMENTS_FIELD, f"needs at least 2 segments, a prefix and the query (got {len(segments)})")
    if any(n < 1 for n in segments):
        raise PICError(SEGMENTS_FIELD, f"every segment needs at least 1 token (got {list(segments)!r:.200})")
    if sum(segments) != prompt_len:
        raise PICError(SEGMENTS_FIELD, f"lengths sum to {sum(segments)}, but the prompt has {prompt_len} tokens")
    seam = extra_args.get(SEAM_FIELD, DEFAULT_SEAM)
    if not _is_int(seam) or not 0 <= seam <= MAX_SEAM:
        raise PICError(SEAM_FIELD, f"must be an integer from 0 to {MAX_SEAM} (got {seam!r:.100})")
    return PICLayout(tuple(segments), seam)
