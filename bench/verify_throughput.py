#!/usr/bin/env python3
"""Throughput of the model_weights verifier (size + parallel sha256) against the disk's read rate, cold cache.

  bench/verify_throughput.py [--size 4G] [--files 8] [--dir /var/tmp/verify-bench] [--workers N]
                             [--bufsize-mib 16] [--cache-drop auto|fadvise|global] [--json-out FILE] [--cleanup]

1. Makes (or reuses, with --dir) a dataset of --files shard-like files of random bytes totalling --size, with a
   manifest.json (sha256 computed while writing).
2. Before every timed pass, evicts the dataset from the page cache: `fadvise` = posix_fadvise(POSIX_FADV_DONTNEED)
   on each file (needs no privilege, touches only these files), `global` = echo 3 > /proc/sys/vm/drop_caches
   (root; evicts everything on the machine), `auto` = fadvise, then global if pages are still resident. The
   resident fraction after eviction is measured with mincore via util-linux `fincore` and reported.
3. Measures, cold each time: the disk's sequential read rate (dd-like 16 MiB reads of the same files, one stream
   and --workers streams), the verifier (plugins/module_utils/model_manifest.verify_files, the code the module
   runs); then,
   not timed against the disk, the verifier again with the files left in the page cache (verifier_warm) and sha256
   on in-memory data (1 thread and --workers threads): the CPU ceiling.
4. Prints one JSON document and a summary line; ratio = verifier / best disk read rate (goal >= 0.80).
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from ansible_collections.b300.pd.plugins.module_utils import model_manifest as mm  # noqa: E402

MIB = 1024 * 1024


def parse_size(s):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", s.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r} (e.g. 4G, 512M)")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def make_dataset(d, total, nfiles, bufsize):
    """Write nfiles random files (sha256 computed on the fly) and manifest.json; reuse a matching dataset."""
    man_path = os.path.join(d, mm.MANIFEST_NAME)
    per = total // nfiles
    if os.path.exists(man_path):
        try:
            m = mm.validate_manifest(mm.read_manifest_file(man_path))
            if len(m["files"]) == nfiles and all(f["size"] == per for f in m["files"]):
                states = mm.verify_files(d, m["files"], deep=False)
                if set(states.values()) == {mm.OK}:
                    return m, False
        except mm.ManifestError:
            pass
    os.makedirs(d, exist_ok=True)
    files = []
    for i in range(nfiles):
        rel = f"model-{i + 1:05d}-of-{nfiles:05d}.safetensors"
        h = hashlib.sha256()
        left = per
        with open(os.path.join(d, rel), "wb") as f:
            while left:
                chunk = os.urandom(min(bufsize, left))
                h.update(chunk)
                f.write(chunk)
                left -= len(chunk)
            f.flush()
            os.fsync(f.fileno())
        files.append({"path": rel, "size": per, "sha256": h.hexdigest()})
    m = {"revision": mm.content_revision(files), "files": files}
    mm.write_atomic(man_path, mm.dumps_manifest(m))
    return m, True


def resident_fraction(paths):
    """Fraction of the files' pages in the page cache (util-linux fincore, i.e. mincore(2)); None if unavailable."""
    if not shutil.which("fincore"):
        return None
    p = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *paths],
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        return None
    res = size = 0
    for line in p.stdout.split("\n"):
        parts = line.split()
        if len(parts) == 2:
            res += int(parts[0])
            size += int(parts[1])
    return res / size if size else None


