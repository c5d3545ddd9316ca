"""The Hugging Face side of an export: a checkpoint's PEFT adapter (downloaded by ``posttrain.export``) loaded
with peft, folded into its base model (``merge``), written as GGUF (``gguf_file``), each verified against the
server, all into one directory or nothing (``export``). Here rather than in ``posttrain`` because it imports
transformers, peft, safetensors and gguf, which ARCHITECTURE §2 keeps out of the library."""
