"""No file of the repository cites a numbered issue ("issue 29", "Issue 17 §2", "issue_29") of a tracker the
repository does not have, nor "the issue" as if one were at hand: code, tests and docs cite docs/ sections instead
(docs/semantics.md §N, docs/ring-cache.md, ...), which a reader of the checkout can open."""

import pathlib
import re
import subprocess
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# "issue 29", "Issues 17", "issue #5", "issue_29", "issue29", "issue\n29"; "the issue" and "the issue's"
TRACKER_REF = re.compile(r"(?i)(?<![a-z])issues?[\s#_]*\d+|\bthe issue\b")
SUFFIXES = {".py", ".md", ".cpp", ".h", ".cu", ".toml", ".txt", ".cfg", ".yml", ".yaml", ".sh", ".ini", ".rst"}


def tracked_files() -> list[pathlib.Path]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split("\n")
        files = [ROOT / f for f in out if f]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist): every file under the root
        files = [p for p in ROOT.rglob("*") if ".git" not in p.parts]
    return sorted(p for p in files if p.suffix in SUFFIXES and p.is_file())


def tracker_refs(text: str) -> list[tuple[int, str]]:
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in TRACKER_REF.finditer(text)]


class TestNoTrackerRefs(unittest.TestCase):
    def test_the_pattern(self):
        for text in ("(issue 29)", "Issue 17 §2", "issues 6 and 7", "issue #12", "issue_29", "test_issue29",
                     "(issue\n29)", "the issue's follow-up", "as the issue measured"):
            self.assertTrue(tracker_refs(text), text)
        for text in ("docs/semantics.md §7", "an issue of the input", "issued 3 requests", "tissue 5"):
            self.assertFalse(tracker_refs(text), text)

    def test_no_file_cites_a_tracker(self):
        files = tracked_files()
        self.assertGreater(len(files), 100)
        this = pathlib.Path(__file__).resolve()
        found = []
        for path in files:
            if path.resolve() == this:
                continue
            text = path.read_text(errors="replace")
            found += [f"{path.relative_to(ROOT)}:{line}: {hit!r}" for line, hit in tracker_refs(text)]
        self.assertEqual(found, [], "cite a docs/ section (docs/semantics.md §N, ...) instead of a tracker's issue")


if __name__ == "__main__":
    unittest.main()
