"""The benches' tests use the suite's plugins (tests/support/); devices first sets TRITON_INTERPRET
where there is no GPU, before any kernel is imported."""
pytest_plugins = ["tests.support.devices", "tests.support.cli"]
