"""Host memory taken by a pinned 1.002 GiB buffer: torch's pin_memory=True (its caching host
allocator rounds to the next power of two) vs behemoth's exact lock (zero/pinned.py), and the
host->device bandwidth of each next to a pageable buffer. One GPU:   python benchmarks/pinned_check.py"""

import time

import torch

from behemoth.parallel.zero import pinned


def used_gib() -> float:
    """The host's memory in use (MemTotal - MemAvailable): what pinning takes from everyone."""
    with open("/proc/meminfo") as f:
        kb = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return (kb["MemTotal"] - kb["MemAvailable"]) / 2**20


def h2d_gbs(src: torch.Tensor, dst: torch.Tensor) -> float:
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * src.numel() * src.element_size() / (time.perf_counter() - t) / 1e9


def main() -> None:
    n = 269_000_000  # fp32 elements: 1.002 GiB, a GPT-6.9B chunk shard in 26 chunks
    dst = torch.empty(n, device="cuda")
    for name, make in (
        ("pageable", lambda: torch.ones(n)),
        ("torch pin_memory=True", lambda: torch.ones(n, pin_memory=True)),
        ("behemoth exact lock", lambda: pinned.zeros(n, torch.float32, True).fill_(1.0)),
    ):
        r0 = used_gib()
        src = make()
        grown = used_gib() - r0
        gbs = h2d_gbs(src, dst)
        ok = bool((dst == 1.0).all())
        print(
            f"PINNED {name}: {n * 4 / 2**30:.3f} GiB asked, host memory in use grew {grown:.3f} GiB, is_pinned {src.is_pinned()}, "
            f"host->device {gbs:.1f} GB/s, copy correct {ok}, locked by behemoth {pinned.locked_bytes / 2**30:.3f} GiB",
            flush=True,
        )
        del src
    print(f"PINNED after release: locked by behemoth {pinned.locked_bytes / 2**30:.3f} GiB")


if __name__ == "__main__":
    main()
