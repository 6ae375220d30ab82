#!/usr/bin/env python3
"""A web page to try a checkpoint (docs/inference.md, "A synthesis page").

Example:
    python bin/serve.py --exp-dir exp/valle --prompt-dir prompts   # then open http://127.0.0.1:8000/
"""

import sys
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from valle.serve.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
