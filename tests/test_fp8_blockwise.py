"""Blockwise FP8 quantisation: the torch reference's numerics on CPU, and the Triton kernels against it on GPU."""

import math

import pytest
import torch

from mcore_rl.kernels.fp8_blockwise import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_blockwise,
    dequantize_blockwise_cpu,
    dequantize_blockwise_ref,
    quantize_blockwise,
    quantize_blockwise_cpu,
    quantize_blockwise_ref,
    scale_grid_shape,
    triton_available,
)

# Shapes that exercise full blocks, partial edge blocks in either dim, and a weight smaller than one block.
SHAPES = [(256, 384), (300, 200), (130, 257), (64, 32), (1, 129)]


def _weight(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Gaussian values with a different magnitude per row band, so blocks get very different scales."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    rows = shape[-2]
    magnitude = torch.logspace(-4, 2, steps=rows).view(rows, 1)
    return w * magnitude


def _block_slices(rows: int, cols: int, block: tuple[int, int]):
    for i in range(math.ceil(rows / block[0])):
        for j in range(math.ceil(cols / block[1])):
            yield i, j, slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_equals_block_amax_over_448(shape, dtype):
    w = _weight(shape).to(dtype)
    q, scale = quantize_blockwise_ref(w)
    assert scale.dtype == torch.float32 and q.dtype == FP8_DTYPE
    for i, j, rs, cs in _block_slices(*shape, (128, 128)):
        amax = w[rs, cs].float().abs().max()
        assert scale[i, j] == amax / FP8_MAX  # exact: the same single fp32 division


@pytest.mark.parametrize("shape", SHAPES)
def test_edge_blocks_are_partial_with_ceil_scale_grid(shape):
    w = _weight(shape)
    q, scale = quantize_blockwise_ref(w)
    assert q.shape == w.shape  # the weight is never padded
    assert tuple(scale.shape) == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert scale_grid_shape(shape) == tuple(scale.shape)
    # The largest element of every block, edge blocks included, maps to exactly +-448: the block's amax is taken
    # over the elements that exist, not over a padded tile.
    for _, _, rs, cs in _block_slices(*shape, (128, 128)):
        assert q[rs, cs].float().abs().max() == FP8_MAX


def test_non_power_of_two_block():
    w = _weight((200, 150))
    q, scale = quantize_blockwise_ref(w, block=(96, 64))
    assert tuple(scale.shape) == (3, 3)
    for i, j, rs, cs in _block_slices(200, 150, (96, 64)):
        assert scale[i, j] == w[rs, cs].abs().max() / FP8_MAX
    w_hat = dequantize_blockwise_ref(q, scale, block=(96, 64), dtype=torch.float32)
    assert w_hat.shape == w.shape


@pytest.mark.parametrize("shape", SHAPES)
def test_roundtrip_error_within_e4m3_bound(shape):
    # Per element, with s the block scale and x = w / s in [-448, 448]:
    # - normal e4m3 values (|x| >= 2^-6) carry 3 mantissa bits, so round-to-nearest errs by <= 2^-4 * |x|;
    # - subnormals (|x| < 2^-6) are spaced 2^-9, so the error is <= 2^-10 in x, i.e. 2^-10 * s in w.
    # Hence |w_hat - w| <= 2^-4 |w| + 2^-10 s. The fp32 division and multiplication add two roundings of
    # relative size 2^-24 each; the 1e-6 relative slack covers them with room to spare.
    w = _weight(shape)
    q, scale = quantize_blockwise_ref(w)
    w_hat = dequantize_blockwise_ref(q, scale, dtype=torch.float32)
    s = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    bound = (2.0**-4 * w.abs() + 2.0**-10 * s) * (1 + 1e-6)
    err = (w_hat - w).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3e}"
    # Coarser but common statement of the same bound: the error never exceeds half the top binade's spacing,
    # 16 of 448, i.e. amax / 28 of the block.
    assert (err <= s * 16 * (1 + 1e-6)).all()
    # The bound is not vacuous: some normal-range element loses more than half of the allowed 2^-4.
    normal = (w / s).abs() >= 2.0**-6
    if normal.sum() > 1000:
        assert (err[normal] / w.abs()[normal]).max() > 2.0**-5


