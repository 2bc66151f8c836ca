"""Helpers shared by the tests (imported as `tests.support.*`; pytest puts the repository root on sys.path)."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
