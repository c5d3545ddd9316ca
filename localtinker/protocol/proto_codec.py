"""Protobuf on the wire (``tinker.proto.tinker_public_pb2``) <-> the engine's plain dataclasses.

``ForwardBackwardRequest`` arrives as protobuf (optionally zstd-compressed); the SDK only accepts
``ForwardBackwardOutput`` and ``SampleResponse`` results as protobuf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from localtinker.engine.api import TOPK_MASK, DatumArrays, ForwardBackwardResult, SampleExtras, SampleResult, TopK

from .errors import ProtocolError, bad_request

# Loss inputs that hold one value per input token; their length must match the model input.
PER_TOKEN_INPUTS = ("target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask")

_NUMPY_OF_DTYPE = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int | None
    loss_fn: str
    loss_fn_config: dict[str, float] | None
    forward_only: bool
    data: list[DatumArrays]


def decompress_zstd(body: bytes, max_bytes: int) -> bytes:
    """Decompresses a zstd body, refusing anything that inflates beyond ``max_bytes``."""
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        out = reader.read(max_bytes + 1)
    except zstandard.ZstdError as e:
        raise bad_request(f"Content-Encoding is zstd but the body is not valid zstd data: {e}") from e
    if len(out) > max_bytes:
        raise ProtocolError(
            413, f"the zstd body inflates to more than {max_bytes} bytes; send smaller forward_backward chunks"
        )
    return out


def zstd_prefix(body: bytes, size: int = 4096) -> bytes:
    """The first ``size`` decompressed bytes of a zstd body (or of its readable start); b"" if none."""
    try:
        return zstandard.ZstdDecompressor().stream_reader(body).read(size)
    except zstandard.ZstdError:
        return b""


def leading_model_and_seq(head: bytes) -> tuple[str | None, int | None]:
    """model_id (field 1) and seq_id (field 2) from the head of a ForwardBackwardRequest.

    Protobuf writes fields in number order, so both precede the (possibly huge, possibly unread) data.
    Returns (None, None) when the head does not start with a readable model_id.
    """
    model_id, seq_id, pos = None, None, 0
    while pos < len(head):
        tag, pos = _varint(head, pos)
        if tag is None:
            break
        if tag == (1 << 3) | 2:  # model_id: length-delimited
            length, pos = _varint(head, pos)
            if length is None or pos + length > len(head):
                break
            model_id, pos = head[pos : pos + length].decode("utf-8", "replace"), pos + length
        elif tag == (2 << 3) | 0:  # seq_id: varint
            seq_id, pos = _varint(head, pos)
        else:
            break
    if not model_id:
        return None, None
    return model_id, seq_id if seq_id else None


def _varint(data: bytes, pos: int) -> tuple[int | None, int]:
    value, shift = 0, 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None, pos


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise bad_request(
            f"forward_backward body is not a valid tinker ForwardBackwardRequest protobuf ({e}); "
            "send it with Content-Type: application/x-protobuf as the tinker SDK does"
        ) from e
    if not msg.model_id:
        raise bad_request("forward_backward: model_id is empty; pass the id create_model returned")
    return msg


def forward_backward_call(msg: pb.ForwardBackwardRequest) -> ForwardBackwardCall:
    """The decoded request; raises a 400 ProtocolError naming the first bad datum or field."""
    if not msg.data:
        raise bad_request(f"forward_backward on {msg.model_id}: data is empty; send at least one Datum")
    data = [_decode_datum(datum, i) for i, datum in enumerate(msg.data)]
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=msg.seq_id if msg.seq_id > 0 else None,
        loss_fn=msg.loss_fn,
        loss_fn_config=_decode_loss_config(msg),
        forward_only=msg.forward_only,
        data=data,
    )


def _decode_loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float] | None:
    if msg.loss_fn_config_v2:
        config: dict[str, float] = {}
        for key, value in msg.loss_fn_config_v2.items():
            if value.WhichOneof("value") != "number":
                raise bad_request(
                    f"loss_fn_config[{key!r}] is text; the supported losses take only numbers"
                )
            config[key] = float(value.number)
        return config
    if msg.loss_fn_config:
        return {key: float(value) for key, value in msg.loss_fn_config.items()}
    return None


def _decode_datum(datum: pb.Datum, index: int) -> DatumArrays:
    pieces = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise bad_request(
                f"data[{index}].model_input.chunks[{j}] is a {kind or 'empty'} chunk; "
                "localtinker serves text models only: send encoded_text chunks"
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise bad_request(f"data[{index}].model_input.chunks[{j}]: token bytes are not int32-aligned")
        pieces.append(np.frombuffer(raw, dtype="<i4"))
    tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
    if tokens.size == 0:
        raise bad_request(f"data[{index}].model_input is empty; every Datum needs at least one token")
    if tokens.min() < 0:
        raise bad_request(f"data[{index}].model_input has negative token id {int(tokens.min())}")
    inputs = {
        name: _decode_tensor(tensor, f"data[{index}].loss_fn_inputs[{name!r}]")
        for name, tensor in datum.loss_fn_inputs.items()
    }
    for name in PER_TOKEN_INPUTS:
        if name in inputs and (inputs[name].ndim == 0 or inputs[name].shape[0] != tokens.size):
            raise bad_request(
                f"data[{index}].loss_fn_inputs[{name!r}] has shape {list(inputs[name].shape)} but "
                f"model_input has {tokens.size} tokens; per-token inputs need one entry per input "
                "token (target_tokens are the inputs shifted left by one)"
            )
    return DatumArrays(tokens=tokens, loss_fn_inputs=inputs)


def _decode_tensor(tensor: pb.Tensor, where: str) -> np.ndarray:
    dtype = _NUMPY_OF_DTYPE.get(tensor.dtype)
    if dtype is None:
        raise bad_request(f"{where}: unsupported dtype {tensor.dtype}; use float32 or int64")
    shape = [int(s) for s in tensor.shape]
    encoding = tensor.WhichOneof("encoding")
    if encoding == "sparse_csr":
        array = _densify_csr(tensor.sparse_csr, dtype, shape, where)
    else:
        raw = tensor.dense
        if len(raw) % dtype.itemsize:
            raise bad_request(f"{where}: {len(raw)} bytes is not a whole number of {dtype} values")
        array = np.frombuffer(raw, dtype=dtype.newbyteorder("<"))
        if shape:
            if math.prod(shape) != array.size:
                raise bad_request(f"{where}: shape {shape} does not match its {array.size} values")
            array = array.reshape(shape)
    if dtype == np.int32:
        array = array.astype(np.int64)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise bad_request(f"{where} contains NaN or infinite values")
    return np.array(array, dtype=array.dtype.newbyteorder("="))


def _densify_csr(csr: pb.SparseCsr, dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    if len(shape) != 2:
        raise bad_request(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    values = np.frombuffer(csr.values, dtype=dtype)
    crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
    col = np.frombuffer(csr.col_indices, dtype=np.int64)
    rows, cols = shape
    valid = (
        crow.size == rows + 1
        and col.size == values.size
        and crow[0] == 0
        and crow[-1] == values.size
        and bool(np.all(np.diff(crow) >= 0))
        and (col.size == 0 or (col.min() >= 0 and col.max() < cols))
    )
    if not valid:
        raise bad_request(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    dense = np.zeros((rows, cols), dtype=dtype)
    row_of_value = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of_value, col] = values
    return dense


def encode_forward_backward_output(result: ForwardBackwardResult, num_datums: int) -> bytes:
    """One ArrayRecord whose fields batch every datum's arrays, as SDK 0.38 decodes it."""
    if len(result.loss_fn_outputs) != num_datums:
        raise RuntimeError(
            f"engine returned {len(result.loss_fn_outputs)} loss_fn_outputs for {num_datums} datums"
        )
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in result.metrics.items():
        out.metrics[_metric_key(key)] = float(value)
    record = out.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = num_datums
    names = sorted({name for output in result.loss_fn_outputs for name in output})
    for name in names:
        arrays = [np.asarray(output[name]) for output in result.loss_fn_outputs]
        is_float = any(a.dtype.kind == "f" for a in arrays)
        wire_dtype = np.dtype("<f4") if is_float else np.dtype("<i8")
        arrays = [np.ascontiguousarray(a, dtype=wire_dtype) for a in arrays]
        batched = record.fields[name]
        batched.dtype = pb.DTYPE_FLOAT32 if is_float else pb.DTYPE_INT64
        batched.trailing_shape.extend(arrays[0].shape[1:] if arrays else ())
        offsets = np.zeros(len(arrays) + 1, dtype="<i8")
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        batched.offsets = offsets.tobytes()
        batched.data = b"".join(a.tobytes() for a in arrays)
    return out.SerializeToString()


