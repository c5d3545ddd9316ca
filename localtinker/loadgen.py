"""Load generator: N concurrent tinker SDK clients training and sampling against one localtinker server.

Each client opens its own ``ServiceClient`` (its own session), trains its own LoRA to answer one shared
prompt with its *own* target token, and samples from its current weights while the others do the same. At
the end every client checks that its weights are its own: greedy sampling gives its target, and its target
outscores every other client's target. A server that mixed up adapters, optimizer state, sampler weights or
results between sessions fails that check.

Latencies are measured on both sides:
- client: submit → ``.result()`` of each future (``forward_backward``, ``optim_step``, ``sample``), what a
  user's script waits for, including queueing behind the other clients;
- server: the duration of every HTTP request by endpoint and status, read from the request log line
  ``GuardMiddleware`` writes (``localtinker.protocol``) — for ``retrieve_future`` 200 = a result delivered,
  408 = a long poll that expired while the op was still queued. Only when the server runs in this process.

Used by ``tests/localtinker/test_load.py`` and ``bench/bench_server_load.py``. Loopback servers only.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import tinker
from tinker import types

SHARED_PROMPT = [101, 202, 303, 404]  # every client uses the same prompt; only the target differs
FIRST_TARGET, TARGET_STRIDE = 1000, 97  # client i learns token FIRST_TARGET + i * TARGET_STRIDE
PROTOCOL_LOGGER = "localtinker.protocol"
ID_SEGMENT = re.compile(r"/[0-9a-f]{8}-[0-9a-f-]{27,}(?=/|$)")  # session / run ids inside a path


@dataclass(frozen=True)
class LoadConfig:
    base_model: str
    clients: int = 8
    duration_s: float = 30.0  # training+sampling phase; each client stops its loop after this
    min_steps: int = 10  # every client trains at least this many steps, whatever the duration
    sample_every: int = 2  # steps between sampler snapshots + samples
    lora_rank: int = 4
    learning_rate: float = 2e-2
    # Once a single target is learnt its gradient vanishes, and with Adam's default eps the normalised step
    # stays lr-sized and throws the weights off again (seen: lp 0.0 → -28 at lr 1e-2). A large eps lets
    # steps shrink with the gradient. Tinker's default beta2 (0.95) forgets the big early gradients within
    # ~20 steps, after which a small one gets a full step again: client 2 fell to lp -44 at step 18 and
    # -12 at steps 36-38, so the load test failed whenever timing ended its run there. With beta2 0.999
    # every client stays converged from step 10 to 80 (checked step by step, all 8 seeds).
    adam_eps: float = 1e-3
    adam_beta2: float = 0.999

    def target(self, client: int) -> int:
        return FIRST_TARGET + client * TARGET_STRIDE


@dataclass
class ClientOutcome:
    client: int
    target: int
    steps: int = 0
    samples: int = 0
    train_seconds: float = 0.0  # the timed train+sample phase, from the common start to this client's last step
    greedy_token: int | None = None
    own_logprob: float | None = None
    best_other_logprob: float | None = None
    error: str | None = None

    @property
    def owns_its_weights(self) -> bool:
        return (
            self.error is None
            and self.greedy_token == self.target
            and self.own_logprob is not None
            and self.best_other_logprob is not None
            and self.own_logprob > self.best_other_logprob
        )


@dataclass
class LoadReport:
    config: LoadConfig
    wall_seconds: float
    clients: list[ClientOutcome]
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def errors(self) -> list[str]:
        return [f"client {c.client}: {c.error}" for c in self.clients if c.error]

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "wall_seconds": round(self.wall_seconds, 2),
            "clients": [{**asdict(c), "owns_its_weights": c.owns_its_weights} for c in self.clients],
            "latency_ms": self.latency_ms,
            "errors": self.errors,
        }

    def table(self) -> str:
        lines = [f"{'latency (ms)':<34}{'n':>6}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}"]
        for name, stats in sorted(self.latency_ms.items()):
            lines.append(
                f"{name:<34}{int(stats['count']):>6}{stats['p50']:>9.1f}{stats['p90']:>9.1f}{stats['p99']:>9.1f}{stats['max']:>9.1f}"
            )
        return "\n".join(lines)


class LatencyLog:
    """Thread-safe named samples in milliseconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: dict[str, list[float]] = defaultdict(list)

    def add(self, name: str, milliseconds: float) -> None:
        with self._lock:
            self._samples[name].append(milliseconds)

    def percentiles(self) -> dict[str, dict[str, float]]:
        with self._lock:
            samples = {name: np.asarray(values) for name, values in self._samples.items() if values}
        return {
            name: {
                "count": float(values.size),
                "p50": float(np.percentile(values, 50)),
                "p90": float(np.percentile(values, 90)),
                "p99": float(np.percentile(values, 99)),
                "max": float(values.max()),
            }
            for name, values in samples.items()
        }


class _RequestLogHandler(logging.Handler):
    """Turns ``GuardMiddleware``'s ``"%s %s %d %.1fms"`` records into ``server <path> <status>`` samples."""

    def __init__(self, log: LatencyLog) -> None:
        super().__init__(level=logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.args, tuple) and len(record.args) == 4:
            _method, path, status, milliseconds = record.args
            endpoint = ID_SEGMENT.sub("/{id}", str(path).rsplit("/api/v1", 1)[-1]).lstrip("/")
            self.log.add(f"server {endpoint} {status}", float(milliseconds))


