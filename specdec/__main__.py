"""``python -m specdec``: the ``specdec`` command, kept under the name scripts, tests and users
already run. The command lives in :mod:`specdec_app` (also ``python -m specdec_app``); this is the
one module of the core that imports it, allowed by tests/test_layering.py because nothing imports
a ``__main__`` module: Python only runs it."""

from specdec_app.cli import app

app()