def _metric_key(key: str) -> str:
    """The SDK splits every metric key into exactly ``name:reduction``; keep keys in that shape."""
    if key.count(":") == 1:
        return key
    return key.replace(":", "_") + ":mean"


def _topk_proto(message: Any, topk: TopK, last_n: int | None = None) -> None:
    token_ids, logprobs = topk.token_ids.astype("<i4"), topk.logprobs.astype("<f4")
    if last_n is not None:  # prompt_logprobs_last_n applies to the prompt's top-k too
        token_ids, logprobs = token_ids.copy(), logprobs.copy()
        token_ids[: max(0, len(token_ids) - last_n)] = 0
        logprobs[: max(0, len(logprobs) - last_n)] = TOPK_MASK
    message.token_ids = token_ids.tobytes()
    message.logprobs = logprobs.tobytes()
    message.length, message.k = token_ids.shape


def _tensor_proto(message: Any, array: np.ndarray) -> None:
    dtype = pb.DTYPE_INT64 if array.dtype.kind in "iu" else pb.DTYPE_FLOAT32
    message.dense = array.astype("<i8" if dtype == pb.DTYPE_INT64 else "<f4").tobytes()
    message.dtype = dtype
    message.shape.extend(array.shape)


def encode_sample_response(
    result: SampleResult, prompt_logprobs_last_n: int | None = None, extras: SampleExtras | None = None
) -> bytes:
    out = pb.SampleResponse()
    for i, sequence in enumerate(result.sequences):
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if sequence.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(sequence.tokens, dtype="<i4").tobytes()
        seq.logprobs = np.asarray(sequence.logprobs, dtype="<f4").tobytes()
        if extras is not None and extras.topk_sample is not None:
            _topk_proto(seq.topk_sampled_logprobs, extras.topk_sample[i])
    if result.prompt_logprobs is not None:
        values = np.array(
            [math.nan if v is None else float(v) for v in result.prompt_logprobs], dtype="<f4"
        )
        if prompt_logprobs_last_n is not None:
            values[: max(0, values.size - prompt_logprobs_last_n)] = math.nan
        out.prompt_logprobs = values.tobytes()
    if extras is not None:
        if extras.topk_prompt is not None:
            _topk_proto(out.topk_prompt_logprobs, extras.topk_prompt, prompt_logprobs_last_n)
        if extras.target_prompt is not None:
            _tensor_proto(out.target_prompt_logprobs, extras.target_prompt)
        if extras.prompt_alt_tokens is not None:
            _tensor_proto(out.prompt_alt_tokens.tokens, extras.prompt_alt_tokens[0])
            _tensor_proto(out.prompt_alt_tokens.logprobs, extras.prompt_alt_tokens[1])
    return out.SerializeToString()
