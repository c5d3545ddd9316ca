"""Every public method of the tinker SDK 0.38 clients and every ``tinker`` CLI command, and how localtinker
answers it: ``works`` (driven against a real server by the test named), or ``hosted only`` with the reason.

tests/localtinker/test_sdk_surface.py enumerates the installed SDK's public methods and CLI commands and
fails when one is missing here, so a new SDK call cannot go unnoticed; README's table is this one.
"""

from __future__ import annotations

WORKS = "works"
HOSTED = "hosted only"

_SURFACE = "tests/localtinker/test_sdk_surface.py"
_TRAINING = "tests/localtinker/test_sdk_training.py"
_SAMPLING = "tests/localtinker/test_sdk_sampling.py"
_OPTIONS = "tests/localtinker/test_sdk_sampling_options.py"
_WEIGHTS = "tests/localtinker/test_sdk_weights.py"
_SESSIONS = "tests/localtinker/test_sdk_sessions.py"
_APP = "tests/localtinker/protocol/test_app.py"
_CUSTOM = "tests/localtinker/test_sdk_custom_loss.py"

_PROJECTS = "hosted projects: localtinker has one local user and one project"
_BILLING = "billing and usage accounting of hosted Tinker"
_CONSOLE = "returns a URL of the hosted Tinker console (computed client-side; there is no local console)"
_JWT = "identity comes from hosted Tinker's JWT auth; localtinker uses a plain API key"

SDK_METHODS: dict[str, tuple[str, str]] = {
    "ServiceClient.close": (WORKS, "tests/localtinker/test_sdk_session_release.py (the session's clients are released, "
                                   "as after --session-timeout without a heartbeat; checkpoints stay)"),
    "ServiceClient.copy_weights": (HOSTED, _PROJECTS),
    "ServiceClient.create_custom_loss": (WORKS, _CUSTOM + " (the traced loss runs client-side)"),
    "ServiceClient.create_lora_training_client": (WORKS, _TRAINING),
    "ServiceClient.create_rest_client": (WORKS, _SURFACE),
    "ServiceClient.create_sampling_client": (WORKS, _SAMPLING),
    "ServiceClient.create_training_client_from_state": (WORKS, _TRAINING),
    "ServiceClient.create_training_client_from_state_with_optimizer": (WORKS, _TRAINING),
    "ServiceClient.get_console_url": (HOSTED, _CONSOLE),
    "ServiceClient.get_server_capabilities": (WORKS, _SURFACE),
    "ServiceClient.get_telemetry": (WORKS, _SURFACE + " (client-side; None with TINKER_TELEMETRY=0)"),
    "TrainingClient.create_sampling_client": (WORKS, _SURFACE),
    "TrainingClient.forward": (WORKS, _TRAINING),
    "TrainingClient.forward_backward": (WORKS, _TRAINING),
    "TrainingClient.forward_backward_custom": (WORKS, _TRAINING),
    "TrainingClient.get_console_url": (HOSTED, _CONSOLE),
    "TrainingClient.get_info": (WORKS, _TRAINING),
    "TrainingClient.get_telemetry": (WORKS, _SURFACE),
    "TrainingClient.get_tokenizer": (WORKS, _TRAINING),
    "TrainingClient.load_state": (WORKS, _TRAINING + " (deprecated by the SDK)"),
    "TrainingClient.load_state_with_optimizer": (WORKS, _TRAINING + " (deprecated by the SDK)"),
    "TrainingClient.optim_step": (WORKS, _TRAINING),
    "TrainingClient.save_state": (WORKS, _TRAINING),
    "TrainingClient.save_weights_and_get_sampling_client": (WORKS, _SAMPLING),
    "TrainingClient.save_weights_external": (WORKS, _WEIGHTS + " (PEFT adapter; age encryption is refused)"),
    "TrainingClient.save_weights_for_sampler": (WORKS, _SAMPLING),
    "SamplingClient.compute_logprobs": (WORKS, _SAMPLING),
    "SamplingClient.create": (WORKS, _SURFACE),
    "SamplingClient.from_sampler_handle": (WORKS, _SURFACE),
    "SamplingClient.get_base_model": (WORKS, _SAMPLING),
    "SamplingClient.get_sampler_handle": (WORKS, _SURFACE),
    "SamplingClient.get_telemetry": (WORKS, _SURFACE),
    "SamplingClient.get_tokenizer": (WORKS, _SAMPLING),
    "SamplingClient.on_queue_state_change": (WORKS, _SURFACE + " (client-side logging hook)"),
    "SamplingClient.sample": (WORKS, _SAMPLING + ", " + _OPTIONS),
    "RestClient.assign_session_project": (HOSTED, _PROJECTS),
    "RestClient.copy_weights": (HOSTED, _PROJECTS),
    "RestClient.delete_checkpoint": (WORKS, _SURFACE),
    "RestClient.delete_checkpoint_from_tinker_path": (WORKS, _WEIGHTS),
    "RestClient.export_session_trace": (WORKS, _SESSIONS + " (Chrome trace JSON; ui.perfetto.dev opens it)"),
    "RestClient.get_audit_log": (HOSTED, "the audit log of a hosted organisation"),
    "RestClient.get_billing_usage": (HOSTED, _BILLING),
    "RestClient.get_current_checkpoint_storage_usage": (HOSTED, _BILLING + " (sizes are in list_user_checkpoints)"),
    "RestClient.get_external_weights_urls": (WORKS, _WEIGHTS),
    "RestClient.get_sampler": (WORKS, _SURFACE),
    "RestClient.get_server_capabilities": (WORKS, _APP),
    "RestClient.get_session": (WORKS, _SESSIONS),
    "RestClient.get_telemetry": (WORKS, _SURFACE),
    "RestClient.get_training_run": (WORKS, _APP),
    "RestClient.get_training_run_by_tinker_path": (WORKS, _SURFACE),
    "RestClient.get_weights_info_by_tinker_path": (WORKS, _APP),
    "RestClient.list_checkpoints": (WORKS, _WEIGHTS),
    "RestClient.list_sessions": (WORKS, _SESSIONS),
    "RestClient.list_training_runs": (WORKS, _APP),
    "RestClient.list_user_checkpoints": (WORKS, _WEIGHTS),
    "RestClient.publish_checkpoint_from_tinker_path": (WORKS, _SESSIONS + " (a flag: every local checkpoint is readable with the key)"),
    "RestClient.search_sessions": (WORKS, _SESSIONS),
    "RestClient.set_checkpoint_ttl_from_tinker_path": (WORKS, _TRAINING),
    "RestClient.unpublish_checkpoint_from_tinker_path": (WORKS, _SESSIONS),
    "RestClient.whoami": (HOSTED, _JWT),
    "AdminClient.get_audit_log": (HOSTED, "the audit log of a hosted organisation"),
    "AdminClient.get_billing_usage": (HOSTED, _BILLING),
    "AdminClient.get_current_checkpoint_storage_usage": (HOSTED, _BILLING),
    "AdminClient.get_telemetry": (WORKS, "client-side, as RestClient.get_telemetry"),
}

