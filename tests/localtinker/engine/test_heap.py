"""The engine keeps freed memory in the heap: a big buffer freed and allocated again costs no page faults.

Each case runs in a fresh interpreter, because the setting is process-wide and cannot be undone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MAX_ROUNDS = 200
OFF_ROUNDS = 40  # switched off: rounds that must all fault (switched on, the steady state came within 22)
QUIET_ROUNDS = 8  # consecutive rounds without new pages that count as the steady state
PAGES_OF_100_MB = 100 * 1024 * 1024 // 4096

_PROBE = f"QUIET_ROUNDS, QUIET = {QUIET_ROUNDS}, {PAGES_OF_100_MB // 20}\n" + r"""
import json, resource, sys
MAX_ROUNDS = int(sys.argv[1])
import torch
from localtinker.engine.heap import keep_freed_memory

applied = keep_freed_memory()
again = keep_freed_memory()

def faults_of_a_fresh_buffer():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.empty(512, 49152)  # 100 MB: above glibc's largest default mmap threshold (32 MB)
    buffer.fill_(1.0)  # touch every page
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del buffer
    return after - before

faults = []
while len(faults) < MAX_ROUNDS and not (len(faults) >= QUIET_ROUNDS and sum(faults[-QUIET_ROUNDS:]) < QUIET):
    faults.append(faults_of_a_fresh_buffer())
print(json.dumps({"applied": applied, "same": applied is again, "faults": faults}))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc policy (Linux)")


def _run_probe(switch: str | None, rounds: int = MAX_ROUNDS) -> dict:
    env = dict(os.environ)
    env.pop("LOCALTINKER_KEEP_FREED_MEMORY", None)
    if switch is not None:
        env["LOCALTINKER_KEEP_FREED_MEMORY"] = switch
    output = subprocess.run([sys.executable, "-c", _PROBE, str(rounds)], env=env, capture_output=True, text=True,
                            check=True)
    return json.loads(output.stdout.strip().splitlines()[-1])


def test_a_freed_big_buffer_is_reused_without_page_faults():
    result = _run_probe(None)
    assert result["applied"] == {"M_MMAP_THRESHOLD": True, "M_TRIM_THRESHOLD": True, "M_ARENA_MAX": True}
    assert result["same"]  # applied once per process
    faults = result["faults"]
    assert faults[0] > PAGES_OF_100_MB // 2  # the heap grew: its pages were touched for the first time
    # glibc's aligned allocation wants a few bytes more than a freed buffer of the same size, so the heap
    # grows for some rounds until freed neighbours coalesce (seen: 1 to 8 rounds on one machine, at least 14 on
    # another); from then on no page is new. Switched off, the probe never gets there (the next test).
    assert len(faults) < MAX_ROUNDS
    assert sum(faults[-QUIET_ROUNDS:]) < PAGES_OF_100_MB // 20


def test_switched_off_glibc_maps_each_big_buffer_afresh():
    result = _run_probe("0", OFF_ROUNDS)
    assert result["applied"] == {}
    assert len(result["faults"]) == OFF_ROUNDS  # no steady state
    assert all(count > PAGES_OF_100_MB // 2 for count in result["faults"])  # what every step used to pay
