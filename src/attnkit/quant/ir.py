"""The one file that writes LLVM IR: the block dot products the hottest loops call.

numba compiles `attnkit.quant.loops` from Python; four rows of a decode product at a time
are written here directly in LLVM IR (llvmlite), as numba intrinsics, because the loops in
Python kept their accumulators in memory (a store and a reload every block) and could not
name the integer dot-product instructions:

- `rows4f_intrinsic(kind)`: `_rows4f_<kind>(raw, r0, r1, r2, r3, xlo, xhi, xsum)`, four
  rows of Q4_0, Q4_1 or Q8_0 blocks against float32 x (16 float32 lanes a row); Q5_0's
  (`_rows4f_q5_0_codegen`: its fifth bits put in by a variable shift a vector), Q4_K's and
  Q6_K's (`_rows4f_k_codegen`: runs of 32 lanes, x given whole) beside them;
- `rows4f_many_intrinsic(kind, m)`: `_rows4f<m>_<kind>`, the same four rows against m rows
  of x, each block decoded once for them all (a batched decode step), each sum the bits of
  the one-row loop;
- `rows4_intrinsic(kind, dot)`: `_rows4_<kind>(raw, r0, r1, r2, r3, q, dx, xs, qsum)`, the
  same on 8-bit x, each block's dot product exact in int32 lanes (`vpdpbusd` with AVX-512
  VNNI, `vpmaddubsw` with AVX2, LLVM's own lowering elsewhere; `dot_instructions()`).

A block's float16 scale is read with one `vcvtph2ps` (`_ir_half`); the rows `PREFETCH_ROWS`
ahead are prefetched (`_ir_prefetch`'s reason). Block sizes come from `GGMLType`'s traits.
"""

from __future__ import annotations

from attnkit import kernels
from attnkit.quant.types import GGMLType

__all__ = ["FLOAT_TYPES", "INT8_LOOP_TYPES", "MANY_TYPES", "MANY_X_ROWS", "PREFETCH_ROWS", "dot_instructions",
           "rows4_intrinsic", "rows4f_intrinsic", "rows4f_many_intrinsic"]

PREFETCH_ROWS = 16
"""How far ahead (in rows) the decode loops prefetch W's blocks."""

MANY_X_ROWS = 4
"""Rows of x the batched loops (`_rows4f4_<kind>`) take at once: 4 x 4 sums in 16 vector
accumulators, the decoded block in 2 and x's values in 8 (AVX-512's 32 registers); the
rows left over go two (`_rows4f2_<kind>`) or one (`_rows4f1_<kind>`) at a time."""

FLOAT_TYPES = (GGMLType.Q4_1, GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K)
"""The types with a four-row loop on float32 x (`_rows4f_<name>`; Q5_0's is `_rows4f_q5_0_codegen`,
Q4_K's and Q6_K's `_rows4f_k_codegen`)."""
MANY_TYPES = (GGMLType.Q4_1, GGMLType.Q4_0, GGMLType.Q8_0)
"""The types whose four-row loop also comes for several rows of x (`rows4f_many_intrinsic`)."""
INT8_LOOP_TYPES = (GGMLType.Q4_1, GGMLType.Q4_0, GGMLType.Q8_0)
"""The types with a four-row loop on 8-bit x (`_rows4_<name>`)."""


def loop_name(prefix: str, kind: GGMLType) -> str:
    """The name the loops call a four-row intrinsic by: `_rows4f_q4_1`, `_rows4_q8_0`, ..."""
    return f"{prefix}_{kind.name.lower()}"


def dot_instructions() -> str:
    """Which block dot product the IR loops emit: "vnni" (AVX-512 VNNI), "avx2", or
    "generic" (LLVM's own lowering), from the host's features; "generic" when numba
    compiles for another CPU (NUMBA_CPU_NAME)."""
    from llvmlite import binding

    nb = kernels.numba()
    if nb.config.CPU_NAME not in (None, "", "host"):
        return "generic"
    features = binding.get_host_cpu_features()
    if features.get("avx512vnni", False) and features.get("avx512vl", False):
        return "vnni"
    return "avx2" if features.get("avx2", False) else "generic"