def fadvise_drop(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def global_drop():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(paths, mode):
    """Evict the dataset; returns (method actually used, resident fraction afterwards)."""
    used = []
    if mode in ("auto", "fadvise"):
        fadvise_drop(paths)
        used.append("fadvise")
    res = resident_fraction(paths)
    if mode == "global" or (mode == "auto" and res is not None and res > 0.02):
        if global_drop():
            used.append("drop_caches")
        res = resident_fraction(paths)
    return "+".join(used) or "none", res


def read_pass(paths, workers, bufsize):
    """dd-like sequential reads of every file (no hashing), with `workers` concurrent streams."""

    def one(p):
        buf = bytearray(bufsize)
        n = 0
        with open(p, "rb", buffering=0) as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    return n
                n += k

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as ex:
        total = sum(ex.map(one, paths))
    return total, time.perf_counter() - t0


def sha_cpu(workers, nbytes=256 * MIB, bufsize=16 * MIB):
    """sha256 rate on data already in memory: the CPU ceiling of the verifier."""
    block = os.urandom(bufsize)
    per = max(1, nbytes // bufsize)

    def one(_worker):
        h = hashlib.sha256()
        for _block in range(per):
            h.update(block)
        return per * bufsize

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as ex:
        total = sum(ex.map(one, range(workers)))
    return total / (time.perf_counter() - t0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("4G"), help="dataset size (default 4G)")
    ap.add_argument("--files", type=int, default=8, help="number of shard files (default 8)")
    ap.add_argument("--dir", default="/var/tmp/verify-bench", help="dataset directory (reused when it matches)")
    ap.add_argument("--workers", type=int, default=mm.default_workers(), help="hashing / read threads")
    ap.add_argument("--bufsize-mib", type=int, default=16)
    ap.add_argument("--cache-drop", choices=["auto", "fadvise", "global"], default="auto")
    ap.add_argument("--json-out", help="also write the JSON result here")
    ap.add_argument("--cleanup", action="store_true", help="delete the dataset afterwards")
    a = ap.parse_args(argv)
    bufsize = a.bufsize_mib * MIB

    t0 = time.perf_counter()
    m, created = make_dataset(a.dir, a.size, a.files, bufsize)
    gen_s = time.perf_counter() - t0
    paths = [os.path.join(a.dir, f["path"]) for f in m["files"]]
    total = sum(f["size"] for f in m["files"])

    def gbps(n, s):
        return round(n / s / 1e9, 3)

    result = {
        "dataset": {"dir": a.dir, "files": len(paths), "bytes": total, "created": created,
                    "create_s": round(gen_s, 2)},
        "workers": a.workers, "bufsize_mib": a.bufsize_mib, "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    method, res = evict(paths, a.cache_drop)
    n, s = read_pass(paths, 1, bufsize)
    result["disk_read_1_stream"] = {"GBps": gbps(n, s), "s": round(s, 2), "evict": method, "resident_before": res}
    method, res = evict(paths, a.cache_drop)
    n, s = read_pass(paths, a.workers, bufsize)
    result["disk_read_parallel"] = {"GBps": gbps(n, s), "s": round(s, 2), "streams": a.workers, "evict": method,
                                    "resident_before": res}
    method, res = evict(paths, a.cache_drop)
    t = time.perf_counter()
    states = mm.verify_files(a.dir, m["files"], workers=a.workers, bufsize=bufsize)
    s = time.perf_counter() - t
    bad = {p: st for p, st in states.items() if st != mm.OK}
    result["verifier"] = {"GBps": gbps(total, s), "s": round(s, 2), "evict": method, "resident_before": res,
                          "all_ok": not bad, "bad": bad}
    # Same verifier with the files already in the page cache (if they fit): the I/O-free, CPU-bound rate.
    t = time.perf_counter()
    mm.verify_files(a.dir, m["files"], workers=a.workers, bufsize=bufsize)
    s = time.perf_counter() - t
    result["verifier_warm"] = {"GBps": gbps(total, s), "s": round(s, 2), "resident_before": resident_fraction(paths)}
    result["sha256_cpu_1_thread_GBps"] = round(sha_cpu(1) / 1e9, 3)
    result["sha256_cpu_threads_GBps"] = round(sha_cpu(a.workers) / 1e9, 3)
    disk = max(result["disk_read_1_stream"]["GBps"], result["disk_read_parallel"]["GBps"])
    result["ratio_verifier_to_disk"] = round(result["verifier"]["GBps"] / disk, 3) if disk else None
    result["goal_met"] = bool(result["ratio_verifier_to_disk"] and result["ratio_verifier_to_disk"] >= 0.8)
    result["loadavg_end"] = os.getloadavg()
    if a.cleanup:
        shutil.rmtree(a.dir)
    doc = json.dumps(result, indent=1)
    print(doc)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(doc + "\n")
    print(
        f"verify_throughput: {total / 1e9:.2f} GB in {len(paths)} files, {a.workers} threads: disk read "
        f"{result['disk_read_1_stream']['GBps']} GB/s (1 stream) / {result['disk_read_parallel']['GBps']} GB/s "
        f"({a.workers} streams), verifier {result['verifier']['GBps']} GB/s cold / "
        f"{result['verifier_warm']['GBps']} GB/s warm, ratio "
        f"{result['ratio_verifier_to_disk']} (goal >= 0.80: {'met' if result['goal_met'] else 'NOT met'}); "
        f"sha256 CPU ceiling {result['sha256_cpu_threads_GBps']} GB/s; evict={result['verifier']['evict']}, "
        f"resident before verify={res}"
    )
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
