"""The token loader's throughput, and what the demo waits for its data.

1. **The loader alone**: tokens/s of `TokenLoader` iterating over a generated token file
   (memory-mapped, uint16), for a few sample lengths and micro-batch sizes, against a plain
   ``DataLoader(TokenDataset, shuffle=True)`` (per-sample reads, default collate) on the same
   file in the main process, and against torchdata's ``StatefulDataLoader`` over the same
   dataset with `--workers` worker processes (what a resumable pipeline with workers looks
   like elsewhere; when torchdata is installed): same samples per batch.
2. **The demo**: the GPT demo with its own defaults (``examples/gpt/train.py``: global batch
   32 x 64 tokens) for ``--steps`` steps; per optimizer step the trainer's ``data_wait_s``
   (``trainer.step_stats``) against the step's time. Goal: data waits under 1 % of step
   time, and a loader far faster than the demo consumes.
3. **Cold and warm page cache**: the demo on a corpus large enough (``--cold-chars``, 100M
   tokens: a 200 MB token file) that its samples land mostly on pages not yet read, with the
   file evicted from the page cache before training (``posix_fadvise(DONTNEED)``: every
   sample a read from the disk) and read whole before it (warm), each with the loader
   reading on the training thread (``prefetch=0``, the CPU default) and two micro-batches
   ahead on a background thread (``prefetch=2``, the CUDA default). Linux.

    python benchmarks/data.py            # ~1.5 minutes on 2 CPU cores
    python benchmarks/data.py --quick    # ~30 s
    python benchmarks/data.py --smoke    # seconds: a 1M-token file, 0.05 s per measurement, 8 steps of a
                                         # small demo (what CI runs)
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from train import main as demo_main  # noqa: E402

from dream_trainer import Callback  # noqa: E402
from dream_trainer.data import TokenDataset, TokenLoader, write_tokens  # noqa: E402
from dream_trainer.testing import spawn_world  # noqa: E402

from common import machine, write_json  # noqa: E402  (benchmarks/common.py)

GOAL = 0.01
# --smoke: the demo shrunk to seconds (a small model and corpus, one validation batch); the
# loader's path is the same
SMOKE_DEMO = ["--n-layer", "2", "--d-model", "64", "--block-size", "32", "--n-chars", "20000", "--val-batches", "1"]
SHAPES = [(64, 32), (1024, 8), (4096, 4)]  # (seq_len, micro-batch): the demo's, then longer contexts


def _rate(batches: Any, tokens_per_batch: int, seconds: float) -> float:
    """Tokens/s over as many batches as `seconds` allows (at least 3), epoch after epoch."""
    iterator, n, start = iter(batches), 0, time.perf_counter()
    while n < 3 or time.perf_counter() - start < seconds:
        try:
            next(iterator)
        except StopIteration:  # the epoch is over: the next one
            iterator = iter(batches)
            continue
        n += 1
    return n * tokens_per_batch / (time.perf_counter() - start)


def _stateful(path: Path, seq_len: int, micro: int, workers: int) -> Any:
    """torchdata's StatefulDataLoader over the same dataset, `workers` processes (None: no torchdata)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader(TokenDataset(path, seq_len), batch_size=micro, shuffle=True, num_workers=workers,
                              persistent_workers=workers > 0, generator=torch.Generator().manual_seed(0))


def loader_alone(path: Path, seconds: float, workers: int) -> list[dict[str, Any]]:
    rows = []
    for seq_len, micro in SHAPES:
        ours = TokenLoader(path, seq_len, micro, seed=0)
        plain = DataLoader(TokenDataset(path, seq_len), batch_size=micro, shuffle=True,
                           generator=torch.Generator().manual_seed(0))
        stateful = _stateful(path, seq_len, micro, workers)
        tokens = seq_len * micro
        for loader in (ours, plain, stateful):  # first touches of the page cache; the workers start
            if loader is not None:
                _rate(loader, tokens, 0.05)
        rows.append({"seq_len": seq_len, "micro_batch": micro, "token_loader_tok_s": _rate(ours, tokens, seconds),
                     "dataloader_tok_s": _rate(plain, tokens, seconds),
                     "stateful_workers_tok_s": _rate(stateful, tokens, seconds) if stateful is not None else None})
        del stateful  # its workers end
    return rows


