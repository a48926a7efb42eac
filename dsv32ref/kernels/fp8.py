"""Writing fp8 e4m3 (and bf16) in a kernel, byte for byte as the reference's quantisers (dsv32ref.reference.fp8_cache)
and torch's casts do; and the Hadamard rotation the FP8 indexer applies to its queries and keys first.

Integer arithmetic only: Triton's interpreter converts some fp32 values to fp8 wrongly (a rounding that carries
into the exponent, e.g. 31.2 -> 16 instead of 32) and truncates fp32 to bf16 where the GPU rounds to nearest
even, so a cast would write different bytes on the CPU and on the GPU; these helpers write the same bytes
everywhere, and CPU tests check them against torch's conversion. A cache of FP8 values amplifies any such
difference: a value one bf16 step away rounds to another fp8 value once in a few tries.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["cast", "e4m3_bytes", "finite_amax", "hadamard", "load_e4m3", "pow2_scale", "quantize_e4m3", "round_bf16"]


@triton.jit
def pow2_scale(amax, MIN_EXP: tl.constexpr):
    """amax >= 0 fp32 (finite) -> (s, 1 / s) fp32: the smallest power of two s = 2^k, k >= MIN_EXP, with
    amax / s <= 448 (dsv32ref.reference.numerics.pow2_scale). With amax = m 2^E, 1 <= m < 2 and 448 = 1.75 x 2^8:
    k = E - 8, one more where m > 1.75. Zero and subnormal amax take 2^MIN_EXP."""
    bits = amax.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.maximum(k, MIN_EXP)
    return ((k + 127) << 23).to(tl.float32, bitcast=True), ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bytes(x):
    """fp32 x -> its fp8 e4m3fn byte (uint8): rounded to nearest even, saturated at +-448; NaN and +-inf -> NaN
    (0x7F with x's sign), so that a non-finite input reads back as NaN, never as a number."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF  # |x|
    # |x| >= 2^-6 (a normal e4m3): round the 23-bit mantissa to 3 bits, ties to even; a carry runs into the
    # exponent, as it should; then rebias the exponent from 127 to 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # |x| < 2^-6 (a subnormal e4m3, steps of 2^-9): |x| 2^9 = significand >> (141 - biased exponent), ties to even
    sig = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - (a >> 23), 1), 31)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(a >= (121 << 23), normal, sub)
    code = tl.where(a > 0x43E00000, 0x7E, code)  # above 448: saturated
    code = tl.where(a >= 0x7F800000, 0x7F, code)  # inf, NaN: NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def round_bf16(x):
    """fp32 x -> fp32 holding the bf16 nearest to x (ties to even; NaN stays NaN, as the quiet NaN; overflow goes to
    inf): a cast to bf16 of the result is exact, under the interpreter too."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
    return tl.where(x != x, float("nan"), rounded.to(tl.float32, bitcast=True))  # a NaN's low bits would carry


@triton.jit
def cast(x, ty: tl.constexpr):
    """x (any float) to ty as the GPU casts, on every machine (bf16: through round_bf16)."""
    x = x.to(tl.float32)
    if ty == tl.bfloat16:
        x = round_bf16(x)
    return x.to(ty)


@triton.jit
def finite_amax(v, axis=None):
    """The largest |v| over v's finite values (0 if none), fp32: over the whole tile, or along `axis`."""
    a = tl.abs(v.to(tl.float32))
    return tl.max(tl.where(a < float("inf"), a, 0.0), axis=axis)


@triton.jit
def quantize_e4m3(x, MIN_EXP: tl.constexpr):
    """fp32 x (a tile) -> (its fp8 e4m3 bytes, s): one power-of-two scale s for the tile, the smallest 2^k, k >=
    MIN_EXP, that holds its finite values (pow2_scale); a NaN or inf is written as NaN, not folded into s."""
    s, inv = pow2_scale(finite_amax(x), MIN_EXP)
    return e4m3_bytes(x * inv), s


@triton.jit
def hadamard(x, scale, N: tl.constexpr, LOG2_N: tl.constexpr):
    """x (N,) fp32 -> x H_N, the orthonormal Walsh-Hadamard transform (Sylvester order; dsv32ref.reference's
    hadamard_transform): LOG2_N butterflies, then `scale`, N^-1/2 as the host's fp32 holds it. Orthogonal: dot
    products are unchanged, and a few large values are spread over all N before an fp8 rounding."""
    for stage in tl.static_range(LOG2_N):
        y = tl.permute(tl.reshape(x, (N // (2 << stage), 2, 1 << stage)), (0, 2, 1))  # (N/2h, h, 2): pairs (i, i+h)
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (N,))
    return x * scale


@triton.jit
def load_e4m3(ptrs, mask, FLAG_NAN: tl.constexpr):
    """fp8 e4m3 values at byte pointers `ptrs` (2-D; masked lanes 0) -> (the values, per row whether one is NaN).
    FLAG_NAN (interpreted): the interpreter reads the NaN bytes 0x7F / 0xFF as +-480, so the caller is told where
    they are and makes them NaN; compiled, the conversion gives NaN itself: the flags are all False and the caller
    leaves them unused (`if FLAG_NAN:`), so the compiled code is the plain load's."""
    raw = tl.load(ptrs, mask=mask, other=0)
    nan = tl.max(((raw & 0x7F) == 0x7F).to(tl.int32), axis=1) > 0 if FLAG_NAN else tl.max(mask.to(tl.int32), axis=1) < 0
    return raw.to(tl.float8e4nv, bitcast=True), nan
