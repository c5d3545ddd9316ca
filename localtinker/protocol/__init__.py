"""The tinker SDK 0.38 wire protocol in front of an ``Engine`` (see ``localtinker.engine.api``).

- ``app``: the service (``ServiceCore`` in ``core`` + the route families in ``routes/``) behind ``guard``
  (API key, size limit, request log);
- ``proto_codec`` / ``json_codec``: wire formats <-> engine dataclasses, with 4xx errors that say what is wrong;
- ``worker``: the single engine thread, per-model ``seq_id`` order, batched sampling;
- ``futures``: request futures for long-poll ``retrieve_future``;
- ``registry``: sessions, training runs (persisted under the storage dir) and samplers.
"""
