import inspect

import pytest
import torch

from kvcalib.attention import flushed_counts
from kvcalib.errors import SettingsError
from kvcalib.methods import METHOD_NAMES, METHODS, Method, MethodSettings, build_method, hold
from kvcalib.methods.kivi import KiviConfig
from kvcalib.models import AttentionShape
from tolerances import U16

SHAPE = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)


def test_flush_rule_keeps_zero_to_block_minus_one_tokens_in_the_residual():
    counts = flushed_counts(num_queries=20, num_keys=20, block=8)
    assert counts.tolist() == [0] * 7 + [8] * 8 + [16] * 5
    assert flushed_counts(num_queries=1, num_keys=17, block=8).tolist() == [16]


def test_sliding_flush_rule_keeps_the_newest_window_in_float16():
    """window R = 8, block 4: the newest 8 tokens always float16, the blocks before them flushed as
    soon as 8 newer tokens follow them, so R..R+block-1 = 8..11 tokens wait."""
    counts = flushed_counts(num_queries=20, num_keys=20, block=4, window=8)
    assert counts.tolist() == [0] * 11 + [4] * 4 + [8] * 4 + [12]
    waiting = torch.arange(1, 21) - counts
    assert waiting[11:].min() == 8 and waiting.max() == 11
    assert flushed_counts(num_queries=1, num_keys=100, block=1, window=8).tolist() == [92]  # per-vector step


@pytest.mark.parametrize("name,settings,block", [
    ("kivi", MethodSettings(group_size=4, residual=8), 4), ("oscar", MethodSettings(group_size=4, residual=8), 4),
    ("kvlinc", MethodSettings(group_size=4, residual=8), 4), ("turboquant", MethodSettings(residual=8), 1)])
def test_sliding_mode_flushes_one_step_of_the_method_behind_a_window_of_r(name, settings, block):
    import dataclasses

    blockwise = build_method(name, SHAPE, settings)
    sliding = build_method(name, SHAPE, dataclasses.replace(settings, residual_mode="sliding"))
    assert (blockwise.block, blockwise.window) == (8, 0)
    assert (sliding.block, sliding.window) == (block, 8)
    k, v = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 21, 16)
    held = hold(sliding, 0, k, v)
    assert held.flushed == (21 - 8) // block * block
    assert not _moved_beyond_float16_rounding(held.k[..., held.flushed:, :], k[..., held.flushed:, :])
    assert _moved_beyond_float16_rounding(held.k[..., :held.flushed, :], k[..., :held.flushed, :])


def test_an_unknown_residual_mode_is_refused():
    with pytest.raises(SettingsError, match="--residual-mode must be one of blockwise, sliding"):
        build_method("kivi", SHAPE, MethodSettings(residual_mode="ring"))
    with pytest.raises(SettingsError, match="--residual-mode is not an option of --method fp16"):
        build_method("fp16", SHAPE, MethodSettings(residual_mode="sliding"))


def _moved_beyond_float16_rounding(held: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether some element of `held` is further from x than rounding x to float16 can take it:
    u16 |x|, or 2^-25 below 2^-14 where float16 is subnormal. Not a round-off bound but a floor: 2-bit
    codes move most elements by a sizeable part of a step, (max − min) / 3 of a group, ~0.7 here."""
    return bool(((held - x).abs() > U16 * x.abs() + 2.0**-25).any())


def test_hold_keeps_last_partial_block_in_float16_and_quantizes_the_rest():
    method = build_method("kivi", SHAPE, MethodSettings(bits=2, group_size=4, residual=8))
    k, v = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 21, 16)
    held = hold(method, 0, k, v)
    assert held.flushed == 16
    assert torch.equal(held.k[..., 16:, :], k[..., 16:, :].half().float())
    assert torch.equal(held.v[..., 16:, :], v[..., 16:, :].half().float())
    assert _moved_beyond_float16_rounding(held.k[..., :16, :], k[..., :16, :])
    assert _moved_beyond_float16_rounding(held.v[..., :16, :], v[..., :16, :])


def test_keys_held_in_float16_only_do_not_pass_for_quantized():
    k = torch.randn(1, 2, 16, 16)
    assert not _moved_beyond_float16_rounding(k.half().float(), k)


def test_held_prefix_does_not_change_as_the_sequence_grows():
    # Key groups never straddle a flush boundary, so a token's stored form is fixed once flushed.
    method = build_method("kivi", SHAPE, MethodSettings(bits=2, group_size=4, residual=8))
    k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    long = hold(method, 0, k, v)
    for n in (8, 17, 31):
        short = hold(method, 0, k[..., :n, :], v[..., :n, :])
        assert torch.equal(long.k[..., : short.flushed, :], short.k[..., : short.flushed, :])


@pytest.mark.parametrize("group,expected_bits", [(4, 2 + 32 / 4), (8, 2 + 32 / 8)])
def test_kivi_stored_bits_match_the_layout(group, expected_bits):
    method = build_method("kivi", SHAPE, MethodSettings(bits=2, group_size=group, residual=16))
    k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    held = hold(method, 0, k, v)
    assert held.stored_bits / (k.numel() + v.numel()) == expected_bits  # integer counts, dyadic ratio: exact


def test_kivi_value_groups_clamp_to_head_dim():
    method = build_method("kivi", SHAPE, MethodSettings(bits=2, group_size=128, residual=128))
    assert method.settings()["value_group_size"] == 16


@pytest.mark.parametrize("kwargs", [dict(bits=0), dict(bits=9), dict(group_size=32, residual=48), dict(residual=0)])
def test_invalid_kivi_settings_are_refused(kwargs):
    with pytest.raises(SettingsError):
        KiviConfig(**kwargs)


def test_unknown_method_is_refused():
    with pytest.raises(SettingsError, match="unknown method"):
        build_method("kivy", SHAPE)


def test_the_codec_is_what_every_method_must_define():
    assert Method.__abstractmethods__ == {"compress", "decompress", "part_bits", "settings"}
    with pytest.raises(TypeError, match="abstract"):
        Method()


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_every_registered_method_module_builds_methods_that_define_the_whole_codec(name):
    """The registry names each method's module by its `--method` name; the module has `SETTINGS` and `build`,
    and no `Method` subclass it defines leaves a codec member abstract."""
    module = METHODS[name]
    assert module.__name__ == f"kvcalib.methods.{name}" and isinstance(module.SETTINGS, tuple) and callable(module.build)
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, Method) and c.__module__ == module.__name__]
    assert classes and not any(inspect.isabstract(c) for c in classes)
