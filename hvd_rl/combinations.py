"""What combines with what: the option space the combination matrix runs (tests/test_option_matrix.py)
and the table of refused pairs in the README and the docs' configuration reference, all derived from
the rules `config.validate()` enforces.

    python -m hvd_rl.combinations      # prints the table

A pair of option values is refused when `validate()` refuses it with every other option at its
most permissive value (the first of its list); the table names the rule that refuses it. The table
spans TABLE_OPTIONS: the matrix's options and the settings whose refusals need no run to show
(tests/test_config.py probes every setting's values in pairs and checks each refusal is here).
"""
from __future__ import annotations

import itertools

from hvd_rl.config import ConfigError, TrainConfig, load_config, validate

OPTIONS: dict[str, list] = {  # first value = the most permissive one
    "algorithm": ["ppo_discrete", "ppo_continuous", "dqn", "mappo"],
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
# The table's options: the matrix's, with fp16 autocast (CUDA only, so the matrix on CPUs leaves it
# out) and gradient clipping, whose default (ppo.max_grad_norm = 0.5) Adasum refuses.
# IPPO refuses what MAPPO refuses (the matrix runs MAPPO for both: they differ in the critic's input),
# and the multi-agent algorithms refuse the CNN and PPO's observation and reward normalisation.
# ppo.pipeline meets every other option in the matrix's own overlap rows (tests/test_option_matrix.py).
TABLE_OPTIONS: dict[str, list] = OPTIONS | {"algorithm": [*OPTIONS["algorithm"], "ippo"],
                                            "amp": [*OPTIONS["amp"], "fp16"], "max_grad_norm": [0, 0.5],
                                            "model_kind": ["auto", "nature_cnn"], "normalize_observations": [False, True],
                                            "pipeline": ["sync", "overlap"]}
ENV_IDS = {"ppo_discrete": "CartPole-v1", "ppo_continuous": "Pendulum-v1", "dqn": "CartPole-v1",
           "mappo": "mpe2/simple_spread_v3", "ippo": "mpe2/simple_spread_v3"}


def uneven_counts(ranks: int) -> list[int]:
    return [1, 3] if ranks == 2 else [1, 2, 3] if ranks == 3 else [2]


def option_overrides(values: dict) -> list[str]:
    """The `--set` values that put a run at these option values (`start` and `ranks` are how it
    is launched, not settings). Without a `max_grad_norm` value, a run asking for Adasum turns
    clipping off, the fix validate names."""
    algorithm = values["algorithm"] if values["algorithm"] in ("dqn", "mappo", "ippo") else "ppo"
    section = "dqn" if algorithm == "dqn" else "ppo"  # MAPPO's hyperparameters are PPO's
    sets = [f"algorithm={algorithm}", f"env.id={ENV_IDS[values['algorithm']]}", f"env.backend={values['backend']}",
            f"distributed.balance={values['balance']}", f"distributed.reduction={values['reduction']}",
            f"distributed.compression={values['compression']}", f"distributed.amp={values['amp']}"]
    if values["layout"] == "uneven":
        sets.append(f"distributed.env_counts={uneven_counts(values['ranks'])}")
    if section == "ppo":
        sets.append(f"ppo.backward_passes_per_step={values['backward_passes_per_step']}")
    if "model_kind" in values:
        sets.append(f"model.kind={values['model_kind']}")
    if values.get("pipeline", "sync") != "sync":
        sets.append(f"ppo.pipeline={values['pipeline']}")
    if values.get("normalize_observations"):
        sets.append("ppo.normalize_observations=true")
    if "max_grad_norm" in values:
        sets.append(f"{section}.max_grad_norm={values['max_grad_norm']}")
    elif values["reduction"] == "adasum":
        sets.append(f"{section}.max_grad_norm=0")
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
    for a, b in itertools.combinations(TABLE_OPTIONS, 2):
        for va, vb in itertools.product(TABLE_OPTIONS[a], TABLE_OPTIONS[b]):
            values = {n: options[0] for n, options in TABLE_OPTIONS.items()} | {a: va, b: vb}
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
