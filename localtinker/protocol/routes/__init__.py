"""The HTTP routes, one module per family; each family is a class over a ``ServiceCore`` with ``routes()``.

- ``sessions``: start-up, sessions, heartbeats, capabilities and creating training models;
- ``session_info``: the RestClient's session queries (get, list, search) and session trace export;
- ``training``: a training client's sequenced ops (forward_backward, optim_step, saving weights);
- ``sampling``: sampling sessions and ``asample``;
- ``checkpoints``: training runs, checkpoint listing, deletion, TTLs and weights info;
- ``weights``: signed download URLs for external weights and the keyless GETs that serve them;
- ``openai``: the OpenAI-compatible chat/completions endpoint under ``/oai/api/v1``;
- ``futures``: ``retrieve_future`` long-polling and ``cancel_future``.
A new family gets its own module here and one line in ``app.LocalTinkerService.build_app``.
"""
