"""vLLM general plugin (installed by roles/vllm_install): make the wake-up of vLLM's shared-memory queue reliable.

vLLM's engine core and its worker processes talk through a shared-memory ring buffer
(``vllm.distributed.device_communicators.shm_broadcast.MessageQueue``). A reader that read something in the
last second spins on the buffer (``SpinCondition.busy_loop_s = 1``, ``sched_yield`` in a loop); after that it
sleeps in ``zmq_poll`` until the writer's wake-up message arrives on a ZMQ PUB/SUB pair, or until a 5-second
re-check. vLLM's CPU build always runs a separate worker process (the CPU platform forces the multiprocessing
executor), so every engine step crosses this queue, and on the embedded default (3 engines on 2 cores) lost
wake-ups gave P/D requests 1-30 s stalls. Two causes, both in libzmq 4.3.5 (the pinned pyzmq's):

- The writer's PUB socket has ``SNDHWM = 1``, and with that libzmq drops every other wake-up message even when
  they are hundreds of milliseconds apart (measured: 10 of 20 delivered; with a high-water mark of 1000, 20 of 20).
- The reader's SUB socket has ``CONFLATE`` (keep only the last message). libzmq's conflating pipe
  (``ypipe_conflate_t``) tells the writer side whether the reader sleeps through a plain ``reader_awake`` flag
  that the I/O thread reads without synchronisation; when a wake-up lands while the reader is finding the pipe
  empty, no activation is sent and the message sits there unseen until the next one (``bench/shm_wakeups.py``,
  bare PUB/SUB in vLLM's round trip: 12 lost in 1.2 M messages with CONFLATE, none with a queue; with vLLM's own
  SpinCondition pairs too rare to show in 1.2 M). On the engines it was one 5-second stall every 1-3 minutes under
  load, and none in 17 minutes with queueing readers.

Set in the engine environment (the inventory's pd_vllm_env, so a change restarts the instances through
vllm_serve):

- ``PD_SHM_NOTIFY_HWM``: the writer's PUB high-water mark. Applied before the socket binds (libzmq copies it
  into each connection when the reader connects; set later it has no effect).
- ``PD_SHM_NOTIFY_READER_HWM``: each reader's SUB queues wake-ups up to this mark instead of conflating them
  (set before it connects); the reader empties the queue every time it wakes, before it looks at the buffer
  again, so a wake-up already acted on never wakes it twice. Wake-ups are one byte; beyond the mark they are
  dropped, harmless since the reader then has wake-ups waiting.
- ``PD_SHM_BUSY_LOOP_S``: the readers' spin window in seconds (vLLM's default 1). With reliable wake-ups
  0 makes every wait a sleep in ``zmq_poll``.

Unset: the plugin changes nothing. The plugin patches only the vLLM it was written for: if
``SpinCondition.__init__`` or ``SpinCondition.wait`` no longer have the signature and the code it replaces, it logs
a warning and leaves vLLM as it is (``applied["patched"]`` stays False; roles/vllm_install's verify step checks it).
"""

import inspect
import logging
import os
import time

ENV_HWM = "PD_SHM_NOTIFY_HWM"
ENV_BUSY = "PD_SHM_BUSY_LOOP_S"
ENV_READER_HWM = "PD_SHM_NOTIFY_READER_HWM"
# What the replaced code of vLLM 0.32's SpinCondition does; checked before patching.
_EXPECTED_PARAMS = ["self", "is_reader", "context", "notify_address", "busy_loop_s"]
_EXPECTED_INIT_CODE = ("context.socket(PUB)", "setsockopt(zmq.SNDHWM, 1)", "bind(notify_address)",
                       "context.socket(SUB)", "setsockopt(zmq.CONFLATE, 1)", "connect(notify_address)",
                       "get_open_zmq_inproc_path()", "self.poller.register(self.local_notify_socket, zmq.POLLIN)")
_EXPECTED_WAIT_PARAMS = ["self", "timeout_ms"]
_EXPECTED_WAIT_CODE = ("self.poller.poll(timeout=timeout_ms)", "self.local_notify_socket.recv(flags=zmq.NOBLOCK",
                       "sched_yield()")
