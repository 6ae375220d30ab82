"""Development support shared by the tests and the scripts (never imported by `valle`).

`harness` runs a function on N local gloo ranks with a deadline; `scenarios` holds the
trainer runs those ranks execute; `sweep` is the allocation sweep behind `make oom-sweep`.
Tests import them as `tests.support.*` (pyproject's pytest `pythonpath = ["."]`); scripts put
the repository root on sys.path first. Spawned workers import them the same way: a spawn
child starts with its parent's sys.path.
"""
