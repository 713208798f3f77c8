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


if __name__ == "__main__":
    unittest.main()
