import math

import pytest
import torch

from kvcalib.errors import SettingsError
from kvcalib.hadamard import block_size, hadamard, on_the_rotation_kernel, rotate
from tolerances import U64, gamma


def _check_orthogonal(h):
    """H Hᵀ = I up to float64 round-off. The entries are ±1/sqrt(b) after two roundings (sqrt(b), then the
    division; exact when b is a power of 4), so entry (i, j) of H Hᵀ, a sum of n products, is within
    gamma_{n+5} * sum_k |h_ik h_jk|; that sum is 1 inside a block (b terms of 1/b) and 0 across blocks.
    n = 2 attains 2u of its 7u deterministically: 1/sqrt(2) rounds up, and both products carry it."""
    n = h.shape[0]
    assert (h @ h.T - torch.eye(n, dtype=h.dtype)).abs().max().item() <= gamma(n + 5, U64)


@pytest.mark.parametrize("n", [2, 16, 64, 128, 96, 80])
def test_hadamard_is_orthogonal_and_symmetric(n):
    h = hadamard(n, torch.float64)
    _check_orthogonal(h)
    assert torch.equal(h, h.T)  # Sylvester's construction is symmetric entry for entry: exact
    assert (h.abs() > 0).sum() == n * (n & -n)  # dense within each block, zero outside


def test_the_orthogonality_check_catches_one_sign_flipped():
    h = hadamard(64, torch.float64).clone()
    h[3, 5] = -h[3, 5]  # rows 3 and j now overlap by ±2/64 instead of 0
    with pytest.raises(AssertionError):
        _check_orthogonal(h)


def _rotation_error(n):
    """‖fl(x @ H) − x H‖ / ‖x‖ for the exact H, in float64: output j sums the b entries of x in its block
    (n terms with the exact zeros) times entries rounded twice, within gamma_{n+3} * sum_k |x_k| / sqrt(b)
    <= gamma_{n+3} ‖x_block‖ (Cauchy–Schwarz); over the b outputs of each block, gamma_{n+3} sqrt(b) ‖x‖."""
    return gamma(n + 3, U64) * math.sqrt(block_size(n))


def _check_dot_products(rq, rk, q, k):
    """rq rkᵀ equals q kᵀ: with H orthogonal, rq·rk − q·k is the rotations' errors against k and q (r ‖q‖ ‖k‖
    each, r = `_rotation_error`), their product, and the round-off of the two n-term dot products
    (gamma_n ‖rq‖ ‖rk‖ and gamma_n ‖q‖ ‖k‖, Cauchy–Schwarz), with ‖rq‖ <= (1 + r) ‖q‖."""
    n = q.shape[-1]
    r = _rotation_error(n)
    bound = (2 * r + 2 * gamma(n, U64)) * (1 + r) ** 2 * q.norm(dim=-1)[..., :, None] * k.norm(dim=-1)[..., None, :]
    assert ((rq @ rk.transpose(-1, -2) - q @ k.transpose(-1, -2)).abs() <= bound).all()


def _check_inverse(back, x):
    """rotate(rotate(x)) = x: the first rotation's error passes unchanged through the second (H orthogonal),
    which adds its own on a vector of norm <= (1 + r) ‖x‖."""
    r = _rotation_error(x.shape[-1])
    assert ((back - x).norm(dim=-1) <= 2 * r * (1 + r) * x.norm(dim=-1)).all()


@pytest.mark.parametrize("n", [64, 96])
def test_rotation_leaves_dot_products_unchanged_and_inverts_itself(n):
    q, k = torch.randn(5, 7, n, dtype=torch.float64), torch.randn(5, 9, n, dtype=torch.float64)
    _check_dot_products(rotate(q), rotate(k), q, k)
    _check_inverse(rotate(rotate(q)), q)


def test_the_rotation_checks_catch_one_sign_flipped():
    q, k = torch.randn(5, 7, 64, dtype=torch.float64), torch.randn(5, 9, 64, dtype=torch.float64)
    flipped = hadamard(64, torch.float64).clone()
    flipped[3, 5] = -flipped[3, 5]
    with pytest.raises(AssertionError):
        _check_dot_products(rotate(q), k @ flipped, q, k)
    with pytest.raises(AssertionError):
        _check_inverse(rotate(q) @ flipped, q)


def test_rotation_spreads_an_outlier_channel():
    x = torch.zeros(1, 64)
    x[0, 5] = 8.0
    # H_64 = ±1/8 exactly, and each output has one nonzero term: 8 * ±1/8 = ±1 with no rounding.
    assert torch.equal(rotate(x).abs(), torch.ones(1, 64))


def test_odd_sizes_are_refused():
    with pytest.raises(SettingsError, match="odd"):
        hadamard(63)


def test_the_rotation_kernel_refuses_what_it_cannot_read_in_one_line():
    """`kvcalib::hadamard_rows` reads raw CUDA pointers: a CPU tensor, an odd width or an integer dtype is refused
    before any launch (`rotate` itself takes them on the product)."""
    for x in (torch.randn(3, 64), torch.randn(3, 81), torch.ones(3, 64, dtype=torch.int32)):
        assert not on_the_rotation_kernel(x)
        with pytest.raises(ValueError, match=r"^hadamard_rows takes [^\n]*$"):
            torch.ops.kvcalib.hadamard_rows(x, False)
