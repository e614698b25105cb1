"""Every public entry of the compiled element-wise and flash kernels checks its arguments
before compiled code touches memory (attnkit.kernels._checks): the cases that aborted the
process, wrote or read out of bounds on 0.1 (issue 45), and one of each kind of mistake,
each a ValueError or TypeError that names the argument, what was expected and what arrived.

The checks run before the loops load, so these tests run with the kernels off too
(ATTNKIT_KERNELS=numpy, or no numba). The random fuzz over every entry is
tests/kernels/test_kernel_fuzz.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from attnkit.kernels import elementwise, flash


def _f32(*shape):
    return np.zeros(shape, np.float32)


# The reports of issue 45, each now refused by name.
ISSUE_CASES = {
    "softmax, lse of length 1 (aborted the process)":
        (lambda: elementwise.softmax(_f32(8, 64), _f32(1)), ValueError, "expected lse of shape (8,), got (1,)"),
    "softmax, lse of length 4 (wrote out of bounds)":
        (lambda: elementwise.softmax(_f32(8, 64), _f32(4)), ValueError, "expected lse of shape (8,), got (4,)"),
    "add_bias_to_leading_columns, bias of 100 (SIGSEGV)":
        (lambda: elementwise.add_bias_to_leading_columns(_f32(8, 64), _f32(100)), ValueError,
         "expected bias of at most x's 64 columns, got 100"),
    "weighted_grad_tile, sums of 2 (heap corruption)":
        (lambda: flash.weighted_grad_tile(_f32(8, 64), _f32(8, 64), _f32(2)), ValueError,
         "expected sums of shape (8,), got (2,)"),
    "weighted_grad_tile, p (4, 64) and sums of 8 (read out of bounds)":
        (lambda: flash.weighted_grad_tile(_f32(8, 64), _f32(4, 64), _f32(8)), ValueError,
         "expected p of shape (8, 64), got (4, 64)"),
    "gelu_bias, bias of the wrong size":
        (lambda: elementwise.gelu_bias(_f32(8, 64), _f32(32)), ValueError, "expected bias of shape (64,), got (32,)"),
    "layer_norm, weight of the wrong size":
        (lambda: elementwise.layer_norm(_f32(8, 64), _f32(16), _f32(64), 1e-5), ValueError,
         "expected weight of shape (64,), got (16,)"),
    "add_layer_norm, residual of the wrong size":
        (lambda: elementwise.add_layer_norm(_f32(8, 64), _f32(64), _f32(2, 64), _f32(64), _f32(64), 1e-5),
         ValueError, "expected residual of shape (8, 64), got (2, 64)"),
}


@pytest.mark.parametrize("name", list(ISSUE_CASES))
def test_issue_45_cases_are_refused_by_name(name):
    call, error, message = ISSUE_CASES[name]
    with pytest.raises(error) as caught:
        call()
    assert message in str(caught.value)


def test_wrong_dtype_is_a_type_error_naming_both():
    with pytest.raises(TypeError, match="expected x of dtype float32, got float64"):
        elementwise.gelu(np.zeros(4))
    with pytest.raises(TypeError, match="expected bias of dtype float32, got >f4"):
        elementwise.gelu_bias(_f32(2, 4), np.zeros(4, ">f4"))
    with pytest.raises(TypeError, match="expected top of dtype int64, got int32"):
        flash.grad_scores_tile(_f32(3, 4), _f32(3, 4), _f32(3), _f32(3), 0.5, np.zeros(3, np.int32), _f32(3))
    with pytest.raises(TypeError, match="expected s as a NumPy array"):
        flash.exp_tile([1.0, 2.0])


def test_strided_and_read_only_arrays_are_refused_not_copied():
    """A strided view would be copied by reshape and the result lost (the call writes in place)."""
    x = _f32(4, 8)
    with pytest.raises(ValueError, match="expected x C-contiguous and aligned, got a view with strides"):
        elementwise.gelu(x[:, ::2])
    with pytest.raises(ValueError, match="expected s C-contiguous"):
        flash.exp_tile(x.T)
    frozen = _f32(4, 8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="expected x writable"):
        elementwise.gelu(frozen)
    unaligned = np.frombuffer(bytearray(4 * 32 + 1), np.uint8)[1:].view(np.float32)
    with pytest.raises(ValueError, match="aligned"):
        flash.exp_tile(unaligned)


def test_written_arrays_may_not_share_memory_with_other_arguments():
    scores = _f32(8, 8)
    with pytest.raises(ValueError, match="expected scores not to share memory with lse"):
        elementwise.softmax(scores, scores[3])
    x = _f32(4, 8)
    with pytest.raises(ValueError, match="expected x not to share memory with bias"):
        elementwise.add_bias_to_leading_columns(x, x[0, :4])
    y = _f32(4, 8)
    with pytest.raises(ValueError, match="expected y not to share memory with residual"):
        elementwise.add_layer_norm(y, _f32(8), y, _f32(8), _f32(8), 1e-5)
    ds = _f32(4, 8)
    with pytest.raises(ValueError, match="expected ds not to share memory with p"):
        flash.weighted_grad_tile(ds, ds, _f32(4))


def test_scalars_are_checked():
    with pytest.raises(ValueError, match="expected scale as a finite positive number, got -1.0"):
        elementwise.attention_softmax(_f32(2, 3), -1.0)
    with pytest.raises(ValueError, match=r"expected scale within float32's range, got 1e\+300"):
        elementwise.attention_softmax(_f32(2, 3), 1e300)
    with pytest.raises(TypeError, match="expected eps as a real number, got str"):
        elementwise.layer_norm(_f32(2, 3), _f32(3), _f32(3), "1e-5")
    with pytest.raises(TypeError, match="expected lo as an integer, got float"):
        flash.band_exp_tile(_f32(2, 3), _f32(2), _f32(2), _f32(2), _f32(2), 0.5, 1)


def test_per_row_vectors_documented_as_converted_are_converted_but_sized():
    with pytest.raises(ValueError, match=r"expected shift of shape \(2, 3\), got \(6,\)"):
        flash.shifted_exp_tile(_f32(2, 3, 4), np.zeros(6))
    with pytest.raises(ValueError, match=r"expected weight of shape \(3,\), got \(2,\)"):
        flash.grad_scores_tile(_f32(3, 4), _f32(3, 4), _f32(3), _f32(2), 0.5, np.zeros(3, np.int64), _f32(3))
    with pytest.raises(TypeError, match="expected extra as an array of real numbers"):
        flash.band_exp_tile(_f32(2, 3), _f32(2), np.array(["a", "b"]), _f32(2), _f32(2), 0, 1)


def test_band_exp_loop_is_deprecated_and_checks():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DeprecationWarning, match="band_exp_loop"):
            flash.band_exp_loop()
    with pytest.warns(DeprecationWarning):
        loop = flash.band_exp_loop()
    with pytest.raises(ValueError, match=r"expected sums of shape \(4,\), got \(2,\)"):
        loop(_f32(4, 8), _f32(4), _f32(4), _f32(4), _f32(2), 4, 0, 1)
    with pytest.raises(ValueError, match="expected period >= 1, got 0"):
        loop(_f32(4, 8), _f32(4), _f32(4), _f32(4), _f32(4), 0, 0, 1)


def test_only_checked_entries_are_exported():
    """Every public name of the two modules is a checked entry, a constant or a switch; the
    unchecked paths the library's hot loops take are private."""
    for module in (elementwise, flash):
        assert not [name for name in module.__all__ if name.startswith("_")]
        assert "band_exp_loop" not in module.__all__


def test_usable_answers_false_for_what_no_loop_takes():
    """`usable` is asked before every call: anything but float32 C-contiguous arrays (nothing
    at all, a list) means the NumPy reference, never an AttributeError."""
    for module in (elementwise, flash):
        assert module.usable() is False
        assert module.usable([1.0, 2.0]) is False
        assert module.usable(np.zeros((64, 64))) is False
