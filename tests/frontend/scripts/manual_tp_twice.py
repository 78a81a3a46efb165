"""manual_tp.py with BUG = "twice"."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import manual_tp  # noqa: E402
from manual_tp import MESH, batch, loss, model, optimizer, parallelize  # noqa: E402,F401

manual_tp.BUG = "twice"
