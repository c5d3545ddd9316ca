"""Fixtures of the scale-out suite (marker ``postgres``; run with ``make test-postgres``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.scaleout.postgres_cluster import PostgresCluster, running_postgres


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresCluster]:
    with running_postgres() as cluster:
        yield cluster
