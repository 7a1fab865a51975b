"""Benchmark: stage 02's HF capture pipeline vs the verifier's bare forward, same batches, same run.

``--batches`` batches of ``[batch, seq]`` random token ids (every sample ``seq`` long, so no
padding on either side), each timed end to end after one warm-up batch (median of ``--repeats``):

- ``bare``: ``model(input_ids, use_cache=False, logits_to_keep=1)`` per batch (no mask: nothing is
  padded, and the capture passes none either), synchronised at the end: the forward work the capture
  cannot avoid;
- ``pipeline``: :func:`eagle3.capture.loop.capture_and_write`, the code stage 02 runs: hooked capture
  of the 3 aux states + last, padding sliced and cast to bf16 on the device, one pinned
  device->host copy per batch overlapped with the next forward, shards serialised, hashed and
  written atomically (fsync + rename) by ``--write-threads`` background threads into a temporary
  folder under ``--out-dir``, manifest rows appended in order; timed until the last shard and
  manifest row are durable (the folder is removed after the timing, outside it);
- ``serial``: the same function with ``write_threads=0`` (no overlap, shards written inline: the
  old stage-02 loop's structure) unless ``--no-serial``;
- ``capture``: ``HFCapture.capture`` only (states in host memory, each sample cloned out of the
  batch buffer, nothing written);
- ``capture_copy``: the pipeline's own capture loop (batch k+1 launched before batch k's pinned copy
  is waited for, states in their stored form) with nothing written: the pipeline's ceiling;
- ``disk``: the same number of shard-sized files of the same bytes written, fsynced and renamed by
  the same number of threads into ``--out-dir`` with no capture at all: the write ceiling of that
  filesystem in this run (unless ``--no-disk``). Where ``pipeline_vs_disk_ratio`` is near 1 the
  capture is bound by the disk, not by the pipeline (compare with ``--out-dir /dev/shm``).

``extract.storage_dtype`` (``--set extract.storage_dtype=float8_e4m3fn``) benchmarks the fp8 shard
writer (:mod:`eagle3.shards.fp8`: half the bytes per token).

``--checksums A [B ...]``: the shard checksum recorded per manifest row (:mod:`eagle3.shards.checksum`); the
first is the headline ``pipeline``, each further one is timed as ``pipeline_<algo>`` in the same run
(e.g. ``--checksums xxh3_128 sha256``: the hash 02 records now against the one it recorded before).
``--threads-variants N [N ...]``: the headline with N writer threads, as ``pipeline_t<N>``.
``--stream-save``: also time ``pipeline_streamsave``, shards streamed through a Python file object
(:data:`eagle3.shards.write.SAVE_VIA_PATH` False: the writer before; same bytes).
``--switch-interval-variants S [S ...]``: the headline with the GIL switch interval S seconds while the
writer threads run (:data:`eagle3.capture.shard_writer.SWITCH_INTERVAL_S`), as ``pipeline_si<S>``
(0.005 = Python's default).
``--profile``: after the timings, the headline pipeline once more under :mod:`stack_sampler` (every
thread's stack every 5 ms), the shares per thread group in the JSON's ``profile``.
``--zip-crc-off``: also time ``pipeline_nozipcrc``, the headline with ``torch.save``'s per-record zip
CRC32 off (``torch.serialization.set_crc32_options(False)``: what the CRC costs the writer; stage 02
keeps torch's default).

Prints a Markdown table and JSON; ``capture_vs_bare_ratio`` = pipeline tokens/s / bare tokens/s.

``--writer-only`` (no model, no GPU): the shard writer alone on ``--batches`` synthetic batches of
``[batch, seq]`` tokens x 4 states of ``--hidden`` columns, bf16, handed over as views into one
``[4, T, H]`` batch buffer like the capture's, same threads, into ``--out-dir``:
``writer_list`` = 4 bf16 tensors per sample (the writer checks and, for fp8, quantises on the
CPU: what stage 02 did before the device-side encoding, and still does for backends without it),
``writer_stored`` = :func:`eagle3.shards.write.encode_batch` per batch first (on the GPU in stage 02; on
the CPU here, timed apart as ``encode_s``), then :class:`eagle3.shards.write.StoredStates` per sample;
``disk`` = the plain-write ceiling above. ``*_vs_disk_ratio`` = writer GB/s / ceiling GB/s.

    python bench/extract_throughput.py --config configs/smollm2-135m.yaml --device cuda --batch 64 --seq 2048 \\
        [--set verifier.path=DIR] [--out-dir /tmp] [--json out.json]
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eagle3.capture.hf import HFCapture  # noqa: E402
from eagle3.capture.loop import capture_and_write, default_write_threads, start_capture  # noqa: E402
from eagle3.capture.prompts import Sample  # noqa: E402
from eagle3.cli import ArgumentParser, non_negative_int, positive_int, run_main  # noqa: E402
from eagle3.config import add_config_args, load_config  # noqa: E402
from eagle3.engines.layers import default_aux_layers  # noqa: E402
from eagle3.io import atomic_write_bytes, atomic_write_json  # noqa: E402
from eagle3.shards.checksum import ALGOS, DEFAULT_ALGO  # noqa: E402
from eagle3.shards.fp8 import storage_from_config  # noqa: E402
from eagle3.verifier.load import load_verifier, verifier_dims  # noqa: E402


@contextlib.contextmanager
def writer_settings(via_path: Optional[bool] = None, switch: Optional[float] = None):
    """Inside the block: shards saved via a path or a file object (``via_path``), and the writer's GIL
    switch interval (``switch`` s); None keeps the module's setting. Restored after."""
    import eagle3.capture.shard_writer as sw
    import eagle3.shards.write as sh

    old = (sh.SAVE_VIA_PATH, sw.SWITCH_INTERVAL_S)
    if via_path is not None:
        sh.SAVE_VIA_PATH = via_path
    if switch is not None:
        sw.SWITCH_INTERVAL_S = switch
    try:
        yield
    finally:
        sh.SAVE_VIA_PATH, sw.SWITCH_INTERVAL_S = old


