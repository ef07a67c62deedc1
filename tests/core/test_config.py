"""Every bad-config case gives one clear error naming the file, the key, the value and the choices."""

from pathlib import Path

import pytest

from searchrl.app.experiment import check_arguments, load_experiment
from searchrl.core.config import Experiment, from_dict, save_resolved
from searchrl.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path):
    f = write(tmp_path, "exp.yaml", "name: x\nenv: {topk: 2}\n")
    exp = load_experiment(f, ["env.topk=5", "data.world.persons=90", "model.lora={r: 4}"])
    assert isinstance(exp, Experiment)
    assert exp.env.topk == 5 and exp.data.world.persons == 90 and exp.model.lora.r == 4
    assert exp.model.lora.alpha == 32  # default kept


def test_exponent_numbers_without_a_dot_are_numbers(tmp_path):
    # YAML 1.1 reads `1e-5` as a string; a float key takes it as the number users mean
    f = write(tmp_path, "exp.yaml", "trainer: {lr: 3e-4}\n")
    exp = load_experiment(f, ["rollout.temperature=5E-1"])
    assert exp.trainer.lr == 3e-4 and exp.rollout.temperature == 0.5
    with pytest.raises(ConfigError, match="key 'trainer.lr': expected a number"):
        load_experiment(None, ["trainer.lr=1e-x"])
    with pytest.raises(ConfigError, match="key 'trainer.steps': expected an integer"):
        load_experiment(None, ["trainer.steps=1e3"])


def test_an_unquoted_no_in_yaml_is_the_choice_no(tmp_path):
    # YAML 1.1 reads `mixed_precision: no` as false; accelerate's own config files quote it, users may not
    f = write(
        tmp_path,
        "exp.yaml",
        "trainer: {mixed_precision: no}\nwarm_start: {trainer: {mixed_precision: bf16}}\n",
    )
    exp = load_experiment(f)
    assert exp.trainer.mixed_precision == "no"
    assert exp.warm_start.trainer.mixed_precision == "bf16"
    with pytest.raises(ConfigError, match="mixed_precision"):
        load_experiment(f, ["trainer.mixed_precision=yes"])
    assert (
        load_experiment(f, ["warm_start.trainer.mixed_precision=no"]).warm_start.trainer.mixed_precision
        == "no"
    )


