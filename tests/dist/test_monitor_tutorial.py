"""DeepSpeed's "Custom Monitoring" tutorial (docs/_tutorials/monitor.md) on a
one-rank group: its four steps verbatim, ``DeepSpeedConfig("ds_config.json")
.monitor_config`` into ``MonitorMaster``, write the CSV monitor's file."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest
import torch

import dsrun

pytestmark = pytest.mark.dist

DS_CONFIG = {
    "train_batch_size": 4, "steps_per_print": 100,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "csv_monitor": {"enabled": True, "output_path": "output/ds_logs/", "job_name": "train_bert"},
}


def test_the_tutorials_custom_monitor_writes_its_csv(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("ds_config.json").write_text(json.dumps(DS_CONFIG))
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    criterion = torch.nn.CrossEntropyLoss()
    trainloader = [(torch.randn(4, 4), torch.tensor([0, 1, 1, 0])) for _ in range(3)]
    model_engine, *_ = dsrun.initialize(model=net, model_parameters=net.parameters(),
                                        config="ds_config.json")
    fp16 = False

    # -- the tutorial, verbatim but for .to(model_engine.device) (its
    #    .to(model_engine.local_rank) means a GPU) and one epoch
    # Step 1: Import monitor (and DeepSpeed config, if needed)
    from deepspeed.monitor.monitor import MonitorMaster
    from deepspeed.runtime.config import DeepSpeedConfig

    # Step 2: Initialized monitor with DeepSpeed config (get DeepSpeed config object, if needed)
    ds_config = DeepSpeedConfig("ds_config.json")
    monitor = MonitorMaster(ds_config.monitor_config)

    for epoch in range(1):  # noqa: B007 - the tutorial's loop

        running_loss = 0.0
        for i, data in enumerate(trainloader):  # noqa: B007
            pre = time.time()
            inputs, labels = data[0].to(model_engine.device), data[1].to(
                model_engine.device)
            if fp16:
                inputs = inputs.half()
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)

            model_engine.backward(loss)
            model_engine.step()
            post = time.time()
            # Step 3: Create list of 3-tuple records (single entry in this case)
            events = [("Time per step", post-pre, model_engine.global_samples)]
            # Step 4: Call monitor.write_events on the list from step 3
            monitor.write_events(events)
    # -- end of the tutorial's code

    assert running_loss == 0.0
    with open(tmp_path / "output/ds_logs/train_bert/Time_per_step.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    assert [int(step) for step, _ in rows[1:]] == [4, 8, 12]  # global_samples
    assert all(0 <= float(seconds) < 60 for _, seconds in rows[1:])
