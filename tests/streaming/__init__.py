"""Tests of the streaming caches (CausalKVCache, ring, rolling, StreamingLLM windows on paged caches; docs/compile.md)."""