def test_base_includes_merge_and_child_wins(tmp_path):
    write(tmp_path, "base.yaml", "name: base\nenv: {topk: 2, max_turns: 3}\nrewards: [{name: em}]\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    f = write(sub, "child.yaml", "base: ../base.yaml\nenv: {topk: 4}\nrewards: [{name: f1, weight: 0.5}]\n")
    exp = load_experiment(f)
    assert exp.env.topk == 4 and exp.env.max_turns == 3
    assert [r.name for r in exp.rewards] == ["f1"] and exp.rewards[0].weight == 0.5  # lists replace
    # the name is the file's own, never a base's (the child would train into the base's run directory)
    assert exp.name == "child" and exp.out == Path("runs/child")
    assert load_experiment(f, ["name=other"]).name == "other"
    assert load_experiment(tmp_path / "base.yaml").name == "base"


def test_a_different_algorithm_in_a_child_does_not_inherit_the_base_arguments(tmp_path):
    write(tmp_path, "base.yaml", "algorithm: {name: grpo, clip_low: 0.1, kl_coef: 0.0}\n")
    same = write(tmp_path, "same.yaml", "base: base.yaml\nalgorithm: {name: grpo, kl_coef: 0.5}\n")
    other = write(tmp_path, "other.yaml", "base: base.yaml\nalgorithm: {name: ppo, vf_coef: 0.2}\n")
    assert load_experiment(same).algorithm.args == {"clip_low": 0.1, "kl_coef": 0.5}
    assert load_experiment(other).algorithm.args == {"vf_coef": 0.2}


def test_unknown_key_names_file_key_and_suggestion(tmp_path):
    f = write(tmp_path, "exp.yaml", "env:\n  topkk: 3\n")
    with pytest.raises(ConfigError) as e:
        load_experiment(f)
    msg = str(e.value)
    assert str(f) in msg and "key 'env.topkk': unknown key" in msg
    assert (
        "valid: agent, agent_program, call_format, chat_kwargs, context, doc_format, doc_max_words, max_parallel_queries,"
        " max_query_chars"
        in msg
        and "did you mean 'topk'?" in msg
    )


def test_unknown_top_level_section(tmp_path):
    f = write(tmp_path, "exp.yaml", "envv: {}\n")
    with pytest.raises(ConfigError, match=r"key 'envv': unknown key(.|\n)*did you mean 'env'\?"):
        load_experiment(f)


def test_wrong_type(tmp_path):
    f = write(tmp_path, "exp.yaml", "env: {topk: three}\n")
    with pytest.raises(ConfigError) as e:
        load_experiment(f)
    assert f"{f}: key 'env.topk': expected an integer\n  got: 'three'" in str(e.value)
    with pytest.raises(ConfigError, match="key 'env.tags': expected a string"):
        load_experiment(None, ["env.tags=3"])
    with pytest.raises(ConfigError, match="key 'teacher.noisy': expected true or false"):
        load_experiment(None, ["teacher.noisy=1"])


def test_unknown_retriever_reward_algorithm_names(tmp_path):
    f = write(tmp_path, "exp.yaml", "env: {retriever: {name: bm52}}\n")
    with pytest.raises(ConfigError) as e:
        load_experiment(f)
    assert "key 'env.retriever.name': unknown retriever name" in str(e.value)
    assert "valid: bm25, dense, http, hybrid" in str(e.value) and "did you mean 'bm25'?" in str(e.value)

    f = write(tmp_path, "r.yaml", "rewards: [{name: f2}]\n")
    with pytest.raises(ConfigError) as e:
        load_experiment(f)
    assert str(f) in str(e.value) and "key 'rewards[0].name': unknown reward name" in str(e.value)
    assert "did you mean 'f1'?" in str(e.value)

    with pytest.raises(ConfigError, match=r"key 'algorithm.name': unknown algorithm name"):
        load_experiment(None, ["algorithm.name=no_such_algorithm"])


def test_bad_choice_and_dotted_reward_path(tmp_path):
    with pytest.raises(ConfigError, match=r"key 'env.tags': invalid value(.|\n)*valid: research, search_r1"):
        load_experiment(None, ["env.tags=resarch"])
    with pytest.raises(
        ConfigError,
        match=r"key 'model.size': invalid value(.|\n)*valid: base, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, small, tiny",
    ):
        load_experiment(None, ["model.size=huge"])
    exp = load_experiment(None, ["rewards=[{name: 'searchrl.rewards.outcome:f1_reward'}]"])
    assert exp.rewards[0].name.endswith(":f1_reward")
    with pytest.raises(
        ConfigError,
        match="cannot import module 'nopkg.x' for 'nopkg.x:y': ModuleNotFoundError: No module named 'nopkg'",
    ):
        load_experiment(None, ["rewards=[{name: 'nopkg.x:y'}]"])


def test_missing_files(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.yaml: config file not found"):
        load_experiment(tmp_path / "nope.yaml")
    f = write(tmp_path, "exp.yaml", "base: missing.yaml\n")
    with pytest.raises(
        ConfigError, match=r"exp.yaml: key 'base': base config not found\n  got: 'missing.yaml'"
    ):
        load_experiment(f)


def test_override_errors_name_the_command_line():
    with pytest.raises(
        ConfigError, match=r"command line override 'env.topk=x': key 'env.topk': expected an integer"
    ):
        load_experiment(None, ["env.topk=x"])
    with pytest.raises(ConfigError, match="an override must look like 'section.key=value'"):
        load_experiment(None, ["env.topk"])


def test_world_section_validation():
    with pytest.raises(ConfigError, match="hop_weights must give 1-4 non-negative weights"):
        load_experiment(None, ["data.world.hop_weights=[1, 1, 1, 1, 1]"])
    with pytest.raises(ConfigError, match=r"key 'data.world.split_fractions': expected a list of 3 items"):
        load_experiment(None, ["data.world.split_fractions=[0.5, 0.5]"])


def test_reward_args_checked_against_signature():
    from searchrl.rewards import register_reward

    @register_reward("test_config_bonus")
    def bonus(traj, *, answers, bonus=1.0):
        return bonus

    exp = load_experiment(None, ["rewards=[{name: test_config_bonus, args: {bonsu: 2}}]"])
    with pytest.raises(
        ConfigError, match=r"key 'rewards\[0\].args.bonsu': reward 'test_config_bonus' has no argument"
    ):
        check_arguments(exp)
    check_arguments(load_experiment(None, ["rewards=[{name: test_config_bonus, args: {bonus: 2}}]"]))
    exp = load_experiment(None, ["rewards=[{name: em, args: {answers: [x]}}]"])  # a provided field
    with pytest.raises(ConfigError, match=r"rewards\[0\].args.answers"):
        check_arguments(exp)
    with pytest.raises(
        ConfigError, match=r"reward 'stepsearch' has no argument 'gama_key'(.|\n)*did you mean 'gamma_key'"
    ):
        check_arguments(load_experiment(None, ["rewards=[{name: stepsearch, args: {gama_key: 2}}]"]))


def test_steppo_needs_a_process_reward():
    exp = load_experiment(None, ["algorithm={name: steppo}", "rewards=[{name: f1}]"])
    with pytest.raises(
        ConfigError, match=r"key 'rewards'.*no configured reward is a process reward(.|\n)*stepsearch"
    ):
        check_arguments(exp, "x.yaml")
    check_arguments(load_experiment(None, ["algorithm={name: steppo}", "rewards=[{name: stepsearch}]"]))


def test_resolved_config_round_trips(tmp_path):
    exp = load_experiment(REPO / "experiments" / "quickstart.yaml", ["env.topk=2"])
    path = save_resolved(exp, tmp_path)
    again = load_experiment(path)
    assert again == exp


def test_every_shipped_experiment_validates(monkeypatch):
    # synthetic/grpo_agent.yaml's program, on PYTHONPATH as the file's header says to run it
    monkeypatch.syspath_prepend(str(REPO / "examples" / "agents"))
    files = sorted((REPO / "experiments").rglob("*.yaml"))
    files = [f for f in files if "accelerate" not in f.parts and "sweeps" not in f.parts]
    assert files
    for f in files:
        check_arguments(load_experiment(f), str(f))


def test_every_shipped_sweep_validates():
    from searchrl.app.sweep import check, load_sweep

    files = sorted((REPO / "experiments" / "sweeps").glob("*.yaml"))
    assert len(files) >= 2
    for f in files:
        sweep = load_sweep(f)
        assert len(sweep.runs) >= (2 if f.stem == "smoke" else 6)
        check(sweep)


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("env.topk=0", "must be at least 1"),
        ("env.max_turns=-1", "must be at least 1"),
        ("trainer.save_every=0", "must be at least 1"),
        ("trainer.keep_checkpoints=0", "must be at least 1"),
        ("trainer.steps=0", "must be at least 1"),
        ("trainer.batch_size=-2", "must be at least 1"),
        ("trainer.lr=.nan", "expected a finite number"),
        ("trainer.lr=0", "must be greater than 0"),
        ("eval.limit=-1", "must be at least 1"),
        ("rollout.top_p=0", "must be in (0, 1]"),
        ("model.lora={dropout: 1.0}", "must be in [0, 1)"),
    ],
)
def test_out_of_range_values_are_config_errors(override, problem):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as e:
        load_experiment(REPO / "experiments" / "quickstart.yaml", [override])
    assert problem in str(e.value) and f"key '{key}" in str(e.value)


