"""Training runs and their checkpoints: listing, deletion, TTLs and weights info (the RestClient's calls)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localtinker.engine.api import CheckpointInfo, checkpoint_ttl_problem

from .. import json_codec as jc
from ..core import ServiceCore, iso, page
from ..errors import bad_request, not_found
from ..registry import RunRecord


CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def checkpoint_json(info: CheckpointInfo) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{info.kind}/{info.name}",
        "checkpoint_type": CHECKPOINT_TYPES[info.kind],
        "time": iso(info.created_at),
        "tinker_path": info.tinker_path,
        "size_bytes": info.size_bytes,
        "expires_at": None if info.expires_at is None else iso(info.expires_at),
        "public": info.public,
    }


class CheckpointRoutes:
    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def routes(self) -> list[Route]:
        return [
            self.core.route("training_runs", self.list_training_runs, "GET"),
            self.core.route("training_runs/{run_id}", self.get_training_run, "GET"),
            self.core.route("training_runs/{run_id}/checkpoints", self.list_run_checkpoints, "GET"),
            # the sub-resource routes first: {checkpoint_id:path} would also match ".../publish"
            self.core.route("training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish", self.publish, "POST"),
            self.core.route("training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish", self.unpublish, "DELETE"),
            self.core.route("training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl", self.set_checkpoint_ttl, "PUT"),
            self.core.route("training_runs/{run_id}/checkpoints/{checkpoint_id:path}", self.delete_checkpoint, "DELETE"),
            self.core.route("checkpoints", self.list_user_checkpoints, "GET"),
            self.core.route("weights_info", self.weights_info, "POST"),
        ]

    async def _checkpoints(self, run_id: str | None) -> list[CheckpointInfo]:
        infos: list[CheckpointInfo] = await self.core.on_worker(
            "list_checkpoints", lambda e: e.list_checkpoints(run_id)
        )
        return sorted(infos, key=lambda c: c.created_at, reverse=True)

    async def _run_json(self, run: RunRecord) -> dict[str, Any]:
        checkpoints = await self._checkpoints(run.training_run_id)
        last = {kind: next((c for c in checkpoints if c.kind == kind), None) for kind in ("weights", "sampler_weights")}
        return {
            "training_run_id": run.training_run_id,
            "base_model": run.base_model,
            "model_owner": "local",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": run.lora_rank,
            "last_request_time": iso(run.last_request_time),
            "last_checkpoint": checkpoint_json(last["weights"]) if last["weights"] else None,
            "last_sampler_checkpoint": checkpoint_json(last["sampler_weights"]) if last["sampler_weights"] else None,
            "user_metadata": run.user_metadata or None,
        }

    async def list_training_runs(self, request: Request) -> Response:
        limit, offset = page(request, default_limit=20)
        runs = self.core.registry.all_runs()
        runs_page = [await self._run_json(run) for run in runs[offset : offset + limit]]
        return JSONResponse(
            {"training_runs": runs_page, "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}
        )

    async def get_training_run(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        run = self.core.registry.run(run_id)
        if run is None:
            raise not_found(f"unknown training run {run_id!r}")
        return JSONResponse(await self._run_json(run))

    async def list_run_checkpoints(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        checkpoints = await self._checkpoints(run_id)
        return JSONResponse({"checkpoints": [checkpoint_json(c) for c in checkpoints], "cursor": None})

    async def list_user_checkpoints(self, request: Request) -> Response:
        limit, offset = page(request, default_limit=100)
        checkpoints = await self._checkpoints(None)
        return JSONResponse(
            {
                "checkpoints": [checkpoint_json(c) for c in checkpoints[offset : offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(checkpoints)},
            }
        )

    async def delete_checkpoint(self, request: Request) -> Response:
        path = f"tinker://{request.path_params['run_id']}/{request.path_params['checkpoint_id']}"
        await self.core.on_worker(f"delete_checkpoint {path}", lambda e: e.delete_checkpoint(path))
        return JSONResponse({})

    async def publish(self, request: Request) -> Response:
        return await self._set_public(request, True)

    async def unpublish(self, request: Request) -> Response:
        return await self._set_public(request, False)

    async def _set_public(self, request: Request, public: bool) -> Response:
        """Locally every checkpoint is readable by whoever holds the server's key; the flag is what
        listings and ``checkpoint info`` show. Idempotent: hosted Tinker answers 409 to a repeat, which
        the SDK retries for minutes."""
        await self.core.body(request)
        path = f"tinker://{request.path_params['run_id']}/{request.path_params['checkpoint_id']}"
        await self.core.on_worker(f"publish {path}", lambda e: e.set_checkpoint_public(path, public))
        return JSONResponse({})

    async def set_checkpoint_ttl(self, request: Request) -> Response:
        endpoint = "checkpoints/ttl"
        body = await self.core.json(request, endpoint)
        if "ttl_seconds" not in body:
            raise bad_request(f"{endpoint}: send {{\"ttl_seconds\": seconds}} (or null to never expire)")
        ttl_seconds = jc.field(body, "ttl_seconds", int, endpoint, default=None)
        problem = checkpoint_ttl_problem(ttl_seconds)
        if problem is not None:
            raise bad_request(f"{endpoint}: {problem}")
        path = f"tinker://{request.path_params['run_id']}/{request.path_params['checkpoint_id']}"
        await self.core.on_worker(f"set_checkpoint_ttl {path}", lambda e: e.set_checkpoint_ttl(path, ttl_seconds))
        return JSONResponse({})

    async def weights_info(self, request: Request) -> Response:
        body = await self.core.json(request, "weights_info")
        path = jc.field(body, "tinker_path", str, "weights_info")
        parts = path.removeprefix("tinker://").split("/")
        run = self.core.registry.run(parts[0]) if path.startswith("tinker://") and len(parts) == 3 else None
        if run is None:
            raise not_found(f"weights_info: no training run is recorded for {path!r}")
        return JSONResponse(
            {
                "base_model": run.base_model,
                "is_lora": True,
                "lora_rank": run.lora_rank,
                "train_unembed": run.train_unembed,
                "train_mlp": run.train_mlp,
                "train_attn": run.train_attn,
            }
        )