def _ir_prefetch(builder, pointer) -> None:  # pragma: no cover - compiled
    """LLVM IR asking for the cache line at `pointer` (i8*): a read, kept in every cache
    level. A decode product streams its weights from the file's pages, whose 4 KB boundaries
    stop the hardware prefetcher: the row loops ask for the rows `PREFETCH_ROWS` ahead
    themselves (the Q8_0 output head ran several times faster so; docs/benchmarks.md,
    'Measurements behind design choices')."""
    from llvmlite import ir
    from numba.core import cgutils

    i32 = ir.IntType(32)
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]), "llvm.prefetch.p0i8")
    builder.call(prefetch, [pointer, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _ir_half(builder, pointer):  # pragma: no cover - compiled
    """LLVM IR of the little-endian float16 at `pointer` (i8*) as float32 (`vcvtph2ps`)."""
    from llvmlite import ir

    return builder.fpext(builder.load(builder.bitcast(pointer, ir.HalfType().as_pointer()), align=1), ir.FloatType())


def _ir_four_rows(context, builder, signature, raw, indices) -> tuple:  # pragma: no cover - compiled
    """(pointers to the rows `indices` of the (rows, bytes) uint8 array `raw`, its row stride)."""
    from numba.core import cgutils

    matrix = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=raw)
    stride = builder.extract_value(matrix.strides, 0)
    return [builder.gep(matrix.data, [builder.mul(r, stride)]) for r in indices], stride


def _ir_prefetch_ahead(builder, rows, stride, offset) -> None:  # pragma: no cover - compiled
    """Prefetch byte `offset` of the rows PREFETCH_ROWS past each of `rows` (never faults: a
    prefetch past the end is dropped)."""
    from llvmlite import ir

    ahead = builder.add(builder.mul(stride, ir.Constant(stride.type, PREFETCH_ROWS)), offset)
    for row in rows:
        _ir_prefetch(builder, builder.gep(row, [ahead]))


def _rows4_codegen(kind, dot=None):  # pragma: no cover - compiled
    """The LLVM IR of `_rows4_<kind>(raw, r0, r1, r2, r3, q, dx, xs, qsum)`: four rows of
    W (blocks of `kind`) against one row of 8-bit x, returning their four sums. Per block:
    the 32 weights as unsigned bytes (nibbles; Q8_0's |w|) against x's 32 signed bytes
    (Q8_0: times sign(w)), summed into eight int32 lanes, converted (exact), scaled by
    d_b dx_b and added to eight float32 lanes per row (allocas that LLVM keeps in
    registers); the minimum's (Q4_1) or the offset's (Q4_0) term in a float32 scalar. The
    rows 16 ahead are prefetched (`_ir_prefetch`'s reason)."""
    from llvmlite import ir
    from numba.core import cgutils

    size = kind.type_size
    dot = dot or dot_instructions()

    def codegen(context, builder, signature, args):
        raw, r0, r1, r2, r3, q, dx, xs, qsum = args
        i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
        lanes_f, lanes_i = ir.VectorType(f32, 8), ir.VectorType(i32, 8)
        bytes32, bytes16 = ir.VectorType(i8, 32), ir.VectorType(i8, 16)
        proxy = cgutils.create_struct_proxy
        rows, stride = _ir_four_rows(context, builder, signature, raw, (r0, r1, r2, r3))
        q_data = proxy(signature.args[5])(context, builder, value=q).data
        dx_array = proxy(signature.args[6])(context, builder, value=dx)
        xs_data = proxy(signature.args[7])(context, builder, value=xs).data
        qsum_data = proxy(signature.args[8])(context, builder, value=qsum).data
        blocks = builder.extract_value(dx_array.shape, 0)
        sums = [cgutils.alloca_once_value(builder, ir.Constant(lanes_f, [0.0] * 8)) for _ in range(4)]
        terms = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(4)]
        module = builder.module
        if dot == "vnni":
            vpdpbusd = cgutils.get_or_insert_function(
                module, ir.FunctionType(lanes_i, [lanes_i, lanes_i, lanes_i]), "llvm.x86.avx512.vpdpbusd.256")
        elif dot == "avx2":
            words = ir.VectorType(i16, 16)
            maddubs = cgutils.get_or_insert_function(module, ir.FunctionType(words, [bytes32, bytes32]),
                                                     "llvm.x86.avx2.pmadd.ub.sw")
            maddwd = cgutils.get_or_insert_function(module, ir.FunctionType(lanes_i, [words, words]),
                                                    "llvm.x86.avx2.pmadd.wd")

        def block_dot(unsigned, signed):  # <32 x i8> (as unsigned) . <32 x i8> -> <8 x i32>
            if dot == "vnni":
                return builder.call(vpdpbusd, [ir.Constant(lanes_i, [0] * 8), builder.bitcast(unsigned, lanes_i),
                                               builder.bitcast(signed, lanes_i)])
            if dot == "avx2":  # pairs of products fit int16: 2 * 255 * 127 < 32768
                pairs = builder.call(maddubs, [unsigned, signed])
                return builder.call(maddwd, [pairs, ir.Constant(ir.VectorType(i16, 16), [1] * 16)])
            wide = ir.VectorType(i32, 32)
            products = builder.mul(builder.zext(unsigned, wide), builder.sext(signed, wide))
            parts = [builder.shuffle_vector(products, products, ir.Constant(lanes_i, list(range(8 * k, 8 * k + 8))))
                     for k in range(4)]
            return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))

        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            offset = builder.mul(b, ir.Constant(b.type, size))
            _ir_prefetch_ahead(builder, rows, stride, offset)
            e = builder.load(builder.gep(dx_array.data, [b]))
            x = builder.load(builder.bitcast(builder.gep(q_data, [builder.mul(b, ir.Constant(b.type, 32))]),
                                             bytes32.as_pointer()), align=1)
            for row, total, term in zip(rows, sums, terms):
                block = builder.gep(row, [offset])
                d = _ir_half(builder, block)
                if kind == GGMLType.Q8_0:
                    w = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(i32, 2)]), bytes32.as_pointer()),
                                     align=1)
                    zero = ir.Constant(bytes32, [0] * 32)
                    negative = builder.icmp_signed("<", w, zero)
                    unsigned = builder.select(negative, builder.sub(zero, w), w)
                    signed = builder.select(negative, builder.sub(zero, x), x)
                else:
                    at = 4 if kind == GGMLType.Q4_1 else 2
                    packed = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(i32, at)]),
                                                          bytes16.as_pointer()), align=1)
                    low = builder.and_(packed, ir.Constant(bytes16, [15] * 16))
                    high = builder.lshr(packed, ir.Constant(bytes16, [4] * 16))
                    unsigned = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(i32, 32), list(range(32))))
                    signed = x
                scale = builder.fmul(d, e)
                lanes = builder.sitofp(block_dot(unsigned, signed), lanes_f)
                spread = builder.insert_element(ir.Constant(lanes_f, ir.Undefined), scale, ir.Constant(i32, 0))
                spread = builder.shuffle_vector(spread, spread, ir.Constant(lanes_i, [0] * 8))
                builder.store(builder.fadd(builder.load(total), builder.fmul(lanes, spread)), total)
                if kind == GGMLType.Q4_1:  # m_b xs_b
                    m = _ir_half(builder, builder.gep(block, [ir.Constant(i32, 2)]))
                    part = builder.fmul(m, builder.load(builder.gep(xs_data, [b])))
                    builder.store(builder.fadd(builder.load(term), part), term)
                elif kind == GGMLType.Q4_0:  # -8 d_b dx_b qsum_b
                    count = builder.sitofp(builder.load(builder.gep(qsum_data, [b])), f32)
                    part = builder.fmul(builder.fmul(scale, ir.Constant(f32, -8.0)), count)
                    builder.store(builder.fadd(builder.load(term), part), term)
        reduce = cgutils.get_or_insert_function(module, ir.FunctionType(f32, [f32, lanes_f]),
                                                "llvm.vector.reduce.fadd.v8f32")
        results = [builder.fadd(builder.call(reduce, [ir.Constant(f32, 0.0), builder.load(total)]), builder.load(term))
                   for total, term in zip(sums, terms)]
        return context.make_tuple(builder, signature.return_type, results)

    return codegen


