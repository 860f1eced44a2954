"""Training throughput and memory: dsrun's engine vs torch DDP (vs DeepSpeed).

    .venv/bin/python bench/train_throughput.py [--rounds 3] [--steps 5] [--warmup 3]
        [--runners ddp,dsrun-stage0] [--model small|large] [--json results.json]

A fixed GPT-like model (vocab 8192, width 512, 6 layers, 8 heads, sequence
128, tied embeddings: 23.2M parameters), fp32, AdamW, 4 sequences per rank,
2 CPU ranks with gloo started by ``dsrun --num_gpus 2`` (so every runner gets
the same process group, OMP_NUM_THREADS and launch path). Each round runs
every runner once, in rotating order (interleaved, so machine noise hits all
alike). A run does ``--warmup`` untimed steps, then ``--steps`` timed ones;
its speed is 1 / the median of its step times on rank 0 (a median, because
this machine's cores are shared and single steps can stall). Reported: the
median over rounds of steps/s (and s/step), the ratio to DDP's s/step, and
each rank's peak RSS (``ru_maxrss``, the largest over rounds).

Every runner starts from the same weights (``build_model`` seeds them) and
each rank sees the same tokens, so every runner's losses must be the same
step by step: each run records its ranks' losses (warm-up steps included),
and the bench compares them across runners and rounds (bench/losscheck.py:
relative tolerance 1e-4), prints the verdict and exits non-zero naming the
runners whose losses differ.

``--model gpu`` is gpu_step.py's model: untied output head, 217.2M
parameters (the other sizes tie the head to the embedding).

Runners are entries of ``RUNNERS``: a function that, inside a rank, wraps the
model and returns ``step(tokens)``. ``dsrun-stage0..3``,
``dsrun-stage3-reuse`` (stage 3 with ``stage3_max_reuse_distance`` above the
model: nothing released between forward and backward), torch's
``zero-redundancy-optimizer`` (ZeRO-1), ``fsdp2`` (``fully_shard`` per
block: ZeRO-3 style) and DeepSpeed's stages 0-3; the ratios of each dsrun
stage to its anchors are printed under the table.

DeepSpeed itself (``deepspeed-stage0``) runs only where ``import deepspeed``
works in the interpreter given by ``--ds-python`` (default
``bench/.venv-ds/bin/python``; ranks are started with it through
``python -m dsrun.launcher.cli``, so that venv also needs this checkout on its
path). How it was set up here (needs PyPI; reuses .venv's torch and click etc.
through .pth files, so both sides run the same torch)::

    .venv/bin/python -m venv bench/.venv-ds
    SP=bench/.venv-ds/lib/python3.11/site-packages
    echo "$PWD" > $SP/dsrun_checkout.pth
    echo "$PWD/.venv/lib/python3.11/site-packages" > $SP/main_venv.pth
    bench/.venv-ds/bin/pip install setuptools wheel
    DS_BUILD_OPS=0 bench/.venv-ds/bin/pip install --no-build-isolation deepspeed==0.19.8

and the runner sets ``DS_ACCELERATOR=cpu``. Without it the table says
"DeepSpeed not installed".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import losscheck  # noqa: E402 - the runners' losses compared

DS_PYTHON = HERE / ".venv-ds" / "bin" / "python"
# (vocab, width, layers, heads, sequence, sequences per rank)
MODELS = {"small": (8192, 512, 6, 8, 128, 4),    # 23.2M parameters
          "large": (8192, 1024, 12, 16, 128, 2),  # 160M: model state dominates memory
          "gpu": (32000, 1024, 12, 16, 512, 8)}   # 217.2M, untied head (as gpu_step.py)
UNTIED = {"gpu"}  # models whose output head is not the embedding (the rest: GPT-2's tying)
VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH = MODELS["small"]
TIED = True


def use_model(name: str) -> None:
    global VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH, TIED
    VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH = MODELS[name]
    TIED = name not in UNTIED
LR = 3e-4
REUSE_ALL = 2_000_000_000  # elements: above both bench models, so nothing is released

# ----------------------------------------------------------------- the model (rank side)


def block_class(width: int, heads: int) -> Any:
    """The bench GPT's transformer block (pre-norm attention + MLP), a class
    named ``Block`` (pipelines partition by ``type:Block``)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                     nn.Linear(4 * width, width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, width))
            return x + self.mlp(self.ln2(x))

    return Block


