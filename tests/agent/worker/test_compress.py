"""Compressed messages: error bounds, wire sizes, int4 / int3 packing, top-k, error feedback.

Unit tests of `agent/worker/compress.py` against the sizes `dtfm.core.codecs` promises (the
scheduler counts those bytes without torch), plus the data-parallel averager's refusal of a
ring all-reduce with compression. The training runs with compression on are in
`test_compress_training.py`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agent.worker.compress import INT3_LEVELS, ErrorFeedback, TensorCodec, make_codec
from agent.worker.data_parallel import GradAverager
from dtfm.core.codecs import BLOCK, INT3_BLOCK, TOPK_BLOCK, Codec, LinkCodecs, parse_codec

# bf16 scales carry 8 significant bits, so a block's scale may be off by 2^-8 relative
SCALE_SLACK = 1.0 + 2.0**-7
SIZES = [1, 2, 7, 8, 9, 31, 32, 33, 127, 128, 129, 255, 256, 257, 1000, 4096 + 3]
# int3: the widest gap between neighbouring levels, and the top level's shortfall
_INT3_UP = (-INT3_LEVELS[0], *INT3_LEVELS)  # the levels from the first negative one up
INT3_HALF_GAP = max(b - a for a, b in zip(_INT3_UP, _INT3_UP[1:], strict=False)) / 2
INT3_TOP_GAP = 1.0 - INT3_LEVELS[-1]


def _codec(name: str) -> TensorCodec:
    codec = make_codec(name)
    assert codec is not None
    return codec


def _block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block's largest magnitude."""
    n = x.numel()
    padded = torch.nn.functional.pad(x, (0, (-n) % block))
    amax = padded.view(-1, block).abs().amax(dim=1)
    return amax.repeat_interleave(block)[:n]


@pytest.mark.parametrize("name", ["int8", "int4", "int3", "topk:0.1", "topk:1"])
@pytest.mark.parametrize("n", SIZES)
def test_message_has_the_promised_size(name: str, n: int) -> None:
    codec = _codec(name)
    msg = codec.encode(torch.randn(n))
    assert msg.dtype == torch.uint8 and msg.dim() == 1
    assert msg.numel() == parse_codec(name).wire_bytes(n)
    assert codec.decode(msg, n).shape == (n,)


