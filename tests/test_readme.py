"""CI runs exactly the README's test command."""

import pathlib
import re
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[1]


class TestReadme(unittest.TestCase):
    def test_ci_runs_the_readme_test_command(self):
        blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
        test_commands = [b for b in blocks if "pytest" in b]
        self.assertEqual(len(test_commands), 1, blocks)
        ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
        self.assertIn(test_commands[0], ci_lines)

    def test_api_tour_runs(self):
        blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
        self.assertEqual(len(blocks), 1)
        scope: dict = {}
        exec(compile(blocks[0], "README.md", "exec"), scope)
        self.assertEqual(tuple(scope["out"].shape), (6, 14, 64))
        self.assertEqual(tuple(scope["o"].shape), (2, 1, 14, 64))


if __name__ == "__main__":
    unittest.main()