def build_model(tied: bool | None = None) -> Any:
    """The bench GPT; ``tied``: the output head shares the embedding (GPT-2);
    None: as the model chosen by :func:`use_model` (untied for ``gpu``)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    Block = block_class(WIDTH, HEADS)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
            if TIED if tied is None else tied:
                self.head.weight = self.wte.weight  # as GPT-2

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.wte(tokens[:, :-1]) + self.wpe.weight[: tokens.shape[1] - 1]
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    torch.manual_seed(0)
    return GPT()


# ------------------------------------------------------------------- runners (rank side)

Step = Callable[[Any], Any]  # tokens -> the step's loss (a tensor)
Builder = Callable[[], Any]


def _ddp(build: Builder) -> Step:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(build())
    return _plain_step(ddp, torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.0))


def _plain_step(module: Any, opt: Any) -> Step:
    def step(tokens: Any) -> Any:
        loss = module(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def _ds_config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
            "gradient_clipping": 0.0,  # as the torch runners: no clipping
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0,
                                                      "torch_adam": True}}}


def _engine_step(engine: Any) -> Step:
    def step(tokens: Any) -> Any:
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        return loss.detach()
    return step


def _dsrun(stage: int, zero: dict[str, Any] | None = None) -> Callable[[Builder], Step]:
    def setup(build: Builder) -> Step:
        import dsrun

        config = _ds_config(stage)
        config["zero_optimization"].update(zero or {})
        if stage == 3:  # built already partitioned: never whole on a rank
            import dsrun.zero

            with dsrun.zero.Init(config_dict_or_path=config):
                model = build()
            # the position table is read in the root's forward, not wpe's own
            dsrun.zero.register_external_parameter(model, model.wpe.weight)
        else:
            model = build()
        engine, _, _, _ = dsrun.initialize(model=model, config=config)
        return _engine_step(engine)
    return setup


def _deepspeed(stage: int) -> Callable[[Builder], Step]:
    def setup(build: Builder) -> Step:
        import deepspeed

        model = build()
        engine, _, _, _ = deepspeed.initialize(model=model, config=_ds_config(stage),
                                               model_parameters=model.parameters())
        return _engine_step(engine)
    return setup


def _zero_redundancy(build: Builder) -> Step:
    """torch's ZeroRedundancyOptimizer (ZeRO-1) under DDP."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(build())
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=LR, weight_decay=0.0)
    return _plain_step(ddp, opt)


