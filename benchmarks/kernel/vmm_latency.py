"""CUDA virtual-memory call latency, the cost the vattention KV backend pays per page (engine/kv_backend/).

Times, per 2 MiB page (the driver's minimum granularity): ``cuMemCreate``, ``cuMemMap`` + ``cuMemSetAccess``
(one call of the backend's ``map``), ``cuMemUnmap``; medians over ``--pages`` pages. Then the question that
decides whether mapping can overlap compute: does a map or unmap of an unrelated page wait for a kernel that
is running? A ~``--busy-ms`` kernel (``torch.cuda._sleep``) is launched and the call is timed while it runs.
Last, all pages mapped and unmapped by 1, 2, 4 and 8 threads: does the driver run them concurrently?

    python -m benchmarks.kernel.vmm_latency [--pages 512] [--busy-ms 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.harness import record
from engine.kv_backend.cuda_vmm import CudaDriver


def timed_us(fn, items: list) -> list[float]:
    times = []
    for item in items:
        start = time.perf_counter()
        fn(item)
        times.append((time.perf_counter() - start) * 1e6)
    return times


def calls_while_busy(
    driver: CudaDriver, base: int, handle: object, page: int, busy_ms: float
) -> dict:
    """Seconds a map and an unmap take while a kernel of ``busy_ms`` runs (``busy_ms`` = they wait for it)."""
    cycles_per_ms = torch.cuda.get_device_properties(0).clock_rate  # kHz = cycles per ms
    result = {}
    for name, call in (
        ("map_us_while_busy", lambda: driver.map(base, page, handle, 0)),
        ("unmap_us_while_busy", lambda: driver.unmap(base, page)),
    ):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(busy_ms * cycles_per_ms))
        start = time.perf_counter()
        call()
        result[name] = (time.perf_counter() - start) * 1e6
        torch.cuda.synchronize()
    return result


def threaded_us_per_page(
    driver: CudaDriver, base: int, handles: list, page: int, threads: int
) -> dict:
    """Wall µs per page to map, then unmap, every page with ``threads`` threads splitting the pages: whether
    the driver runs VA operations concurrently (the calls release the GIL if this scales)."""
    chunks = [list(range(i, len(handles), threads)) for i in range(threads)]
    result = {}
    for name, call in (
        ("map", lambda i: driver.map(base + i * page, page, handles[i], 0)),
        ("unmap", lambda i: driver.unmap(base + i * page, page)),
    ):
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda chunk: [call(i) for i in chunk], chunks))
        result[f"{name}_us_per_page_{threads}_threads"] = (
            (time.perf_counter() - start) * 1e6 / len(handles)
        )
    return result


def measure(pages: int, busy_ms: float) -> dict:
    driver = CudaDriver(torch.device("cuda", 0))
    page = driver.granularity
    handles: list = []
    create = timed_us(lambda _: handles.append(driver.create(page)), list(range(pages)))
    base = driver.reserve((pages + 1) * page)
    maps = timed_us(lambda i: driver.map(base + i * page, page, handles[i], 0), list(range(pages)))
    unmaps = timed_us(lambda i: driver.unmap(base + i * page, page), list(range(pages)))
    busy = calls_while_busy(driver, base + pages * page, handles[0], page, busy_ms)
    for threads in (1, 2, 4, 8):
        busy.update(threaded_us_per_page(driver, base, handles, page, threads))
    for handle in handles:
        driver.release(handle)
    driver.free_address(base, (pages + 1) * page)
    return {
        "page_bytes": page,
        "pages": pages,
        "create_us_median": statistics.median(create),
        "map_us_median": statistics.median(maps),
        "unmap_us_median": statistics.median(unmaps),
        "busy_ms": busy_ms,
        **busy,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--busy-ms", type=float, default=50.0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    record.require_cuda(__spec__.name)
    result = measure(args.pages, args.busy_ms)
    print("| call | µs per 2 MiB page (median) |\n|---|---|")
    for key in ("create", "map", "unmap"):
        print(f"| {key} | {result[f'{key}_us_median']:.1f} |")
    print(f"| map while a {args.busy_ms:.0f} ms kernel runs | {result['map_us_while_busy']:.1f} |")
    print(
        f"| unmap while a {args.busy_ms:.0f} ms kernel runs | {result['unmap_us_while_busy']:.1f} |"
    )
    for threads in (1, 2, 4, 8):
        print(
            f"| map / unmap, {threads} threads (wall per page) | {result[f'map_us_per_page_{threads}_threads']:.1f}"
            f" / {result[f'unmap_us_per_page_{threads}_threads']:.1f} |"
        )
    env = record.environment(__spec__.name, "cuda")
    print(record.environment_line(env))
    record.write_json(args.json, {"environment": env, **result})


if __name__ == "__main__":
    main()