def _rows4f_codegen(kind, many=None):  # pragma: no cover - compiled
    """The LLVM IR of `_rows4f_<kind>(raw, r0, r1, r2, r3, xlo, xhi, xsum)`: four rows of W
    (Q4_0, Q4_1 or Q8_0 blocks) against one row of float32 x, returning their four sums.
    Per block: x's 16 low-nibble and 16 high-nibble values (Q8_0: its 32 values, xlo = xhi
    = the row of x) loaded once for the four rows; each row's weights dequantized in 16
    float32 lanes as `dequantize` gives them (d q + m rounded once, by an fma, for Q4_1;
    d (q - 8) and d q exact for Q4_0 and Q8_0: d has 11 significant bits), then added into
    16 float32 lanes per row by two explicit fmas, w_lo * xlo then w_hi * xhi (allocas LLVM
    keeps in registers: the accumulators of a loop in Python stayed in memory, a store and
    a reload every block); the lanes summed by a tree at the end. xsum gives the number of
    blocks (the Q4 types). The rows 16 ahead are prefetched (`_ir_prefetch`'s reason).

    many = m: `_rows4f<m>_<kind>(raw, r0, r1, r2, r3, xlo, xhi, xsum, i)`, the same four
    rows of W against the m rows i .. i + m - 1 of x (xlo, xhi, xsum 2-D, C-contiguous),
    returning 4 m sums (x row j's four at 4 j ..): each block of W read and dequantized once
    for the m rows of x, and each (row of x, row of W) sum computed by the same operations
    as in the one-row loop, in the same order (this function writes both; explicit fmas, no
    fast-math flags on the sums, so no pass may reorder them): the same bits whatever m is
    (the batched decode step's invariance rests on it)."""
    from llvmlite import ir
    from numba.core import cgutils

    size = kind.type_size
    fast = ("contract", "reassoc", "nsz")
    count = 1 if many is None else many

    def codegen(context, builder, signature, args):
        raw, r0, r1, r2, r3, xlo, xhi, xsum = args[:8]
        i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
        lanes = ir.VectorType(f32, 16)
        bytes16 = ir.VectorType(i8, 16)
        proxy = cgutils.create_struct_proxy
        rows, stride = _ir_four_rows(context, builder, signature, raw, (r0, r1, r2, r3))
        xl_array = proxy(signature.args[5])(context, builder, value=xlo)
        xh_array = proxy(signature.args[6])(context, builder, value=xhi)
        xs_array = proxy(signature.args[7])(context, builder, value=xsum)
        axis = 0 if many is None else 1  # the axis along K
        if kind == GGMLType.Q8_0:  # x's length / 32
            blocks = builder.udiv(builder.extract_value(xl_array.shape, axis), ir.Constant(stride.type, 32))
        else:
            blocks = builder.extract_value(xs_array.shape, axis)
        if many is None:
            sources = [(xl_array.data, xh_array.data, xs_array.data)]  # (xlo, xhi, xsum) of each row of x
        else:  # rows i .. i + m - 1 of the C-contiguous 2-D arrays
            first = args[8]
            sources = []
            for j in range(count):
                row = builder.add(first, ir.Constant(first.type, j))
                sources.append(tuple(builder.gep(array.data, [builder.mul(row, builder.extract_value(array.shape, 1))])
                                     for array in (xl_array, xh_array, xs_array)))
        sums = [[cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * 16)) for _ in range(4)]
                for _ in range(count)]
        module = builder.module
        fma16 = cgutils.get_or_insert_function(module, ir.FunctionType(lanes, [lanes] * 3), "llvm.fma.v16f32")

        def spread(value):
            one = builder.insert_element(ir.Constant(lanes, ir.Undefined), value, ir.Constant(i32, 0))
            return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(i32, 16), [0] * 16))

        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            offset = builder.mul(b, ir.Constant(b.type, size))
            _ir_prefetch_ahead(builder, rows, stride, offset)
            if kind == GGMLType.Q8_0:
                at_lo = builder.mul(b, ir.Constant(b.type, 32))
                at_hi = builder.add(at_lo, ir.Constant(b.type, 16))
            else:
                at_lo = at_hi = builder.mul(b, ir.Constant(b.type, 16))
            xs = []  # each row of x's values for this block, loaded once for the four rows of W
            for xl_data, xh_data, _ in sources:
                xl = builder.load(builder.bitcast(builder.gep(xl_data, [at_lo]), lanes.as_pointer()), align=4)
                xh = builder.load(builder.bitcast(builder.gep(xh_data, [at_hi]), lanes.as_pointer()), align=4)
                xs.append((xl, xh))
            for k, row in enumerate(rows):
                block = builder.gep(row, [offset])
                d = spread(_ir_half(builder, block))
                if kind == GGMLType.Q8_0:
                    def signed(at):
                        values = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(i32, at)]),
                                                              bytes16.as_pointer()), align=1)
                        return builder.sitofp(values, lanes)

                    w_low, w_high = builder.fmul(d, signed(2)), builder.fmul(d, signed(18))  # exact
                else:
                    at = 4 if kind == GGMLType.Q4_1 else 2
                    packed = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(i32, at)]),
                                                          bytes16.as_pointer()), align=1)
                    low = builder.uitofp(builder.and_(packed, ir.Constant(bytes16, [15] * 16)), lanes)
                    high = builder.uitofp(builder.lshr(packed, ir.Constant(bytes16, [4] * 16)), lanes)
                    if kind == GGMLType.Q4_1:  # d q + m rounded once, as the dequantized weight
                        shift = spread(_ir_half(builder, builder.gep(block, [ir.Constant(i32, 2)])))
                    else:  # d q - 8 d = d (q - 8), exact
                        shift = builder.fmul(d, ir.Constant(lanes, [-8.0] * 16))
                    w_low = builder.call(fma16, [d, low, shift])
                    w_high = builder.call(fma16, [d, high, shift])
                for (xl, xh), total in zip(xs, (t[k] for t in sums)):
                    updated = builder.call(fma16, [w_low, xl, builder.load(total)])
                    builder.store(builder.call(fma16, [w_high, xh, updated]), total)
        reduce = cgutils.get_or_insert_function(module, ir.FunctionType(f32, [f32, lanes]),
                                                "llvm.vector.reduce.fadd.v16f32")
        results = []
        for j in range(count):
            for k in range(4):  # a tree
                results.append(builder.call(reduce, [ir.Constant(f32, 0.0), builder.load(sums[j][k])], fastmath=fast))
        return context.make_tuple(builder, signature.return_type, results)

    return codegen



