"""The communication logger's arithmetic, records and table (no processes)."""

from __future__ import annotations

import logging

import pytest

from dsrun.errors import DsrunConfigError
from dsrun.runtime.commlog import (
    CommsLogger,
    bandwidths,
    bus_factor,
    gbps,
    size_str,
    straggler_analysis,
    straggler_ms,
    summary_table,
    trimmed_mean,
)
from dsrun.runtime.config import resolve


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)  # 2(n-1)/n
    assert bus_factor("inference_all_reduce", 2) == pytest.approx(1.0)
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "all_gather", "reduce_scatter"):
        assert bus_factor(op, 4) == pytest.approx(0.75)  # (n-1)/n
    for op in ("broadcast", "reduce", "send", "recv", "barrier"):
        assert bus_factor(op, 8) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0  # nothing moves between ranks


def test_gbps_and_sizes() -> None:
    assert gbps(125_000_000, 1.0) == pytest.approx(1.0)  # 1e9 bits in one second
    assert gbps(10, 0.0) == 0.0
    # DeepSpeed 0.19.8's convert_size gives these same strings
    assert size_str(0) == "0B"
    assert size_str(8) == "8.0 B"
    assert size_str(1023) == "1023.0 B"
    assert size_str(4000) == "3.91 KB"
    assert size_str(3 * 1024 ** 2) == "3.0 MB"
    assert size_str(5 * 1024 ** 4) == "5.0 TB"


def test_records_per_name_and_size() -> None:
    logger = CommsLogger()
    logger.append("all_reduce", "all_reduce", 0.002, 4000, 2)
    logger.append("all_reduce", "all_reduce", 0.004, 4000, 2)
    logger.append("all_reduce", "all_reduce", 0.010, 8000, 2)
    logger.append("broadcast", "params", 0.001, 100, 2)
    summary = logger.summary()
    assert list(summary) == ["all_reduce", "params"]
    row = summary["all_reduce"][4000]
    assert row["count"] == 2
    assert row["total_latency_ms"] == pytest.approx(6.0)
    assert row["avg_latency_ms"] == pytest.approx(3.0)
    assert row["tput_avg_gbps"] == pytest.approx(4000 * 8 / 0.003 / 1e9)
    assert row["busbw_avg_gbps"] == pytest.approx(row["tput_avg_gbps"])  # 2(n-1)/n = 1
    assert summary["all_reduce"][8000]["count"] == 1
    assert logger.totals() == {("all_reduce", 4000): pytest.approx(0.006),
                               ("all_reduce", 8000): pytest.approx(0.010),
                               ("params", 100): pytest.approx(0.001)}
    logger.reset()
    assert logger.summary() == {}


def test_gathers_are_filed_per_rank_and_their_bandwidth_counts_the_result() -> None:
    """DeepSpeed files an all-gather under one rank's input; algbw counts
    the gathered result (size x n), busbw (n-1)/n of that."""
    logger = CommsLogger()
    logger.append("all_gather_into_tensor", "all_gather_into_tensor", 0.001, 1024, 4)
    logger.append("reduce_scatter_tensor", "reduce_scatter_tensor", 0.001, 4096, 4)
    summary = logger.summary()
    gather = summary["all_gather_into_tensor"][1024]
    assert gather["tput_avg_gbps"] == pytest.approx(gbps(4096, 0.001))
    assert gather["busbw_avg_gbps"] == pytest.approx(gbps(4096, 0.001) * 0.75)
    # the same bytes reduce-scattered: the same bandwidths
    scatter = summary["reduce_scatter_tensor"][4096]
    assert scatter["tput_avg_gbps"] == pytest.approx(gather["tput_avg_gbps"])
    assert bandwidths("all_gather", 10, 1, 1.0) == (gbps(10, 1.0), 0.0)
    assert bandwidths("broadcast", 10, 4, 1.0) == (gbps(10, 1.0), gbps(10, 1.0))


