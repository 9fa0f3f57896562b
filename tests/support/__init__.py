"""What the tests share: small models (``models``, ``family_models``, ``fidelity_models``, ``cli_models``), the
random-graph fuzzer (``fuzzgraphs``), the Markdown page runner (``doccheck``) and functions tests name by their
qualified name (``helper_ops``). Imported as ``support.<module>``: tests/conftest.py puts tests/ on the path, as
the benchmark scripts that reuse these do."""
