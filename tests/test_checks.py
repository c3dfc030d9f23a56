"""The shared input checks: the value each returns, the exception class (a wrong type is
TypeError, a wrong value ValueError) and the exact wording of each message."""

import re

import numpy as np
import pytest
import torch

from multihead.checks import (
    check_int,
    check_kv_heads,
    check_nonnegative_int,
    check_positive_int,
    check_same_dtype_device,
)


@pytest.mark.parametrize("value, kw, expected", [
    (3, {}, 3),
    (0, {"minimum": 0}, 0),
    (np.int64(5), {"minimum": 1}, 5),
    (torch.tensor(7), {"minimum": 1, "maximum": 7}, 7),
    (-4, {"maximum": -1}, -4),
    (None, {"minimum": 1, "allow_none": True}, None),
])
def test_check_int_returns_a_python_int(value, kw, expected):
    got = check_int("n", value, **kw)
    assert got == expected and (got is None or type(got) is int)


@pytest.mark.parametrize("value, kw, message", [
    (0, {"minimum": 1}, "n must be an int >= 1; received 0"),
    (9, {"maximum": 8}, "n must be an int <= 8; received 9"),
    (12, {"minimum": 0, "maximum": 11}, "n must be an int in [0, 11]; received 12"),
    (-1, {"minimum": 0, "allow_none": True}, "n must be an int >= 0 or None; received -1"),
])
def test_check_int_out_of_range_is_value_error(value, kw, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_int("n", value, **kw)


@pytest.mark.parametrize("value, message", [
    (True, "n must be an int >= 1; received True (bool)"),
    (2.0, "n must be an int >= 1; received 2.0 (float)"),
    ("2", "n must be an int >= 1; received '2' (str)"),
    (None, "n must be an int >= 1; received None (NoneType)"),
])
def test_check_int_wrong_type_is_type_error(value, message):
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        check_int("n", value, minimum=1)


def test_positive_and_nonnegative_are_check_int_with_a_minimum():
    assert check_positive_int("n", 1) == 1 and check_nonnegative_int("n", 0) == 0
    with pytest.raises(ValueError, match=r"^n must be an int >= 1; received 0$"):
        check_positive_int("n", 0)
    with pytest.raises(ValueError, match=r"^n must be an int >= 0; received -1$"):
        check_nonnegative_int("n", -1)


@pytest.mark.parametrize("n_heads, n_kv_heads, expected", [(12, 12, 12), (12, 4, 4), (12, 1, 1), (12, None, 12)])
def test_check_kv_heads_returns_the_kv_head_count(n_heads, n_kv_heads, expected):
    assert check_kv_heads(n_heads, n_kv_heads) == expected


def test_check_kv_heads_words_the_rule_once():
    with pytest.raises(ValueError, match=r"^n_heads \(12\) must be divisible by n_kv_heads \(5\); "
                                         r"valid: 1, 2, 3, 4, 6, 12$"):
        check_kv_heads(12, 5)
    with pytest.raises(ValueError, match=r"^--n-heads \(6\) must be divisible by --n-kv-heads \(4\); "
                                         r"valid: 1, 2, 3, 6$"):
        check_kv_heads(6, 4, n_heads_name="--n-heads", n_kv_heads_name="--n-kv-heads")


@pytest.mark.parametrize("n_heads, n_kv_heads, error, message", [
    (0, 1, ValueError, "n_heads must be an int >= 1; received 0"),
    (4, 0, ValueError, "n_kv_heads must be an int >= 1 or None; received 0"),
    (4.0, 1, TypeError, "n_heads must be an int >= 1; received 4.0 (float)"),
    (4, "2", TypeError, "n_kv_heads must be an int >= 1 or None; received '2' (str)"),
])
def test_check_kv_heads_checks_each_count(n_heads, n_kv_heads, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        check_kv_heads(n_heads, n_kv_heads)


def test_check_same_dtype_device():
    a, b = torch.zeros(2), torch.zeros(3)
    check_same_dtype_device(q=a, k=b, v=a)  # shapes are not its business
    with pytest.raises(TypeError, match=r"^q, k, v must share a dtype; received q torch.float32, "
                                        r"k torch.float16, v torch.float32$"):
        check_same_dtype_device(q=a, k=b.half(), v=a)
    with pytest.raises(ValueError, match=r"^q, k must be on one device; received q cpu, k meta$"):
        check_same_dtype_device(q=a, k=torch.zeros(2, device="meta"))


def test_register_backend_refuses_a_bad_name_by_class():
    from multihead.kernels.registry import register_backend

    def fn(*args, **kwargs):
        raise AssertionError("never called")

    with pytest.raises(TypeError, match=r"^backend name must be a non-empty string other than 'auto'; "
                                        r"received 3 \(int\)$"):
        register_backend(3, fn, weights=False, dropout=False)
    with pytest.raises(ValueError, match=r"^backend name must be a non-empty string other than 'auto'; "
                                         r"received 'auto'$"):
        register_backend("auto", fn, weights=False, dropout=False)


def test_attend_and_ring_share_the_qkv_check():
    """`ring_attention` calls `check_qkv`; `attend` raises its TypeError for two dtypes."""
    import multihead as mh

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(TypeError, match=r"^q, k, v must share a dtype; received q torch.float32, "
                                        r"k torch.float64, v torch.float32$"):
        mh.scaled_dot_product_attention(q, q.double(), q, mask=torch.ones(3, 3, dtype=torch.bool))