@contextmanager
def server_request_latencies(log: LatencyLog) -> Iterator[None]:
    """Records the in-process server's per-request durations into ``log`` while the block runs."""
    logger = logging.getLogger(PROTOCOL_LOGGER)
    handler, previous_level = _RequestLogHandler(log), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


def _timed(log: LatencyLog, name: str, future: Any, submitted: float) -> Any:
    result = future.result()
    log.add(f"client {name}", (time.perf_counter() - submitted) * 1000)
    return result


def _datum(target: int) -> types.Datum:
    tokens = [*SHARED_PROMPT, target]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 2) + [1.0]},
    )


def _sample(sampler: tinker.SamplingClient, log: LatencyLog) -> int:
    params = types.SamplingParams(max_tokens=1, temperature=1.0, top_k=1, seed=0)
    submitted = time.perf_counter()
    future = sampler.sample(types.ModelInput.from_ints(SHARED_PROMPT), num_samples=1, sampling_params=params)
    return _timed(log, "sample", future, submitted).sequences[0].tokens[0]


def _new_trainer(service: tinker.ServiceClient, config: LoadConfig, index: int) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model=config.base_model, rank=config.lora_rank, seed=index).result()


def _train_step(trainer: tinker.TrainingClient, config: LoadConfig, index: int, log: LatencyLog) -> None:
    adam = types.AdamParams(learning_rate=config.learning_rate, eps=config.adam_eps, beta2=config.adam_beta2)
    submitted = time.perf_counter()
    backward = trainer.forward_backward([_datum(config.target(index))], "cross_entropy")
    step = trainer.optim_step(adam)
    _timed(log, "forward_backward", backward, submitted)
    _timed(log, "optim_step", step, submitted)


def _logprob_of(sampler: tinker.SamplingClient, target: int) -> float:
    return sampler.compute_logprobs(types.ModelInput.from_ints([*SHARED_PROMPT, target])).result()[-1]


def train_alone(config: LoadConfig, index: int, steps: int, base_url: str, api_key: str) -> float:
    """Client ``index``'s run replayed with no other client: its own target's logprob after ``steps`` steps.

    Training is deterministic (seeded LoRA init, fixed data), so the same number under load means no other
    session's work leaked into this client's weights, optimizer state or results.
    """
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    try:
        trainer = _new_trainer(service, config, index)
        for _ in range(steps):
            _train_step(trainer, config, index, LatencyLog())
        return _logprob_of(trainer.save_weights_and_get_sampling_client().result(), config.target(index))
    finally:
        service.close("success").result(timeout=60)


def _run_client(
    index: int, config: LoadConfig, base_url: str, api_key: str, start: threading.Barrier, log: LatencyLog
) -> ClientOutcome:
    outcome = ClientOutcome(client=index, target=config.target(index))
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    try:
        trainer = _new_trainer(service, config, index)
        start.wait()  # all clients hold a model: the timed phase starts for everyone at once
        phase_start = time.monotonic()
        deadline = phase_start + config.duration_s
        while outcome.steps < config.min_steps or time.monotonic() < deadline:
            _train_step(trainer, config, index, log)
            outcome.steps += 1
            if outcome.steps % config.sample_every == 0:
                _sample(trainer.save_weights_and_get_sampling_client().result(), log)
                outcome.samples += 1
        outcome.train_seconds = time.monotonic() - phase_start
        sampler = trainer.save_weights_and_get_sampling_client().result()
        outcome.greedy_token = _sample(sampler, log)
        rivals = range(max(config.clients, 2))  # a lone client is still checked against one other target
        scores = {client: _logprob_of(sampler, config.target(client)) for client in rivals}
        outcome.own_logprob = scores.pop(index)
        outcome.best_other_logprob = max(scores.values())
    except Exception as error:  # noqa: BLE001 - reported per client; the run goes on for the others
        outcome.error = f"{type(error).__name__}: {error}"
        start.abort()  # a client that failed before the barrier must not leave the others waiting
    finally:
        service.close("success").result(timeout=60)
    return outcome


def run_load(config: LoadConfig, base_url: str, api_key: str, *, server_in_process: bool = True) -> LoadReport:
    """Runs ``config.clients`` clients concurrently; they start training together, after all have a model."""
    log = LatencyLog()
    outcomes: list[ClientOutcome | None] = [None] * config.clients
    start = threading.Barrier(config.clients)
    started = time.monotonic()

    def worker(index: int) -> None:
        outcomes[index] = _run_client(index, config, base_url, api_key, start, log)

    recorder = server_request_latencies(log) if server_in_process else _nothing()
    with recorder:
        threads = [threading.Thread(target=worker, args=(i,), name=f"load-client-{i}") for i in range(config.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return LoadReport(
        config=config,
        wall_seconds=time.monotonic() - started,
        clients=[o if o is not None else ClientOutcome(i, config.target(i), error="no outcome") for i, o in enumerate(outcomes)],
        latency_ms=log.percentiles(),
    )


@contextmanager
def _nothing() -> Iterator[None]:
    yield
