"""How much shader code an SM keeps hot between dispatches (docs/DESIGN.md).

Usage: python3 code_cache.py [DEVICE (default 0)] [CHAIN (default 48)]

code_fetch.py showed a dependent dispatch whose code was not run just before pays to fetch it.
Here chains of dependent dispatches of code_fetch.py's `busy` kernel (N unrolled steps, a SALT
per pipeline) measure two things:
- a sweep: the chain cycles round-robin through P pipelines of one size; once P pipelines' code
  no longer fits the instruction cache, every link fetches its code again;
- sets of sizes shaped like a layer's kernels: the chain cycling through the set, against the
  same links grouped so that each pipeline runs several times in a row (its code hot): the
  difference is what fetching code costs per link when a layer's kernels take turns."""
from chains import chain_us, device_and_links
from code_fetch import busy
from zdsl.models.qwen35.cli.profile import code_size

SETS = {  # KB of NVIDIA binary per kernel, in the order a layer runs them
    "delta-net layer (HEAD)": (5.9, 13.7, 26.0, 3.7, 24.4, 5.9, 8.4),
    "router and step halved": (5.9, 13.7, 13.0, 3.7, 12.2, 5.9, 8.4),
    "every kernel <= 8 KB": (5.9, 8.0, 8.0, 3.7, 8.0, 5.9, 8.0),
    "seven of 3.6 KB": (3.6,) * 7,
}


def steps_for(kb: float) -> int:
    """busy's N for a binary of about kb KB on NVIDIA (3.6 KB at N = 16, 12.8 KB at N = 64)."""
    return max(1, round((kb - 1.15) / 0.153))


def main():
    dev, L = device_and_links()
    bufs = [dev.alloc(4 * 64 * 132) for _ in range(2)]

    def chain(order):
        def record(seq):
            for l, v in enumerate(order):
                v.dispatch(seq, 132, src=bufs[l % 2], dst=bufs[(l + 1) % 2])
        return chain_us(dev, record, len(order))

    for N in (16, 64, 256):
        variants = [busy.specialize(N=N, SALT=s) for s in range(L)]
        size = code_size(dev, variants[0])
        row = [f"P={P} {chain([variants[l % P] for l in range(L)]):.2f}" for P in (1, 2, 3, 4, 6, 8, 12, 16, 24, 48)
               if P <= L]
        print(f"N={N} binary {size} B: " + ", ".join(row) + " us/link", flush=True)
    for name, sizes in SETS.items():
        variants = [busy.specialize(N=steps_for(kb), SALT=100 + s) for s, kb in enumerate(sizes)]
        real = [code_size(dev, v) for v in variants]
        reps = 6
        cycled = chain([v for _ in range(reps) for v in variants])
        grouped = chain([v for v in variants for _ in range(reps)])
        print(f"{name}: binaries {real} B ({sum(r or 0 for r in real) / 1024:.0f} KB): cycled {cycled:.2f}, "
              f"grouped {grouped:.2f} us/link, fetch {cycled - grouped:+.2f}", flush=True)
    for b in bufs:
        b.free()
    dev.close()


if __name__ == "__main__":
    main()
