"""SDK-over-HTTP train step vs calling the localtinker engine directly, in the same process.

Baseline: ``engine.forward_backward`` + ``engine.optim_step`` on one training model, called on the
server's engine worker thread (``EngineWorker.call``, a queue hand-off of microseconds). Measured: the
same step through the real tinker SDK (protobuf request, futures, long-poll) on another model of
the same engine. Rounds alternate between the two so machine load hits both alike; the ratio of
medians is printed. Goal: overhead <= 5%.

Both sides compute on the one worker thread, so they share its OpenMP team: direct calls from the main
thread would start a second team, and with more team threads than CPUs libgomp makes every team's
workers sleep after each parallel region (``measure.in_own_thread``), slowing both sides by an amount
that is not protocol overhead.

On a busy machine the two medians differ by more noise than overhead, so the script also times the
same SDK step against an engine that does no work: that is the protocol's own cost per step, and
its share of the direct step is the second figure printed.

    python bench/bench_http_overhead.py [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from localtinker.engine.api import AdamSpec, DatumArrays, ForwardBackwardResult, LoraSpec, ModelInfo  # noqa: E402
from localtinker.server import start_server  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    return parser.parse_args()


class NoWorkEngine:
    """Answers instantly with correctly shaped outputs: what is left of an SDK step is protocol cost."""

    def create_model(self, model_id, base_model, lora):
        return ModelInfo(model_id, base_model, "", lora.rank, "none", 0)

    def forward_backward(self, model_id, data, loss_fn, loss_fn_config, forward_only):
        outputs = [{"logprobs": np.zeros(d.tokens.size, np.float32)} for d in data]
        return ForwardBackwardResult(outputs, {"loss:sum": 0.0})

    def optim_step(self, model_id, adam):
        return {"step": 1.0}


def time_sdk_steps(trainer, data, adam, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        fwd = trainer.forward_backward(data, "cross_entropy")
        step = trainer.optim_step(adam)
        fwd.result()
        step.result()
        times.append(time.perf_counter() - start)
    return times[1:]  # the first includes connection set-up


def protocol_cost(data, adam, rounds: int) -> float:
    with tempfile.TemporaryDirectory() as storage, start_server(storage, engine=NoWorkEngine()) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-local")
        trainer = client.create_lora_training_client(base_model="none", rank=16).result()
        cost = statistics.median(time_sdk_steps(trainer, data, adam, rounds))
        client.close("success").result()
    return cost


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, 20000, size=(args.batch, args.seq_len + 1))
    adam = types.AdamParams(learning_rate=1e-4)
    sdk_data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={"target_tokens": row[1:].tolist(), "weights": [1.0] * args.seq_len},
        )
        for row in tokens
    ]
    engine_data = [
        DatumArrays(
            tokens=row[:-1].astype(np.int64),
            loss_fn_inputs={"target_tokens": row[1:].astype(np.int64), "weights": np.ones(args.seq_len, np.float32)},
        )
        for row in tokens
    ]
    with tempfile.TemporaryDirectory() as storage, start_server(storage, dtype=args.dtype) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-local")
        trainer = client.create_lora_training_client(base_model=args.model, rank=args.rank, seed=0).result()
        worker = server.service.worker
        direct_id = "bench:train:direct"
        lora = LoraSpec(rank=args.rank, seed=0)
        worker.call("bench: create the direct model", lambda engine: engine.create_model(direct_id, args.model, lora)).result()
        adam_spec = AdamSpec(learning_rate=1e-4)

        def engine_step(engine) -> None:
            engine.forward_backward(direct_id, engine_data, "cross_entropy", None, False)
            engine.optim_step(direct_id, adam_spec)

        def direct_step() -> float:
            start = time.perf_counter()
            worker.call("bench: direct step", engine_step).result()
            return time.perf_counter() - start

        def sdk_step() -> float:
            start = time.perf_counter()
            fwd = trainer.forward_backward(sdk_data, "cross_entropy")
            step = trainer.optim_step(adam)
            fwd.result()
            step.result()
            return time.perf_counter() - start

        direct_step(), sdk_step()  # warm-up
        direct, sdk = [], []
        for round_index in range(args.rounds):
            if round_index % 2 == 0:  # ABBA order: neither path always runs right after the other
                direct.append(direct_step())
                sdk.append(sdk_step())
            else:
                sdk.append(sdk_step())
                direct.append(direct_step())
            print(f"round {round_index}: direct {direct[-1]:.3f} s, SDK {sdk[-1]:.3f} s", flush=True)
        client.close("success").result()

    protocol_s = protocol_cost(sdk_data, adam, rounds=20)
    direct_med, sdk_med = statistics.median(direct), statistics.median(sdk)
    tokens_per_step = args.batch * args.seq_len
    print(f"model {args.model} ({args.dtype}), {args.batch}x{args.seq_len} tokens, LoRA rank {args.rank}, {args.rounds} rounds")
    print(f"engine direct : median {direct_med * 1000:8.1f} ms/step  ({tokens_per_step / direct_med:8.0f} tok/s)")
    print(f"SDK over HTTP : median {sdk_med * 1000:8.1f} ms/step  ({tokens_per_step / sdk_med:8.0f} tok/s)")
    overhead = sdk_med / direct_med - 1
    print(f"HTTP overhead ratio {sdk_med / direct_med:.3f} ({overhead:+.1%}; goal <= +5%): {'PASS' if overhead <= 0.05 else 'FAIL'}")
    print(
        f"protocol cost alone (no-work engine): {protocol_s * 1000:.1f} ms/step = "
        f"{protocol_s / direct_med:.2%} of a direct step"
    )


if __name__ == "__main__":
    main()
