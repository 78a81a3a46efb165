"""fsdp_mlp.py with BUG = "no_divide"."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_mlp  # noqa: E402
from fsdp_mlp import MESH, batch, loss, model, optimizer, parallelize, shard  # noqa: E402,F401

fsdp_mlp.BUG = "no_divide"
