"""Tests of the KV transfer ops, planner, wire format and multi-process worlds (docs/transfer.md)."""