@contextlib.contextmanager
def zip_crc32(on: bool):
    """``torch.save``'s per-record zip CRC32 on or off inside the block (a process-wide torch
    setting, restored after; ``torch.serialization.set_crc32_options``, torch >= 2.6)."""
    if on:
        yield
        return
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_SCRATCH: list[Path] = []


def scratch(prefix: str, out_dir) -> Path:
    """A new temporary folder under ``out_dir``, removed by :func:`remove_scratch` after the timing:
    deleting gigabytes of shards is not part of what a run is timed for (it took 11% of the RAM
    pipeline's and 29% of the disk pipeline's wall in the 2026-12-01 profile)."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=out_dir))
    _SCRATCH.append(root)
    return root


def remove_scratch() -> None:
    """Remove every folder :func:`scratch` made."""
    while _SCRATCH:
        shutil.rmtree(_SCRATCH.pop(), ignore_errors=True)


def write_files(out_dir, n_files: int, nbytes: int, threads: int) -> None:
    """The disk ceiling: ``n_files`` files of ``nbytes`` random bytes each, written by ``threads``
    threads into a :func:`scratch` folder under ``out_dir`` with :func:`eagle3.io.atomic_write_bytes`
    (temp name, fsync, rename: the shard writer's own write path, minus capture and serialisation)."""
    from concurrent.futures import ThreadPoolExecutor

    buf = (os.urandom(1 << 20) * (nbytes // (1 << 20) + 1))[:nbytes]
    root = scratch("disk-bench-", out_dir)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda i: atomic_write_bytes(root / f"{i}.pt", buf), range(n_files)))


def device_encoding_check(
    cap: HFCapture, batch: list[list[int]], storage, n: int = 4
) -> Optional[bool]:
    """Whether the shards of the first ``n`` samples of ``batch`` encoded on the capture device
    (:func:`eagle3.shards.write.encode_batch`, what stage 02 writes) are byte-identical to the writer's
    CPU path on the plain bf16 capture of the same batch (None on an older tree without it)."""
    try:
        from eagle3.shards.write import shard_object

        stored = cap.capture_async(batch, storage=storage).stored()
    except (ImportError, TypeError, AttributeError):
        return None
    plain = cap.capture(batch)

    def enc(ids, states) -> bytes:
        buf = io.BytesIO()
        torch.save(
            shard_object(ids, states, [1] * len(ids), storage if storage.is_fp8 else None), buf
        )
        return buf.getvalue()

    return all(
        enc(batch[i], stored[i]) == enc(batch[i], plain[i]) for i in range(min(n, len(batch)))
    )


def hidden_states_check(cap: HFCapture, batch: list[list[int]]) -> dict:
    """The capture (sync-free launch: pinned non-blocking inputs, no mask when nothing is padded)
    against transformers' own ``output_hidden_states`` of the same padded batch with its explicit
    all-ones/zeros attention mask, run with the same attention backends (cuDNN SDPA off, as in the
    capture). Per case, ``batch`` as given (``unpadded``) and with every other sample cut to half its
    length (``padded``): ``{"equal": bitwise equal on every real row, "max_abs_diff": float}``."""
    from eagle3.sdpa import no_cudnn_sdpa

    model = cap.model
    out_d = {}
    cases = {
        "unpadded": batch,
        "padded": [s if i % 2 == 0 else s[: max(1, len(s) // 2)] for i, s in enumerate(batch)],
    }
    for name, b in cases.items():
        got = cap.capture(b)
        B, Lmax = len(b), max(len(s) for s in b)
        ids = torch.zeros((B, Lmax), dtype=torch.long)  # [B, Lmax]
        att = torch.zeros((B, Lmax), dtype=torch.long)  # [B, Lmax]
        for i, s in enumerate(b):
            ids[i, : len(s)] = torch.tensor(s)
            att[i, : len(s)] = 1
        with torch.inference_mode(), no_cudnn_sdpa():
            out = model(
                input_ids=ids.to(cap.device),
                attention_mask=att.to(cap.device),
                use_cache=False,
                output_hidden_states=True,
                logits_to_keep=1,
            )
        ref = [out.hidden_states[j] for j in cap.aux_layers + [-1]]  # 4 x [B, Lmax, H]
        equal, diff = True, 0.0
        for i, s in enumerate(b):
            for k in range(4):
                r = ref[k][i, : len(s)].to("cpu", torch.bfloat16)  # [L, H]
                equal = equal and torch.equal(got[i][k], r)
                diff = max(diff, (got[i][k].float() - r.float()).abs().max().item())
        out_d[name] = {"equal": equal, "max_abs_diff": diff}
    return out_d


def path_save_check(out_dir) -> bool:
    """Whether a shard saved by path (:func:`eagle3.io.atomic_torch_save` ``via_path=True``, this torch's
    C++ writer) is byte-identical to ``torch.save`` into a BytesIO (the stream writer's bytes)."""
    from eagle3.io import atomic_torch_save

    g = torch.Generator().manual_seed(1)
    obj = {
        "input_ids": torch.arange(33),
        "hidden_states": [torch.randn((33, 16), generator=g).to(torch.bfloat16) for _ in range(4)],
        "loss_mask": torch.ones(33, dtype=torch.int64),
    }
    buf = io.BytesIO()
    torch.save(obj, buf)
    root = Path(tempfile.mkdtemp(prefix="path-save-check-", dir=out_dir))
    try:
        atomic_torch_save(obj, root / "data_0.pt", via_path=True)
        return (root / "data_0.pt").read_bytes() == buf.getvalue()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def writer_bench(a, cfg) -> dict:
    """``--writer-only``: the shard writer's GB/s (list path, stored path) vs the plain-write ceiling."""
    from eagle3.capture.shard_writer import ShardWriter
    from eagle3.shards.manifest import ManifestWriter

    try:
        from eagle3.shards.write import StoredStates, encode_batch
    except ImportError:  # an older tree: only the list path exists
        StoredStates = encode_batch = None
    B, L, K, H = a.batch, a.seq, a.batches, a.hidden
    storage = storage_from_config(cfg.extract)
    threads = (
        a.write_threads
        if a.write_threads is not None
        else (
            cfg.extract.write_threads
            if cfg.extract.write_threads is not None
            else default_write_threads()
        )
    )
    g = torch.Generator().manual_seed(a.seed)
    packs = [
        torch.randn((4, B * L, H), generator=g).to(torch.bfloat16) for _ in range(K)
    ]  # K x [4, T, H]
    ids, mask = list(range(L)), [1] * L
    fp8 = storage if storage.is_fp8 else None
    encoded: list = []
    encode_s = 0.0
    if encode_batch is not None:
        t = time.perf_counter()
        for pack in packs:
            v, sc, fin = encode_batch(pack, storage)
            encoded.append((v, sc, bool(fin)))
        encode_s = time.perf_counter() - t

    def per_sample(k: int, stored: bool):
        if not stored:
            return [[packs[k][j, b * L : (b + 1) * L] for j in range(4)] for b in range(B)]
        v, sc, fin = encoded[k]
        return [
            StoredStates(
                [v[j, b * L : (b + 1) * L] for j in range(4)],
                None if sc is None else [sc[j, b * L : (b + 1) * L] for j in range(4)],
                source_finite=fin,
            )
            for b in range(B)
        ]

    def writer(
        stored: bool,
        checksum: str = a.checksums[0],
        zip_crc: bool = True,
        via_path: Optional[bool] = None,
    ):
        def fn() -> None:
            root = scratch("writer-bench-", a.out_dir)
            with (
                zip_crc32(zip_crc),
                writer_settings(via_path),
                ManifestWriter(root / "manifest.jsonl") as man,
                ShardWriter(
                    root,
                    2000,
                    man,
                    threads=threads,
                    max_pending_tokens=2 * B * L,
                    storage=fp8,
                    checksum=checksum,
                ) as w,
            ):
                for k in range(K):
                    for b, st in enumerate(per_sample(k, stored)):
                        w.submit(k * B + b, f"s{k * B + b}", ids, st, mask)

        return fn

    bpt = storage.bytes_per_token(H)
    fns = {
        "writer_list": writer(False),
        "disk": lambda: write_files(a.out_dir, K * B, L * bpt, max(threads, 1)),
    }
    if encode_batch is not None:
        fns["writer_stored"] = writer(True)
        for algo in a.checksums[1:]:
            fns[f"writer_stored_{algo}"] = writer(True, algo)
        if a.zip_crc_off:
            fns["writer_stored_nozipcrc"] = writer(True, zip_crc=False)
        if a.stream_save:
            fns["writer_stored_streamsave"] = writer(True, via_path=False)
    times: dict = {k: [] for k in fns}
    for _ in range(a.repeats):
        for k, fn in fns.items():
            try:
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
            finally:
                remove_scratch()
    med = {k: statistics.median(v) for k, v in times.items()}
    n = K * B * L
    gbs = {k: round(n * bpt / v / 1e9, 3) for k, v in med.items()}
    import eagle3.capture.shard_writer as sw
    import eagle3.shards.write as sh

    res = {
        "mode": "writer_only",
        "storage_dtype": storage.dtype,
        "checksum": a.checksums[0],
        "save_via_path": sh.SAVE_VIA_PATH,
        "switch_interval_s": sw.SWITCH_INTERVAL_S,
        "hidden": H,
        "batch": B,
        "seq": L,
        "batches": K,
        "repeats": a.repeats,
        "write_threads": threads,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "out_dir": str(a.out_dir or tempfile.gettempdir()),
        "bytes_per_token": bpt,
        **{f"{k}_gb_per_s": v for k, v in gbs.items()},
        **{f"{k}_tokens_per_s": round(n / v, 1) for k, v in med.items()},
        **{f"{k}_vs_disk_ratio": round(med["disk"] / med[k], 3) for k in med if k != "disk"},
        **({"encode_s_cpu": round(encode_s, 3)} if encode_batch is not None else {}),
        "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
    }
    print(
        "| storage | threads | tokens | list path GB/s | stored path GB/s | plain-write ceiling GB/s | "
        "list / ceiling | stored / ceiling |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {storage.dtype} | {threads} | {n} | {gbs['writer_list']} | {gbs.get('writer_stored', '-')} | "
        f"{gbs['disk']} | {res['writer_list_vs_disk_ratio']} | {res.get('writer_stored_vs_disk_ratio', '-')} |"
    )
    for k in (k for k in fns if k.startswith("writer_stored_")):
        print(f"| {k} | {gbs[k]} GB/s | {res[f'{k}_vs_disk_ratio']} of the ceiling |")
    print(json.dumps(res))
    if a.json:
        atomic_write_json(a.json, res)
    return res


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: verifier.device)")
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--seq", type=positive_int, default=512)
    p.add_argument("--batches", type=positive_int, default=6, help="batches per timed run")
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument(
        "--write-threads",
        type=non_negative_int,
        default=None,
        help="default: extract.write_threads or the auto count; 0 = serial",
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where the temporary shard folders go (default: $TMPDIR)",
    )
    p.add_argument(
        "--no-serial",
        dest="serial",
        action="store_false",
        help="skip the serial (no overlap) timing",
    )
    p.add_argument(
        "--no-disk",
        dest="disk",
        action="store_false",
        help="skip the plain-write disk ceiling timing",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    p.add_argument(
        "--writer-only",
        action="store_true",
        help="no model: time the shard writer alone (list vs stored path) against the plain-write ceiling",
    )
    p.add_argument(
        "--hidden",
        type=positive_int,
        default=576,
        help="--writer-only: hidden size H (SmolLM2-135M: 576)",
    )
    p.add_argument(
        "--checksums",
        nargs="+",
        choices=ALGOS,
        default=[DEFAULT_ALGO],
        help="shard checksum(s): the first is the headline, the others timed in the same run",
    )
    p.add_argument(
        "--threads-variants",
        type=positive_int,
        nargs="*",
        default=[],
        help="also time the headline pipeline with these writer thread counts (pipeline_t<N>)",
    )
    p.add_argument(
        "--stream-save",
        action="store_true",
        help="also time the headline with shards streamed through a Python file object (the writer before)",
    )
    p.add_argument(
        "--switch-interval-variants",
        type=float,
        nargs="*",
        default=[],
        help="also time the headline with these GIL switch intervals (s) while the writers run",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timings, run the headline pipeline once more under bench/stack_sampler.py "
        "(every thread's stack every 5 ms): where the main thread and the writer threads sit",
    )
    p.add_argument(
        "--zip-crc-off",
        action="store_true",
        help="also time the headline with torch.save's zip CRC32 off (what the CRC costs)",
    )
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    if a.writer_only:
        writer_bench(a, cfg)
        return 0

    t0 = time.perf_counter()
    model, _tok = load_verifier(cfg.verifier, device=a.device)
    load_s = time.perf_counter() - t0
    dims = verifier_dims(model.config)
    aux = cfg.extract.aux_layers or default_aux_layers(dims["num_layers"])
    device = model.get_input_embeddings().weight.device
    B, L, K = a.batch, a.seq, a.batches
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, dims["vocab_size"], (K, B, L), generator=g)  # [K, B, L]
    ids_dev = ids.to(device)
    cap = HFCapture(model, aux, batch_tokens=B * L)
    samples = [Sample(i, f"s{i}", ids[i // B, i % B].tolist(), [1] * L) for i in range(K * B)]
    batches = [list(range(k * B, (k + 1) * B)) for k in range(K)]
    threads = (
        a.write_threads
        if a.write_threads is not None
        else (
            cfg.extract.write_threads
            if cfg.extract.write_threads is not None
            else default_write_threads()
        )
    )
    H = dims["hidden_size"]
    storage = storage_from_config(cfg.extract)
    bytes_per_token = storage.bytes_per_token(H)

    @torch.inference_mode()
    def bare() -> None:  # no mask: nothing is padded (what the capture passes too)
        for k in range(K):
            model(input_ids=ids_dev[k], use_cache=False, logits_to_keep=1)

    def capture_only() -> None:
        for grp in batches:
            cap.capture([samples[i].input_ids for i in grp])

    def capture_copy() -> None:
        prev = None  # the pipeline's capture loop, the writer left out: its ceiling
        for grp in batches:
            handle = start_capture(cap, [samples[i].input_ids for i in grp], storage)
            if prev is not None:
                prev.states()
            prev = handle
        prev.states()

    def pipeline(
        n_threads: int,
        checksum: str = a.checksums[0],
        zip_crc: bool = True,
        via_path: Optional[bool] = None,
        switch: Optional[float] = None,
    ):
        def fn() -> None:
            root = scratch("extract-bench-", a.out_dir)
            with zip_crc32(zip_crc), writer_settings(via_path, switch):
                rows = capture_and_write(
                    cap,
                    samples,
                    batches,
                    {},
                    H,
                    root,
                    2000,
                    root / "manifest.jsonl",
                    write_threads=n_threads,
                    max_pending_tokens=2 * B * L,
                    storage=storage if storage.is_fp8 else None,
                    checksum=checksum,
                )
            assert len(rows) == K * B

        return fn

    def disk() -> None:
        write_files(a.out_dir, K * B, L * bytes_per_token, max(threads, 1))

    fns = {
        "bare": bare,
        "pipeline": pipeline(threads),
        "capture": capture_only,
        "capture_copy": capture_copy,
    }
    for algo in a.checksums[1:]:
        fns[f"pipeline_{algo}"] = pipeline(threads, algo)
    if a.zip_crc_off:
        fns["pipeline_nozipcrc"] = pipeline(threads, zip_crc=False)
    for n_threads in a.threads_variants:
        fns[f"pipeline_t{n_threads}"] = pipeline(n_threads)
    if a.stream_save:
        fns["pipeline_streamsave"] = pipeline(threads, via_path=False)
    for si in a.switch_interval_variants:
        fns[f"pipeline_si{si:g}"] = pipeline(threads, switch=si)
    if a.serial:
        fns["serial"] = pipeline(0)
    if a.disk:
        fns["disk"] = disk
    # warm-up (one batch's worth of each), then the runs interleaved per repeat so that a load
    # change on a shared machine hits all of them alike
    with torch.inference_mode():
        model(input_ids=ids_dev[0], use_cache=False, logits_to_keep=1)
    cap.capture([samples[i].input_ids for i in batches[0]])
    _sync(device)
    times: dict = {k: [] for k in fns}
    for _ in range(a.repeats):
        for k, fn in fns.items():
            try:
                _sync(device)
                t = time.perf_counter()
                fn()
                _sync(device)
                times[k].append(time.perf_counter() - t)
            finally:
                remove_scratch()
    profile = None
    if a.profile:  # untimed: the sampler takes the GIL every 5 ms
        from stack_sampler import StackSampler

        try:
            with StackSampler(interval=0.005, depth=5) as sampler:
                fns["pipeline"]()
                _sync(device)
        finally:
            remove_scratch()
        profile = sampler.table(top=12)
    med = {k: statistics.median(v) for k, v in times.items()}
    n = K * B * L
    tps = {k: round(n / v, 1) for k, v in med.items()}
    import eagle3.capture.shard_writer as sw
    import eagle3.shards.write as sh

    res = {
        "verifier": cfg.verifier.display_name(),
        "device": str(device),
        "dtype": cfg.verifier.dtype,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "batch": B,
        "seq": L,
        "batches": K,
        "repeats": a.repeats,
        "aux_layers": list(aux),
        "write_threads": threads,
        "out_dir": str(a.out_dir or tempfile.gettempdir()),
        "load_s": round(load_s, 2),
        "hooks": bool(cap._hooks_ok),
        "bare_tokens_per_s": tps["bare"],
        "pipeline_tokens_per_s": tps["pipeline"],
        "capture_only_tokens_per_s": tps["capture"],
        "capture_copy_tokens_per_s": tps["capture_copy"],
        "capture_copy_vs_bare_ratio": round(med["bare"] / med["capture_copy"], 3),
        **({"serial_pipeline_tokens_per_s": tps["serial"]} if "serial" in tps else {}),
        "capture_vs_bare_ratio": round(med["bare"] / med["pipeline"], 3),
        "checksum": a.checksums[0],
        "save_via_path": sh.SAVE_VIA_PATH,
        "switch_interval_s": sw.SWITCH_INTERVAL_S,
        **{f"{k}_tokens_per_s": tps[k] for k in fns if k.startswith("pipeline_")},
        **{
            f"capture_vs_bare_ratio_{k[len('pipeline_') :]}": round(med["bare"] / med[k], 3)
            for k in fns
            if k.startswith("pipeline_")
        },
        "storage_dtype": storage.dtype,
        "shard_write_gb_per_s": round(n * bytes_per_token / med["pipeline"] / 1e9, 3),
        "bytes_per_token": bytes_per_token,
        **(
            {
                "disk_write_gb_per_s": round(n * bytes_per_token / med["disk"] / 1e9, 3),
                "disk_bound_tokens_per_s": tps["disk"],
                "pipeline_vs_disk_ratio": round(med["disk"] / med["pipeline"], 3),
            }
            if "disk" in med
            else {}
        ),
        "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        # shards encoded on the device (NaN/Inf flag; fp8 quantisation) == the CPU path's bytes
        "device_encoding_bytes_equal": device_encoding_check(
            cap, [samples[i].input_ids for i in batches[0]], storage
        ),
        "hidden_states_vs_hf": (
            hs_check := hidden_states_check(cap, [samples[i].input_ids for i in batches[0][:4]])
        ),
        "hidden_states_equal_hf": all(c["equal"] for c in hs_check.values()),
        "path_save_bytes_equal": path_save_check(a.out_dir),
        **({"profile": profile} if profile is not None else {}),
    }
    print(
        "| verifier | device | storage | batch x seq x batches | bare tok/s | pipeline tok/s (capture + copy + write) | "
        "serial tok/s | capture only tok/s | capture + copy tok/s | disk ceiling tok/s | pipeline / bare |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {res['verifier']} | {res['device']} {res['dtype']} | {storage.dtype} | {B} x {L} x {K} | {tps['bare']} | "
        f"{tps['pipeline']} | {tps.get('serial', '-')} | {tps['capture']} | {tps['capture_copy']} | {tps.get('disk', '-')} | "
        f"{res['capture_vs_bare_ratio']} |"
    )
    for k in (k for k in fns if k.startswith("pipeline_")):
        print(f"| {k} | {tps[k]} tok/s | {round(med['bare'] / med[k], 3)} of bare |")
    print(json.dumps(res))
    if a.json:
        atomic_write_json(a.json, res)
    return 0


if __name__ == "__main__":
    run_main(main)
