"""How `make test` spreads the suite over pytest-xdist workers (`-n 2 --dist loadgroup`).

Each test file runs whole on one worker, so a module-scoped fixture (a recipe or a demo run
end to end) is built once. The files that share a session-scoped corpus costing minutes
(egs/tiny's held-out layout with its phoneme judge) run together on one worker, so it too is
built once. Files go to whichever worker is free."""

from __future__ import annotations

import pytest

# session fixtures built once for the whole run, not once per worker
SHARED_CORPORA = ("heldout_data",)


def pytest_collection_modifyitems(config, items):
    for item in items:
        shared = next((name for name in SHARED_CORPORA if name in getattr(item, "fixturenames", ())), None)
        item.add_marker(pytest.mark.xdist_group(shared or item.path.relative_to(config.rootpath).as_posix()))
