"""examples/tree_verify.py: greedy verification of a 1 + 4 + 16 draft tree (one attention call per layer with a
custom mask, docs/tree-mask.md) emits exactly the tokens of plain greedy decoding, in both mask forms and with the
plain-torch attention it is checked against; and its command line."""

import json
import os
import subprocess
import sys

import torch

from tests.example_loader import ROOT, load_example

ex = load_example("tree_verify")


def _decode(attention: str, packed: bool, batch: int = 2, n: int = 10):
    torch.manual_seed(1)
    model = ex.build_model(3, seed=1)
    prompts = [torch.randint(0, ex.VOCAB, (6 + 3 * b,)).tolist() for b in range(batch)]
    with torch.no_grad():
        tree, steps = ex.tree_decode(model, prompts, n, draft_layers=1, attention=attention, packed=packed)
        plain = [ex.greedy(model, p, n) for p in prompts]
    return tree, plain, steps


def test_accept_walks_the_argmax_path():
    tokens = [9] + [10, 11, 12, 13] + list(range(20, 36))  # node 6 = second child of node 1
    argmax = [0] * 21
    argmax[0], argmax[1], argmax[6] = 10, 21, 5  # root -> node 1 (token 10) -> node 6 (token 21) -> bonus 5
    assert ex.accept(tokens, argmax) == [0, 1, 6]
    argmax[0] = 99  # no child carries the target's token: only the root
    assert ex.accept(tokens, argmax) == [0]


def test_tree_verification_equals_greedy_with_the_torch_attention():
    tree, plain, steps = _decode("torch", packed=False)
    assert tree == plain
    assert steps < 10  # the tree accepted more than one token in some step


def test_tree_verification_equals_greedy_with_kvops_custom_mask():
    for packed in (False, True):
        tree, plain, steps = _decode("kvops", packed=packed, batch=3)
        assert tree == plain, packed
        assert steps < 10


def test_command_line_reports_identical_tokens(tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "tree_verify.py"), "--new-tokens", "6",
                        "--packed", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "tokens identical to plain greedy decoding: True" in p.stdout
    result = json.loads(out.read_text())
    assert result["identical"] and result["tree"] == result["greedy"] and len(result["tree"][0]) == 6