def _fsdp2(build: Builder) -> Step:
    """torch FSDP2 ``fully_shard`` per block, then the root (ZeRO-3 style)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    model = build()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return _plain_step(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0))


RUNNERS: dict[str, Callable[[Builder], Step]] = {
    "ddp": _ddp,
    "dsrun-stage0": _dsrun(0),
    "dsrun-stage1": _dsrun(1),
    "dsrun-stage2": _dsrun(2),
    "dsrun-stage3": _dsrun(3),
    # every parameter kept gathered from forward to backward (DeepSpeed's
    # behaviour at its default reuse distance on models under ~1e9 parameters)
    "dsrun-stage3-reuse": _dsrun(3, {"stage3_max_reuse_distance": REUSE_ALL}),
    "zero-redundancy-optimizer": _zero_redundancy,
    "fsdp2": _fsdp2,
    "deepspeed-stage0": _deepspeed(0),
    "deepspeed-stage1": _deepspeed(1),
    "deepspeed-stage2": _deepspeed(2),
    "deepspeed-stage3": _deepspeed(3),
}
NEEDS_DEEPSPEED = {name for name in RUNNERS if name.startswith("deepspeed")}
COMPARISONS = [(f"dsrun-stage{s}", f"deepspeed-stage{s}") for s in range(4)] + [
    ("dsrun-stage1", "zero-redundancy-optimizer"), ("dsrun-stage3", "fsdp2")]


def worker(runner: str, steps: int, warmup: int, out: str) -> None:
    """One rank: build, warm up, time ``steps`` steps, write facts to ``out``."""
    import resource

    import torch
    import torch.distributed as dist

    import dsrun

    dsrun.init_distributed()
    rank = dist.get_rank()
    built: list[Any] = []

    def build() -> Any:
        built.append(build_model())
        return built[-1]

    step = RUNNERS[runner](build)
    model = built[0]
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    losses = [float(step(tokens)) for _ in range(warmup)]
    dist.barrier()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step(tokens)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))  # after the timer: CPU ranks have the value already
    dist.barrier()
    facts = {"rank": rank, "times": times, "losses": losses, "maxrss_mib": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, "params": sum(
        p.numel() for p in {id(p): p for p in model.parameters()}.values())}
    Path(out, f"rank{rank}.json").write_text(json.dumps(facts))


# -------------------------------------------------------------- orchestration (driver)


def deepspeed_python(path: Path) -> str | None:
    """The interpreter that can import deepspeed, or None."""
    if not path.exists():
        return None
    probe = subprocess.run([str(path), "-c", "import deepspeed, dsrun"], capture_output=True,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return str(path) if probe.returncode == 0 else None


def run_once(python: str, runner: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        argv = [python, "-m", "dsrun.launcher.cli", "--num_gpus", "2", __file__, "--worker",
                runner, "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", out,
                "--model", args.model]
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(ROOT))
        if res.returncode != 0:
            raise SystemExit(f"{runner} failed ({res.returncode}):\n{res.stderr[-3000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def summarise(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    table = {}
    for name, rounds in runs.items():
        rates = [1 / statistics.median(r[0]["times"]) for r in rounds]
        rss = [max(r[rank]["maxrss_mib"] for r in rounds) for rank in range(len(rounds[0]))]
        table[name] = {"steps_per_s": statistics.median(rates),
                       "s_per_step": 1 / statistics.median(rates), "rates": rates,
                       "peak_rss_mib": rss, "params": rounds[0][0]["params"]}
    return table


def print_table(table: dict[str, dict[str, Any]], missing: list[str], args: Any) -> None:
    base = table.get("ddp", {}).get("s_per_step")
    params = next(iter(table.values()))["params"] if table else 0
    print(f"GPT-like {params / 1e6:.1f}M params, fp32 AdamW, {BATCH}x{SEQ} tokens per rank, "
          f"2 CPU ranks (gloo); {args.rounds} interleaved round(s) of {args.steps} timed steps")
    print(f"{'runner':<20}{'steps/s':>9}{'s/step':>9}{'vs DDP':>8}{'peak RSS MiB/rank':>22}")
    for name, row in table.items():
        ratio = f"{row['s_per_step'] / base:.3f}x" if base else "-"
        rss = " / ".join(f"{m:.0f}" for m in row["peak_rss_mib"])
        print(f"{name:<20}{row['steps_per_s']:>9.3f}{row['s_per_step']:>9.3f}{ratio:>8}{rss:>22}")
    for name in missing:
        print(f"{name:<20}  DeepSpeed not installed (see this file's docstring)")
    for mine, anchor in COMPARISONS:
        if mine in table and anchor in table:
            ratio = table[mine]["s_per_step"] / table[anchor]["s_per_step"]
            print(f"{mine} / {anchor} = {ratio:.3f} (step time)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--model", choices=sorted(MODELS), default="small",
                        help="large: ~160M parameters, to compare peak RSS where model "
                             "state dominates (use few steps)")
    parser.add_argument("--ds-python", default=str(DS_PYTHON))
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_model(args.model)
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.out)
        return
    names = [n for n in args.runners.split(",") if n]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise SystemExit(f"unknown runner(s) {unknown}; choose from {list(RUNNERS)}")
    ds_python = deepspeed_python(Path(args.ds_python))
    missing = [n for n in names if n in NEEDS_DEEPSPEED and ds_python is None]
    names = [n for n in names if n not in missing]
    runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            python = ds_python if name in NEEDS_DEEPSPEED else sys.executable
            runs[name].append(run_once(python or sys.executable, name, args))
            print(f"round {i + 1} {name}: {len(runs[name][-1][0]['times'])} steps in "
                  f"{sum(runs[name][-1][0]['times']):.1f}s", file=sys.stderr, flush=True)
    table = summarise(runs)
    print_table(table, missing, args)
    found = losscheck.check(run_losses(runs), "losses (every rank, every step)")
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "missing": missing,
                                               "loss_mismatches": found}, indent=1))
    losscheck.exit_on(found)


def run_losses(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, list[float]]:
    """Each run's losses, its ranks' one after the other, by "runner round N"."""
    return {f"{name} round {i + 1}": [v for rank in ranks for v in rank["losses"]]
            for name, rounds in runs.items() for i, ranks in enumerate(rounds)}


if __name__ == "__main__":
    main()
