"""attnkit.functional.precision.matmul_in_chunks: np.matmul's result and broadcasting,
each output rounded over at most a chunk of terms and the chunks' partials."""

from __future__ import annotations

import numpy as np
import pytest

from attnkit.functional.precision import REDUCTION_CHUNK, matmul_in_chunks


@pytest.mark.parametrize("a_shape, b_shape", [
    ((4, 3, 200), (4, 200, 5)),  # a remainder of 8
    ((4, 3, 256), (1, 256, 5)),  # b shared by a's batch (GQA): one product per chunk
    ((3, 130), (130, 7)),  # 2-D
    ((2, 4, 1, 64), (4, 64, 3)),  # one chunk: a plain product
    ((2, 1, 3, 300), (5, 300, 2)),  # broadcast batch dims
], ids=str)
def test_matmul_in_chunks_is_matmul(a_shape, b_shape):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    got = matmul_in_chunks(a, b)
    np.testing.assert_allclose(got, np.matmul(a, b), rtol=1e-12, atol=1e-12)
    assert got.shape == np.matmul(a, b).shape


def test_matmul_in_chunks_rounds_over_a_chunk_and_the_partials():
    """float32 over 8192 terms: within the classic bound for a run of chunk + N / chunk
    additions (each output's error at most that many units of 2^-24 times sum |a||b|),
    where one run over all 8192 terms is allowed 8192."""
    rng = np.random.default_rng(1)
    a = rng.random((8, 3, 8192), dtype=np.float32)
    b = rng.standard_normal((8, 8192, 16)).astype(np.float32)
    truth = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    terms = REDUCTION_CHUNK + 8192 // REDUCTION_CHUNK + 1
    assert np.all(np.abs(matmul_in_chunks(a, b) - truth) <= terms * 2.0 ** -24 * scale)
