"""Triton pack/unpack against their PyTorch references on awkward inputs (interpreter on CPU)."""

import pytest
import torch

import os

from actoffload.triton_kernels import pack as k
from helpers import CUDA

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Triton runs kernels on CPU tensors only through its interpreter (set when there is no GPU).
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; CI has none")),
]

CASES = {
    "empty_list": [],
    "one_empty": [0],
    "one_byte": [1],
    "odd_sizes": [1, 3, 7, 13, 1023, 1025],
    "block_edges": [k.BLOCK * 8 - 1, k.BLOCK * 8, k.BLOCK * 8 + 1],
    "many_small": [64] * 50 + [0, 5],
    "larger_than_split": [k.BLOCK * 8 * k.SPLIT * 2 + 3],
}


def _sources(sizes, device, misalign):
    """Byte views of fresh random tensors of mixed dtypes, optionally at odd addresses."""
    out = []
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.float64, torch.int16]
    for i, n in enumerate(sizes):
        base = torch.randint(0, 256, (n + 16,), dtype=torch.uint8, device=device)
        dt = dtypes[i % len(dtypes)]
        es = torch.empty((), dtype=dt).element_size()
        start = (i % 3) if misalign else 0
        src = base[start : start + n]
        if not misalign and n % es == 0:  # through a real tensor of another dtype
            src = base[: n].view(dt).view(torch.uint8)
        out.append(src)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("align", [16, 1])
def test_pack_and_unpack_match_reference(device, case, misalign, align):
    srcs = _sources(CASES[case], device, misalign)
    offsets, total = k.packed_layout([s.numel() for s in srcs], align=align)
    got = torch.full((total + 5,), 0xAB, dtype=torch.uint8, device=device)  # poisoned
    want = got.clone()
    k.pack(srcs, got, offsets)
    k.pack_reference(srcs, want, offsets)
    assert torch.equal(got, want)
    dsts = [torch.full_like(s, 0xCD) for s in srcs]
    k.unpack(got, dsts, offsets)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_at_a_misaligned_offset_in_the_packed_buffer(device):
    srcs = [torch.arange(10, dtype=torch.uint8, device=device), torch.arange(6, dtype=torch.uint8, device=device)]
    out = torch.zeros(40, dtype=torch.uint8, device=device)
    k.pack(srcs, out[3:], [1, 17])
    assert out[4:14].tolist() == list(range(10)) and out[20:26].tolist() == list(range(6))


@pytest.mark.parametrize(
    "srcs, out, offsets, message",
    [
        ([torch.ones(4)], torch.zeros(8, dtype=torch.uint8), [0], "contiguous 1-D uint8 tensor"),
        ([torch.ones(4, dtype=torch.uint8)], torch.zeros(8), [0], "packed buffer must be a contiguous 1-D uint8"),
        ([torch.ones(4, dtype=torch.uint8)], torch.zeros(8, dtype=torch.uint8), [6], r"range \[6, 10\) outside"),
        ([torch.ones(4, dtype=torch.uint8)], torch.zeros(8, dtype=torch.uint8), [0, 1], "1 tensors but 2 offsets"),
    ],
)
def test_pack_validates_its_inputs(srcs, out, offsets, message):
    with pytest.raises(ValueError, match=message):
        k.pack(srcs, out, offsets)


def test_packed_layout_aligns_every_offset():
    offsets, total = k.packed_layout([1, 17, 0, 32, 5])
    assert offsets == [0, 16, 48, 48, 80] and total == 85
    assert all(o % 16 == 0 for o in offsets)


@pytest.mark.skipif(INTERPRETED, reason="checks the message when the interpreter is off")
def test_pack_on_cpu_without_the_interpreter_says_what_to_set():
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        k.pack([torch.ones(4, dtype=torch.uint8)], torch.zeros(8, dtype=torch.uint8), [0])