class DataWaits(Callback[Any]):
    """Per optimizer step: (data wait s, step time s), from ``trainer.step_stats``."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []
        self._wait = 0.0

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        stats = self.trainer.step_stats
        if not self.trainer.is_accumulating_gradients:
            self.steps.append((stats.data_wait_s, stats.step_time_s))


class PageCache(Callback[Any]):
    """Before training, the demo's training token file out of the page cache (``cold``) or
    read whole into it (warm); after it, the share of the file's pages resident."""

    def __init__(self, cold: bool) -> None:
        self.cold, self.resident_before, self.resident_after = cold, None, None

    def pre_train_epoch(self) -> None:
        if self.trainer.current_epoch:
            return
        path = self.trainer.train_file
        if self.cold:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        else:
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass
        self.resident_before = resident_share(path)

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        self.resident_after = resident_share(self.trainer.train_file)


def resident_share(path: str | os.PathLike[str]) -> float | None:
    """The share of `path`'s pages in the page cache (``mincore``), or None where that
    cannot be read."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        size = os.path.getsize(path)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
            view = np.frombuffer(mapped, dtype=np.uint8)
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            ok = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec) == 0
            del view
        return sum(v & 1 for v in vec) / pages if ok else None
    except (OSError, AttributeError, ValueError):
        return None


def demo(steps: int, root: str, extra: list[str] | None = None, cache: PageCache | None = None,
         name: str = "bench") -> dict[str, Any]:
    """The demo with its defaults (and `extra` flags) for `steps` steps, as run `name`: what it
    waits for its data."""
    waits = DataWaits()
    trainer = demo_main(["--steps", str(steps), "--root-dir", root, "--run-name", name, "--checkpoint-every", "None",
                         *(extra or [])], callbacks=[waits, *([cache] if cache else [])])
    timed = waits.steps[5:]  # the first steps include building the iterator and warm-up
    wait, total = sum(w for w, _ in timed), sum(t for _, t in timed)
    tokens = trainer.config.training_parameters.global_batch_size * trainer.config.model.block_size
    step_s = statistics.median(t for _, t in timed)
    first = timed[:20]  # a cold cache warms as the run reads: its first steps are the coldest
    out = {"steps_timed": len(timed), "data_wait_share": wait / total,
           "data_wait_share_first_20": sum(w for w, _ in first) / sum(t for _, t in first), "data_wait_ms_median":
           1e3 * statistics.median(w for w, _ in timed), "data_wait_ms_max": 1e3 * max(w for w, _ in timed),
           "step_ms_median": 1e3 * step_s, "tokens_per_step": tokens, "demo_tok_s": tokens / step_s}
    if cache is not None:
        out.update(file_mb=os.path.getsize(trainer.train_file) / 1e6, resident_before=cache.resident_before,
                   resident_after=cache.resident_after)
    return out


def _page_cache_run(steps: int, root: str, extra: list[str], cold: bool, name: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return demo(steps, root, extra, PageCache(cold), name=name)


def page_cache_runs(steps: int, root: str, chars: int, smoke: bool) -> list[dict[str, Any]]:
    """The demo on a `chars`-token corpus, cold and warm page cache, prefetch 0 and 2, each
    in a fresh process (a memory map an earlier run left in this one would keep its pages
    from being evicted)."""
    rows = []
    for prefetch, cold in [(0, True), (2, False)] if smoke else [(0, True), (0, False), (2, True), (2, False)]:
        extra = ["--n-chars", str(chars), "--data.prefetch", str(prefetch), "--val-batches", "2",  # not 10 % of it
                 *(SMOKE_DEMO[:-4] if smoke else [])]
        name = f"bench-{'cold' if cold else 'warm'}-{prefetch}"
        args = (steps, root, extra, cold, name)  # --smoke: in this process (seconds; the path, not the numbers)
        run = _page_cache_run(*args) if smoke else spawn_world(1, _page_cache_run, *args, timeout=1200)[0]
        rows.append({"cache": "cold" if cold else "warm", "prefetch": prefetch, **run})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=50_000_000, help="tokens in the generated file (uint16)")
    p.add_argument("--seconds", type=float, default=3.0, help="time per loader measurement")
    p.add_argument("--steps", type=int, default=250, help="demo steps (its default)")
    p.add_argument("--workers", type=int, default=2, help="StatefulDataLoader's worker processes")
    p.add_argument("--cold-chars", type=int, default=100_000_000,
                   help="tokens of the corpus of the cold/warm page-cache runs (0: skip them)")
    p.add_argument("--quick", action="store_true", help="a 5M-token file, 1 s per measurement, 60 demo steps")
    p.add_argument("--smoke", action="store_true",
                   help="seconds: a 1M-token file, 0.05 s per measurement, 8 steps of a small demo")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "data.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.seconds, args.steps = 5_000_000, 1.0, 60
    if args.smoke:
        args.tokens, args.seconds, args.steps, args.cold_chars = 1_000_000, 0.05, 8, 2_000_000
    torch.set_num_threads(1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dream_data_") as root:
        rng = np.random.default_rng(0)
        path = write_tokens(Path(root) / "bench.tokens", (rng.integers(0, 50_000, size=1_000_000)
                                                          for _ in range(max(1, args.tokens // 1_000_000))))
        rows = loader_alone(path, args.seconds, args.workers)
        run = demo(args.steps, root, SMOKE_DEMO if args.smoke else None)
        cache_rows = page_cache_runs(args.steps, root, args.cold_chars, args.smoke) if args.cold_chars else []
    demo_shape = rows[0]
    result = {"loader": rows, "demo": run, "page_cache": cache_rows, "goal_data_wait_share": GOAL,
              "goal_met": run["data_wait_share"] < GOAL,
              "loader_over_demo": demo_shape["token_loader_tok_s"] / run["demo_tok_s"],
              "settings": vars(args), "wall_s": time.perf_counter() - start, "machine": machine()}
    print(f"\nthe token loader alone ({args.tokens / 1e6:.0f}M uint16 tokens, memory-mapped, main process); "
          f"torch {torch.__version__}\n")
    workers = f"Stateful({args.workers}w) tok/s"
    print(f"{'seq_len x micro':<18}{'TokenLoader tok/s':>20}{'DataLoader tok/s':>20}{'ratio':>8}{workers:>26}{'ratio':>8}")
    for r in rows:
        st = r["stateful_workers_tok_s"]
        st_text = (f"{st:>26,.0f}{r['token_loader_tok_s'] / st:>7.1f}x" if st else f"{'not measured (no torchdata)':>34}")
        print(f"{str(r['seq_len']) + ' x ' + str(r['micro_batch']):<18}{r['token_loader_tok_s']:>20,.0f}"
              f"{r['dataloader_tok_s']:>20,.0f}{r['token_loader_tok_s'] / r['dataloader_tok_s']:>7.1f}x{st_text}")
    shape = f"shrunk: {' '.join(SMOKE_DEMO)}" if args.smoke else "with its defaults"
    print(f"\nthe demo {shape} ({run['tokens_per_step']} tokens/step), {run['steps_timed']} steps timed:")
    print(f"  step {run['step_ms_median']:.1f} ms (median), data wait {run['data_wait_ms_median']:.3f} ms (median); "
          f"data wait share {100 * run['data_wait_share']:.3f} % (goal < {100 * GOAL:.0f} %: "
          f"{'met' if result['goal_met'] else 'NOT met'})")
    print(f"  the demo consumes {run['demo_tok_s']:,.0f} tok/s; the loader gives {demo_shape['token_loader_tok_s']:,.0f} "
          f"({result['loader_over_demo']:.0f}x)")
    if cache_rows:
        print(f"\nthe demo on a {cache_rows[0]['file_mb']:.0f} MB token file ({args.cold_chars:,} tokens), cold page cache "
              "(evicted before training) and warm (read whole before it):")
        print(f"{'cache':<7}{'prefetch':>9}{'step ms':>9}{'wait ms (median)':>18}{'wait ms (max)':>15}{'wait share':>12}"
              f"{'first 20 steps':>16}{'resident before/after':>24}")
        for r in cache_rows:
            res = "/".join("-" if x is None else f"{100 * x:.0f} %" for x in (r["resident_before"], r["resident_after"]))
            print(f"{r['cache']:<7}{r['prefetch']:>9}{r['step_ms_median']:>9.1f}{r['data_wait_ms_median']:>18.3f}"
                  f"{r['data_wait_ms_max']:>15.2f}{100 * r['data_wait_share']:>11.2f}%"
                  f"{100 * r['data_wait_share_first_20']:>15.2f}%{res:>24}")
    write_json(result, args.out)
    print(f"({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