@pytest.mark.parametrize(("name", "qmax"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("n", SIZES)
def test_quantization_error_is_half_a_step_of_the_block_scale(name: str, qmax: int,
                                                              n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    # magnitudes that differ by block, as activations and gradients do
    x = torch.randn(n, generator=gen) * torch.logspace(-6, 3, n)
    codec = _codec(name)
    err = (codec.decode(codec.encode(x), n) - x).abs()
    bound = _block_amax(x, BLOCK) / (2 * qmax) * SCALE_SLACK
    assert bool((err <= bound + 1e-30).all()), float((err - bound).max())


@pytest.mark.parametrize("n", SIZES)
def test_int3_error_is_bounded_by_its_grid(n: int) -> None:
    """int3 rounds to the nearest of its levels: within half the widest gap between levels,
    and a block's largest values within the top level's shortfall, of the block's scale."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * torch.logspace(-6, 3, n)
    codec = _codec("int3")
    err = (codec.decode(codec.encode(x), n) - x).abs()
    amax = _block_amax(x, INT3_BLOCK)
    bound = amax * max(INT3_HALF_GAP, INT3_TOP_GAP) * SCALE_SLACK
    assert bool((err <= bound + 1e-30).all()), float((err - bound).max())


def test_int3_keeps_most_of_a_normal_message() -> None:
    """The grid is fitted to normal values: it loses ~2.8 % of their energy (a uniform
    8-level grid scaled to each block's maximum: ~3.8 %; int4: ~1.5 %)."""
    x = torch.randn(64 * INT3_BLOCK, generator=torch.Generator().manual_seed(0))
    codec = _codec("int3")
    lost = float((codec.decode(codec.encode(x), x.numel()) - x).square().sum() / x.square().sum())
    assert 0.02 < lost < 0.035, lost


def test_int3_grid_is_symmetric_and_dense_near_zero() -> None:
    """Lloyd-Max's levels for a normal distribution: the gaps grow away from zero, so the
    many small values get the fine steps."""
    gaps = [b - a for a, b in zip(_INT3_UP, _INT3_UP[1:], strict=False)]
    assert gaps == sorted(gaps) and 0 < INT3_LEVELS[-1] < 1


def test_tiny_and_zero_blocks_survive() -> None:
    """Gradients of activations are ~1e-8: bf16 scales keep fp32's range; zeros stay zeros
    (int3 too, though its grid has no zero level)."""
    x = torch.cat([torch.zeros(BLOCK), torch.full((BLOCK,), 3e-9), torch.tensor([-1e-30])])
    for name in ("int8", "int4", "int3"):
        codec = _codec(name)
        y = codec.decode(codec.encode(x), x.numel())
        assert bool((y[:BLOCK] == 0).all())
        rtol = 0.1 if name == "int3" else 0.01  # a constant block: int3's top level, 0.92
        assert torch.allclose(y[BLOCK : 2 * BLOCK], x[BLOCK : 2 * BLOCK], rtol=rtol)


@pytest.mark.parametrize("n", [1, 2, 3, 128, 129, 255])
def test_int4_packing_round_trips_exactly(n: int) -> None:
    """Values on the int4 grid with an exactly representable scale come back bit for bit,
    whichever half of a byte they land in, odd lengths included."""
    gen = torch.Generator().manual_seed(n)
    q = torch.randint(-7, 8, (n,), generator=gen).float()
    q[::BLOCK] = 7.0  # every block's largest magnitude is 7: the scale is exactly 0.25
    x = q * 0.25
    codec = _codec("int4")
    assert torch.equal(codec.decode(codec.encode(x), n), x)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 31, 32, 33, 100])
def test_int3_packing_round_trips_exactly(n: int) -> None:
    """Values on the int3 grid with a power-of-two scale come back bit for bit, wherever
    their three bits fall in a group of three bytes (across byte boundaries), any length."""
    gen = torch.Generator().manual_seed(n)
    grid = torch.tensor([-v for v in reversed(INT3_LEVELS)] + list(INT3_LEVELS))
    codes = torch.randint(0, 8, (n,), generator=gen)
    scale = 0.5
    x = grid[codes] * scale
    x[::INT3_BLOCK] = scale  # every block's largest magnitude is the scale, exactly in bf16
    want = x.clone()
    want[::INT3_BLOCK] = INT3_LEVELS[-1] * scale  # which the grid's top level represents
    codec = _codec("int3")
    assert torch.equal(codec.decode(codec.encode(x), n), want)


def test_int3_packs_eight_codes_in_three_bytes() -> None:
    """The layout `dtfm.core.codecs` documents: after the scales, code i in bits 3i..3i+2 of
    each little-endian group of three bytes."""
    x = torch.tensor([INT3_LEVELS[-1]] + [-INT3_LEVELS[-1]] * 7) * 2.0
    msg = _codec("int3").encode(x)
    assert msg.numel() == 2 + 3
    assert msg[:2].view(torch.bfloat16).item() == pytest.approx(2 * INT3_LEVELS[-1], rel=0.01)
    assert msg[2:].tolist() == [7, 0, 0]  # code 7 (the top level) then seven code 0s


def test_topk_keeps_the_largest_of_each_block() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 3 * TOPK_BLOCK + 17
    x = torch.randn(n, generator=gen)
    codec = _codec("topk:0.1")
    k = parse_codec("topk:0.1").topk_per_block
    y = codec.decode(codec.encode(x), n)
    for start in range(0, n, TOPK_BLOCK):
        xb, yb = x[start : start + TOPK_BLOCK], y[start : start + TOPK_BLOCK]
        kept = yb != 0
        assert int(kept.sum()) == min(k, xb.numel())
        top = xb.abs().topk(min(k, xb.numel())).indices
        assert bool(kept[top].all())
        amax = xb.abs().max()
        assert bool(((yb - xb)[kept].abs() <= amax / 254 * SCALE_SLACK).all())


def test_topk_of_everything_is_int8_on_its_own_blocks() -> None:
    x = torch.randn(TOPK_BLOCK * 2)
    y = _codec("topk:1").decode(_codec("topk:1").encode(x), x.numel())
    assert bool(((y - x).abs() <= _block_amax(x, TOPK_BLOCK) / 254 * SCALE_SLACK).all())


@pytest.mark.parametrize("name", ["int8", "int4", "int3", "topk:0.05"])
def test_error_feedback_tracks_the_running_sum(name: str) -> None:
    """After T messages, sum(sent) = sum(true) - residual: the running sums differ by one
    message's error, while plain compression's error grows with T."""
    gen = torch.Generator().manual_seed(1)
    n, steps = 1000, 200
    bias = torch.randn(n, generator=gen) * 0.1  # a persistent gradient direction
    ef, codec = ErrorFeedback(_codec(name)), _codec(name)
    true_sum, ef_sum, plain_sum = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for _ in range(steps):
        x = bias + torch.randn(n, generator=gen) * 0.05
        msg, sent = ef.encode(x)
        assert torch.equal(sent, codec.decode(msg, n))  # what the receiver decodes
        true_sum += x
        ef_sum += sent
        plain_sum += codec.decode(codec.encode(x), n)
    assert ef.residual is not None
    torch.testing.assert_close(ef_sum + ef.residual, true_sum, rtol=0, atol=1e-3)
    ef_err = (ef_sum - true_sum).norm()
    plain_err = (plain_sum - true_sum).norm()
    assert ef_err < 0.2 * plain_err, (float(ef_err), float(plain_err))
    # bounded by what one message can miss, not by the number of steps
    assert ef_err < 0.1 * true_sum.norm()


@pytest.mark.parametrize(("name", "block", "step"), [
    ("int4", BLOCK, 1 / 14), ("int3", INT3_BLOCK, max(INT3_HALF_GAP, INT3_TOP_GAP))])
def test_quantizer_residual_is_within_one_message_bound(name: str, block: int,
                                                        step: float) -> None:
    """The residual never outgrows one message's error: it does not pile up over steps."""
    gen = torch.Generator().manual_seed(2)
    ef = ErrorFeedback(_codec(name))
    for _ in range(50):
        x = torch.randn(600, generator=gen)
        v = x + (ef.residual if ef.residual is not None else 0.0)
        ef.encode(x)
        assert ef.residual is not None
        bound = _block_amax(v, block) * step * SCALE_SLACK
        assert bool((ef.residual.abs() <= bound + 1e-7).all())


def test_names_and_refusals() -> None:
    assert make_codec("") is None and make_codec("none") is None
    with pytest.raises(ValueError, match="int3, topk:RATIO"):
        make_codec("int2")
    with pytest.raises(ValueError, match="data-parallel gradients only"):
        parse_codec("int3", topk=False, what="--pp-compress")
    with pytest.raises(ValueError, match="ratio"):
        parse_codec("topk:0")
    with pytest.raises(ValueError, match="not a codec"):
        parse_codec("topk:0.1", topk=False, what="--pp-compress")
    with pytest.raises(ValueError, match="bytes"):
        _codec("int8").decode(torch.zeros(10, dtype=torch.uint8), 100)
    assert Codec("int8").ratio_to(4) == pytest.approx((1 + 2 / BLOCK) / 4)
    assert Codec("int3").ratio_to(4) == pytest.approx((3 / 8 + 2 / INT3_BLOCK) / 4)
    assert 1 / Codec("int3").ratio_to(4) > 8  # the data-parallel target
    assert Codec("int3").wire_bytes(8) == 3 + 2 and Codec("int3").wire_bytes(9) == 4 + 2
    assert Codec("int3").wire_bytes(33) == 13 + 4


def test_link_codecs_name_each_ranks_links() -> None:
    codecs = LinkCodecs(pp=[["int8", "none"], ["int4", "int8"]], dp=["none", "int8", "int4"])
    assert codecs.rank_codecs(0, 1) == ("", "none", "none")
    assert codecs.rank_codecs(1, 0) == ("int8", "int4", "int8")
    assert codecs.rank_codecs(2, 1) == ("int8", "", "int4")
    assert LinkCodecs.uniform("auto", "topk:0.10", 2, 2) == LinkCodecs(
        pp=[["none", "none"]], dp=["topk:0.1", "topk:0.1"])
    with pytest.raises(ValueError, match="do not fit"):
        codecs.check(2, 2)
    LinkCodecs(pp=[["int4", "int4"]], dp=["int3", "int3"]).check(2, 2)
    with pytest.raises(ValueError, match="data-parallel gradients only"):
        LinkCodecs(pp=[["int3", "int4"]], dp=["int3", "int3"]).check(2, 2)
    with pytest.raises(ValueError, match="data-parallel gradients only"):
        LinkCodecs.uniform("int3", "none", 2, 2)


def test_ring_allreduce_refuses_compression() -> None:
    with pytest.raises(ValueError, match="sharded"):
        GradAverager(nn.Linear(2, 2), None, [0, 1], "allreduce", codec=_codec("int8"))