def test_a_mapping_override_merges_into_its_section():
    base = load_experiment(REPO / "experiments" / "quickstart.yaml")
    exp = load_experiment(REPO / "experiments" / "quickstart.yaml", ["trainer={steps: 2}"])
    assert exp.trainer.steps == 2 and exp.trainer.lr == base.trainer.lr and exp.trainer.lr != 1.0e-6
    other = load_experiment(REPO / "experiments" / "quickstart.yaml", ["algorithm={name: ppo}"])
    assert other.algorithm.name == "ppo" and "clip_low" not in other.algorithm.args  # a new name: replaced


def test_a_partial_section_merges_onto_its_own_defaults(tmp_path):
    """A section given in part keeps the defaults of the keys it leaves out, its own section's defaults
    included: the warm start's trainer (600 steps, lr 1e-3, cosine) is not the plain trainer (100, 1e-6,
    constant), whether the part comes from the command line or from a file."""
    from dataclasses import replace

    from searchrl.core.config import TrainerConfig, WarmStartConfig

    warm = WarmStartConfig().trainer
    assert warm != TrainerConfig()
    exp = load_experiment(None, ["warm_start={teacher_passes: 4}", "warm_start.trainer.steps=50"])
    assert exp.warm_start.teacher_passes == 4 and exp.warm_start.trainer == replace(warm, steps=50)
    f = tmp_path / "x.yaml"
    f.write_text("warm_start: {trainer: {lr: 2.0e-3, guards: {on_trip: rollback}}}\ntrainer: {guards: {}}\n")
    exp = load_experiment(f)
    assert exp.warm_start.trainer == replace(warm, lr=2e-3, guards=replace(warm.guards, on_trip="rollback"))
    assert exp.trainer == TrainerConfig()
    with pytest.raises(ConfigError, match="warm_start.trainer.stpes"):
        load_experiment(None, ["warm_start.trainer.stpes=3"])


