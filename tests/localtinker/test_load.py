"""The server under load: 8 concurrent SDK clients train and sample on one localtinker, without cross-talk.

Each client trains its own LoRA to answer one shared prompt with its own target token while all the others
do the same (``localtinker.loadgen``); at the end each client's greedy sample is its own target and its own
target outscores every other client's. Latency percentiles (client futures; server requests, incl.
``retrieve_future``) are printed and written to ``load_report.json`` in the test's tmp dir.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localtinker.loadgen import LoadConfig, run_load, train_alone
from localtinker.server import RunningServer
from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL

CLIENTS = 8


@pytest.mark.slow
def test_eight_concurrent_clients_keep_their_own_weights_and_report_latencies(
    tinker_server: RunningServer, tmp_path: Path
) -> None:
    config = LoadConfig(base_model=TINY_MODEL, clients=CLIENTS, duration_s=15.0)
    report = run_load(config, tinker_server.base_url, LOCAL_API_KEY)
    (tmp_path / "load_report.json").write_text(json.dumps(report.to_json(), indent=2))
    print(f"\n{CLIENTS} clients, {report.wall_seconds:.1f} s wall (machine shared, under load)\n{report.table()}")

    assert report.errors == []
    assert [c.target for c in report.clients] == [config.target(i) for i in range(CLIENTS)]
    assert len({c.target for c in report.clients}) == CLIENTS
    crossed = [(c.client, c.greedy_token, c.own_logprob, c.best_other_logprob) for c in report.clients if not c.owns_its_weights]
    assert crossed == [], f"clients whose weights are not their own (client, greedy, own lp, best other lp): {crossed}"
    # Deterministic training: one client replayed alone lands on the very logprob it reached under load.
    replayed = report.clients[CLIENTS // 2]
    alone = train_alone(config, replayed.client, replayed.steps, tinker_server.base_url, LOCAL_API_KEY)
    assert alone == pytest.approx(replayed.own_logprob, abs=1e-4)
    assert all(c.steps >= config.min_steps and c.samples >= config.min_steps // config.sample_every for c in report.clients)

    latency = report.latency_ms
    for name in ("client forward_backward", "client optim_step", "client sample", "server retrieve_future 200", "server asample 200"):
        assert name in latency, f"no {name!r} samples: {sorted(latency)}"
        stats = latency[name]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    steps = sum(c.steps for c in report.clients)
    assert latency["client forward_backward"]["count"] == steps
    assert latency["client sample"]["count"] == sum(c.samples for c in report.clients) + CLIENTS
    assert not any(name.startswith("server ") and name.split()[-1].startswith("5") for name in latency), sorted(latency)
    saved = json.loads((tmp_path / "load_report.json").read_text())
    assert saved["latency_ms"]["client sample"]["p50"] == latency["client sample"]["p50"]
