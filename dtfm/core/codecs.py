"""Names and wire sizes of the compression codecs for pipeline and data-parallel messages.

The worker implements the codecs in torch (`agent/worker/compress.py`); the scheduler counts
their bytes (`coordinator/scheduler/compression.py`) and the config validates their names.
Those three must agree to the byte, and two of them may not import torch, so the vocabulary
and the size formulas live here, in the core library, and a test pins the worker's real
messages to `wire_bytes`.

A codec is one of:

- `none`: the tensor as it is (fp32, or the training dtype for activations under bf16);
- `int8`: blocks of `BLOCK` elements, each scaled by its largest magnitude to -127..127,
  one byte per element plus one bf16 scale per block;
- `int4`: the same with -7..7, two elements per byte;
- `int4h`: int4's bytes exactly, each block first rotated by a fixed, signed
  Hadamard transform (`agent/worker/rotate.py`). A transformer's activations have a few
  outlier channels; in plain int4 one outlier sets its block's scale and the other 127 values
  round to a handful of levels. The rotation spreads every block's energy evenly over its 128
  values, so the scale follows the block's typical magnitude (TAH-Quant, QuaRot). The receiver
  undoes the rotation after dequantising. Gradients going back are rounded stochastically,
  so they are unbiased. No extra byte: the same block and scale as int4, which
  `wire_bytes` pins. Made for pipeline links (`--pp-compress int4h`; `auto` does not take
  it yet, see `PP_LOSSINESS`); a data-parallel group may ask for it too (rounded to
  nearest, under error feedback);
- `int3` (data-parallel only): blocks of `INT3_BLOCK` elements, each as eight levels (a
  fixed, non-uniform grid, fractions of the block's largest magnitude) in 3 bits, eight
  elements to three bytes, plus one bf16 scale per block: 9.14x fewer bytes than fp32, the one
  quantizer past the 8x that int4 cannot reach (its 2-byte scales keep it at 7.76x). Its
  smaller blocks follow local magnitudes more closely (they cost 0.5 bit per element), which
  buys back part of what the fourth bit would have. It loses about twice int4's error per
  message; error feedback resends what a message missed, and pipeline messages have none
  (each carries a different micro-batch), so it is refused there;
- `topk:RATIO` (data-parallel only): in each block of `TOPK_BLOCK` elements, the
  `ceil(RATIO * TOPK_BLOCK)` largest magnitudes, each as a one-byte position and an int8
  value, plus one bf16 scale per block. What is not sent waits in the error-feedback
  residual for a later step.

`auto` is not a codec but a setting: the coordinator chooses a codec per pipeline link and per
data-parallel group from the measured links (`coordinator.scheduler.compression`).

Pure Python: no torch, numpy or grpc.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BLOCK = 128  # elements per scale for int8 / int4: small enough to follow local magnitudes
# int3's blocks: with 3 bits the grid is coarse, so each scale follows fewer values. Blocks of
# 32 trained gpt-mini closer to the exact run than 64 or 128 (docs/runtime.md) and still send
# 3.5 bits per value, under the 4 that an 8x cut allows.
INT3_BLOCK = 32
TOPK_BLOCK = 256  # elements per top-k block: a position fits in one byte
SCALE_BYTES = 2  # one bf16 scale per block: fp32's range (gradients are tiny), half the bytes
KINDS = ("none", "int8", "int4", "int4h", "int3", "topk")
# bits per element of the block quantizers
QUANT_BITS = {"int8": 8, "int4": 4, "int4h": 4, "int3": 3}
AUTO = "auto"
PP_SETTINGS = ("none", "int8", "int4", "int4h", AUTO)  # --pp-compress
DP_SETTINGS = ("none", "int8", "int4", "int4h", "int3", "topk:RATIO", AUTO)  # --dp-compress
# The codecs `auto` may consider, least lossy first. Data-parallel groups also int3 (error
# feedback makes up for it); top-k never: it changes convergence too much (docs/benchmarks.md)
# to choose silently. Not int4h either, yet: on gpt-mini trained from scratch it trailed int4
# by 0.2-0.4 % in validation loss on three paired runs, for twice the codec time
# (docs/benchmarks.md, "int4h"); it is there for jobs that ask for it, and `auto` prices it
# should it join this list.
PP_LOSSINESS = ("none", "int8", "int4")
DP_LOSSINESS = ("none", "int8", "int4", "int3")


@dataclass(frozen=True)
class Codec:
    """One codec: `kind` and, for top-k, the share of each block that is sent."""

    kind: str = "none"
    ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown codec {self.kind!r}; use one of none, int8, int4, "
                             f"int4h, int3, topk:RATIO")
        if self.kind == "topk" and not (0.0 < self.ratio <= 1.0):
            raise ValueError(f"topk ratio must be in (0, 1], got {self.ratio}")

    @property
    def name(self) -> str:
        return f"topk:{self.ratio:g}" if self.kind == "topk" else self.kind

    @property
    def lossless(self) -> bool:
        return self.kind == "none"

    @property
    def block(self) -> int:
        """Elements per bf16 scale (top-k: per block of `TOPK_BLOCK`; none: 0)."""
        return {"none": 0, "topk": TOPK_BLOCK, "int3": INT3_BLOCK}.get(self.kind, BLOCK)

    @property
    def topk_per_block(self) -> int:
        return max(1, min(TOPK_BLOCK, math.ceil(self.ratio * TOPK_BLOCK)))

    def wire_bytes(self, n: int, raw_bytes: int = 4) -> int:
        """Bytes of the message that carries `n` elements (`raw_bytes` each uncompressed)."""
        if n < 0:
            raise ValueError(f"a message cannot hold {n} elements")
        if self.kind == "none":
            return n * raw_bytes
        if self.kind == "topk":
            blocks = -(-n // TOPK_BLOCK)
            return blocks * (2 * self.topk_per_block + SCALE_BYTES)
        blocks = -(-n // self.block)
        payload = -(-n * QUANT_BITS[self.kind] // 8)  # the last byte may be part-filled
        return payload + blocks * SCALE_BYTES

    def bytes_per_element(self, raw_bytes: int = 4) -> float:
        """Wire bytes per element of a long message: what the cost model charges."""
        if self.kind == "none":
            return float(raw_bytes)
        if self.kind == "topk":
            return (2 * self.topk_per_block + SCALE_BYTES) / TOPK_BLOCK
        return QUANT_BITS[self.kind] / 8 + SCALE_BYTES / self.block

    def ratio_to(self, raw_bytes: int = 4) -> float:
        """Wire bytes over uncompressed bytes for a long message (1.0 for none)."""
        return self.bytes_per_element(raw_bytes) / raw_bytes


NONE = Codec()


def parse_codec(text: str, *, topk: bool = True, what: str = "codec") -> Codec:
    """A concrete codec from its name (`none`, `int8`, `int4`, `int3`, `topk:RATIO`).

    `what` names the flag or field in the error. `topk=False` (pipeline messages) refuses the
    data-parallel-only codecs, top-k and int3: both lose so much of one message that they
    rely on error feedback, which pipeline messages do not have (each carries a different
    micro-batch). The keyword is older than int3."""
    text = (text or "none").strip()
    if text in ("none", "int8", "int4", "int4h"):
        return Codec(text)
    if text == "int3":
        if not topk:
            raise ValueError(f"{what} {text!r}: int3 is for data-parallel gradients only; "
                             f"it relies on error feedback, which pipeline messages do not "
                             f"have (each carries a different micro-batch): use int4 or int8")
        return Codec(text)
    if text.startswith("topk:") and topk:
        raw = text.removeprefix("topk:")
        try:
            ratio = float(raw)
        except ValueError:
            ratio = float("nan")
        if not (0.0 < ratio <= 1.0):
            raise ValueError(f"{what} {text!r}: the ratio after 'topk:' must be a number in "
                             f"(0, 1], e.g. topk:0.1 (send a tenth of each block)")
        return Codec("topk", ratio)
    allowed = "none, int8, int4, int4h" + (", int3, topk:RATIO" if topk else "")
    raise ValueError(f"{what} {text!r} is not a codec: use one of {allowed}")


def check_setting(text: str, *, topk: bool, what: str) -> None:
    """Validate a `--pp-compress` / `--dp-compress` setting: a codec or `auto`."""
    if (text or "none").strip() == AUTO:
        return
    parse_codec(text, topk=topk, what=what)


@dataclass(frozen=True)
class LinkCodecs:
    """The codec of every link of one plan: what each rank's assignment names.

    `pp[j][k]`: the link between stage j and stage j+1 of pipeline k (activations forward,
    their gradients back); `dp[j]`: stage j's data-parallel group (one codec for all of it,
    since its replicas must decode the same averaged gradients)."""

    pp: list[list[str]]
    dp: list[str]

    @classmethod
    def uniform(cls, pp: str, dp: str, stages: int, replicas: int) -> LinkCodecs:
        """Every link on the given settings, `auto` read as `none`: without a link matrix
        (`agent local`, all ranks on one machine) there is no slow link to compress for."""
        pp_name = "none" if pp == AUTO else parse_codec(pp, topk=False, what="pp").name
        dp_name = "none" if dp == AUTO else parse_codec(dp, what="dp").name
        return cls(pp=[[pp_name] * replicas for _ in range(stages - 1)],
                   dp=[dp_name if replicas > 1 else "none"] * stages)

    def check(self, stages: int, replicas: int) -> None:
        """Raise ValueError unless this names every link of a stages x replicas layout, with
        no data-parallel-only codec on a pipeline link."""
        if len(self.pp) != stages - 1 or any(len(row) != replicas for row in self.pp) \
                or len(self.dp) != stages:
            raise ValueError(f"link codecs for {len(self.dp)} stages do not fit a {stages} x "
                             f"{replicas} layout")
        for name in (n for row in self.pp for n in row):
            parse_codec(name, topk=False, what="pipeline link codec")
        for name in self.dp:
            parse_codec(name, what="data-parallel codec")

    def rank_codecs(self, stage: int, replica: int) -> tuple[str, str, str]:
        """(link to the previous stage, link to the next stage, data-parallel group) of the
        rank holding (stage, replica); "" where it has no such link."""
        prev = self.pp[stage - 1][replica] if stage > 0 else ""
        nxt = self.pp[stage][replica] if stage < len(self.pp) else ""
        return prev, nxt, self.dp[stage]

    def summary(self) -> dict[str, int]:
        """How many pipeline links and data-parallel groups use each codec, e.g.
        {"pp:int4": 6, "pp:none": 2, "dp:int8": 4}."""
        out: dict[str, int] = {}
        for name in (n for row in self.pp for n in row):
            out[f"pp:{name}"] = out.get(f"pp:{name}", 0) + 1
        for name in self.dp:
            out[f"dp:{name}"] = out.get(f"dp:{name}", 0) + 1
        return out
