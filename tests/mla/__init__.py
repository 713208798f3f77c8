"""Tests of the MLA latent-cache ops (docs/mla.md)."""