def _rows4f_q5_0_codegen():  # pragma: no cover - compiled
    """The LLVM IR of `_rows4f_q5_0(raw, r0, r1, r2, r3, xlo, xhi, xsum)`: `_rows4f_codegen`'s
    four rows on float32 x for Q5_0 blocks (d, 32 high bits qh, 16 bytes of nibbles). Per
    block and row: the nibbles widened to 16 int32 lanes each, the fifth bits put in from
    qh shifted by the lane's position (0..15 for the low nibbles, 16..31 for the high ones:
    one variable shift a vector), converted (exact), lo * xlo + hi * xhi scaled by d_b into
    16 float32 lanes; the offset's term -16 d_b xsum_b in a float32 scalar. Rows 16 ahead
    are prefetched."""
    from llvmlite import ir
    from numba.core import cgutils

    size = GGMLType.Q5_0.type_size
    fast = ("contract", "reassoc", "nsz")

    def codegen(context, builder, signature, args):
        raw, r0, r1, r2, r3, xlo, xhi, xsum = args
        i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
        lanes, ints = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
        bytes16 = ir.VectorType(i8, 16)
        proxy = cgutils.create_struct_proxy
        rows, stride = _ir_four_rows(context, builder, signature, raw, (r0, r1, r2, r3))
        xl_data = proxy(signature.args[5])(context, builder, value=xlo).data
        xh_data = proxy(signature.args[6])(context, builder, value=xhi).data
        xs_array = proxy(signature.args[7])(context, builder, value=xsum)
        blocks = builder.extract_value(xs_array.shape, 0)
        sums = [cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * 16)) for _ in range(4)]
        terms = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(4)]
        low_shifts = ir.Constant(ints, list(range(16)))
        high_shifts = ir.Constant(ints, list(range(16, 32)))

        def spread(value, vector):
            one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(i32, 0))
            return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(i32, 16), [0] * 16))

        def fifth_bits(qh, shifts):  # (qh >> position) & 1, moved to bit 4
            bits = builder.and_(builder.lshr(qh, shifts), ir.Constant(ints, [1] * 16))
            return builder.shl(bits, ir.Constant(ints, [4] * 16))

        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            offset = builder.mul(b, ir.Constant(b.type, size))
            _ir_prefetch_ahead(builder, rows, stride, offset)
            at = builder.mul(b, ir.Constant(b.type, 16))
            xl = builder.load(builder.bitcast(builder.gep(xl_data, [at]), lanes.as_pointer()), align=4)
            xh = builder.load(builder.bitcast(builder.gep(xh_data, [at]), lanes.as_pointer()), align=4)
            s = builder.load(builder.gep(xs_array.data, [b]))
            for row, total, term in zip(rows, sums, terms):
                block = builder.gep(row, [offset])
                d = _ir_half(builder, block)
                qh_pointer = builder.bitcast(builder.gep(block, [ir.Constant(i32, 2)]), i32.as_pointer())
                qh = spread(builder.load(qh_pointer, align=1), ints)  # little-endian, as the file stores it
                packed = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(i32, 6)]), bytes16.as_pointer()),
                                      align=1)
                low = builder.zext(builder.and_(packed, ir.Constant(bytes16, [15] * 16)), ints)
                high = builder.zext(builder.lshr(packed, ir.Constant(bytes16, [4] * 16)), ints)
                low = builder.uitofp(builder.or_(low, fifth_bits(qh, low_shifts)), lanes)
                high = builder.uitofp(builder.or_(high, fifth_bits(qh, high_shifts)), lanes)
                mixed = builder.fadd(builder.fmul(low, xl, flags=fast), builder.fmul(high, xh, flags=fast), flags=fast)
                updated = builder.fadd(builder.load(total), builder.fmul(spread(d, lanes), mixed, flags=fast),
                                       flags=fast)
                builder.store(updated, total)
                part = builder.fmul(builder.fmul(d, ir.Constant(f32, -16.0), flags=fast), s, flags=fast)
                builder.store(builder.fadd(builder.load(term), part, flags=fast), term)
        reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, lanes]),
                                                "llvm.vector.reduce.fadd.v16f32")
        results = []
        for total, term in zip(sums, terms):
            summed = builder.call(reduce, [ir.Constant(f32, 0.0), builder.load(total)], fastmath=fast)
            results.append(builder.fadd(summed, builder.load(term), flags=fast))
        return context.make_tuple(builder, signature.return_type, results)

    return codegen


