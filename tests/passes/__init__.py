"""Unit tests of each pass on small hand-built graphs (no ``ampfx.convert``).

A package (imported as ``passes.*`` from ``tests/``) so that its ``test_shapes.py`` and
``tests/test_shapes.py`` can be collected in one run: pytest's default import mode
needs distinct module names.
"""