def test_zero_blocks_get_unit_scale_and_exact_zeros():
    w = _weight((256, 256))
    w[:128, 128:] = 0.0
    q, scale = quantize_blockwise_ref(w)
    assert scale[0, 1] == 1.0
    assert (q[:128, 128:].float() == 0).all()
    w_hat = dequantize_blockwise_ref(q, scale, dtype=torch.float32)
    assert torch.equal(w_hat[:128, 128:], w[:128, 128:])
    # The other blocks are quantised as if the zero block did not exist.
    q_other, scale_other = quantize_blockwise_ref(w[:, :128])
    assert torch.equal(scale[:, 0], scale_other[:, 0])
    # An all-zero weight is fine too.
    q0, s0 = quantize_blockwise_ref(torch.zeros(3, 5))
    assert torch.equal(s0, torch.ones(1, 1)) and (q0.float() == 0).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_requantizing_a_dequantized_weight_is_idempotent(shape):
    w = _weight(shape, seed=1)
    q1, s1 = quantize_blockwise_ref(w)
    q2, s2 = quantize_blockwise_ref(dequantize_blockwise_ref(q1, s1, dtype=torch.float32))
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
    # s2 = fl(fl(448 s1) / 448) can differ from s1 by one fp32 ulp at most (two roundings); q is unaffected
    # because q1 is already on the e4m3 grid and a 2^-23 relative nudge cannot move it to a neighbour.
    torch.testing.assert_close(s2, s1, rtol=2.0**-22, atol=0)


def test_expert_stack_is_quantized_per_expert():
    w = _weight((3, 130, 200))
    w[1] *= 1000.0  # a much larger expert must not change the others' scales
    q, scale = quantize_blockwise_ref(w)
    assert q.shape == w.shape and tuple(scale.shape) == (3, 2, 2) == scale_grid_shape(w.shape)
    for e in range(3):
        q_e, s_e = quantize_blockwise_ref(w[e])
        assert torch.equal(q[e].view(torch.uint8), q_e.view(torch.uint8))
        assert torch.equal(scale[e], s_e)
    w_hat = dequantize_blockwise_ref(q, scale, dtype=torch.float32)
    assert torch.equal(w_hat[2], dequantize_blockwise_ref(q[2], scale[2], dtype=torch.float32))


def test_dequantize_multiplies_q_by_scale_inv_blockwise():
    w = _weight((300, 200))
    q, scale = quantize_blockwise_ref(w)
    w_hat = dequantize_blockwise_ref(q, scale, dtype=torch.float32)
    for i, j, rs, cs in _block_slices(300, 200, (128, 128)):
        assert torch.equal(w_hat[rs, cs], q[rs, cs].float() * scale[i, j])
    # bf16 output is the fp32 product rounded once.
    assert torch.equal(dequantize_blockwise_ref(q, scale, dtype=torch.bfloat16), w_hat.to(torch.bfloat16))


