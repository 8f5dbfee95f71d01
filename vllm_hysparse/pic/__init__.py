# SPDX-License-Identifier: Apache-2.0
"""Position-independent caching (PIC) of prompt segments (SPEC §4)."""
