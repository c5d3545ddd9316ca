"""The Tinker side of an export, through the tinker SDK only (so hosted Tinker and localtinker behave alike):
the PEFT adapter downloaded as ``tinker checkpoint download`` does (``adapter``), and the server's logprobs the
exported models are checked against (``verify``). The Hugging Face side (PEFT, merge, GGUF) is
``resources.hf_export``: this package imports only tinker, numpy and torch (ARCHITECTURE §2)."""
