"""Rolling out groups of environments through a Tinker sampling client.

Within a group, every env's request for a turn is submitted before any is awaited; when all G envs of
a group open with the same prompt and stop condition (the usual single-turn GRPO group), the first turn
is *one* request with ``num_samples=G``, so the server prefills the shared prompt once. Groups run
concurrently, each in a worker thread that mostly waits on the server; :func:`rollout_groups` returns
them in order, :func:`iter_finished_groups` yields each as soon as it is done (streaming training).

Every request carries a seed derived from (group seed, turn, env), so a batch rolled out again with
the same weights samples the same tokens: that is what makes a resumed RL run repeat its steps exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from posttrain.completers import StopCondition, TokenCompleter, TokensWithLogprobs
from posttrain.rl.data import observation_tokens
from posttrain.rl.types import Env, EnvGroupBuilder, Observation, Trajectory, TrajectoryGroup, Transition

MAX_CONCURRENT_GROUPS = 64
_SEED_MODULUS = 2**31 - 1


def derive_seed(*parts: int) -> int:
    """A stable seed from integers (Python's ``hash`` of a tuple is stable for ints, but spelled out here)."""
    seed = 17
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % _SEED_MODULUS
    return seed


def _sample_turn(
    completer: TokenCompleter, prompts: list[tuple[Observation, StopCondition]], seed: int, turn: int, indices: list[int]
) -> list[TokensWithLogprobs]:
    """One action per prompt; a single num_samples request when every prompt is the same (turn 0)."""
    shared = turn == 0 and len(prompts) > 1 and all(
        stop == prompts[0][1] and observation_tokens(ob) == observation_tokens(prompts[0][0]) for ob, stop in prompts
    )
    if shared:
        observation, stop = prompts[0]
        return completer.submit(observation, stop, num_samples=len(prompts), seed=derive_seed(seed, turn)).result()
    pending = [
        completer.submit(observation, stop, seed=derive_seed(seed, turn, index))
        for (observation, stop), index in zip(prompts, indices, strict=True)
    ]
    return [request.result()[0] for request in pending]


def run_episodes(envs: Sequence[Env], completer: TokenCompleter, seed: int) -> list[Trajectory]:
    """Play every env to the end, turn by turn, all envs of a turn sampled concurrently."""
    prompts: dict[int, tuple[Observation, StopCondition]] = {index: env.initial_observation() for index, env in enumerate(envs)}
    transitions: dict[int, list[Transition]] = {index: [] for index in prompts}
    final_observations: dict[int, Observation | None] = {}
    turn = 0
    while prompts:
        active = sorted(prompts)
        actions = _sample_turn(completer, [prompts[index] for index in active], seed, turn, active)
        for index, action in zip(active, actions, strict=True):
            observation, _ = prompts.pop(index)
            result = envs[index].step(list(action.tokens))
            transitions[index].append(Transition(observation, action, float(result.reward), result.episode_done, dict(result.metrics)))
            if result.episode_done:
                final_observations[index] = result.next_observation
            elif result.next_observation is None or result.next_stop is None:
                raise ValueError(
                    f"{type(envs[index]).__name__}.step returned episode_done=False without a next_observation "
                    "and next_stop; an unfinished episode must say what the model sees next"
                )
            else:
                prompts[index] = (result.next_observation, result.next_stop)
        turn += 1
    return [Trajectory(transitions[index], final_observations.get(index)) for index in range(len(envs))]


def rollout_group(builder: EnvGroupBuilder, completer: TokenCompleter, seed: int) -> TrajectoryGroup:
    envs = builder.make_envs()
    if not envs:
        raise ValueError(f"{type(builder).__name__}.make_envs returned no envs; a group needs at least one")
    trajectories = run_episodes(envs, completer, seed)
    group_rewards = builder.compute_group_rewards(trajectories, envs)
    return TrajectoryGroup(
        trajectories_G=trajectories,
        final_rewards_G=[float(reward) for reward, _ in group_rewards],
        metrics_G=[dict(metrics) for _, metrics in group_rewards],
        tags=tuple(builder.logging_tags()),
        logs_G=[dict(logs) for logs in builder.trajectory_logs(envs)],
    )


def iter_finished_groups(
    builders: Sequence[EnvGroupBuilder], completer: TokenCompleter, seeds: Sequence[int]
) -> Iterator[tuple[int, TrajectoryGroup]]:
    """(index, group) for every builder, in the order the groups finish."""
    if len(seeds) != len(builders):
        raise ValueError(f"{len(builders)} group builders but {len(seeds)} seeds; give one seed per group")
    if not builders:
        return
    with ThreadPoolExecutor(max_workers=min(len(builders), MAX_CONCURRENT_GROUPS), thread_name_prefix="rollout") as pool:
        futures = {pool.submit(rollout_group, builder, completer, seed): index for index, (builder, seed) in enumerate(zip(builders, seeds))}
        for future in as_completed(futures):
            yield futures[future], future.result()


def rollout_groups(builders: Sequence[EnvGroupBuilder], completer: TokenCompleter, seeds: Sequence[int]) -> list[TrajectoryGroup]:
    """Every builder's group, concurrently, returned in the builders' order."""
    finished = dict(iter_finished_groups(builders, completer, seeds))
    return [finished[index] for index in range(len(builders))]