def _rows4f_k_codegen(kind):  # pragma: no cover - compiled
    """The LLVM IR of `_rows4f_q4_k` / `_rows4f_q6_k(raw, r0, r1, r2, r3, x, x, xsum)`: four
    rows of Q4_K or Q6_K blocks (256 weights each) against one row of float32 x (given
    whole; xsum its sums over each 32 values), returning their four sums. Per block and row,
    runs of 32 weights are widened to 32 float32 lanes (exact), multiplied with x's 32 values
    (loaded once for the four rows) and added to 32 lanes per row, scaled by the run's
    scale: Q4_K's run s (the low or high nibbles of 32 bytes) by d sc_s, its minimum's term
    -dmin mn_s xsum in a float32 scalar; Q6_K's run (four-bit low from ql, two-bit high
    from qh, minus 32) by d scale per 16 lanes. Rows 16 ahead are prefetched."""
    from llvmlite import ir
    from numba.core import cgutils

    size = kind.type_size
    fast = ("contract", "reassoc", "nsz")

    def codegen(context, builder, signature, args):
        raw, r0, r1, r2, r3, xrow, _, xsum = args
        i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
        lanes, bytes32 = ir.VectorType(f32, 32), ir.VectorType(i8, 32)
        proxy = cgutils.create_struct_proxy
        rows, stride = _ir_four_rows(context, builder, signature, raw, (r0, r1, r2, r3))
        x_data = proxy(signature.args[5])(context, builder, value=xrow).data
        xs_array = proxy(signature.args[7])(context, builder, value=xsum)
        blocks = builder.udiv(builder.extract_value(xs_array.shape, 0), ir.Constant(stride.type, 8))
        sums = [cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * 32)) for _ in range(4)]
        terms = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(4)]

        def splat(value, count=32):
            one = builder.insert_element(ir.Constant(ir.VectorType(f32, count), ir.Undefined), value,
                                         ir.Constant(i32, 0))
            return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(i32, count), [0] * count))

        def two_scales(first, second):  # 16 lanes of `first`, then 16 of `second`
            pair = builder.insert_element(builder.insert_element(ir.Constant(ir.VectorType(f32, 2), ir.Undefined),
                                                                 first, ir.Constant(i32, 0)),
                                          second, ir.Constant(i32, 1))
            return builder.shuffle_vector(pair, pair, ir.Constant(ir.VectorType(i32, 32), [0] * 16 + [1] * 16))

        def byte(block, at):
            return builder.load(builder.gep(block, [ir.Constant(i32, at)]))

        def bytes_at(block, at):
            return builder.load(builder.bitcast(builder.gep(block, [ir.Constant(i32, at)]), bytes32.as_pointer()),
                                align=1)

        def unsigned(value):  # an i8 as a float32 (0..255)
            return builder.uitofp(value, f32)

        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            offset = builder.mul(b, ir.Constant(b.type, size))
            _ir_prefetch_ahead(builder, rows, stride, offset)
            first_x = builder.mul(b, ir.Constant(b.type, 256))
            xs = [builder.load(builder.bitcast(builder.gep(x_data, [builder.add(first_x, ir.Constant(b.type, 32 * t))]),
                                               lanes.as_pointer()), align=4) for t in range(8)]  # x by runs of 32
            if kind == GGMLType.Q4_K:
                xsums = [builder.load(builder.gep(xs_array.data, [builder.add(builder.mul(b, ir.Constant(b.type, 8)),
                                                                              ir.Constant(b.type, t))]))
                         for t in range(8)]
            for row, total, term in zip(rows, sums, terms):
                block = builder.gep(row, [offset])
                acc = builder.load(total)
                if kind == GGMLType.Q4_K:
                    d = _ir_half(builder, block)
                    dmin = _ir_half(builder, builder.gep(block, [ir.Constant(i32, 2)]))
                    s = [byte(block, 4 + t) for t in range(12)]
                    c63, c15 = ir.Constant(i8, 63), ir.Constant(i8, 15)
                    c6, c4 = ir.Constant(i8, 6), ir.Constant(i8, 4)
                    minimum = builder.load(term)
                    for sub in range(8):
                        if sub < 4:
                            sc, mn = builder.and_(s[sub], c63), builder.and_(s[sub + 4], c63)
                        else:
                            sc = builder.or_(builder.and_(s[sub + 4], c15),
                                             builder.shl(builder.lshr(s[sub - 4], c6), c4))
                            mn = builder.or_(builder.lshr(s[sub + 4], c4), builder.shl(builder.lshr(s[sub], c6), c4))
                        packed = bytes_at(block, 16 + 32 * (sub // 2))
                        nibbles = builder.and_(packed, ir.Constant(bytes32, [15] * 32)) if sub % 2 == 0 else \
                            builder.lshr(packed, ir.Constant(bytes32, [4] * 32))
                        product = builder.fmul(builder.uitofp(nibbles, lanes), xs[sub], flags=fast)
                        scale = builder.fmul(d, unsigned(sc), flags=fast)
                        acc = builder.fadd(acc, builder.fmul(splat(scale), product, flags=fast), flags=fast)
                        low = builder.fmul(builder.fmul(dmin, unsigned(mn), flags=fast), xsums[sub], flags=fast)
                        minimum = builder.fsub(minimum, low, flags=fast)
                    builder.store(minimum, term)
                else:  # Q6_K
                    d = _ir_half(builder, builder.gep(block, [ir.Constant(i32, 208)]))
                    c3, c15, c32 = ir.Constant(bytes32, [3] * 32), ir.Constant(bytes32, [15] * 32), \
                        ir.Constant(bytes32, [32] * 32)
                    for h in range(2):
                        lows = (bytes_at(block, 64 * h), bytes_at(block, 64 * h + 32))
                        highs = bytes_at(block, 128 + 32 * h)
                        for run in range(4):  # positions 128h + 32 run .. + 31
                            quad = builder.and_(lows[run % 2], c15) if run < 2 else \
                                builder.lshr(lows[run % 2], ir.Constant(bytes32, [4] * 32))
                            pair = builder.and_(builder.lshr(highs, ir.Constant(bytes32, [2 * run] * 32)), c3)
                            value = builder.sub(builder.or_(quad, builder.shl(pair, ir.Constant(bytes32, [4] * 32))),
                                                c32)  # -32 .. 31
                            product = builder.fmul(builder.sitofp(value, lanes), xs[4 * h + run], flags=fast)
                            at = 192 + 8 * h + 2 * run
                            first = builder.fmul(d, builder.sitofp(byte(block, at), f32), flags=fast)
                            second = builder.fmul(d, builder.sitofp(byte(block, at + 1), f32), flags=fast)
                            acc = builder.fadd(acc, builder.fmul(two_scales(first, second), product, flags=fast),
                                               flags=fast)
                builder.store(acc, total)
        reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, lanes]),
                                                "llvm.vector.reduce.fadd.v32f32")
        results = []
        for total, term in zip(sums, terms):
            summed = builder.call(reduce, [ir.Constant(f32, 0.0), builder.load(total)], fastmath=fast)
            results.append(builder.fadd(summed, builder.load(term), flags=fast))
        return context.make_tuple(builder, signature.return_type, results)

    return codegen


