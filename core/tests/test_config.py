import os
import subprocess
import sys

import attrs
import pytest

from plait.config import RunConfig, TrainerSection, apply_overrides, load_config
from plait.errors import ConfigError
from plait.schema import structure
from plait.types import AdamParams


def test_defaults_load():
    cfg = load_config(None)
    assert isinstance(cfg, RunConfig)
    assert cfg.rl.group_size == 8


def test_a_run_and_a_bare_optimizer_step_have_one_adam_default():
    """`[trainer]`'s optimizer defaults are AdamParams'; only the learning rate and clipping are
    the run's own. eps is 1e-8, what every run has used (Tinker's SDK has 1e-12)."""
    trainer, adam = load_config(None).trainer, AdamParams()
    shared = ("beta1", "beta2", "eps", "weight_decay")
    assert {k: getattr(trainer, k) for k in shared} == {k: getattr(adam, k) for k in shared}
    assert (trainer.beta1, trainer.beta2, trainer.eps) == (0.9, 0.95, 1e-8)
    own = {a.name for a in attrs.fields(TrainerSection)} - {"engine", "options", *shared}
    assert own == {"learning_rate", "grad_clip_norm"}  # a new optimizer field: shared, or say why


def test_unknown_key_names_path_allowed_keys_and_suggestion(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[rl]\nstepz = 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert msg.startswith("config rl.stepz: unknown key")
    assert 'did you mean "steps"' in msg
    assert "group_size" in msg  # the allowed keys are listed


def test_unknown_section():
    with pytest.raises(
        ConfigError, match=r"config trainr: unknown key \(did you mean \"trainer\"\?\)"
    ):
        structure(RunConfig, {"trainr": {}})


@pytest.mark.parametrize(
    "data, path, problem",
    [
        ({"rl": {"steps": "ten"}}, "rl.steps", "expected an integer"),
        ({"rl": {"steps": 1.5}}, "rl.steps", "expected an integer"),
        ({"rl": {"steps": True}}, "rl.steps", "expected an integer"),
        ({"trainer": {"learning_rate": "x"}}, "trainer.learning_rate", "expected a number"),
        ({"rl": {"schedule": "both"}}, "rl.schedule", "is not one of"),
        ({"metrics": {"sinks": "jsonl"}}, "metrics.sinks", "expected a list"),
        ({"model": "smollm2"}, "model", "expected a table"),
    ],
)
def test_type_errors_name_the_key(data, path, problem):
    with pytest.raises(ConfigError) as info:
        structure(RunConfig, data)
    assert info.value.path == path
    assert problem in str(info.value)


def test_validators_report_the_section():
    with pytest.raises(ConfigError, match=r"config rl: steps must be > 0"):
        structure(RunConfig, {"rl": {"steps": 0}})


def test_rl_kl_becomes_the_trainers_kl_penalty_keys():
    """`[rl.kl]` reaches the trainer as loss_fn_config's kl_coef and kl_estimator (the estimator
    as its number); off, the loss config is the run's own."""
    rl = structure(RunConfig, {"rl": {"loss_config": {"clip": 0.2}}}).rl
    assert rl.train_loss_config == {"clip": 0.2}
    rl = structure(RunConfig, {"rl": {"kl": {"coef": 0.05, "estimator": "k1"}}}).rl
    assert rl.train_loss_config == {"kl_coef": 0.05, "kl_estimator": 1.0}
    assert structure(RunConfig, {"rl": {"kl": {"coef": 0.1}}}).rl.kl.estimator == "k3"


@pytest.mark.parametrize(
    "kl, path, problem",
    [
        ({"estimator": "k4"}, "rl.kl.estimator", "is not one of"),
        ({"coef": -0.1}, "rl.kl", "coef must be >= 0"),
        ({"where": "advantage"}, "rl.kl.where", "is not one of"),
        ({"beta": 0.1}, "rl.kl.beta", "unknown key"),
    ],
)
def test_rl_kl_errors_name_the_key(kl, path, problem):
    with pytest.raises(ConfigError) as info:
        structure(RunConfig, {"rl": {"kl": kl}})
    assert (info.value.path, problem in str(info.value)) == (path, True), str(info.value)


def test_one_kl_penalty_per_run():
    with pytest.raises(ConfigError, match="both set a KL penalty"):
        structure(RunConfig, {"rl": {"kl": {"coef": 0.1}, "loss_config": {"kl_coef": 0.1}}})


def test_int_accepted_for_float():
    assert structure(RunConfig, {"trainer": {"learning_rate": 1}}).trainer.learning_rate == 1.0


def test_overrides_parse_toml_values():
    data = apply_overrides(
        {},
        [
            "rl.steps=5",
            "trainer.learning_rate=1e-5",
            "env.name=math.arith",
            "metrics.sinks=['jsonl']",
        ],
    )
    assert data == {
        "rl": {"steps": 5},
        "trainer": {"learning_rate": 1e-5},
        "env": {"name": "math.arith"},
        "metrics": {"sinks": ["jsonl"]},
    }


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"key\.path=value"):
        apply_overrides({}, ["nonsense"])
    with pytest.raises(ConfigError, match="no config file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[rl\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_validate_components_names_unknown_engine_and_provider():
    """With no plugin installed (only the core's own), the default config's trainer engine is
    unknown: the error names the key and the distribution to install."""
    code = (
        "from plait.components import validate_components\n"
        "from plait.config import load_config\n"
        "from plait.errors import ConfigError\n"
        "try:\n    validate_components(load_config())\n"
        "except ConfigError as exc:\n    print(exc.path, '|', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PLAIT_PLUGINS": "none"},
    )
    assert out.returncode == 0, out.stderr
    path, message = out.stdout.split(" | ", 1)
    assert path == "trainer.engine"
    assert "unknown trainer engine 'torch'" in message and "pip install plait-torch" in message


