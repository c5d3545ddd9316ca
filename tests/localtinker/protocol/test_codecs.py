"""Wire codecs checked against the SDK's own encoder (request_conv) and decoders (response_conv)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from localtinker.engine.api import ForwardBackwardResult, SampledSequence, SampleResult
from localtinker.protocol import json_codec, proto_codec
from localtinker.protocol.errors import ProtocolError


def _sdk_request_bytes(data: list[types.Datum], loss_fn="cross_entropy", config=None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=7,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_forward_backward_request_decodes_tokens_inputs_and_config() -> None:
    ids = torch.zeros((3, 8), dtype=torch.int64)
    ids[1, 0] = 5
    sparse_ids = types.TensorData.from_torch_sparse(ids)
    assert sparse_ids.sparse_crow_indices is not None
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([10, 11]).append_int(12),
        loss_fn_inputs={
            "target_tokens": [11, 12, 13],
            "advantages": types.TensorData(data=[0.5, -1.0, 2.0], dtype="float32", shape=[3]),
            "mask_ids": sparse_ids,
        },
    )
    body = zstandard.ZstdCompressor().compress(_sdk_request_bytes([datum], "ppo", {"clip_low_threshold": 0.7}))
    call = proto_codec.forward_backward_call(proto_codec.parse_forward_backward(proto_codec.decompress_zstd(body, 10**6)))
    assert (call.model_id, call.seq_id, call.loss_fn, call.loss_fn_config) == ("s:train:0", 7, "ppo", {"clip_low_threshold": 0.7})
    [decoded] = call.data
    assert decoded.tokens.tolist() == [10, 11, 12] and decoded.tokens.dtype == np.int64
    assert decoded.loss_fn_inputs["target_tokens"].tolist() == [11, 12, 13]
    assert decoded.loss_fn_inputs["advantages"].tolist() == [0.5, -1.0, 2.0]
    assert decoded.loss_fn_inputs["mask_ids"].tolist() == ids.tolist()


def test_per_token_inputs_must_match_the_input_length() -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0]},
    )
    with pytest.raises(ProtocolError, match=r"data\[0\].loss_fn_inputs\['weights'\] has shape \[2\] but model_input has 3 tokens"):
        proto_codec.forward_backward_call(proto_codec.parse_forward_backward(_sdk_request_bytes([datum])))


def test_garbage_is_refused_with_a_message_not_an_exception() -> None:
    with pytest.raises(ProtocolError, match="not a valid tinker ForwardBackwardRequest"):
        proto_codec.parse_forward_backward(b"\xff\xff\xff garbage")
    with pytest.raises(ProtocolError, match="not valid zstd"):
        proto_codec.decompress_zstd(b"not zstd", 1000)
    with pytest.raises(ProtocolError, match="inflates to more than"):
        proto_codec.decompress_zstd(zstandard.ZstdCompressor().compress(b"x" * 5000), 1000)


def test_forward_backward_output_is_what_the_sdk_decodes() -> None:
    result = ForwardBackwardResult(
        loss_fn_outputs=[
            {"logprobs": np.array([-1.0, -2.0], np.float32), "topk": np.arange(6, dtype=np.float32).reshape(2, 3)},
            {"logprobs": np.array([-3.0], np.float32), "topk": np.ones((1, 3), np.float32)},
        ],
        metrics={"loss:sum": 6.0, "tokens": 3},
    )
    out = deserialize_forward_backward_output(proto_codec.encode_forward_backward_output(result, 2))
    assert out.metrics == {"loss:sum": 6.0, "tokens:mean": 3.0}  # every key keeps the SDK's name:reduction shape
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    assert out.loss_fn_outputs[0]["topk"].shape == [2, 3]
    assert out.loss_fn_outputs[1]["topk"].tolist() == [[1.0, 1.0, 1.0]]


def test_sample_response_is_what_the_sdk_decodes() -> None:
    result = SampleResult(
        sequences=[SampledSequence([5, 6], [-0.1, -0.2], "stop"), SampledSequence([7], [-0.3], "length")],
        prompt_logprobs=[None, -1.5, -2.5, -3.5],
    )
    response = deserialize_sample_response(proto_codec.encode_sample_response(result, prompt_logprobs_last_n=2))
    assert [(s.tokens, s.stop_reason) for s in response.sequences] == [([5, 6], "stop"), ([7], "length")]
    assert np.allclose(response.sequences[0].logprobs, [-0.1, -0.2])
    assert response.prompt_logprobs == [None, None, -2.5, -3.5]


def test_stop_parameter_semantics() -> None:
    def spec(stop):
        body = {"prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]}, "sampling_params": {"stop": stop}}
        parsed, _ = json_codec.parse_sample_spec(body)
        return parsed.stop_strings, parsed.stop_token_ids

    assert spec(None) == ((), None)  # EOS only
    assert spec([]) == ((), ())  # nothing stops generation, not even EOS
    assert spec("\n\nUser:") == (("\n\nUser:",), None)
    assert spec([2, 7]) == ((), (2, 7))


def test_bad_adam_params_name_every_problem() -> None:
    with pytest.raises(ProtocolError) as info:
        json_codec.parse_adam({"adam_params": {"learning_rate": -1.0, "beta1": 1.5, "eps": math.inf}})
    assert info.value.status == 400
    for problem in (
        "AdamParams.learning_rate must be finite and >= 0, got -1.0",
        "AdamParams.beta1 must be finite and in [0, 1), got 1.5",
        "AdamParams.eps must be finite and > 0",
    ):
        assert problem in info.value.message


@pytest.mark.parametrize(
    "bad",
    [{"eps": 0.0}, {"eps": -1e-8}, {"beta2": 1.0}, {"weight_decay": -0.1}, {"grad_clip_norm": math.nan}, {"learning_rate": math.inf}],
)
def test_protocol_and_engine_reject_the_same_adam_params(bad) -> None:
    """One rule set: the protocol's 400 and the engine's error carry the same problems."""
    from localtinker.engine.api import AdamSpec, EngineUserError
    from localtinker.engine.optimizer import validate_adam

    with pytest.raises(ProtocolError) as protocol_error:
        json_codec.parse_adam({"adam_params": bad})
    with pytest.raises(EngineUserError) as engine_error:
        validate_adam(AdamSpec(**bad))
    assert protocol_error.value.status == 400
    (name,) = bad
    assert f"AdamParams.{name} must be" in protocol_error.value.message
    assert protocol_error.value.message.removeprefix("optim_step: bad AdamParams: ") == str(engine_error.value).rstrip(".")


def test_max_tokens_defaults_to_no_limit() -> None:
    """The SDK's SamplingParams.max_tokens defaults to None: the engine then samples to the context end."""
    body = {"prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]}, "sampling_params": {"max_tokens": None}}
    assert json_codec.parse_sample_spec(body)[0].max_tokens is None
    body["sampling_params"] = {}
    assert json_codec.parse_sample_spec(body)[0].max_tokens is None
    body["sampling_params"] = {"max_tokens": 0}
    with pytest.raises(ProtocolError, match="max_tokens=0 must be >= 1"):
        json_codec.parse_sample_spec(body)


def test_unsupported_losses_are_refused_naming_the_supported_ones() -> None:
    with pytest.raises(ProtocolError, match="stable_reinforce.*no published formula.*cross_entropy, importance_sampling, ppo, cispo, dro, gspo"):
        json_codec.check_loss_fn("stable_reinforce")


def test_model_and_seq_are_read_from_the_head_of_an_unread_body() -> None:
    body = _sdk_request_bytes([types.Datum(model_input=types.ModelInput.from_ints(list(range(5000))), loss_fn_inputs={})])
    assert proto_codec.leading_model_and_seq(body[:32]) == ("s:train:0", 7)
    assert proto_codec.leading_model_and_seq(proto_codec.zstd_prefix(zstandard.ZstdCompressor().compress(body))) == ("s:train:0", 7)
    assert proto_codec.leading_model_and_seq(body[:5]) == (None, None)  # model_id cut off: nothing to free
    assert proto_codec.leading_model_and_seq(b"garbage") == (None, None)
