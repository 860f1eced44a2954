"""Training metrics: DeepSpeed's monitors (csv_monitor, tensorboard, wandb,
comet), the wall-clock breakdown, and reading a run back for ``dsrun plot``.

* :mod:`events` - event names and the CSV file layout (pure, DeepSpeed's).
* :mod:`writers` - one writer per backend behind one ``write`` interface.
* :mod:`master` - :class:`~master.Monitor`, ``engine.monitor``: rank 0
  fans events out to the enabled writers; a writer that fails after the
  start is warned about once and dropped, training goes on.
* :mod:`timers` - forward/backward/step timers and the registry that
  ZeRO's collectives report their wait time into.
* :mod:`training` - :class:`~training.EngineMonitor`, what the engine calls
  per micro-step and per optimizer step.
* :mod:`runs` / :mod:`plot` - read run directories, draw one PNG.

Importing this package (and :mod:`events`, :mod:`runs`, :mod:`plot`) does
not import torch: the launcher's ``dsrun plot`` uses them.
"""
