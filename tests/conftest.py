"""The suite's fixtures and hooks are pytest plugins in tests/support/, registered here (devices first:
it sets TRITON_INTERPRET before any kernel is imported); tests import plain helpers from there."""
pytest_plugins = ["tests.support.devices", "tests.support.layout", "tests.support.cli", "tests.support.servers",
                  "tests.support.slurm", "tests.support.in_process"]
