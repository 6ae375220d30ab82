import sys
from pathlib import Path

# pytest runs with --import-mode=importlib (no rootdir on sys.path): make the shared
# helpers of this directory importable under a name no other test directory uses.
sys.path.insert(0, str(Path(__file__).parent))
