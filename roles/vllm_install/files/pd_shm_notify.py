"""vLLM general plugin (installed by roles/vllm_install): make the wake-up of vLLM's shared-memory queue reliable.

vLLM's engine core and its worker processes talk through a shared-memory ring buffer
(``vllm.distributed.device_communicators.shm_broadcast.MessageQueue``). A reader that read something in the
last second spins on the buffer (``SpinCondition.busy_loop_s = 1``, ``sched_yield`` in a loop); after that it
sleeps in ``zmq_poll`` until the writer's wake-up message arrives on a ZMQ PUB/SUB pair, or until a 5-second
re-check. The writer's PUB socket has ``SNDHWM = 1``, and with that libzmq (4.3.5, the pinned pyzmq's) drops
every other wake-up message even when they are hundreds of milliseconds apart (measured: 10 of 20 delivered;
with a high-water mark of 1000, 20 of 20). A sleeping reader whose wake-up was dropped waits for the 5-second
re-check. vLLM's CPU build always runs a separate worker process (the CPU platform forces the multiprocessing
executor), so every engine step crosses this queue, and on the embedded default (3 engines on 2 cores) that
gave P/D requests 1-30 s stalls, and the 1-second spinning after every message used the cores the other
engines needed.

Set in the engine environment (the inventory's pd_vllm_env, so a change restarts the instances through
vllm_serve):

- ``PD_SHM_NOTIFY_HWM``: the writer's PUB high-water mark. Applied before the socket binds (libzmq copies it
  into each connection when the reader connects; set later it has no effect). Wake-ups are one byte and the
  reader's SUB socket keeps only the last (``CONFLATE``), so a larger mark costs nothing.
- ``PD_SHM_BUSY_LOOP_S``: the readers' spin window in seconds (vLLM's default 1). With reliable wake-ups
  0 makes every wait a sleep in ``zmq_poll``.

Unset: the plugin changes nothing. The plugin patches only the vLLM it was written for: if
``SpinCondition.__init__`` no longer has the signature and the writer code it replaces, it logs a warning and
leaves vLLM as it is (``applied["patched"]`` stays False; roles/vllm_install's verify step checks it).
"""

import inspect
import logging
import os

ENV_HWM = "PD_SHM_NOTIFY_HWM"
ENV_BUSY = "PD_SHM_BUSY_LOOP_S"
# What the replaced writer branch of vLLM 0.32's SpinCondition.__init__ does; checked before patching.
_EXPECTED_PARAMS = ["self", "is_reader", "context", "notify_address", "busy_loop_s"]
_EXPECTED_WRITER_CODE = ("context.socket(PUB)", "setsockopt(zmq.SNDHWM, 1)", "bind(notify_address)")
_log = logging.getLogger("vllm.pd_shm_notify")
applied = {"patched": False, "hwm": None, "busy_loop_s": None, "writers": 0, "readers": 0, "reason": ""}


def _setting(name, kind, minimum):
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: must be a {kind.__name__} >= {minimum} (or unset)") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: must be a {kind.__name__} >= {minimum} (or unset)")
    return value


def settings():
    """(hwm, busy_loop_s) from the environment; None where unset. Bad values raise ValueError naming the variable."""
    return _setting(ENV_HWM, int, 1), _setting(ENV_BUSY, float, 0.0)


def _matches(cls):
    try:
        params = list(inspect.signature(cls.__init__).parameters)
        source = inspect.getsource(cls.__init__)
    except (TypeError, OSError) as exc:
        return f"cannot inspect SpinCondition.__init__: {exc}"
    if params != _EXPECTED_PARAMS:
        return f"SpinCondition.__init__ parameters are {params}, expected {_EXPECTED_PARAMS}"
    missing = [code for code in _EXPECTED_WRITER_CODE if code not in source]
    if missing:
        return f"SpinCondition.__init__ no longer contains {missing}"
    return ""


def register():
    """Entry point: patch SpinCondition once per process when either variable is set."""
    hwm, busy = settings()
    if hwm is None and busy is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    if getattr(cls, "_pd_shm_notify", False):
        return  # vLLM loads general plugins in several places of one process
    reason = _matches(cls)
    if reason:
        applied["reason"] = reason
        _log.warning("pd_shm_notify: not applied (%s); vLLM's shared-memory queue keeps its defaults", reason)
        return
    import zmq

    original = cls.__init__

    def __init__(self, is_reader, context, notify_address, busy_loop_s=1):
        if is_reader or hwm is None:
            if is_reader and busy is not None:
                busy_loop_s = busy
                applied["readers"] += 1
            original(self, is_reader, context, notify_address, busy_loop_s)
            return
        # vLLM's writer branch, with the high-water mark set before bind() so that the readers'
        # connections get it.
        self.is_reader = False
        self.local_notify_socket = context.socket(zmq.PUB)
        self.local_notify_socket.setsockopt(zmq.SNDHWM, hwm)
        self.local_notify_socket.bind(notify_address)
        self.last_read = 0
        self.busy_loop_s = 0
        self.read_cancel_socket = None
        self.write_cancel_socket = None
        self.poller = None
        applied["writers"] += 1

    cls.__init__ = __init__
    cls._pd_shm_notify = True
    applied.update(patched=True, hwm=hwm, busy_loop_s=busy)
    _log.info("pd_shm_notify: shared-memory queue wake-up high-water mark %s, reader busy loop %s s",
              hwm if hwm is not None else "vLLM's", busy if busy is not None else "vLLM's")
