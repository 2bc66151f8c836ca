"""The start-up heap frozen out of the collector's reach, and given back to it at exit."""
import subprocess
import sys

from tests.support import REPO

PROGRAM = """
import atexit, gc
atexit.register(lambda: print("at exit", gc.get_freeze_count()))    # atexit is LIFO: this runs after the unfreeze
from replicas.startup_heap import freeze_startup_heap
kept = [[i] for i in range(20000)]
frozen = freeze_startup_heap()
young = [[i] for i in range(100)]
print("frozen", frozen >= 20000, gc.get_freeze_count() == frozen, freeze_startup_heap() >= frozen + 100)
"""


def test_what_lives_at_start_up_is_frozen_and_unfrozen_at_exit():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["frozen True True True", "at exit 0"]