def rows4_intrinsic(kind: GGMLType, dot: str | None = None):
    """The numba intrinsic `_rows4_<kind>(raw, r0, r1, r2, r3, q, dx, xs, qsum)` -> four
    float32 sums, its block dots on `dot` ("vnni", "avx2", "generic"; default: the host's)."""
    from numba import types
    from numba.extending import intrinsic

    def _rows4_typing(typingctx, raw, r0, r1, r2, r3, q, dx, xs, qsum):
        return types.UniTuple(types.float32, 4)(raw, r0, r1, r2, r3, q, dx, xs, qsum), _rows4_codegen(kind, dot)

    return intrinsic(_rows4_typing)


def rows4f_many_intrinsic(kind: GGMLType, many: int):
    """The numba intrinsic `_rows4f<m>_<kind>(raw, r0, r1, r2, r3, xlo, xhi, xsum, i)` -> 4 m
    float32 sums: four rows of W against rows i .. i + m - 1 of x (2-D), each sum the bits
    `_rows4f_<kind>` gives for that row of x (`_rows4f_codegen`)."""
    from numba import types
    from numba.extending import intrinsic

    def _rows4f_many_typing(typingctx, raw, r0, r1, r2, r3, xlo, xhi, xsum, i):
        return (types.UniTuple(types.float32, 4 * many)(raw, r0, r1, r2, r3, xlo, xhi, xsum, i),
                _rows4f_codegen(kind, many))

    return intrinsic(_rows4f_many_typing)


def rows4f_intrinsic(kind: GGMLType):
    """The numba intrinsic `_rows4f_<kind>(raw, r0, r1, r2, r3, xlo, xhi, xsum)` -> four float32 sums."""
    from numba import types
    from numba.extending import intrinsic

    if kind == GGMLType.Q5_0:
        codegen = _rows4f_q5_0_codegen()
    elif kind in (GGMLType.Q4_K, GGMLType.Q6_K):
        codegen = _rows4f_k_codegen(kind)
    else:
        codegen = _rows4f_codegen(kind)

    def _rows4f_typing(typingctx, raw, r0, r1, r2, r3, xlo, xhi, xsum):
        return types.UniTuple(types.float32, 4)(raw, r0, r1, r2, r3, xlo, xhi, xsum), codegen

    return intrinsic(_rows4f_typing)

