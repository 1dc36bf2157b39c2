"""Property-based fuzzing of the configuration surface (issue 22, item 5).

Generated `--set section.key=value` texts for every field of every section of TrainConfig (wrong
types, out of range, empty, huge, unicode, newlines, NaN/inf, lists for scalars, tables, dates)
go through load_config + validate; generated `hvd-rl slurm render` arguments go through the
render parser in-process. Each input is either accepted or refused with one clear line (a
ConfigError / SlurmRenderError), never another exception; nothing that reaches a rendered script
can end or inject an #SBATCH directive or a shell line.

Derandomized (the same examples every run, no .hypothesis database in the tree); set
HVD_RL_FUZZ_EXAMPLES to run more, HVD_RL_FUZZ_RANDOM=1 for fresh random examples.
"""
import argparse
import dataclasses
import json
import os
import re
import subprocess
import typing
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_rl.config import ConfigError, TrainConfig, load_config, toml_string, validate
from hvd_rl.cluster.slurm import TEMPLATES, SlurmRenderError, add_render_arguments, render_from_args, template_dir

EXAMPLES = int(os.environ.get("HVD_RL_FUZZ_EXAMPLES", "0")) or None


def fuzz(examples: int) -> settings:
    return settings(max_examples=EXAMPLES or examples, deadline=None, database=None,
                    derandomize=not os.environ.get("HVD_RL_FUZZ_RANDOM"),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _fields() -> list[tuple[str, typing.Any]]:
    """('section.key' or 'key', declared type) of every field, from the dataclasses themselves."""
    hints = typing.get_type_hints(TrainConfig)
    found = []
    for f in dataclasses.fields(TrainConfig):
        if dataclasses.is_dataclass(hints[f.name]):
            sub = typing.get_type_hints(hints[f.name])
            found += [(f"{f.name}.{g.name}", sub[g.name]) for g in dataclasses.fields(hints[f.name])]
        else:
            found.append((f.name, hints[f.name]))
    return found


FIELDS = _fields()
KEYS = [key for key, _ in FIELDS]


def test_every_section_and_field_is_fuzzed():
    sections = {k.split(".")[0] for k in KEYS if "." in k}
    assert {"env", "model", "ppo", "dqn", "distributed", "checkpoint", "logging", "debug"} <= sections
    assert {"seed", "run_dir", "algorithm", "env.id", "model.hidden_sizes", "distributed.env_counts"} <= set(KEYS)


# ---- values -------------------------------------------------------------------------------------

NASTY = ["", " ", "\n", "\r\n", "\t", "\x00", "'", '"', '"""', "#", "=", "[", "]", "{", "}", ",",
         "[]", "[[]]", "[[1, 2]]", "{}", "{a = 1}", '{id = "Acrobot-v1"}', "nan", "-nan", "inf", "-inf",
         "+inf", "1e400", "-1e400", "1e300", "1e-400", "0", "-0", "-1", "0.0", "-0.0", "1.5", "0.5",
         "0x10", "0o17", "0b101", "1_000", "1__0", "_1", "true", "false", "True", "yes", "no", "maybe",
         "1979-05-27", "1979-05-27T07:32:00Z", "07:32:00", "CartPole-v1", "ALE/Pong-v5", "NoSuch-v0",
         "ppo", "dqn", "sync", "async", "average", "adasum", "fp16", "bf16", "auto", "static",
         "dynamic", "mlp", "nature_cnn", "[64, 64]", "64 64", "64,64", "[0]", "[-1]", "[1.5]", '["a"]',
         "[1e400]", "1 # comment", "1\nseed = 3", "0.9\nrun_dir = '/etc'", "a\nb", "\u2028", "\u00e9",
         "\U0001f680", "\u202e", "\ufeff1", "\u0661", "\u00b2", "9" * 5000, "-" + "9" * 5000,
         "1" + "0" * 400, "[" * 3000, "{a = " * 300, "x" * 20_000, '"' + "\\" * 3 + '"',
         '"\\ud83d"', '"\\u0000"', "'''a\nb'''"]


def _toml_scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


scalars = st.one_of(st.booleans(), st.integers(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30))
raw_values = st.one_of(
    st.sampled_from(NASTY),
    scalars.map(_toml_scalar),
    st.lists(scalars, max_size=4).map(lambda xs: "[" + ", ".join(map(_toml_scalar, xs)) + "]"),
    st.lists(st.integers(min_value=-3, max_value=300), max_size=4).map(lambda xs: " ".join(map(str, xs))),
    st.text(max_size=40),  # any unicode: control characters, newlines, NUL, combining marks
    st.text(alphabet="0123456789.e+-_inf[],\"' \n", max_size=25),
)
keys = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS), st.sampled_from(KEYS),
                 st.sampled_from(["ppo.bogus", "nosuch.key", "ppo", "env.id.x", "seed.x", ".x", "x.",
                                  "ppo..gamma", " ppo.gamma ", "PPO.gamma", "ppo.gamma\n", "a\nb.c",
                                  "env.\u00e9", "dqn.__class__", "__init__"]))
