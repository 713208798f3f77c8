"""CPU kernels written as torch composites (functional aten ops, no host syncs): what eager CPU calls run, and what
Inductor's decompositions inline where the op is pure (so the ops fuse with their neighbours)."""
