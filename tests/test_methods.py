import pytest
import torch

from kvcalib.attention import flushed_counts
from kvcalib.errors import SettingsError
from kvcalib.methods import MethodSettings, build_method, hold
from kvcalib.methods.kivi import KiviConfig
from kvcalib.models import AttentionShape

SHAPE = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)


def test_flush_rule_keeps_zero_to_block_minus_one_tokens_in_the_residual():
    counts = flushed_counts(num_queries=20, num_keys=20, block=8)
    assert counts.tolist() == [0] * 7 + [8] * 8 + [16] * 5
    assert flushed_counts(num_queries=1, num_keys=17, block=8).tolist() == [16]


def test_hold_keeps_last_partial_block_in_float16_and_quantizes_the_rest():
    method = build_method("kivi", SHAPE, MethodSettings(bits=2, group_size=4, residual=8))
    k, v = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 21, 16)
    held = hold(method, 0, k, v)
    assert held.flushed == 16
    assert torch.equal(held.k[..., 16:, :], k[..., 16:, :].half().float())
    assert torch.equal(held.v[..., 16:, :], v[..., 16:, :].half().float())
    assert not torch.allclose(held.k[..., :16, :], k[..., :16, :], atol=1e-3)


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
    assert held.stored_bits / (k.numel() + v.numel()) == pytest.approx(expected_bits)


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