def test_deepspeeds_comms_dict_and_logger_methods() -> None:
    logger = CommsLogger()
    logger.append("all_reduce", "all_reduce", 0.002, 4000, 2)
    logger.append("all_reduce", "all_reduce", 0.004, 4000, 2)
    logger.append("all_gather", "all_gather", 0.001, 100, 2)
    raw = logger.comms_dict
    count, lats, algbws, busbws = raw["all_reduce"][4000]
    assert count == 2 and lats == pytest.approx([2.0, 4.0])  # ms, as DeepSpeed
    assert algbws == pytest.approx([gbps(4000, 0.002), gbps(4000, 0.004)])
    assert busbws == pytest.approx(algbws)  # 2(n-1)/n = 1 on 2 ranks
    assert raw["all_gather"][100][2] == pytest.approx([gbps(200, 0.001)])
    assert logger.get_raw_data() == raw and logger.has_data()
    assert logger.get_operation_names() == ["all_reduce", "all_gather"]
    assert logger.get_total_operations() == 3
    logger.stop_profiling_comms()
    logger.start_profiling_op(["broadcast", "all_reduce"])
    logger.stop_profiling_op(["all_reduce"])
    assert not logger.prof_all and logger.prof_ops == ["broadcast"]
    logger.start_profiling_comms()
    assert logger.prof_all
    logger.reset_data()
    assert logger.comms_dict == {} and not logger.has_data()


def test_deepspeeds_comms_logging_helpers() -> None:
    import dsrun.utils
    from dsrun.utils import comms_logging

    assert "comms_logging" in dir(dsrun.utils)  # deepspeed.utils.comms_logging without an import
    assert comms_logging.CommsLogger is CommsLogger
    assert comms_logging.convert_size(0) == "0B"
    assert comms_logging.convert_size(1024) == "1.0 KB"
    assert comms_logging.convert_size(1536 * 1024) == "1.5 MB"
    assert comms_logging.convert_size(1000) == "1000.0 B"
    # no process group: world size 1 - an all-gather moves nothing between ranks
    assert comms_logging.calc_bw_log("all_gather", 1000, 2.0) == \
        pytest.approx((gbps(1000, 0.002), 0.0))
    assert comms_logging.calc_bw_log("broadcast", 1000, 2.0) == \
        pytest.approx((gbps(1000, 0.002),) * 2)
    with pytest.raises(ValueError, match="unknown communication operation"):
        comms_logging.calc_bw_log("all_sideways", 1, 1.0)

    def my_caller() -> str:
        return comms_logging.get_caller_func(frame=1)

    assert my_caller() == "my_caller"


def test_what_is_profiled() -> None:
    logger = CommsLogger()
    assert not logger.wants("all_reduce", prof=True)  # disabled: nothing
    logger.configure(enabled=True)
    assert logger.wants("anything", prof=False)  # prof_all by default
    logger.configure(prof_all=False, prof_ops=["broadcast"])
    assert logger.wants("broadcast", prof=False)
    assert not logger.wants("all_reduce", prof=False)
    assert logger.wants("all_reduce", prof=True)
    logger.configure(verbose=True)  # None leaves the others alone
    assert (logger.enabled, logger.prof_all, logger.prof_ops) == (True, False, ["broadcast"])
    with pytest.raises(TypeError, match="list of operation names"):
        logger.configure(prof_ops="broadcast")


def test_debug_names_the_caller() -> None:
    logger = CommsLogger()

    def collective() -> str:  # stands for a dsrun.comm function
        return helper()

    def helper() -> str:  # stands for dsrun.comm.profiled.call
        return logger.name_for("all_reduce")

    def training_loop() -> str:
        return collective()

    assert training_loop() == "all_reduce"
    logger.configure(debug=True)
    assert training_loop() == "all_reduce | [Caller Func: training_loop]"


def test_verbose_prints_each_operation(caplog: pytest.LogCaptureFixture) -> None:
    logger = CommsLogger()
    logger.configure(enabled=True, verbose=True)
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.comm"):
        logger.append("all_reduce", "all_reduce", 0.001, 2048, 2)
    assert "comm op: all_reduce | time (ms): 1.00 | msg size: 2.0 KB" in caplog.text
    # printed, not only logged: dsrun's runtime logger got its handler and level
    runtime = logging.getLogger("dsrun.runtime")
    assert runtime.handlers and runtime.getEffectiveLevel() <= logging.INFO
    assert logging.getLogger("dsrun.runtime.comm").parent is runtime


