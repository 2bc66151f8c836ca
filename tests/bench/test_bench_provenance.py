import subprocess

from bench.provenance import REPO, provenance


def test_the_commit_is_heads_unless_whoever_copied_the_tree_names_it(monkeypatch):
    """A working tree copied to another machine may sit beside an older commit's .git: there the one who copied it
    names the commit (`TIDAL_COMMIT`), and whether the tree differed from it is not known here (null)."""
    monkeypatch.delenv("TIDAL_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    here = provenance("bench.example", ["--flag"], "cpu", 7)
    assert here["commit"] == head and isinstance(here["tree_dirty"], bool)
    assert here["command"] == "python -m bench.example --flag" and here["seed"] == 7
    monkeypatch.setenv("TIDAL_COMMIT", "0123abc")
    given = provenance("bench.example", [], "cpu", 7)
    assert given["commit"] == "0123abc" and given["tree_dirty"] is None
