"""Fast rendering of whole datasets of conversations into token columns.

Public API (stable; the data layer codes against it)::

    from posttrain.renderers import get_renderer, TrainOnWhat
    from posttrain.renderers.batch import render_supervised_batch, RenderedBatch

    renderer = get_renderer("chatml", tokenizer)          # tokenizer: HF fast tokenizer
    batch: RenderedBatch = render_supervised_batch(
        renderer,
        conversations,                                    # Sequence[Sequence[Message]]
        train_on_what=TrainOnWhat.LAST_ASSISTANT_MESSAGE,  # or ALL_ASSISTANT_MESSAGES, ...
        max_length=None,                                  # int: truncate from the right
    )
    batch.columns() -> dict[str, list]   # arrow-friendly, one entry per conversation:
        "tokens"              list[int]    full rendered sequence (after truncation, unshifted)
        "weights"             list[float]  per-token loss weight, same length as "tokens" (raw 0/1)
        "num_tokens"          int          len(tokens)
        "num_trained_tokens"  int          tokens with weight > 0
        "original_num_tokens" int          length before max_length truncation
        "truncated"           bool         original_num_tokens > max_length
    batch.to_arrow() -> pyarrow.Table     # the same columns (tokens int32 lists, weights float32 lists)

Shifting into a training ``tinker.Datum`` (input = tokens[:-1], target = tokens[1:], weights[1:]),
with SFT "mean" normalisation, is ``posttrain.renderers.datum.datum_from_tokens_weights``.

The rows are token-for-token identical to ``renderer.build_supervised_example`` (tested); the speed
comes from encoding the message contents of all conversations in one batched tokenizer call and
encoding each template piece (headers, end-of-turn markers) once.
"""