WORDS = ["CartPole-v1", "Pendulum-v1", "Acrobot-v1", "ALE/Pong-v5", "ppo", "dqn", "sync", "async",
         "ale_vector", "average", "adasum", "none", "fp16", "bf16", "off", "auto", "cpu", "cuda", "static",
         "dynamic", "mlp", "nature_cnn", "runs/x"]


def plausible(tp) -> st.SearchStrategy[str]:
    """Values of the field's own type, near the edges of what validate() allows."""
    if typing.get_origin(tp) is list:
        return st.lists(st.integers(min_value=-1, max_value=70), max_size=4).map(
            lambda xs: "[" + ", ".join(map(str, xs)) + "]")
    if tp is bool:
        return st.sampled_from(["true", "false", "1", "0", "yes", "no"])
    if tp is int:
        return st.one_of(st.integers(min_value=-2, max_value=12), st.integers(min_value=0, max_value=10**7),
                         st.sampled_from(["1e3", "2.0", "1_000", "-0"])).map(str)
    if tp is float:
        return st.one_of(st.sampled_from([0.0, 1.0, -0.0, 0.5, 0.999, 1e-8, 1.0000001]),
                         st.floats(min_value=-2, max_value=2)).map(repr)
    return st.sampled_from(WORDS).map(json.dumps)


typed = st.sampled_from(FIELDS).flatmap(lambda kt: plausible(kt[1]).map(lambda v: f"{kt[0]}={v}"))
generated = st.tuples(keys, raw_values, st.sampled_from(["=", " = ", "="])).map(lambda t: f"{t[0]}{t[2]}{t[1]}")
overrides = st.lists(st.one_of(generated, typed), min_size=1, max_size=4)


def _assert_one_clear_line(message: str) -> None:
    """One printable line of bounded length; several validation problems may be listed one per
    line under a header that counts them."""
    assert message, "empty message"
    lines = message.split("\n")
    if len(lines) > 1:
        assert lines[0] == f"invalid configuration ({len(lines) - 1} problems):", message[:300]
        assert all(line.startswith("  - ") for line in lines[1:]), message[:300]
    for line in lines:
        assert line and all(c.isprintable() for c in line), f"not printable lines: {message[:300]!r}"
        assert len(line) <= 2000, f"{len(line)} characters: {line[:300]!r}"


# ---- config -------------------------------------------------------------------------------------

@fuzz(1500)
@given(overrides=overrides)
def test_generated_overrides_are_accepted_or_refused_with_one_line(overrides, tmp_path_factory):
    try:
        cfg = load_config(None, overrides)
        validate(cfg)
    except ConfigError as exc:
        _assert_one_clear_line(str(exc))
        return
    # Accepted: the resolved config written the way run directories keep it (config.toml) reads
    # back to the same configuration, and every value has its declared type.
    path = tmp_path_factory.getbasetemp() / "fuzz_config.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg
    for key, tp in FIELDS:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        expected = typing.get_origin(tp) or tp
        assert type(value) is expected, (key, value)
        if expected is list:
            assert all(type(v) is typing.get_args(tp)[0] for v in value), (key, value)


