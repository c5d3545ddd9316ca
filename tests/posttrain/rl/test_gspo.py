"""An RL step with loss_fn="gspo" through the real SDK and localtinker, checked against GSPO-token's formula.

The formula (ARCHITECTURE §4, Tinker's GSPO docs) is recomputed here in plain numpy from what the server
returned (learner logprobs lp) and what was sent (sampler logprobs q, advantages A, sequence_ratio_mask):
s = exp(mean over the mask of lp − q); every token's ratio has s's value; loss = −Σ min(s·A, clip(s, lo, hi)·A).
Sampling at temperature 0.7 makes q the logprob of the *tempered* distribution while lp is the learner's
at temperature 1, so s differs from 1 and from sequence to sequence: the step is off-policy enough that
the clip bounds decide the loss, and a token-level ratio (PPO) would give a different value. The tiny
random model never answers arithmetic, so a group bonus (the share of even token ids in the answer) makes
rewards, hence advantages, differ within each group.
"""

import numpy as np
import pytest
import tinker

from posttrain.rl.config import RLConfig
from posttrain.rl.data import MASK_KEY
from posttrain.rl.recipe import RLRecipe
from posttrain.rl.types import EnvGroupBuilder, RLDataset
from tests.fixtures.server import TINY_MODEL
from tests.posttrain.rl.test_recipe import make_config, recipe_for


class FutureKeepingTrainingClient:
    """The real training client; each forward_backward call's sent datums and future are kept."""

    def __init__(self, client: tinker.TrainingClient):
        self._client = client
        self.calls: list[tuple[str, dict | None, list[tinker.Datum], object]] = []

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        future = self._client.forward_backward(data, loss_fn, loss_fn_config)
        self.calls.append((loss_fn, loss_fn_config, list(data), future))
        return future

    def __getattr__(self, name):
        return getattr(self._client, name)


class EvenTokenBonus(EnvGroupBuilder):
    """An arithmetic group whose final reward adds the share of even token ids in each answer."""

    def __init__(self, inner: EnvGroupBuilder):
        self.inner = inner

    def make_envs(self):
        return self.inner.make_envs()

    def compute_group_rewards(self, trajectories, envs):
        shares = [np.mean([token % 2 == 0 for token in t.transitions[0].action.tokens]) for t in trajectories]
        return [(float(share), {}) for share in shares]


class EvenTokenDataset(RLDataset):
    def __init__(self, inner: RLDataset):
        self.inner = inner

    def get_batch(self, index: int):
        return [EvenTokenBonus(builder) for builder in self.inner.get_batch(index)]

    def __len__(self) -> int:
        return len(self.inner)


def arrays(datum: tinker.Datum, key: str) -> np.ndarray:
    return datum.loss_fn_inputs[key].to_numpy().astype(np.float64)


def gspo_loss(lp: np.ndarray, q: np.ndarray, advantages: np.ndarray, mask: np.ndarray, low: float, high: float) -> float:
    sequence_ratio = np.exp((lp - q)[mask != 0].mean())
    clipped = np.clip(sequence_ratio, low, high)
    return float(-np.minimum(sequence_ratio * advantages, clipped * advantages).sum())


def ppo_loss(lp: np.ndarray, q: np.ndarray, advantages: np.ndarray, low: float, high: float) -> float:
    ratio = np.exp(lp - q)
    return float(-np.minimum(ratio * advantages, np.clip(ratio, low, high) * advantages).sum())


def run_gspo_step(service_client, config: RLConfig) -> tuple[FutureKeepingTrainingClient, dict[str, float]]:
    client = FutureKeepingTrainingClient(service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result())
    recipe = recipe_for(config)
    recipe = RLRecipe(config, EvenTokenDataset(recipe.dataset), recipe.tokenizer)
    recipe.start(client, service_client, 0)
    try:
        outcome = recipe.submit_step(0, client, tinker.AdamParams(learning_rate=1e-3)).result()
    finally:
        recipe.close()
    return client, outcome.metrics


@pytest.mark.parametrize("bounds", [(1 - 3e-4, 1 + 4e-4), (0.96, 1.01)])
def test_gspo_step_loss_matches_the_sequence_ratio_formula(service_client, tmp_path, bounds):
    low, high = bounds
    config = make_config(
        tmp_path,
        loss_fn="gspo",
        loss_fn_config={"clip_low_threshold": low, "clip_high_threshold": high},
        temperature=0.7,
        remove_constant_reward_groups=False,
        num_substeps=2,
    )
    client, metrics = run_gspo_step(service_client, config)

    assert [call[0] for call in client.calls] == ["gspo", "gspo"]
    expected_gspo, token_level_ppo, server_loss, ratios = 0.0, 0.0, 0.0, []
    for _, loss_config, sent, future in client.calls:
        assert loss_config == {"clip_low_threshold": low, "clip_high_threshold": high}
        output = future.result()
        server_loss += float(output.metrics["loss:sum"])
        assert len(output.loss_fn_outputs) == len(sent)
        for datum, returned in zip(sent, output.loss_fn_outputs, strict=True):
            assert set(datum.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages", "sequence_ratio_mask"}
            lp = np.asarray(returned["logprobs"].to_numpy(), dtype=np.float64)
            q, advantages, mask = (arrays(datum, key) for key in ("logprobs", "advantages", "sequence_ratio_mask"))
            assert lp.shape == q.shape == mask.shape and mask.sum() >= 1
            # The mask marks exactly the sampled tokens: the ones carrying an advantage and a sampler logprob.
            assert np.all(q[mask == 0] == 0) and np.all(advantages[mask == 0] == 0)
            expected_gspo += gspo_loss(lp, q, advantages, mask, low, high)
            token_level_ppo += ppo_loss(lp, q, advantages, low, high)
            ratios.append(float(np.exp((lp - q)[mask != 0].mean())))

    assert len(ratios) == 12  # 4 groups x 3 samples, none removed
    assert metrics["frac_constant_reward_groups"] < 1  # advantages are not all zero
    assert max(ratios) - min(ratios) > 1e-2  # the tempered sampler makes the sequence ratios differ
    assert any(r < low or r > high for r in ratios)  # some sequences are clipped: the bounds matter
    assert server_loss == pytest.approx(expected_gspo, rel=1e-4, abs=1e-4)
    assert metrics["loss:sum"] == pytest.approx(expected_gspo, rel=1e-4, abs=1e-4)
    assert abs(expected_gspo - token_level_ppo) > 1e-2  # the check tells GSPO from a token-level ratio
    assert np.isfinite(metrics["reward/mean"]) and metrics["num_datums"] == 12


def test_gspo_sequence_ratio_mask_is_the_rl_mask(service_client, tmp_path):
    """What the step sends as ``sequence_ratio_mask`` is the datum's own action mask (prompt tokens excluded)."""
    config = make_config(tmp_path, loss_fn="gspo", remove_constant_reward_groups=False)
    client, _ = run_gspo_step(service_client, config)
    sent = [datum for call in client.calls for datum in call[2]]
    for datum in sent:
        mask = arrays(datum, "sequence_ratio_mask")
        assert MASK_KEY not in datum.loss_fn_inputs
        prompt_positions = np.flatnonzero(mask == 0)
        sampled_positions = np.flatnonzero(mask != 0)
        # Prompt first, then the sampled completion: the mask is a contiguous block of ones at the end.
        assert prompt_positions.size > 0 and sampled_positions.size > 0
        assert sampled_positions.min() > prompt_positions.max()
        assert sampled_positions.max() == len(mask) - 1
