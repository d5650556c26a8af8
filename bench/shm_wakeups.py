#!/usr/bin/env python3
"""Lost wake-ups of vLLM's shared-memory queue: vLLM's conflating reader vs the plugin's queueing reader.

vLLM's engine core and worker wait for each other through ``shm_broadcast.SpinCondition`` (a PUB/SUB wake-up
beside the shared-memory ring buffer). Two processes play that round trip here with vLLM's own SpinCondition
objects, built with roles/vllm_install's plugin applied (high-water marks 1000, no spinning): each side
publishes its counter in shared memory and notifies; the other checks the counter, else sleeps in wait() with a
1 s re-check, exactly the shape of ``MessageQueue.acquire_read`` (vLLM re-checks after 5 s). A wait that ends by
the re-check while the counter had already moved is a lost wake-up; on the engines each one is a 5 s stall.

Side by side, in one run, the same number of round trips:
- ``conflate``: the reader as vLLM builds it (SUB with ZMQ_CONFLATE, vLLM's wait());
- ``queued``:   the plugin's reader (SUB queueing up to the high-water mark, drained on every wake-up);
- ``bare-conflate`` / ``bare-queue``: the same round trip with bare pyzmq sockets (one SUB polled alone, no vLLM),
  where libzmq's conflating pipe loses wake-ups often enough to see in a few runs.

    .cache/vllm-venv/bin/python bench/shm_wakeups.py [--round-trips 200000] [--repeats 3]

Prints one JSON line per run and a summary line per mode (lost wake-ups per million messages).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

RECHECK_MS = 1000


class _BareCondition:
    """A PUB or SUB wake-up socket with vLLM's wait() shape, without vLLM (modes bare-conflate, bare-queue)."""

    def __init__(self, mode: str, is_reader: bool, ctx, addr: str):
        import zmq

        self.zmq, self.queue = zmq, mode == "bare-queue"
        self.sock = ctx.socket(zmq.SUB if is_reader else zmq.PUB)
        if is_reader:
            self.sock.setsockopt(zmq.RCVHWM if self.queue else zmq.CONFLATE, 1000 if self.queue else 1)
            self.sock.setsockopt_string(zmq.SUBSCRIBE, "")
            self.sock.connect(addr)
            self.poller = zmq.Poller()
            self.poller.register(self.sock, zmq.POLLIN)
        else:
            self.sock.setsockopt(zmq.SNDHWM, 1000)
            self.sock.bind(addr)

    def notify(self):
        self.sock.send(b"\x00")

    def wait(self, timeout_ms):
        if self.sock in dict(self.poller.poll(timeout_ms)):
            while True:
                try:
                    self.sock.recv(self.zmq.NOBLOCK)
                except self.zmq.Again:
                    return
                if not self.queue:
                    return


def _condition(mode: str, is_reader: bool, ctx, addr: str):
    if mode.startswith("bare-"):
        return _BareCondition(mode, is_reader, ctx, addr)
    from vllm.distributed.device_communicators import shm_broadcast as sb

    cls = sb.SpinCondition
    if is_reader and mode == "conflate":
        cond = cls.__new__(cls)
        cls._pd_vllm_init(cond, True, ctx, addr, 0)  # vLLM's own reader branch (CONFLATE), no spinning
        return cond
    return cls(is_reader=is_reader, context=ctx, notify_address=addr, busy_loop_s=0)


def _side(me: int, job: dict) -> None:
    mode, n, addrs, counters, ready, out = (job[k] for k in ("mode", "n", "addrs", "counters", "ready", "out"))
    os.environ["PD_SHM_NOTIFY_HWM"] = "1000"
    os.environ["PD_SHM_BUSY_LOOP_S"] = "0"
    os.environ["PD_SHM_NOTIFY_READER_HWM"] = "1000"
    import pd_shm_notify  # the vLLM venv has it (scripts/bootstrap.d/45-vllm-venv), as the hosts do
    import zmq

    pd_shm_notify.register()
    assert pd_shm_notify.applied["patched"], pd_shm_notify.applied["reason"]
    ctx = zmq.Context()
    writer = _condition(mode, False, ctx, addrs[me])
    ready.wait()  # both writers bound
    reader = _condition(mode, True, ctx, addrs[1 - me])
    time.sleep(0.5)  # the SUB connects and subscribes
    ready.wait()
    lost, waits, longest = 0, 0, 0.0
    peer = 1 - me
    for i in range(n):
        want = i + 1 if me == 1 else i  # side 0 starts each round trip, side 1 answers it
        while counters[peer] < want:
            t0 = time.monotonic()
            reader.wait(timeout_ms=RECHECK_MS)
            took = time.monotonic() - t0
            waits += 1
            longest = max(longest, took)
            if took >= RECHECK_MS / 1000 * 0.99 and counters[peer] >= want:
                lost += 1
        counters[me] = i + 1
        writer.notify()
    out.put({"side": me, "lost": lost, "waits": waits, "longest_wait_s": round(longest, 3)})


def run_once(mode: str, n: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="shm-wakeups-")
    addrs = [f"ipc://{tmp}/side0", f"ipc://{tmp}/side1"]
    ctx = mp.get_context("spawn")
    counters = ctx.Array("q", 2, lock=False)
    ready, out = ctx.Barrier(2), ctx.Queue()
    job = {"mode": mode, "n": n, "addrs": addrs, "counters": counters, "ready": ready, "out": out}
    procs = [ctx.Process(target=_side, args=(m, job)) for m in (0, 1)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    sides = sorted((out.get(timeout=n / 100 + 600) for _proc in procs), key=lambda s: s["side"])
    for p in procs:
        p.join(timeout=60)
    return {"mode": mode, "round_trips": n, "messages": 2 * n, "wall_s": round(time.monotonic() - t0, 1),
            "lost_wakeups": sum(s["lost"] for s in sides), "longest_wait_s": max(s["longest_wait_s"] for s in sides),
            "sides": sides}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--round-trips", type=int, default=200_000, help="round trips per run (2 messages each)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved")
    ap.add_argument("--modes", nargs="+", default=["conflate", "queued"],
                    choices=["conflate", "queued", "bare-conflate", "bare-queue"])
    a = ap.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("shm_wakeups: run it with the vLLM venv's python (.cache/vllm-venv/bin/python)", file=sys.stderr)
        return 2
    totals = {m: {"lost": 0, "messages": 0, "wall_s": 0.0, "longest_wait_s": 0.0} for m in a.modes}
    for _repeat in range(a.repeats):
        for mode in a.modes:
            r = run_once(mode, a.round_trips)
            print(json.dumps(r), flush=True)
            t = totals[mode]
            t["lost"] += r["lost_wakeups"]
            t["messages"] += r["messages"]
            t["wall_s"] += r["wall_s"]
            t["longest_wait_s"] = max(t["longest_wait_s"], r["longest_wait_s"])
    for mode, t in totals.items():
        print(json.dumps({"summary": mode, "messages": t["messages"], "lost_wakeups": t["lost"],
                          "lost_per_million": round(t["lost"] / t["messages"] * 1e6, 2),
                          "wall_s": round(t["wall_s"], 1), "longest_wait_s": t["longest_wait_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
