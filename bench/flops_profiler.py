"""The flops profiler on the bench GPT: what it counts and what profiling costs.

    .venv/bin/python bench/flops_profiler.py [--model small|large] [--repeats 7]

One process, no ranks. Prints, for the forward of ``bench/train_throughput.py``'s
GPT (one batch of its ``BATCH`` sequences):

* flops and MACs as dsrun counts them, against torch's ``FlopCounterMode``
  (which counts only matrix products and attention) and the textbook
  estimate ``2 x matmul parameters x tokens + attention``;
* the median forward time unprofiled, the median wall time of a profiled
  forward, and the forward latency the profiler reports (its own counting
  cost subtracted): the ratios say what profiling one step costs and how
  much of that cost the reported latency still contains.

With DeepSpeed importable (``--ds-python``, see train_throughput.py) its
``get_model_profile`` on the same model is printed beside dsrun's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train_throughput as tt  # noqa: E402  (the bench model)


def measure(repeats: int) -> dict[str, Any]:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from dsrun.profiling.flops_profiler import FlopsProfiler

    torch.set_num_threads(1)
    model = tt.build_model()
    tokens = torch.randint(0, tt.VOCAB, (tt.BATCH, tt.SEQ))
    plain, wall, reported = [], [], []
    with torch.no_grad():
        model(tokens)
        with FlopCounterMode(display=False) as torch_counter:
            model(tokens)
        for _ in range(repeats):
            started = time.perf_counter()
            model(tokens)
            plain.append(time.perf_counter() - started)
        prof = FlopsProfiler(model)
        for _ in range(repeats):
            prof.start_profile()
            started = time.perf_counter()
            model(tokens)
            wall.append(time.perf_counter() - started)
            prof.stop_profile()
            reported.append(prof.get_total_duration())
    tokens_in = tt.BATCH * (tt.SEQ - 1)
    # the output head is counted once below, tied (``gpu``: untied) or not
    matmul_params = sum(p.numel() for name, p in model.named_parameters()
                        if p.dim() == 2 and not name.startswith(("wte", "wpe", "head")))
    attention = 2 * 2 * tt.LAYERS * tt.BATCH * (tt.SEQ - 1) ** 2 * tt.WIDTH
    return {"flops": prof.get_total_flops(), "macs": prof.get_total_macs(),
            "torch_flops": torch_counter.get_total_flops(),
            "textbook": 2 * (matmul_params + tt.WIDTH * tt.VOCAB) * tokens_in + attention,
            "plain_s": statistics.median(plain), "wall_s": statistics.median(wall),
            "reported_s": statistics.median(reported)}


def deepspeed_profile(python: str, model: str) -> dict[str, Any] | None:
    probe = subprocess.run([python, "-c", "import deepspeed"], capture_output=True)
    if probe.returncode != 0:
        return None
    code = "; ".join([
        "import sys, json, torch", f"sys.path.insert(0, {str(HERE)!r})",
        "import train_throughput as tt", f"tt.use_model({model!r})",
        "from deepspeed.profiling.flops_profiler import get_model_profile",
        "m = tt.build_model()", "x = torch.randint(0, tt.VOCAB, (tt.BATCH, tt.SEQ))",
        "f, mac, p = get_model_profile(m, args=[x], print_profile=False, as_string=False)",
        "print(json.dumps({'flops': f, 'macs': mac}))"])
    res = subprocess.run([python, "-c", code], capture_output=True, text=True,
                         env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"})
    if res.returncode != 0:
        return {"error": res.stderr[-500:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=sorted(tt.MODELS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ds-python", default=str(tt.DS_PYTHON))
    args = parser.parse_args()
    tt.use_model(args.model)
    r = measure(args.repeats)
    print(f"bench GPT ({args.model}): batch {tt.BATCH} x {tt.SEQ - 1} positions (sequences "
          f"of {tt.SEQ} tokens, shifted by one for the targets), one forward, 1 thread")
    print(f"{'counted by':<40}{'flops':>16}{'MACs':>16}")
    print(f"{'dsrun':<40}{r['flops']:>16,}{r['macs']:>16,}")
    print(f"{'torch FlopCounterMode':<40}{r['torch_flops']:>16,}{'':>16}")
    print(f"{'textbook (2 x params x tokens + attn)':<40}{r['textbook']:>16,}{'':>16}")
    ds = deepspeed_profile(args.ds_python, args.model) if Path(args.ds_python).exists() else None
    if ds is None:
        print(f"{'DeepSpeed':<40}{'not installed':>16}")
    elif "error" in ds:
        print(f"DeepSpeed failed: {ds['error']}")
    else:
        print(f"{'DeepSpeed get_model_profile':<40}{ds['flops']:>16,}{ds['macs']:>16,}")
    print(f"\nforward, median of {args.repeats}:")
    print(f"  unprofiled                 {r['plain_s'] * 1e3:9.1f} ms   1.00x")
    print(f"  profiled, wall             {r['wall_s'] * 1e3:9.1f} ms   "
          f"{r['wall_s'] / r['plain_s']:.2f}x")
    print(f"  profiled, reported latency {r['reported_s'] * 1e3:9.1f} ms   "
          f"{r['reported_s'] / r['plain_s']:.2f}x")


if __name__ == "__main__":
    main()