def test_component_options_are_checked_with_their_class():
    from plait.schema import structure_options

    @attrs.frozen
    class ConsoleOptions:
        keys: list[str] = attrs.field(factory=list)

    with pytest.raises(ConfigError) as info:
        structure_options(ConsoleOptions, {"kyes": []}, "metrics.options.console")
    assert info.value.path == "metrics.options.console.kyes"
    assert 'did you mean "keys"' in str(info.value)
    with pytest.raises(ConfigError, match="takes no options"):
        structure_options(None, {"x": 1}, "sync.options")


def test_each_policy_starts_from_the_top_level_tables_and_overrides_its_own_keys():
    cfg = load_config(
        None,
        [
            "trainer.learning_rate=0.01",
            'policies.a.roles=["x"]',
            'policies.b.roles=["y"]',
            "policies.b.trainer.learning_rate=0.5",
            "policies.b.model.name=other",
        ],
    )
    a, b = cfg.policies["a"], cfg.policies["b"]
    assert (a.trainer.learning_rate, b.trainer.learning_rate) == (0.01, 0.5)
    assert (a.model.name, b.model.name) == (cfg.model.name, "other")
    assert a.trainer.engine == b.trainer.engine == cfg.trainer.engine
    assert list(cfg.policy_sections()) == ["a", "b"]
    single = load_config().policy_sections()
    assert list(single) == ["policy"] and single["policy"].trainer == load_config().trainer


def test_a_policy_key_error_names_the_policy():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["policies.a.trainer.learning_rat=1"])
    assert info.value.path == "policies.a.trainer.learning_rat"


def test_every_role_has_one_policy_and_every_policy_acts():
    from plait.components import validate_components

    twice = load_config(None, ['policies.a.roles=["x"]', 'policies.b.roles=["x"]'])
    with pytest.raises(ConfigError, match="role 'x' is also played by policy 'a'") as info:
        validate_components(twice)
    assert info.value.path == "policies.b.roles"
    idle = load_config(None, ['policies.a.roles=["x"]', "policies.b.model.name=other"])
    with pytest.raises(ConfigError, match="would never act") as info:
        validate_components(idle)
    assert info.value.path == "policies.b.roles"
