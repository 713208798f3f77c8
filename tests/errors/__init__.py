"""Tests of refused input across ops and caches: the unhappy-path registry, value checks, limits, non-finite values, contract fuzzing (docs/semantics.md)."""
