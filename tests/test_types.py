"""QuantizedTensor and GroupedTensor on their own."""

import pytest
import torch

import actoffload as ao
from actoffload.quantized import FP8_ABS_ERROR, FP8_REL_ERROR


@pytest.mark.parametrize("shape", [(1,), (7, 13), (64, 64), (0,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_quantize_error_within_fp8_e4m3_bound(shape, dtype):
    x = (torch.randn(shape) * 10).to(dtype)
    q = ao.quantize(x)
    y = q.dequantize()
    assert y.dtype == dtype and y.shape == x.shape
    bound = FP8_REL_ERROR * x.double().abs() + FP8_ABS_ERROR * q._scale_inv.double() + 1e-2 * x.double().abs() * (dtype == torch.bfloat16)
    assert ((y.double() - x.double()).abs() <= bound).all()


def test_quantize_keeps_the_extremes_and_zero():
    q = ao.quantize(torch.tensor([0.0, 448.0, -3.5]))
    assert q._data.dtype == torch.float8_e4m3fn and q._scale_inv.dtype == torch.float32
    assert torch.equal(q.dequantize(), torch.tensor([0.0, 448.0, -3.5]))
    assert torch.equal(ao.quantize(torch.zeros(3)).dequantize(), torch.zeros(3))


def test_quantize_transpose_matches_data():
    q = ao.quantize(torch.randn(5, 9), with_transpose=True)
    assert torch.equal(q._transpose.float(), q._data.t().float())
    with pytest.raises(ValueError, match="with_transpose needs a 2-D tensor"):
        ao.quantize(torch.randn(2, 3, 4), with_transpose=True)
    with pytest.raises(TypeError, match="floating-point"):
        ao.quantize(torch.ones(3, dtype=torch.int32))


def test_quantized_tensor_ops_run_on_dequantized_values():
    x = torch.randn(4, 4)
    q = ao.quantize(x)
    assert torch.equal(q + 1, q.dequantize() + 1)
    assert isinstance(q.detach(), ao.QuantizedTensor)


@pytest.mark.parametrize("sizes", [[3], [0, 4, 0], [1, 1, 1, 1], [10, 0]])
def test_grouped_tensor_splits_back_exactly(sizes):
    parts = [torch.randn(n, 6) for n in sizes]
    g = ao.GroupedTensor.from_tensors(parts)
    assert g.shape == (sum(sizes), 6) and g.split_sizes == sizes
    assert torch.equal(g.offsets, torch.tensor([0] + sizes).cumsum(0))
    for a, b in zip(g.split(), parts):
        assert torch.equal(a, b)
    assert torch.equal(g * 2, torch.cat(parts) * 2)


def test_grouped_tensor_rejects_mismatched_parts():
    with pytest.raises(ValueError, match="same dtype, device and trailing shape"):
        ao.GroupedTensor.from_tensors([torch.ones(2, 3), torch.ones(2, 4)])
    with pytest.raises(ValueError, match="at least one tensor"):
        ao.GroupedTensor.from_tensors([])
    with pytest.raises(ValueError, match="must be >= 0 and sum to"):
        ao.GroupedTensor(torch.ones(4, 2), [1, 2])
