"""Pipeline message headers (dsrun.runtime.pipe.p2p), without processes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsrun.errors import DsrunError
from dsrun.runtime.pipe.p2p import (
    DTYPES,
    HEADER_LEN,
    KINDS,
    Header,
    PipeMessageError,
    TensorMeta,
    check_header,
    check_metas,
    decode_header,
    encode_header,
    flatten_payload,
)

metas_st = st.lists(st.builds(TensorMeta, st.sampled_from(DTYPES),
                              st.lists(st.integers(0, 5000), max_size=5).map(tuple),
                              st.booleans()), max_size=8)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(KINDS), st.integers(0, 2**40), st.integers(0, 4096), metas_st,
       st.booleans())
def test_headers_round_trip(kind: str, batch: int, micro_batch: int,
                            metas: list[TensorMeta], is_tuple: bool) -> None:
    header = Header(kind, batch, micro_batch, tuple(metas), is_tuple)
    values = encode_header(header)
    assert len(values) == HEADER_LEN
    assert decode_header(values) == header


def test_shapes_change_per_micro_batch() -> None:
    """Nothing is cached: each header carries its own shapes."""
    a = Header("train-activation", 1, 0, (TensorMeta(torch.float32, (4, 7, 16), True),))
    b = Header("train-activation", 1, 1, (TensorMeta(torch.float32, (4, 9, 16), True),
                                          TensorMeta(torch.int64, (4, 9))), True)
    assert decode_header(encode_header(a)).metas[0].shape == (4, 7, 16)
    assert decode_header(encode_header(b)).metas[1] == TensorMeta(torch.int64, (4, 9), False)


def test_a_message_for_another_micro_batch_is_refused() -> None:
    got = Header("labels", 3, 5, ())
    check_header(got, "labels", 3, 5, "stage 1")
    with pytest.raises(PipeMessageError, match=r"stage 1 expected the labels of micro-batch 4 "
                       r"of batch 3 but received the labels of micro-batch 5 of batch 3"):
        check_header(got, "labels", 3, 4, "stage 1")
    with pytest.raises(PipeMessageError, match="expected the train-activation"):
        check_header(Header("eval-activation", 3, 4, ()), "train-activation", 3, 4, "stage 1")
    with pytest.raises(PipeMessageError, match="out of step"):
        check_header(Header("gradient", 2, 0, ()), "gradient", 3, 0, "stage 0")


def test_a_later_batch_mid_batch_says_the_first_stages_data_ran_out() -> None:
    """Batch 3's micro-batch 0 while waiting for batch 2's micro-batch 1: the
    first stage caught its DataIteratorExhausted and went on."""
    with pytest.raises(PipeMessageError, match=r"forward calls; the first stage's data iterator "
                       r"probably ran out at micro-batch 1 of batch 2"):
        check_header(Header("train-activation", 3, 0, ()), "train-activation", 2, 1, "stage 1")
    for got, want in ((Header("train-activation", 3, 1, ()), ("train-activation", 2, 1)),
                      (Header("train-activation", 3, 0, ()), ("train-activation", 2, 0)),
                      (Header("gradient", 3, 0, ()), ("gradient", 2, 1))):
        with pytest.raises(PipeMessageError) as info:
            check_header(got, *want, "stage 1")
        assert "ran out" not in str(info.value)


def test_gradient_shapes_must_match_the_activation() -> None:
    want = [TensorMeta(torch.float32, (4, 8), True)]
    check_metas([TensorMeta(torch.float32, (4, 8))], want, "stage 0, micro-batch 2")
    with pytest.raises(PipeMessageError, match=r"stage 0, micro-batch 2: received gradients "
                       r"\['float32\[4, 9\]'\] for activations \['float32\[4, 8\] \(requires"):
        check_metas([TensorMeta(torch.float32, (4, 9))], want, "stage 0, micro-batch 2")
    with pytest.raises(PipeMessageError):
        check_metas([TensorMeta(torch.float16, (4, 8))], want, "stage 0")


def test_malformed_and_oversized_headers() -> None:
    with pytest.raises(PipeMessageError, match="malformed"):
        decode_header([0] * HEADER_LEN)
    huge = Header("gradient", 0, 0, tuple(TensorMeta(torch.float32, (1,) * 8)
                                          for _ in range(40)))
    with pytest.raises(DsrunError, match="too many to describe"):
        encode_header(huge)
    odd = Header("gradient", 0, 0, (TensorMeta(torch.float8_e4m3fn, (2,)),))
    with pytest.raises(DsrunError, match="cannot be sent between pipeline stages"):
        encode_header(odd)


def test_payloads_are_tensors_or_tuples_of_tensors() -> None:
    t = torch.zeros(2)
    assert flatten_payload(t, "x") == ([t], False)
    assert flatten_payload((t, t), "x")[1] is True
    with pytest.raises(DsrunError, match=r"the output of stage 0, micro-batch 1 is a dict"):
        flatten_payload({"h": t}, "the output of stage 0, micro-batch 1")
    with pytest.raises(DsrunError, match=r"is a tuple of \(Tensor, int\)"):
        flatten_payload((t, 3), "y")
