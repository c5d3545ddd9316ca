"""Models out of a Tinker checkpoint, through the tinker SDK only (so hosted Tinker and localtinker behave alike):
the PEFT adapter (``adapter``), an optional merged Hugging Face model (``merge``), each verified against the
server's ``compute_logprobs`` (``verify``), written atomically by :func:`run.export_checkpoint`."""
