"""The RL recipe on the training core (``posttrain.training.core.train``).

    recipe = RLRecipe(config, dataset)          # dataset: posttrain.rl.envs.build_rl_dataset(...)
    train(config.training, recipe, service_client)

The core owns the training client, LR schedule, checkpoints, resume and evaluation; the recipe owns one
step: sample with the current weights, score, build datums, ``forward_backward`` and ``optim_step``
(``posttrain.rl.step``), driven by the driver ``config.mode`` names (``posttrain.rl.drivers``).
Rows: one per sample (prompt, completion, tokens, sampler logprobs, reward, advantage, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tinker

from posttrain.rl.config import RLConfig
from posttrain.rl.drivers import AsyncDriver, StreamingDriver, SyncDriver
from posttrain.rl.types import RLDataset
from posttrain.training.recipe import PendingStep

DRIVERS = {"sync": SyncDriver, "streaming": StreamingDriver, "async": AsyncDriver}


class RLRecipe:
    name = "rl"

    def __init__(self, config: RLConfig, dataset: RLDataset, tokenizer: Any | None = None, parent_sampler_path: str | None = None):
        """``parent_sampler_path``: sampler weights of the checkpoint ``init_from`` names, the KL reference when
        ``kl_reference='parent'`` (a run that starts from no checkpoint has the base model as its parent)."""
        config.validate()
        if len(dataset) == 0:
            raise ValueError("RLRecipe got an empty dataset: it has no batches to train on")
        if config.kl_penalty_coef > 0 and config.kl_reference == "parent" and config.training.init_from and not parent_sampler_path:
            raise ValueError(
                f"kl_reference='parent' needs the sampler weights of the parent checkpoint {config.training.init_from}: "
                "start from a registered checkpoint (its manifest names them) or set kl_reference='base'"
            )
        self.config = config
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.parent_sampler_path = parent_sampler_path if config.training.init_from else None
        self._driver: SyncDriver | StreamingDriver | AsyncDriver | None = None

    def num_steps(self) -> int:
        return len(self.dataset)

    def identity(self) -> dict[str, Any]:
        rl = {**self.config.identity(), "kl_reference": self.kl_reference_path()}
        return {"recipe": self.name, "rl": rl, "dataset": self.dataset.identity()}

    def kl_reference_path(self) -> str:
        """What the KL is measured from: the parent's sampler path, or ``base`` (also a parent-less run's parent)."""
        if self.config.kl_reference == "parent" and self.parent_sampler_path:
            return self.parent_sampler_path
        return "base"

    def start(self, training_client: tinker.TrainingClient, service_client: tinker.ServiceClient, start_step: int) -> None:
        if self.tokenizer is None:
            self.tokenizer = training_client.get_tokenizer()
        reference = self.kl_reference(service_client) if self.config.kl_penalty_coef > 0 else None
        self._driver = DRIVERS[self.config.mode](self.config, self.dataset, self._decode, reference)
        self._driver.start(training_client, start_step)

    def kl_reference(self, service_client: tinker.ServiceClient) -> tinker.SamplingClient:
        """The policy the KL penalty measures divergence from. The parent by default: RL from a trained checkpoint
        should refine it, and a KL towards the base model would pull it back to what SFT already fixed."""
        path = self.kl_reference_path()
        if path != "base":
            return service_client.create_sampling_client(model_path=path).result()
        return service_client.create_sampling_client(base_model=self.config.training.base_model).result()

    def submit_step(self, step: int, training_client: tinker.TrainingClient, adam: tinker.AdamParams) -> PendingStep:
        if self._driver is None:
            raise RuntimeError("RLRecipe.submit_step before start(): call start(training_client, service_client, start_step) first")
        return self._driver.submit_step(step, training_client, adam)

    def close(self) -> None:
        if self._driver is not None:
            self._driver.close()
            self._driver = None

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))