def test_straggler_analysis_is_deepspeeds() -> None:
    """Per call, the fastest rank's latency; a rank's straggling is its
    excess over it (calls all ranks made; a 10 %-trimmed mean)."""
    ranks = [{("all_reduce", 8): [0.001, 0.004, 0.002]},
             {("all_reduce", 8): [0.003, 0.001, 0.002], ("barrier", 0): [0.5]}]
    got = straggler_analysis(ranks, 0)["all_reduce"][8]
    assert got["count"] == 3 and got["msg_size_str"] == "8.0 B"
    assert got["total_comm_lat_ms"] == pytest.approx(1.0 + 1.0 + 2.0)
    assert got["total_straggler_ms"] == pytest.approx(0.0 + 3.0 + 0.0)
    assert got["avg_straggler_ms"] == pytest.approx(1.0)
    assert straggler_analysis(ranks, 1)["barrier"][0]["total_straggler_ms"] == 0.0
    assert trimmed_mean(range(10)) == pytest.approx(4.5) and trimmed_mean([]) == 0.0
    assert trimmed_mean([0, 1, 2, 3, 4, 5, 6, 7, 8, 100]) == pytest.approx(4.5)


def test_straggler_is_the_spread_between_ranks() -> None:
    ranks = [{("all_reduce", 10): 0.005, ("broadcast", 4): 0.001},
             {("all_reduce", 10): 0.002},
             {("all_reduce", 10): 0.004, ("broadcast", 4): 0.003}]
    got = straggler_ms(ranks)
    assert got["all_reduce"][10] == pytest.approx(3.0)
    assert got["broadcast"][4] == pytest.approx(2.0)


def test_table_has_a_row_per_size() -> None:
    logger = CommsLogger()
    logger.append("all_reduce", "all_reduce", 0.002, 4000, 2)
    logger.append("all_reduce", "all_reduce", 0.002, 1 << 20, 2)
    text = summary_table(logger.summary(), {"all_reduce": {4000: 1.5}})
    lines = text.splitlines()
    assert lines[0].startswith("Comm. Op") and "straggler (ms)" in lines[0]
    assert lines[1] == "all_reduce"
    assert "3.91 KB" in lines[2] and lines[2].rstrip().endswith("1.50")
    assert "1.0 MB" in lines[3] and lines[3].rstrip().endswith("0.00")
    assert "straggler" not in summary_table(logger.summary())


def test_config_section() -> None:
    config = resolve({"train_batch_size": 1, "comms_logger": {
        "enabled": True, "prof_all": False, "prof_ops": ["all_reduce"], "debug": True}},
        dp_size=1, dp_source="test")
    section = config.comms_logger
    assert (section.enabled, section.prof_all, section.prof_ops, section.debug,
            section.verbose) == (True, False, ("all_reduce",), True, False)
    assert "comms_logger" not in config.passthrough  # acted on, not just accepted
    assert config.to_dict()["comms_logger"]["prof_ops"] == ["all_reduce"]
    assert resolve({"train_batch_size": 1}, dp_size=1, dp_source="t").comms_logger.enabled \
        is False
    for bad, message in (({"prof_ops": "all_reduce"}, "list of operation names"),
                         ({"prof_ops": [1]}, "list of operation names"),
                         ({"enabeld": True}, 'did you mean "enabled"'),
                         ({"verbose": "yes"}, "true or false")):
        with pytest.raises(DsrunConfigError, match=message):
            resolve({"train_batch_size": 1, "comms_logger": bad}, dp_size=1, dp_source="t")


def test_trimmed_mean_rounds_the_share_as_deepspeed() -> None:
    """15 values at 10%: DeepSpeed's trim_mean drops round(1.5) = 2 from each
    end (int() would drop one), so the 2nd-lowest and 2nd-highest go too."""
    values = [-1000.0, -100.0, *[1.0] * 11, 100.0, 1000.0]
    assert trimmed_mean(values) == 1.0
