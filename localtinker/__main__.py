"""``python -m localtinker serve``: a tinker-compatible server over a local model.

Point any tinker SDK script at it with ``TINKER_BASE_URL=http://127.0.0.1:8000`` and
``TINKER_API_KEY=tml-local`` (or the key given with ``--api-key``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import uvicorn

from localtinker.protocol.app import LocalTinkerService, ProtocolConfig
from localtinker.server import DTYPES, bind_socket, build_engine, uvicorn_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m localtinker", description="A tinker-compatible server over a local model.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the tinker HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--storage", type=Path, required=True, help="directory for checkpoints; survives restarts")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("LOCALTINKER_API_KEY"),
        help="require this X-API-Key on every request (default: $LOCALTINKER_API_KEY, else no key needed)",
    )
    serve.add_argument(
        "--dtype", choices=(*DTYPES, "auto"), default="auto",
        help="weights' precision (default auto: bfloat16 on a GPU from sm80, float32 on the CPU and older GPUs)",
    )
    serve.add_argument(
        "--device",
        default=None,
        help="auto | cpu | cuda | cuda:N (default: $LOCALTINKER_DEVICE, else auto = the first CUDA GPU if torch sees one)",
    )
    serve.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice, one per core)"
    )
    serve.add_argument("--max-request-mb", type=int, default=64, help="largest request body accepted")
    serve.add_argument(
        "--session-timeout", type=float, default=ProtocolConfig.session_timeout_s, metavar="SECONDS",
        help="release the training and sampling clients of a session not heard from for this long (the SDK "
             "heartbeats every 10 s while its process lives; default 1800, 0 = never); checkpoints stay",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    if args.dtype == "auto":
        from localtinker.engine.device import default_dtype, resolve_device

        args.dtype = default_dtype(resolve_device(args.device))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logging.getLogger("localtinker").warning(
            "serving on %s without --api-key: anyone who can reach this address can train and sample", args.host
        )
    storage = args.storage.expanduser().resolve()
    storage.mkdir(parents=True, exist_ok=True)
    config = ProtocolConfig(api_key=args.api_key, max_request_bytes=args.max_request_mb * 1024 * 1024,
                            session_timeout_s=args.session_timeout)
    sock = bind_socket(args.host, args.port)
    engine = build_engine(storage, args.dtype, args.threads, device=args.device)
    service = LocalTinkerService(engine, storage, config)
    from localtinker.engine.device import describe_device

    print(f"localtinker serving http://{args.host}:{sock.getsockname()[1]} (storage {storage}, "
          f"{describe_device(engine.device)}, {engine.dtype})", flush=True)
    try:
        uvicorn.Server(uvicorn_config(service.build_app(), args.log_level)).run(sockets=[sock])
    finally:
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
