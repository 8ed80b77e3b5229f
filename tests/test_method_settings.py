"""One rule for the method options of every method: an artifact fixes what it was made with, a given
option that contradicts it is refused naming both values, an option the method does not use is
refused, and the defaults are the same in every command and library function."""

import inspect

import pytest

from kvcalib.cli import cli, main
from kvcalib.defaults import DEFAULTS
from kvcalib.errors import SettingsError
from kvcalib.methods import MethodSettings, build_method
from kvcalib.models import AttentionShape

SHAPE = AttentionShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def _run(capsys, args):
    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code, capsys.readouterr()


@pytest.fixture(scope="module")
def tiny_oscar(tmp_path_factory, tiny_lm):
    """An OScaR artifact of the tiny model, made with group size 8 and residual 16."""
    from kvcalib.methods.oscar_fit import save_oscar_artifact

    return save_oscar_artifact(str(tmp_path_factory.mktemp("art") / "oscar"), model=tiny_lm, group_size=8, residual=16)


@pytest.fixture
def kvlinc_artifact(monkeypatch):
    """A KVLinC artifact as `load_adapters` reads it: trained for 2 bits, G=128, R=128 (no adapters needed)."""
    import kvcalib.methods.kvlinc as kvlinc

    monkeypatch.setattr(kvlinc, "load_adapters", lambda path, shape, model=None: ({}, {"bits": 2, "group_size": 128,
                                                                                        "residual": 128}))
    return "runs/some-kvlinc-artifact"


@pytest.mark.parametrize("name,option", [("fp16", "bits"), ("fp16", "residual"), ("kivi", "scaling"),
                                         ("kvlinc", "scaling"), ("kvlinc", "rotation"), ("vecinfer", "group_size"),
                                         ("vecinfer", "bits")])
def test_an_option_the_method_does_not_use_is_refused(name, option):
    value = {"bits": 3, "residual": 64, "scaling": "max", "rotation": False, "group_size": 16}[option]
    with pytest.raises(SettingsError, match=f"--{option.replace('_', '-')}.* is not an option of --method {name}"):
        build_method(name, SHAPE, MethodSettings(**{option: value}))


def test_an_artifact_fixes_its_settings_and_a_contradicting_option_names_both(tiny_lm, tiny_oscar, kvlinc_artifact):
    from kvcalib.models import attention_shape

    shape = attention_shape(tiny_lm.config)
    oscar = build_method("oscar", shape, MethodSettings(), tiny_oscar, tiny_lm)
    assert (oscar.config.group_size, oscar.config.residual) == (8, 16)  # not the defaults 32, 128
    with pytest.raises(SettingsError, match=r"--bits 3 contradicts the artifact .* bits=2"):
        build_method("oscar", shape, MethodSettings(bits=3), tiny_oscar, tiny_lm)
    with pytest.raises(SettingsError, match=r"--group-size 128 contradicts the artifact .* group_size=8"):
        build_method("oscar", shape, MethodSettings(group_size=128), tiny_oscar, tiny_lm)
    same = build_method("oscar", shape, MethodSettings(bits=2, group_size=8, scaling="l2"), tiny_oscar, tiny_lm)
    assert same.config == oscar.config  # repeating the artifact's values is allowed
    kvlinc = build_method("kvlinc", SHAPE, MethodSettings(), kvlinc_artifact)
    assert kvlinc.config.group_size == 128
    with pytest.raises(SettingsError, match=r"--group-size 32 contradicts the artifact .* group_size=128"):
        build_method("kvlinc", SHAPE, MethodSettings(group_size=32), kvlinc_artifact)
    with pytest.raises(SettingsError, match="--scaling is not an option of --method kvlinc"):
        build_method("kvlinc", SHAPE, MethodSettings(scaling="l2"), kvlinc_artifact)


def test_without_an_artifact_given_options_rule_and_the_rest_are_the_defaults():
    kivi = build_method("kivi", SHAPE, MethodSettings(group_size=16))
    assert (kivi.config.bits, kivi.config.group_size, kivi.config.residual) == (DEFAULTS["bits"], 16, DEFAULTS["residual"])
    oscar = build_method("oscar", SHAPE, MethodSettings(rotation=False))
    assert (oscar.config.scaling, oscar.config.rotation, oscar.config.group_size) == ("l2", False, DEFAULTS["group_size"])