def test_the_configuration_reference_shows_the_effective_default_of_every_key():
    """Every key's default in the generated reference is what the loader gives a file that leaves it out (a
    section that defaults to null, opened as `{}`)."""
    import dataclasses
    import typing

    from searchrl.algorithms import ALGORITHMS
    from searchrl.app.config_reference import algorithm_rows, markdown, rows
    from searchrl.core.config import from_dict

    def loaded(cls, instance, prefix=""):
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            yield prefix + f.name, value
            t = typing.get_type_hints(cls)[f.name]
            nested = [a for a in (t, *typing.get_args(t)) if dataclasses.is_dataclass(a)]
            if nested and typing.get_origin(t) is not tuple:
                if value is None:
                    try:
                        value = from_dict(nested[0], {})
                    except ConfigError:  # required keys: nothing to compare below it
                        continue
                yield from loaded(nested[0], value, f"{prefix}{f.name}.")

    effective = dict(loaded(Experiment, from_dict(Experiment, {})))
    checked = 0
    for key, _, default, _, _ in rows(Experiment):
        if default in ("(section)", "(required)") or key not in effective:
            continue
        value = effective[key]
        text = "null" if value is None else repr(value)
        assert default == (text if len(text) <= 60 else text[:57] + "..."), key
        checked += 1
    assert checked > 150
    assert any(k == "warm_start.trainer.lr" and d == "0.001" for k, _, d, _, _ in rows(Experiment))
    by_algorithm = algorithm_rows()
    assert set(by_algorithm) == set(ALGORITHMS.names())
    for name, table in by_algorithm.items():
        fields = {f.name for f in dataclasses.fields(ALGORITHMS.get(name).Config)}
        assert {key.split(".")[1] for key, *_ in table} == fields, name
    assert "## `algorithm` with `name: grpo`" in markdown()


def test_every_key_has_its_help_as_field_metadata():
    """The configuration reference reads each key's help from the field itself (`core.config.setting`), not from
    the source's comments: every key of an experiment file and of every algorithm has one."""
    from searchrl.app.config_reference import algorithm_rows, rows
    from searchrl.core.config import Experiment

    missing = [r[0] for r in rows(Experiment) if not r[4].strip()]
    missing += [r[0] for group in algorithm_rows().values() for r in group if not r[4].strip()]
    assert not missing, missing


def test_every_call_format_can_be_named_in_a_file():
    """env.call_format's choices are `auto` and every format the parser reads."""
    import typing

    from searchrl.core.config import EnvConfig
    from searchrl.envs.call_formats import FORMATS

    hint = typing.get_type_hints(EnvConfig)["call_format"]
    assert set(typing.get_args(hint)) == {"auto", *FORMATS}
    assert from_dict(EnvConfig, {"protocol": "tools", "call_format": "mistral"}).call_format == "mistral"