@pytest.mark.parametrize("text, fragment", [
    ("ppo.total_timesteps=" + "9" * 5000, "expected an integer"),  # int() refuses > 4300 digits
    ("ppo.gamma=" + "[" * 3000, "expected a number"),  # tomllib recursion
    ("ppo.gamma=0.9\nseed = 3", "expected a number"),  # a second TOML key was silently dropped
    ("ppo.learning_rate=inf", "finite"),
    ("debug.iteration_sleep=inf", "finite"),  # a run that sleeps forever
    ("distributed.peer_timeout=nan", "finite"),
    ("a\nb.c=1", "unknown key 'a\\nb'"),
    ("env.id=CartPole-v" + "9" * 5000, "not a registered Gymnasium environment"),
    ("env.id=a\nb", "is not a registered Gymnasium environment"),
    ("algorithm=" + "x" * 100_000, "algorithm must be one of"),
])
def test_found_by_fuzzing(text, fragment):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, [text]))
    _assert_one_clear_line(str(err.value))
    assert fragment in str(err.value)


def test_one_problem_is_one_line_and_several_are_listed():
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, ["ppo.gamma=2"]))
    assert str(err.value) == "invalid configuration: ppo.gamma must be in [0, 1], got 2.0"
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, ["ppo.gamma=2", "ppo.gae_lambda=-1"]))
    text = str(err.value)
    assert text.startswith("invalid configuration (2 problems):"), text
    assert "ppo.gamma must be in [0, 1], got 2.0" in text and "ppo.gae_lambda must be in [0, 1], got -1.0" in text
    _assert_one_clear_line(str(err.value))


def test_toml_strings_round_trip_through_config_toml(tmp_path):
    for run_dir in ["runs/\U0001f680", "a\"b\\c", "tab\there", "del\x7f", "nl\nx", "\u00e9\u0301", "'"]:
        cfg = load_config(None, [f"run_dir={toml_string(run_dir)}"])
        assert cfg.run_dir == run_dir
        (tmp_path / "c.toml").write_text(cfg.to_toml())
        assert load_config(tmp_path / "c.toml").run_dir == run_dir


# ---- slurm render -------------------------------------------------------------------------------

def _render_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvd-rl slurm render", exit_on_error=False)
    add_render_arguments(parser)
    return parser


TEXT_OPTIONS = ["job-name", "partition", "account", "time", "config", "run-root", "ranks", "sweep-nodes"]
INT_OPTIONS = ["nodes", "ntasks-per-node", "cpus-per-task", "gpus-per-node", "signal-seconds", "iterations"]
GOOD = {"job-name": ["cart", "pong_v5.run-2", "a+b", "x@y:z=1,2"], "partition": ["cpu", "gpu-a100,cpu", "p.1"],
        "account": ["proj42", "a.b_c-d"], "time": ["02:00:00", "1-12:00:00", "30", "1-0"],
        "config": ["configs/cartpole_ppo.toml", "my configs/a'b.toml", "$HOME/x.toml", "`id`.toml"],
        "run-root": ["runs", "/scratch/$USER/runs", "a b", "--x", "-"], "ranks": ["1 2 4", "3", " 1  2 "],
        "sweep-nodes": ["1 1 1", "1", "1 2"]}
SBATCH_NASTY = ["x\nrm -rf ~", "p\n#SBATCH --foo", "a b", "a$(id)", "a`id`", "a;b", "a|b", "a&b", "a>b",
                "a'b", 'a"b', "a#b", "a\\b", "../x", "a/b", "*", "?", "~", "-", "--x", "\u00e9", "\u2028",
                "\x00", "\t", "\r", "01:00:00\n", "\u0661", "\u00b2", "1\n2", "0", "-1", "x" * 5000]
text_values = st.one_of(st.sampled_from(SBATCH_NASTY), st.sampled_from(NASTY), st.text(max_size=20),
                        st.text(alphabet="ab01:-_.,@+=/ $`'\"#;\n\\", max_size=12))
