"""Standard benchmarks (GSM8K, MATH-500, MMLU, IFEval, HumanEval, any inspect task) for any Tinker model.

Framework-free pieces the Dagster assets and the ``benchmark`` CLI share:
- :mod:`provider` — the inspect-ai model provider ``tinker/<base model | tinker:// sampler path>``;
- :mod:`tasks` — benchmarks by name, ``inspect_evals`` registry names and local task files;
- :mod:`hub` — their datasets from a local mirror or the Hugging Face cache, offline;
- :mod:`graders` and :mod:`code_scorer` — math-verify answers, multiple choice, HumanEval in bubblewrap;
- :mod:`runner` and :mod:`results` — one run of one task, read back as metric ± s.e., n and per-sample scores.
"""
