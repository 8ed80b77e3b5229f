import pytest
import torch

from kvcalib.errors import SettingsError
from kvcalib.hadamard import hadamard, rotate


@pytest.mark.parametrize("n", [2, 16, 64, 128, 96, 80])
def test_hadamard_is_orthogonal_and_symmetric(n):
    h = hadamard(n, torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64))
    torch.testing.assert_close(h, h.T)
    assert (h.abs() > 0).sum() == n * (n & -n)  # dense within each block, zero outside


@pytest.mark.parametrize("n", [64, 96])
def test_rotation_leaves_dot_products_unchanged_and_inverts_itself(n):
    q, k = torch.randn(5, 7, n, dtype=torch.float64), torch.randn(5, 9, n, dtype=torch.float64)
    torch.testing.assert_close(rotate(q) @ rotate(k).transpose(-1, -2), q @ k.transpose(-1, -2))
    torch.testing.assert_close(rotate(rotate(q)), q)


def test_rotation_spreads_an_outlier_channel():
    x = torch.zeros(1, 64)
    x[0, 5] = 8.0
    assert rotate(x).abs().max() == pytest.approx(1.0)


def test_odd_sizes_are_refused():
    with pytest.raises(SettingsError, match="odd"):
        hadamard(63)
