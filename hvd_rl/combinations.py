"""What combines with what: the option space the combination matrix runs (tests/test_option_matrix.py)
and the table of refused pairs in the README and the docs' configuration reference, all derived from
the rules `config.validate()` enforces.

    python -m hvd_rl.combinations      # prints the table

A pair of option values is refused when `validate()` refuses it with every other option at its
most permissive value (the first of its list); the table names the rule that refuses it.
"""
from __future__ import annotations

import itertools

from hvd_rl.config import ConfigError, TrainConfig, load_config, validate

OPTIONS: dict[str, list] = {  # first value = the most permissive one
    "algorithm": ["ppo_discrete", "ppo_continuous", "dqn"],
    "ranks": [1, 2, 3],
    "balance": ["off", "static", "dynamic"],
    "reduction": ["average", "adasum"],
    "layout": ["even", "uneven"],
    "backward_passes_per_step": [1, 2],
    "start": ["fresh", "resume_ranks", "resume_envs"],
    "backend": ["sync", "async"],
    "compression": ["none", "fp16", "powersgd", "topk"],
    "amp": ["off", "bf16"],
}
NAMES = list(OPTIONS)
ENV_IDS = {"ppo_discrete": "CartPole-v1", "ppo_continuous": "Pendulum-v1", "dqn": "CartPole-v1"}


def uneven_counts(ranks: int) -> list[int]:
    return [1, 3] if ranks == 2 else [1, 2, 3] if ranks == 3 else [2]


def option_overrides(values: dict) -> list[str]:
    """The `--set` values that put a run at these option values (`start` and `ranks` are how it
    is launched, not settings). A run asking for Adasum turns clipping off, the fix validate names."""
    algorithm = "dqn" if values["algorithm"] == "dqn" else "ppo"
    sets = [f"algorithm={algorithm}", f"env.id={ENV_IDS[values['algorithm']]}", f"env.backend={values['backend']}",
            f"distributed.balance={values['balance']}", f"distributed.reduction={values['reduction']}",
            f"distributed.compression={values['compression']}", f"distributed.amp={values['amp']}"]
    if values["layout"] == "uneven":
        sets.append(f"distributed.env_counts={uneven_counts(values['ranks'])}")
    if algorithm == "ppo":
        sets.append(f"ppo.backward_passes_per_step={values['backward_passes_per_step']}")
    if values["reduction"] == "adasum":
        sets.append(f"{algorithm}.max_grad_norm=0")
    return sets


def refusal(cfg: TrainConfig, ranks: int) -> str | None:
    try:
        validate(cfg, world_size=ranks)
    except ConfigError as exc:
        return str(exc)
    return None


def refused_pairs() -> list[tuple[str, str, str]]:
    """(option = value, option = value, why) for every pair validate() refuses on its own."""
    out = []
    for a, b in itertools.combinations(NAMES, 2):
        for va, vb in itertools.product(OPTIONS[a], OPTIONS[b]):
            values = {n: OPTIONS[n][0] for n in NAMES} | {a: va, b: vb}
            why = refusal(load_config(None, option_overrides(values)), values["ranks"])
            if why:
                out.append((f"{a} = {va}", f"{b} = {vb}", why.removeprefix("invalid configuration: ")))
    return out


def markdown_table() -> str:
    rows = ["| option | with | refused because |", "| --- | --- | --- |"]
    rows += [f"| `{x}` | `{y}` | {why} |" for x, y, why in refused_pairs()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
