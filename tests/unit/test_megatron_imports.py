"""The DeepSpeed names Megatron-DeepSpeed imports at the top of its modules,
through the ``deepspeed`` alias: checkpoint key constants (with DeepSpeed
0.19.8's values), ``BufferOpInstruction``, ``OpBuilder``'s start-up query and
``env_report.main``."""

from __future__ import annotations

import pytest

import dsrun  # noqa: F401 - installs the deepspeed alias
from dsrun.errors import DsrunError


def test_checkpoint_constants_have_deepspeeds_values() -> None:
    from deepspeed.checkpoint import (
        ORIGINAL_VOCAB_SIZE,
        PADDED_VOCAB_SIZE,
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )
    from deepspeed.checkpoint.constants import DS_VERSION, PARAM_SHAPES, ZERO_FILE_PREFIX

    assert (ORIGINAL_VOCAB_SIZE, PADDED_VOCAB_SIZE) == ("original_vocab_size",
                                                        "padded_vocab_size")
    assert (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
            UNIVERSAL_CHECKPOINT_VERSION_VALUE) == ("universal_checkpoint_info",
                                                    "universal_checkpoint_version", 0.4)
    # the keys load_checkpoint returns in its client state are these names
    assert (DS_VERSION, PARAM_SHAPES, ZERO_FILE_PREFIX) == ("ds_version", "param_shapes",
                                                            "zero_pp_rank_")


def test_buffer_op_instruction_is_the_micro_batch_base() -> None:
    from deepspeed.runtime.pipe.schedule import BufferOpInstruction, ForwardPass, LoadMicroBatch

    assert issubclass(LoadMicroBatch, BufferOpInstruction)
    assert issubclass(ForwardPass, BufferOpInstruction)
    assert LoadMicroBatch(3).micro_batch == 3


def test_op_builder_answers_queries_and_refuses_builds() -> None:
    import torch
    from deepspeed.ops.op_builder.builder import OpBuilder

    assert OpBuilder.is_rocm_pytorch() is (getattr(torch.version, "hip", None) is not None)
    with pytest.raises(DsrunError, match="builds no C\\+\\+/CUDA extensions"):
        OpBuilder("cpu_adam")


def test_env_report_prints_deepspeeds_rows(capsys: pytest.CaptureFixture[str]) -> None:
    from deepspeed.env_report import main

    main(hide_operator_status=True)
    out = capsys.readouterr().out
    assert out.startswith("DeepSpeed general environment info:\n")
    assert "torch version ...." in out and "deepspeed info ..." in out
    assert "+dsrun." in out and "op report" not in out
    main()
    assert "op report: none" in capsys.readouterr().out