def test_the_cli_refuses_a_contradicting_option_with_one_line_and_exit_2(tiny_model_dir, text_file, tiny_oscar, capsys,
                                                                          tmp_path):
    # The artifact is the tiny model's; the model directory is the same model saved to disk.
    code, out = _run(capsys, ["eval", "--model", str(tiny_model_dir), "--dataset", str(text_file), "--num-samples",
                              "1", "--seq-len", "32", "--method", "oscar", "--artifacts", tiny_oscar, "--bits", "3",
                              "--json", str(tmp_path / "r.json")])
    assert code == 2 and out.err.count("\n") == 1 and "Traceback" not in out.err
    assert "--bits 3 contradicts" in out.err and "bits=2" in out.err
    assert not (tmp_path / "r.json").exists()
    code, out = _run(capsys, ["eval", "--model", str(tiny_model_dir), "--dataset", str(text_file), "--num-samples",
                              "1", "--seq-len", "32", "--method", "fp16", "--group-size", "32"])
    assert code == 2 and "--group-size is not an option of --method fp16" in out.err


def _click_default(command: str, option: str):
    params = {p.name: p for p in cli.commands[command].params}
    return params[option].default


@pytest.mark.parametrize("option", ["bits", "group_size", "residual", "scaling", "rotation"])
def test_defaults_are_the_same_in_every_command_and_library_function(option):
    from kvcalib.diagnose import diagnose
    from kvcalib.methods.kivi import KiviConfig
    from kvcalib.methods.kvlinc_fit import TrainConfig, train_adapters
    from kvcalib.methods.oscar import OscarConfig
    from kvcalib.methods.oscar_fit import save_oscar_artifact

    want = DEFAULTS[option]
    assert _click_default("eval", option) is None  # eval: not given = the artifact's value, else DEFAULTS
    assert _click_default("oscar-artifact", option) == want
    assert inspect.signature(save_oscar_artifact).parameters[option].default == want
    assert getattr(OscarConfig(), option) == want
    if option in ("bits", "group_size", "residual"):
        assert _click_default("train-adapters", option) == want
        assert inspect.signature(train_adapters).parameters[option].default == want
        assert getattr(TrainConfig(), option) == want and getattr(KiviConfig(), option) == want
    if option == "group_size":
        assert _click_default("diagnose", option) == want
        assert inspect.signature(diagnose).parameters[option].default == want


# ---- float16 sink tokens, an option of every method that compresses ----

@pytest.mark.parametrize("name,settings", [("kivi", dict(group_size=8, residual=8)), ("oscar", dict(group_size=8, residual=8)),
                                           ("kvlinc", dict(group_size=8, residual=8)), ("turboquant", dict(residual=8))])
def test_sink_tokens_keep_the_first_tokens_in_float16_for_every_method(name, settings):
    import torch

    from kvcalib.methods import hold

    k, v = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 21, 16)
    plain = hold(build_method(name, SHAPE, MethodSettings(**settings)), 0, k, v)
    sunk = hold(build_method(name, SHAPE, MethodSettings(sink_tokens=3, **settings)), 0, k, v)
    k16, v16 = k.half().float(), v.half().float()
    assert torch.equal(sunk.k[..., :3, :], k16[..., :3, :]) and torch.equal(sunk.v[..., :3, :], v16[..., :3, :])
    assert not torch.equal(plain.k[..., :3, :], k16[..., :3, :])  # without sinks they are coded like the rest
    assert torch.equal(sunk.k[..., 3:, :], plain.k[..., 3:, :]) and torch.equal(sunk.v[..., 3:, :], plain.v[..., 3:, :])
    assert sunk.stored_bits == plain.stored_bits + 16 * 2 * (1 * 2 * 3 * 16)  # K and V of 3 tokens, 2 heads, d=16


@pytest.mark.parametrize("value,match", [(-1, "0 or more"), (2, "not an option of --method fp16")])
def test_bad_sink_tokens_are_refused(value, match):
    name = "kivi" if value < 0 else "fp16"
    with pytest.raises(SettingsError, match=match):
        build_method(name, SHAPE, MethodSettings(sink_tokens=value))


def test_sink_tokens_that_contradict_a_vecinfer_artifact_are_refused(monkeypatch):
    import kvcalib.methods.vecinfer as vecinfer
    from kvcalib.methods.fp16 import Fp16

    class Fitted(Fp16):  # a stand-in codec: an artifact fitted with 4 float16 sinks
        sink, block = 4, 128

    monkeypatch.setattr(vecinfer, "load", lambda *a, **k: Fitted())
    with pytest.raises(SettingsError, match="--sink-tokens 2 contradicts the artifact .* sink_tokens=4"):
        build_method("vecinfer", SHAPE, MethodSettings(sink_tokens=2), "runs/some-vecinfer-artifact")
    assert build_method("vecinfer", SHAPE, MethodSettings(sink_tokens=4), "runs/some-vecinfer-artifact").sink == 4
