"""Reinforcement learning on Tinker, framework-free (tinker-cookbook's vocabulary, our code).

- ``types``: Env, EnvGroupBuilder, RLDataset, Transition, Trajectory, TrajectoryGroup;
- ``rollouts``: concurrent group rollouts through a sampling client (sampler logprobs kept);
- ``advantages``: group-centred advantages, constant-group removal;
- ``data``: trajectories -> datums (target_tokens, logprobs, advantages, mask);
- ``kl``: KL penalty against a reference sampler; sampler/learner KL and entropy estimates;
- ``envs``: environments by name (``build_rl_dataset``);
- ``config`` / ``recipe`` / ``step`` / ``drivers``: the RL recipe on the training core.
"""
