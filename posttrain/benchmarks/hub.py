"""A benchmark's dataset from a local copy: ``$POSTTRAIN_HUB_MIRROR/<org>/<name>`` or the Hugging Face cache.

The same loader as training data (``posttrain.datasets.sources``): a hub id resolves to its mirror
directory, laid out like the hub repository, when ``POSTTRAIN_HUB_MIRROR`` holds one, else to
``datasets.load_dataset(<hub id>)``, which reads the HF cache offline and downloads when online.
A dataset found in neither is a :class:`BenchmarkDataMissing` naming the dataset and both fixes.
:func:`local_copy` says where a copy is without reading it, so automation can leave out a benchmark whose
data is not here instead of launching a run that fails (or downloads in the background).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.datasets.sources import HUB_MIRROR_ENV, SourceNotFoundError, iter_raw_rows, mirror_dir


class BenchmarkDataMissing(FileNotFoundError):
    """A benchmark's dataset is not available locally (offline) and could not be downloaded."""


@dataclass(frozen=True)
class HubDataset:
    hub_id: str
    split: str
    config: str | None = None

    def describe(self) -> str:
        return f"{self.hub_id} (" + (f"config {self.config!r}, " if self.config else "") + f"split {self.split!r})"


def load_records(dataset: HubDataset, benchmark: str) -> list[dict[str, Any]]:
    """Every record of ``dataset``'s split, in order."""
    try:
        return [raw.record for raw in iter_raw_rows(dataset.hub_id, split=dataset.split, config_name=dataset.config)]
    except SourceNotFoundError as error:
        raise missing(benchmark, dataset, error) from error


def local_copy(dataset: HubDataset) -> Path | None:
    """The mirror directory, or the ``datasets`` cache folder, that holds ``dataset``; None when neither does.

    Only the cache ``load_dataset`` builds counts: offline, ``datasets`` reads nothing else (hub files fetched
    without it, e.g. by ``hf download``, are not enough). Reads directory names only (a sensor calls it every tick)."""
    import datasets.config
    from datasets.naming import camelcase_to_snakecase

    mirror = mirror_dir(dataset.hub_id)
    if mirror is not None:
        return mirror
    *namespace, name = dataset.hub_id.split("/")
    built = Path(datasets.config.HF_DATASETS_CACHE).expanduser() / "___".join([*namespace, camelcase_to_snakecase(name)])
    if any(path.is_dir() for path in built.glob(f"{dataset.config or '*'}/*/*")):
        return built
    return None


def missing(benchmark: str, dataset: HubDataset, cause: BaseException) -> BenchmarkDataMissing:
    return BenchmarkDataMissing(
        f"benchmark {benchmark!r} needs the dataset {dataset.describe()}, which is not available here "
        f"({type(cause).__name__}: {str(cause)[:300]}). Fix: put a copy laid out like the hub repository at "
        f"${HUB_MIRROR_ENV}/{dataset.hub_id}, or download it once into the Hugging Face cache on a machine "
        f"with network (`python -c \"import datasets; datasets.load_dataset('{dataset.hub_id}'"
        + (f", '{dataset.config}'" if dataset.config else "")
        + f", split='{dataset.split}')\"`) and run with HF_DATASETS_OFFLINE=1."
    )
