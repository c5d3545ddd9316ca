"""Dagster definitions, jobs and the command line of the post-training code location."""

from pipelines import fast_exit

fast_exit.register()
