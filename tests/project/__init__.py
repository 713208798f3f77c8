"""Tests of the repository as a whole: README and docs pages, packaging, layers, names, schemas, the examples' and benchmarks' CLIs."""