set_values = st.one_of(st.sampled_from(["env.id=ALE/Pong-v5", "ppo.total_timesteps=2e7",
                                        "run_dir=\"a b\"", "x=$(id)", "k='v'", "=1", "noequals"]),
                       overrides.map(lambda o: o[0]))


@st.composite
def render_args(draw):
    template = draw(st.sampled_from(sorted(TEMPLATES)))
    args = ["--template", template]
    for option in draw(st.lists(st.sampled_from(TEXT_OPTIONS), unique=True, max_size=5)):
        good = draw(st.booleans())
        value = draw(st.sampled_from(GOOD[option])) if good else draw(text_values)
        args.append(f"--{option}={value}")
    for option in draw(st.lists(st.sampled_from(INT_OPTIONS), unique=True, max_size=3)):
        args.append(f"--{option}={draw(st.integers(min_value=-3, max_value=10**6))}")
    for text in draw(st.lists(set_values, max_size=3)):
        args.append(f"--set={text}")
    if template == "learning":
        args.append("--plan=" + draw(st.sampled_from(["benchmarks/learning_cartpole.toml", "nope.toml",
                                                      "benchmarks/learning_atari_quick.toml"])))
    return args


def _settings_values(text: str) -> list[str]:
    """What bash makes of the rendered settings lines: CONFIG, RUN_ROOT, then each SET_ARGS word."""
    lines = [line for line in text.split("\n") if "# hvd-rl:" in line and not line.startswith("#")]
    script = "\n".join(lines) + '\nprintf "%s\\0" "${CONFIG-}" "${RUN_ROOT-}" "${SET_ARGS[@]}"\n'
    out = subprocess.run(["bash", "-c", script], capture_output=True, env={"PATH": os.environ["PATH"]})
    assert out.returncode == 0 and not out.stderr, out
    return out.stdout.decode("utf-8", "surrogateescape").split("\0")[:-1]


@fuzz(600)
@given(argv=render_args())
def test_generated_render_arguments_render_safely_or_are_refused(argv, tmp_path_factory):
    out = tmp_path_factory.getbasetemp() / "fuzz_render" / "job.sbatch"
    try:
        args = _render_parser().parse_args([*argv, f"--out={out}"])
    except (argparse.ArgumentError, SystemExit):
        return  # argparse's own refusal (e.g. a value for a choices option)
    out.unlink(missing_ok=True)
    try:
        render_from_args(args)
    except SlurmRenderError as exc:
        _assert_one_clear_line(str(exc))
        # Our checks refuse first: a value that passes them always makes valid shell.
        assert "bash -n" not in str(exc), str(exc)
        assert not out.exists()
        return
    text = out.read_text()
    assert not [c for c in text if c not in "\n\t" and unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp")], \
        "a control or line-separator character in the script"
    lines = text.split("\n")
    template = (template_dir() / TEMPLATES[args.template]).read_text().split("\n")
    directive = re.compile(r"^#{1,2}SBATCH\b")
    # No value added a line: the script has the template's other lines, one for one.
    assert sum(not directive.match(line) for line in lines) == sum(not directive.match(line) for line in template)
    body = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    for i, line in enumerate(lines):
        if line.startswith("#SBATCH"):
            assert i < body, f"#SBATCH line after the first command: {line!r}"
            assert re.fullmatch(r"#SBATCH --[a-z-]+(=[^\s'\"`$;&|<>#\\]+)?", line), line  # one directive
    for option in ("job-name", "partition", "account", "time"):
        given_value = getattr(args, option.replace("-", "_"))
        if given_value is not None:
            assert f"#SBATCH --{option}={given_value}" in lines
    # What bash reads back from the settings lines is exactly what was given: nothing injected.
    values = _settings_values(text)
    if args.config is not None and "# hvd-rl:config" in text:
        assert values[0] == args.config
    if args.run_root is not None:
        assert values[1] == args.run_root
    given_sets = [f"--set={o}" for o in args.overrides]
    if given_sets:
        assert values[2:][-len(given_sets):] == given_sets
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