CLI_COMMANDS: dict[str, tuple[str, str]] = {
    "auth login": (HOSTED, "browser login to hosted Tinker; set TINKER_API_KEY for localtinker"),
    "auth logout": (HOSTED, "clears the hosted login"),
    "auth status": (HOSTED, "reports the hosted login"),
    "auth whoami": (HOSTED, _JWT),
    "billing checkpoint-storage": (HOSTED, _BILLING),
    "billing usage": (HOSTED, _BILLING),
    "checkpoint delete": (WORKS, _SURFACE),
    "checkpoint download": (WORKS, _WEIGHTS + " (weights/ and external_weights/ paths; plain peft loads the result)"),
    "checkpoint info": (WORKS, _SURFACE),
    "checkpoint list": (WORKS, _SURFACE),
    "checkpoint publish": (WORKS, _SESSIONS),
    "checkpoint push-hf": (HOSTED, "uploads to the Hugging Face Hub (needs the network; the download half works locally)"),
    "checkpoint set-ttl": (WORKS, _SURFACE),
    "checkpoint unpublish": (WORKS, _SESSIONS),
    "model list": (WORKS, _SURFACE),
    "run info": (WORKS, _SURFACE),
    "run list": (WORKS, _SURFACE),
    "session export-trace": (WORKS, _SESSIONS),
    "version": (WORKS, _SURFACE),
}


def markdown_table() -> str:
    """The README table: one row per SDK method and CLI command."""
    rows = ["| SDK method / CLI command | localtinker | tested by / reason |", "|---|---|---|"]
    rows += [f"| `{name}` | {status} | {why} |" for name, (status, why) in SDK_METHODS.items()]
    rows += [f"| `tinker {name}` | {status} | {why} |" for name, (status, why) in CLI_COMMANDS.items()]
    return "\n".join(rows)


def document() -> str:
    """docs/sdk_surface.md (regenerate with ``python -m localtinker.sdk_surface > docs/sdk_surface.md``)."""
    return f"""# The tinker SDK 0.38 surface against localtinker

Every public method of the SDK's clients (`ServiceClient`, `TrainingClient`, `SamplingClient`, `RestClient`,
`AdminClient`; the deprecated `*_async` twins behave as the methods they wrap) and every `tinker` CLI command:
**works** against `python -m localtinker serve` (the test that drives it), or **hosted only** (why). No call fails.
Generated from `localtinker/sdk_surface.py`; `tests/localtinker/test_sdk_surface.py` fails when the installed SDK
grows a method or command this table lacks, and when this file differs from the module.

{markdown_table()}
"""


if __name__ == "__main__":
    print(document(), end="")
