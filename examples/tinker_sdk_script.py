"""A plain tinker SDK script: nothing localtinker-specific, so it runs against hosted Tinker too.

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python examples/tinker_sdk_script.py

It creates a LoRA training client, trains a few steps on one sentence, saves its state, restores it
with the optimizer into a new client, trains one more step, and samples from the result.
"""

from __future__ import annotations

import argparse

import tinker
from tinker import types

TEXT = "The quick brown fox jumps over the lazy dog."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    service = tinker.ServiceClient()  # reads TINKER_BASE_URL and TINKER_API_KEY
    trainer = service.create_lora_training_client(base_model=args.base_model, rank=8, seed=0).result()
    tokenizer = trainer.get_tokenizer()
    tokens = tokenizer.encode(TEXT)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    adam = types.AdamParams(learning_rate=1e-2)
    for step in range(args.steps):
        loss = trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(adam)
        print(f"step {step}: loss/token {loss.result().metrics['loss:sum'] / (len(tokens) - 1):.4f}")

    state_path = trainer.save_state("example-final").result().path
    print(f"saved state {state_path}")
    resumed = service.create_training_client_from_state_with_optimizer(state_path).result()
    loss = resumed.forward_backward([datum], "cross_entropy")
    resumed.optim_step(adam).result()
    print(f"resumed step: loss/token {loss.result().metrics['loss:sum'] / (len(tokens) - 1):.4f}")

    sampler = resumed.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("The quick brown"))
    result = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=8, seed=1)).result()
    for i, sequence in enumerate(result.sequences):
        print(f"sample {i} ({sequence.stop_reason}): {tokenizer.decode(sequence.tokens)!r}")
    service.close("success").result()


if __name__ == "__main__":
    main()
