import sys
from pathlib import Path

# pytest runs with --import-mode=importlib (no rootdir on sys.path): the tiny models these
# tests synthesise with are tests/models' shared helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