@pytest.mark.parametrize("shape", [*SHAPES, (3, 300, 200), (2, 1, 129)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_dequantize_is_the_reference_bit_for_bit(shape, dtype):
    q, s = quantize_blockwise_ref(_weight(shape))
    assert torch.equal(dequantize_blockwise_cpu(q, s, dtype=dtype), dequantize_blockwise_ref(q, s, dtype=dtype))
    odd = (128, 64)  # a block that is not square
    q, s = quantize_blockwise_ref(_weight(shape), odd)
    assert torch.equal(dequantize_blockwise_cpu(q, s, odd, dtype), dequantize_blockwise_ref(q, s, odd, dtype))


@pytest.mark.parametrize("shape", [*SHAPES, (3, 300, 200), (2, 1, 129)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_quantize_is_the_reference_bit_for_bit(shape, dtype):
    w = _weight(shape).to(dtype)
    w.view(-1)[: min(w.numel(), 200)] = 0  # a zero (unit-scale) block where the weight is big enough
    for block in ((128, 128), (128, 64), (32, 96)):
        q, s = quantize_blockwise_cpu(w, block)
        q_ref, s_ref = quantize_blockwise_ref(w, block)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref), block


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_cpu_quantize_refuses_non_finite_like_the_reference(bad):
    w = _weight((300, 300))
    w[250, 7] = bad  # in the last block row: found through that block's amax
    for fn in (quantize_blockwise_cpu, quantize_blockwise_ref):
        with pytest.raises(ValueError, match=r"shape \(300, 300\) holds inf or NaN"):
            fn(w)


def test_cpu_dequantize_reads_every_fp8_bit_pattern_as_torch_does():
    """All 256 codes (subnormals, -0, +-448, the two NaNs) through the table, against torch's own cast."""
    q = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).view(16, 16)
    scale = torch.full((1, 1), 0.75)
    ours, ref = (
        dequantize_blockwise_cpu(q, scale, dtype=torch.float32),
        dequantize_blockwise_ref(q, scale, dtype=torch.float32),
    )
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))  # bitwise: NaN payloads and -0 included
    assert ours.isnan().sum() == 2


def test_bench_fp8_smoke(capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_fp8

    assert bench_fp8.main(["--shape", "130", "257", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "deq cpu" in out and "q cpu" in out and out.splitlines()[2].count("x") == 2


def test_dispatch_uses_reference_on_cpu():
    w = _weight((130, 257))
    q, s = quantize_blockwise(w)
    q_ref, s_ref = quantize_blockwise_ref(w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert torch.equal(dequantize_blockwise(q, s), dequantize_blockwise_ref(q, s))


@pytest.mark.parametrize(
    "tensor, message",
    [
        (torch.randn(10), r"shape \(10,\)"),
        (torch.randn(2, 3, 4, 5), r"shape \(2, 3, 4, 5\)"),
        (torch.ones(4, 4, dtype=torch.int32), "torch.int32"),
        (torch.zeros(4, 4).to(torch.float8_e4m3fn), "float8_e4m3fn"),
        (torch.zeros(0, 4), r"empty weight of shape \(0, 4\)"),
        (torch.tensor([[1.0, float("nan")]]), "inf or NaN"),
    ],
)
def test_refuses_what_it_cannot_quantize(tensor, message):
    with pytest.raises(ValueError, match=message):
        quantize_blockwise(tensor)


def test_refuses_bad_block_and_mismatched_scales():
    with pytest.raises(ValueError, match="block must be two positive ints"):
        quantize_blockwise_ref(torch.randn(4, 4), block=(0, 128))
    q, s = quantize_blockwise_ref(torch.randn(130, 10))
    with pytest.raises(ValueError, match=r"expected \(2, 1\)"):
        dequantize_blockwise_ref(q, s[:1])
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        dequantize_blockwise_ref(q.float(), s)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(4, 130, 257)])
def test_triton_matches_reference_bit_for_bit(shape):
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton stores float8e4nv only on compute capability >= 8.9; the reference runs there instead")
    assert triton_available()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for block in ((128, 128), (96, 64)):  # (96, 64): a block that is not a power of two (masked tile)
            w = _weight(shape).clamp(-6e4, 6e4).to(dtype)  # within fp16 range
            w[..., : min(2, shape[-2]), :] = 0.0  # zero rows; the (1, 129) weight becomes all-zero blocks
            q_ref, s_ref = quantize_blockwise_ref(w, block)
            q, s = quantize_blockwise(w.cuda(), block)
            assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)), (dtype, block)
            assert torch.equal(s.cpu(), s_ref), (dtype, block)
            for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
                y = dequantize_blockwise(q, s, block, out_dtype)
                assert torch.equal(y.cpu(), dequantize_blockwise_ref(q_ref, s_ref, block, out_dtype)), out_dtype
