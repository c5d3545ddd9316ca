"""Shared fixtures live in tests/fixtures/<area>.py, one module per owner, loaded as plugins."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
# The suite checks the CPU path's numbers; GPU tests (`-m gpu`) choose their device themselves.
os.environ.setdefault("LOCALTINKER_DEVICE", "cpu")
# A stray key would send the resource to hosted Tinker (and the SDK retries ~5 min with no network):
# only the opt-in remote tests (`-m remote`, POSTTRAIN_REMOTE_TESTS=1) keep it.
if os.environ.get("POSTTRAIN_REMOTE_TESTS") != "1":
    os.environ.pop("TINKER_API_KEY", None)

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.server",
    "tests.fixtures.data",
    "tests.fixtures.dagster_env",
]