_log = logging.getLogger("vllm.pd_shm_notify")
applied = {"patched": False, "hwm": None, "busy_loop_s": None, "reader_hwm": None, "writers": 0, "readers": 0,
           "queued_readers": 0, "reason": ""}


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
    """(hwm, busy_loop_s, reader_hwm) from the environment; None where unset. Bad values raise ValueError naming the
    variable."""
    return _setting(ENV_HWM, int, 1), _setting(ENV_BUSY, float, 0.0), _setting(ENV_READER_HWM, int, 1)


def _matches(cls):
    checks = (("__init__", _EXPECTED_PARAMS, _EXPECTED_INIT_CODE), ("wait", _EXPECTED_WAIT_PARAMS, _EXPECTED_WAIT_CODE))
    for attr, want_params, want_code in checks:
        name, func = f"SpinCondition.{attr}", getattr(cls, attr, None)
        if not callable(func):
            return f"{name} is missing"
        try:
            params = list(inspect.signature(func).parameters)
            source = inspect.getsource(func)
        except (TypeError, OSError) as exc:
            return f"cannot inspect {name}: {exc}"
        if params != want_params:
            return f"{name} parameters are {params}, expected {want_params}"
        missing = [code for code in want_code if code not in source]
        if missing:
            return f"{name} no longer contains {missing}"
    return ""


def register():
    """Entry point: patch SpinCondition once per process when any of the variables is set."""
    hwm, busy, reader_hwm = settings()
    if hwm is None and busy is None and reader_hwm is None:
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

    original_init, original_wait = cls.__init__, cls.wait

    def __init__(self, is_reader, context, notify_address, busy_loop_s=1):
        if is_reader and busy is not None:
            busy_loop_s = busy
        if (reader_hwm is None) if is_reader else (hwm is None):
            original_init(self, is_reader, context, notify_address, busy_loop_s)
            applied["readers" if is_reader else "writers"] += 1
            return
        if is_reader:
            # vLLM's reader branch with a queueing SUB (high-water mark reader_hwm) instead of CONFLATE, set
            # before connect(); wait() below empties it on every wake-up.
            self.is_reader = True
            self.last_read = time.monotonic()
            self.busy_loop_s = busy_loop_s
            self.local_notify_socket = context.socket(zmq.SUB)
            self.local_notify_socket.setsockopt(zmq.RCVHWM, reader_hwm)
            self.local_notify_socket.setsockopt_string(zmq.SUBSCRIBE, "")
            self.local_notify_socket.connect(notify_address)
            cancel_path = shm_broadcast.get_open_zmq_inproc_path()
            self.write_cancel_socket = context.socket(zmq.PAIR)
            self.write_cancel_socket.bind(cancel_path)
            self.read_cancel_socket = context.socket(zmq.PAIR)
            self.read_cancel_socket.connect(cancel_path)
            self.poller = zmq.Poller()
            self.poller.register(self.read_cancel_socket, zmq.POLLIN)
            self.poller.register(self.local_notify_socket, zmq.POLLIN)
            self._pd_queued = True
            applied["readers"] += 1
            applied["queued_readers"] += 1
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

    def wait(self, timeout_ms=None):
        if not getattr(self, "_pd_queued", False):
            original_wait(self, timeout_ms)
            return
        # vLLM's wait() for a queueing reader: every wake-up queued so far is taken, so the next poll sleeps
        # until a message written after the caller's next look at the buffer.
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            shm_broadcast.sched_yield()
            return
        events = dict(self.poller.poll(timeout=timeout_ms))
        if self.local_notify_socket in events:
            while True:
                try:
                    self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break

    cls.__init__ = __init__
    if reader_hwm is not None:  # only queueing readers need another wait(); vLLM's stays on its hot path otherwise
        cls.wait = wait
    cls._pd_shm_notify = True
    cls._pd_vllm_init = original_init  # vLLM's own reader, for bench/shm_wakeups.py
    applied.update(patched=True, hwm=hwm, busy_loop_s=busy, reader_hwm=reader_hwm)
    _log.info("pd_shm_notify: shared-memory queue wake-up high-water mark %s, readers %s, reader busy loop %s s",
              hwm if hwm is not None else "vLLM's",
              f"queue up to {reader_hwm}" if reader_hwm is not None else "conflate (vLLM's)",
              busy if busy is not None else "vLLM's")
