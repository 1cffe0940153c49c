"""An emulated CUDA device on a CPU-only machine, for device-discipline and host-sync tests.

    with FakeCuda() as fc:          # in the rank, after scaleout.init(); world.device = fc.device
        ...training code...
    fc.violations                   # collectives issued on host tensors (also raised at the call)
    fc.syncs                        # device -> host reads: (kind, "file:line") per read
    fc.h2d                          # host -> device copies from pageable (unpinned) memory, same

Why: on a GPU every collective tensor must live on ``world.device`` (an NCCL-only default group has
no CPU backend: "No backend type associated with device type cpu"), and every ``.item()`` /
``bool()`` / ``.cpu()`` of a device tensor stalls the host until the device catches up. On CPU both
mistakes are invisible: every tensor is on the CPU and reading one costs nothing. Only a GPU can
exist for real, so this emulates one (a mock, said so): every tensor physically stays on the CPU,
and a ``TorchFunctionMode`` keeps the *emulated* placement:

- a tensor is *on the host* when it was made without a device (``torch.zeros(2)``,
  ``torch.from_numpy``,
  ``torch.tensor([...])``), with ``device="cpu"``, by ``.cpu()`` / ``.to("cpu")``, or by an op whose
  tensor inputs are all on the host. Everything else is *on the device*: factories with
  ``device="cuda"`` / ``world.device``, ``.to(world.device)``, ops with a device input, and tensors
  the
  mode never saw (autograd gradients, parameters, tensors made in other threads);
- ``t.device`` answers ``cuda:0`` / ``cpu`` and ``t.is_cuda`` accordingly, so code that derives a
  device
  from a tensor (``device=x.device``) behaves as on a GPU, and CUDA-only branches run;
- an op mixing host and device tensors raises, as CUDA does (a 0-dim host tensor is allowed, as on
  CUDA);
  ``.numpy()`` of a device tensor raises, as on CUDA;
- every collective of every process group (patched on ``ProcessGroup``, so every thread and every
  saved
  reference to a ``torch.distributed`` function is covered) raises on a host tensor with NCCL's
  message,
  and torch's object collectives use the device as they do under NCCL; a group created with
  ``new_group(backend="gloo")`` under FakeCuda is a CPU group, as on a NCCL world (host tensors
  and host object collectives allowed): ``cpu_groups`` holds their names;
- ``tensor.record_stream(s)`` is recorded in ``recorded`` (shape, dtype, stream name), and tells
  the allocator model (below) that ``s`` uses the tensor's block;
- reads of device values on the host (``item``, ``tolist``, ``bool``/``float``/``int``, ``.cpu()``,
  boolean
  masks, ``nonzero``, ``torch.cuda.synchronize``) are recorded with their call site;
- host -> device copies from *pageable* memory are recorded with their call site (``fc.h2d``):
  ``torch.tensor(data, device=cuda)`` and ``as_tensor`` / ``new_tensor`` of Python values or a host
  tensor, ``.to(cuda)`` / ``.cuda()`` / ``copy_`` of an unpinned host tensor, a host index or value
  tensor in indexing a device tensor. On CUDA each is a synchronous staging copy (the driver may
  wait for the stream) instead of an asynchronous DMA. Pinned memory (``pin_memory=True``,
  ``.pin_memory()``; ``is_pinned()`` answers) is emulated as a mark: copies from it are not
  recorded.

Streams (the rules a GPU run lives by, which gloo on CPU does not have):

- every thread has its own *current stream*, starting at the device's default stream (the compute
  stream); ``torch.cuda.stream(s)`` sets it for the thread, ``torch.cuda.Stream()`` makes a side
  stream, ``torch.cuda.Event`` records a point of a stream, ``wait_event`` / ``wait_stream`` order
  one stream after another (nothing blocks the host); every op the mode sees is enqueued on its
  thread's current stream;
- a *synchronous* collective (``async_op=False``) runs on the issuing thread's current stream (torch
  >= 2.8, PyTorch #150398); an *asynchronous* one runs on its process group's internal stream, which
  first waits for the issuing thread's current stream (as ProcessGroupNCCL does), and its
  ``work.wait()`` makes the *caller's current stream* wait for it (not the host);
- ``launches`` lists every collective as (op, group, thread name, stream name, async); ``hazards``
  records what would be wrong on a GPU: a collective reading a tensor whose last writer was another
  stream it has not waited for, an op reading a collective's result on a stream that has not waited
  for it, and device collectives issued from more than one thread (NCCL matches a communicator's
  collectives by issue order; several threads enqueueing onto the device in a rank-dependent order
  can deadlock across communicators).

The caching allocator (its stream rule, which a CPU allocator does not have): a block belongs to the
stream that was current when it was allocated, and when its tensor dies the block is handed to that
stream's next allocation at once, whatever is still queued on other streams. So ``hazards`` also
records:

- a *cross-stream free*: a tensor that another stream used (an op or a collective on it) dies
  while its allocating stream has not waited for that use and no ``record_stream`` of the user
  stream was made (the next allocation on the allocating stream may overwrite what the other
  stream still reads or writes). Only tensors the mode saw allocated are tracked, and only frees
  while the context is open;
- an *engine write* (:meth:`FakeCuda.engine_write`: a writer that does not honour the stream it is
  given, as nvJPEG's hardware decoder, pytorch/vision#9606, meta-pytorch/torchcodec#1634) into a
  block handed out on a stream with work the host has not seen finish (the block may be one that
  queued kernels still read). A host synchronisation (``stream.synchronize()``,
  ``event.synchronize()``, ``torch.cuda.synchronize()``) marks what it waited for as finished;
  :meth:`FakeCuda.finished` answers whether a tensor's last write is.

CUDA graphs (``FakeCuda(world, graphs=True)``; the rules a capture lives by): ``torch.cuda.graph``
captures and ``torch.cuda.CUDAGraph.replay`` replays, as on a GPU, only the *device* work:

- during a capture every ATen op and collective the capturing thread dispatches is recorded (a
  ``TorchDispatchMode``), with its arguments as they are then: a Python number an op takes is
  frozen into the graph, exactly as a kernel argument is in a real capture;
- a host read of a device value (``item``, ``tolist``, ``bool``, ``.cpu()``, synchronize) or a copy
  from pageable host memory raises in the capturing thread, as ``cudaErrorStreamCaptureUnsupported``
  does (``capture_error_mode="thread_local"``: other threads are not checked);
- a real capture runs nothing: the ops run here (the host needs their shapes), but every device
  tensor they wrote is put back when the capture ends, so the capture leaves the device state as
  it found it (host writes stay: the host code of a capture runs for real);
- ``replay()`` runs the recorded device ops again in order, on the same tensors (fresh results
  copied into the capture's outputs, collectives issued and waited for), and no Python: host
  bookkeeping, hooks and callbacks ran once, at capture. A copy from a pinned host buffer reads
  it at replay, as a captured memcpy does. Host-only ops are not replayed;
- ``torch.cuda.is_current_stream_capturing()`` answers for the calling thread.

The mode is process-wide: threads started while the context is open (the comm thread among them)
run under it too, and the comm-thread and comm-stream registries of scaleout.comm.handles start
empty for the context, so a rank's communication path runs under the emulation. Threads started
before the context are not covered. Ops inside a torch function's own implementation are not seen,
only the call.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from scaleout.comm import handles

DEVICE = torch.device("cuda", 0)
HOST = torch.device("cpu")
_MARK = "_fakecuda_host"
_PINNED = "_fakecuda_pinned"
# Names of the gloo groups made under FakeCuda in this process: CPU groups in every later context
# too (a pooled rank keeps its World, and the World its groups, from one test to the next).
_CPU_GROUPS: set[str] = set()
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tensor methods that read a device value on the host (each one a stream synchronisation on CUDA).
_READS = {
    "item",
    "tolist",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "__format__",
    "__repr__",
    "equal",
    "allclose",
    "is_nonzero",
}
# Ops whose output size depends on values: CUDA computes it on the device and the host waits for it.
_VALUE_SHAPED = {
    "nonzero",
    "masked_select",
    "unique",
    "unique_consecutive",
    "argwhere",
    "nonzero_static",
}
# Factories that only take a block from the allocator (no kernel: nothing enqueued or written).
_ALLOCATE_ONLY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
# Ops where host and device tensors may meet without an error on CUDA.
_MIX_OK = {
    "copy_",
    "to",
    "__getitem__",
    "__setitem__",
    "index_put_",
    "set_",
    "backward",
    "cpu",
    "cuda",
    "__get__",
    "__set__",
    "type",
}
# ProcessGroup methods that move tensors (every torch.distributed collective ends in one of them).
_COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "_allgather_base",
    "all_gather_single",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "_reduce_scatter_base",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "recv_anysource",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
)


class FakeStream:
    """An emulated CUDA stream: a count of the ops enqueued on it (``pos``) and, for every other
    stream, up to which of its ops this one has waited (``seen``)."""

    def __init__(self, name: str):
        self.name = name
        self.device = DEVICE
        self.pos = 0
        self.seen: dict[FakeStream, int] = {}

    def covers(self, other: FakeStream, pos: int) -> bool:
        """Op ``pos`` of ``other`` is ordered before everything enqueued on this stream from now."""
        return other is self or self.seen.get(other, 0) >= pos

    def _join(self, other: FakeStream, pos: int, seen: dict[FakeStream, int]) -> None:
        for s, p in [*seen.items(), (other, pos)]:
            if s is not self and self.seen.get(s, 0) < p:
                self.seen[s] = p

    def wait_stream(self, other: FakeStream) -> None:
        self._join(other, other.pos, dict(other.seen))

    def wait_event(self, event: FakeEvent) -> None:
        if event.stream is not None:
            self._join(event.stream, event.pos, event.seen)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _ACTIVE[0].syncs.append(("stream synchronize", call_site()))
        _ACTIVE[0]._publish(self, self.pos)  # the host waited: all of it has run

    def __repr__(self) -> str:
        return f"<fake stream {self.name}>"


class FakeEvent:
    """An emulated ``torch.cuda.Event``: the point of a stream it was recorded at."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.stream: FakeStream | None = None
        self.pos = 0
        self.seen: dict[FakeStream, int] = {}

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or _ACTIVE[0].current_stream()
        self.stream, self.pos, self.seen = stream, stream.pos, dict(stream.seen)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or _ACTIVE[0].current_stream()).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _ACTIVE[0].syncs.append(("event synchronize", call_site()))
        if self.stream is not None:
            _ACTIVE[0]._publish(self.stream, self.pos)

    def elapsed_time(self, other: FakeEvent) -> float:
        return 0.0


class _StreamContext:
    def __init__(self, owner: FakeCuda, stream: FakeStream | None):
        self.owner, self.stream = owner, stream

    def __enter__(self) -> FakeStream | None:
        self.prev = self.owner.current_stream()
        if self.stream is not None:
            self.owner._local.stream = self.stream
        return self.stream

    def __exit__(self, *exc: object) -> None:
        self.owner._local.stream = self.prev


class FakeWork:
    """A process group's work as the emulated device sees it: ``wait()`` makes the caller's
    current stream wait for the collective's stream (NCCL's ``work.wait()``), then waits on the
    host for the real (gloo) work, which has to finish for its data to exist on CPU."""

    def __init__(self, work: Any, owner: FakeCuda, stream: FakeStream, pos: int):
        self._work, self._owner, self._stream, self._pos = work, owner, stream, pos

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._owner.current_stream()._join(self._stream, self._pos, {})
        local = self._owner._local
        local.in_wait = True  # what the backend runs here belongs to the collective (_Recorder)
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            local.in_wait = False

    def get_future(self) -> Any:
        fut = self._work.get_future()
        # A CUDA future makes whoever waits on it wait for the collective's stream; not emulated
        # per waiter: the result counts as visible to every stream once the future completes.
        fut.add_done_callback(lambda _f: self._owner._publish(self._stream, self._pos))
        return fut

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Block:
    """A block of the caching allocator model: the stream it was allocated on and how many ops that
    stream held then (``pos``), the last use of it by every other stream, the streams
    ``record_stream`` named, what it was made as (for the message)."""

    __slots__ = ("stream", "pos", "ref", "uses", "recorded", "watched", "what")

    def __init__(self, storage: Any, stream: FakeStream, pos: int, what: str):
        self.stream, self.pos, self.ref, self.what = stream, pos, weakref.ref(storage), what
        self.uses: dict[FakeStream, tuple[int, str]] = {}
        self.recorded: set[FakeStream] = set()
        self.watched = False


# The FakeCuda context that is open (process-wide), if any.
_ACTIVE: list[FakeCuda] = []


def _storage(t: torch.Tensor) -> Any:
    """The tensor's storage (one Python object per storage while it lives), None without one."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested)
        return None


def on_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


def pinned(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _PINNED, False)


def _pin(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _MARK, True)
    setattr(t, _PINNED, True)
    return t


# Factories that copy their data argument to the device they are given.
_FROM_DATA = {"tensor", "as_tensor", "asarray", "new_tensor"}
# Tensor methods where a host tensor argument is copied to the device of a device ``self``.
_H2D_ARGS = {"copy_", "__setitem__", "index_put_", "__getitem__"}


def _mark(out: Any, host: bool) -> Any:
    if host:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                setattr(t, _MARK, True)
    return out


def _emulated(dev: Any) -> torch.device | None:
    """The emulated device a ``device=`` / ``.to()`` argument names (None: not a device)."""
    if isinstance(dev, int) and not isinstance(dev, bool):
        return DEVICE
    if isinstance(dev, str | torch.device):
        d = torch.device(dev)
        return DEVICE if d.type == "cuda" else HOST if d.type == "cpu" else d
    return None


def _physical(x: Any) -> Any:
    return HOST if _emulated(x) == DEVICE else x


def call_site() -> str:
    """The innermost frame in this repository outside this file: where a read or a collective
    came from."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if frame.filename.startswith(_ROOT) and not frame.filename.endswith("fakecuda.py"):
            return f"{os.path.relpath(frame.filename, _ROOT)}:{frame.lineno}"
    return "?"


class _Mode(TorchFunctionMode):
    def __init__(self, owner: FakeCuda):
        super().__init__()
        self.owner = owner

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if not self.owner.active:  # a thread that outlived its FakeCuda context
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "__get__":  # property reads: answer device / is_cuda as a GPU would
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop in ("device", "is_cuda", "is_cpu") and isinstance(args[0], torch.Tensor):
                host = on_host(args[0])
                return {"device": HOST if host else DEVICE, "is_cuda": not host, "is_cpu": host}[
                    prop
                ]
            return func(*args, **kwargs)
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is not None and not on_host(src):
            self._check_read(name, src, args)
        if name in ("to", "cpu", "cuda"):
            return self._move(func, name, args, kwargs)
        if func is torch.Tensor.backward:
            return self._backward(args[0], **kwargs)
        if name == "is_pinned" and src is not None:
            return pinned(src)
        if name == "pin_memory" and src is not None:  # a CPU-only torch cannot pin: emulated
            return _pin(src.clone())
        pin = bool(kwargs.pop("pin_memory", False))
        target = _emulated(kwargs["device"]) if "device" in kwargs else None
        self._check_h2d(name, src, args, target)
        if "device" in kwargs:
            kwargs["device"] = _physical(kwargs["device"])
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        hosts = [t for t in tensors if on_host(t)]
        devs = len(hosts) < len(tensors)
        if (
            devs
            and name not in _MIX_OK
            and not name.startswith("_foreach")
            and any(h.dim() > 0 for h in hosts)
        ):
            raise RuntimeError(
                f"fakecuda: {name} mixes host and device tensors (an error on CUDA) at "
                f"{call_site()}"
            )
        out = func(*args, **kwargs)
        if (
            target is not None
            and any(out is t for t in tensors)
            and on_host(out) != (target == HOST)
        ):
            out = out.clone()  # e.g. torch.as_tensor(t, device=...) returned its input
        if target is not None:
            host = target == HOST
        else:
            host = not devs  # no device input (factories, host-only ops) -> on the host
        inplace = name.endswith("_") and not name.endswith("__") and src is not None
        if not getattr(func, "__module__", "").startswith("torch.distributed"):
            # (collectives are enqueued by the process-group patch, on their own stream)
            writes = inplace or (name == "__setitem__" and src is not None)
            self.owner._enqueue(name, tensors, src if writes else out, writes)
        if inplace:
            return out  # in place: the tensor keeps its placement
        if pin and host:
            return _pin(out)
        return _mark(out, host)

    def _check_h2d(
        self, name: str, src: torch.Tensor | None, args: tuple, target: torch.device | None
    ) -> None:
        """Record a host -> device copy from pageable memory (module docstring)."""
        if name in _FROM_DATA:
            data = args[1] if name == "new_tensor" else (args[0] if args else None)
            to_device = (
                target == DEVICE
                if target is not None
                else (name == "new_tensor" and src is not None and not on_host(src))
            )
            if to_device and not (isinstance(data, torch.Tensor) and not on_host(data)):
                if not pinned(data):
                    self.owner.h2d.append((name, call_site()))
            return
        if name in _H2D_ARGS and src is not None and not on_host(src):
            for t in tree_flatten(args[1:])[0]:
                if on_host(t) and not pinned(t) and (t.dim() > 0 or name == "copy_"):
                    self.owner.h2d.append((name, call_site()))
                    return

    def _backward(
        self,
        loss: torch.Tensor,
        gradient: Any = None,
        retain_graph: Any = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        """Run the autograd engine with the mode on: gradient hooks and engine callbacks (the
        reducer's collectives) are training code too. Tensor.backward would dispatch back here,
        so the engine is called the way torch.autograd.backward calls it (torch 2.13)."""
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        tensors = (loss,)
        grads = _make_grads(
            tensors, _tensor_or_tensors_to_tuple(gradient, 1), is_grads_batched=False
        )
        with self:
            _engine_run_backward(
                tensors,
                grads,
                create_graph if retain_graph is None else retain_graph,
                create_graph,
                tuple(inputs or ()),
                allow_unreachable=True,
                accumulate_grad=True,
            )

    def _check_read(self, name: str, src: torch.Tensor, args: tuple) -> None:
        if name in ("numpy", "__array__"):
            raise TypeError(
                f"fakecuda: can't convert cuda:0 device type tensor to numpy at {call_site()}"
            )
        bool_index = name in ("__getitem__", "__setitem__") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in tree_flatten(args[1:2])[0]
        )
        if name in _READS or name in _VALUE_SHAPED or bool_index:
            self.owner.syncs.append((name, call_site()))

    def _move(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        src, out = args[0], args[0]
        if name == "cpu":
            target = HOST
        elif name == "cuda":
            target = DEVICE
        else:
            spec = kwargs.get("device", args[1] if len(args) > 1 else None)
            target = (
                (HOST if on_host(spec) else DEVICE)
                if isinstance(spec, torch.Tensor)
                else _emulated(spec)
            )
            if "device" in kwargs:
                kwargs["device"] = _physical(kwargs["device"])
            out = func(*(_physical(a) for a in args), **kwargs)
        here = HOST if on_host(src) else DEVICE
        if target is None or target == here:
            if out is not src and here == DEVICE:  # a conversion on the device: a kernel
                self.owner._enqueue(name, [src], out, False)
            return out if out is src else _mark(out, here == HOST)
        if target == HOST:
            self.owner.syncs.append(("to host", call_site()))
        elif not pinned(src):
            self.owner.h2d.append((name, call_site()))
        if out is src:
            out = src.clone()
        if target == DEVICE:  # the copy is written on the current stream
            self.owner._enqueue(name, [src], out, False)
        return _mark(out, target == HOST)


class FakeCuda:
    """Context manager: the emulated device (module docstring). ``device`` is what world.device
    becomes."""

    device = DEVICE

    def __init__(self, world: Any = None, graphs: bool = False):
        self.world = world
        self.graphs = graphs
        self.capturing: int | None = None  # the thread capturing a CUDA graph (graphs=True)
        self.captures = 0
        self.replays = 0
        self.violations: list[str] = []
        self.syncs: list[tuple[str, str]] = _HostLog(self, "a host read of a device value")
        # (op, group, issuing thread, stream it ran on, async) per collective, in issue order
        self.launches: list[tuple[str, str, str, str, bool]] = []
        self.hazards: list[str] = []  # what would race or hang on a GPU (module docstring)
        self.default = FakeStream("default")
        self.active = False
        self._local = threading.local()
        self._internal: dict[str, FakeStream] = {}  # a process group's own stream (async ops)
        # storage address -> (stream, op, the storage) of its last write; an entry whose storage
        # died is stale (the caching allocator never hands a freed block to another stream)
        self._writers: dict[int, tuple[FakeStream, int, Any]] = {}
        self._published: dict[FakeStream, int] = {}
        self._threads: list[str] = []  # threads that issued device collectives
        self._streams = 0
        # host -> device copies from pageable memory
        self.h2d: list[tuple[str, str]] = _HostLog(self, "a copy from pageable host memory")
        # tensor.record_stream(s) calls: (shape, dtype, stream name) of the tensor a stream uses
        self.recorded: list[tuple[tuple[int, ...], torch.dtype, str]] = []
        self.cpu_groups = _CPU_GROUPS  # names of the gloo groups made under FakeCuda
        self._undo: list[tuple[Any, str, Any]] = []
        # the caching allocator model (module docstring): storage address -> its live block
        self._blocks: dict[int, _Block] = {}
        self._all_streams: list[FakeStream] = [self.default]

    # -- streams ----------------------------------------------------------------------------------
    def current_stream(self, device: Any = None) -> FakeStream:
        return getattr(self._local, "stream", None) or self.default

    def new_stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> FakeStream:
        self._streams += 1
        stream = FakeStream(f"side{self._streams}")
        self._all_streams.append(stream)
        return stream

    # -- the caching allocator model --------------------------------------------------------------
    def _ordered(self, stream: FakeStream, other: FakeStream, pos: int) -> bool:
        """Op ``pos`` of ``other`` is done before what ``stream`` runs from now (a stream wait or a
        host synchronisation)."""
        return stream.covers(other, pos) or self._published.get(other, 0) >= pos

    def _block(self, storage: Any) -> _Block | None:
        block = None if storage is None else self._blocks.get(storage.data_ptr())
        return block if block is not None and block.ref() is storage else None

    def _allocated(self, t: torch.Tensor, stream: FakeStream, pos: int) -> None:
        storage = _storage(t)
        if storage is not None and storage.nbytes():  # (empty storages share address 0)
            what = f"{tuple(t.shape)} {t.dtype}"
            self._blocks[storage.data_ptr()] = _Block(storage, stream, pos, what)

    def _used(self, storage: Any, stream: FakeStream, site: str | None = None) -> None:
        block = self._block(storage)
        if block is None or stream is block.stream:
            return
        block.uses[stream] = (stream.pos, site or call_site())
        if not block.watched:  # the free is checked only for blocks another stream used
            block.watched = True
            weakref.finalize(storage, self._freed, block)

    def _freed(self, block: _Block) -> None:
        if not self.active:
            return
        for user, (pos, site) in block.uses.items():
            safe = self._ordered(block.stream, user, pos) or any(
                r is user or self._ordered(r, user, pos) for r in block.recorded
            )
            if not safe:
                self._hazard(
                    f"cross-stream free: a {block.what} tensor allocated on stream "
                    f"{block.stream.name} died while stream {user.name} may still use it (last "
                    f"use at {site}; no wait for it, no record_stream({user.name})): the allocator "
                    f"hands its block to the next allocation on {block.stream.name}, at "
                    f"{call_site()}"
                )

    def _record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        self.recorded.append((tuple(t.shape), t.dtype, stream.name))
        block = self._block(_storage(t))
        if block is not None:
            block.recorded.add(stream)

    def engine_write(self, t: torch.Tensor, what: str = "an engine") -> None:
        """``t`` (allocated under the mode) is written by a writer that ignores stream order (module
        docstring): a hazard unless the host saw its allocating stream's earlier work finish. The
        write then counts as done on the current stream (the engine's caller synchronises it)."""
        block = self._block(_storage(t))
        if block is not None and self._published.get(block.stream, 0) < block.pos:
            self._hazard(
                f"{what} writes a {block.what} block handed out on stream {block.stream.name} "
                f"while {block.pos - self._published.get(block.stream, 0)} op(s) queued there "
                f"before it were not seen finished (queued kernels may still read that memory), "
                f"at {call_site()}"
            )
        self._wrote(_storage(t), self.current_stream())

    def finished(self, t: torch.Tensor) -> bool:
        """Whether the host has seen the last write of ``t`` finish (a synchronisation after it):
        only then is it safe to keep for readers on any stream, at any later time."""
        w = self._writer(_storage(t))
        return w is None or self._published.get(w[0], 0) >= w[1]

    def _hazard(self, msg: str) -> None:
        if msg not in self.hazards:
            self.hazards.append(msg)

    def _visible(self, stream: FakeStream, writer: tuple[FakeStream, int]) -> bool:
        w, pos = writer
        return stream.covers(w, pos) or self._published.get(w, 0) >= pos

    def _writer(self, storage: Any) -> tuple[FakeStream, int] | None:
        entry = None if storage is None else self._writers.get(storage.data_ptr())
        if entry is None or entry[2]() is not storage:
            return None
        return entry[0], entry[1]

    def _wrote(self, storage: Any, stream: FakeStream) -> None:
        if storage is not None:
            self._writers[storage.data_ptr()] = (stream, stream.pos, weakref.ref(storage))

    def _publish(self, stream: FakeStream, pos: int) -> None:
        self._published[stream] = max(self._published.get(stream, 0), pos)

    def _enqueue(self, name: str, inputs: list[torch.Tensor], written: Any, inplace: bool) -> None:
        """An op of the mode: check its device inputs' last writers, enqueue it on the thread's
        current stream, record what it wrote. Metadata reads (``numel``, ``size``) and views (an
        output aliasing an input) touch no data: not checked, not writes."""
        outs = [t for t in tree_flatten(written)[0] if isinstance(t, torch.Tensor)]
        if not outs and name not in _READS and name not in _VALUE_SHAPED:
            return  # metadata
        keys = {id(_storage(t)) for t in inputs if not on_host(t)}
        if not inplace and outs and all(id(_storage(t)) in keys for t in outs):
            return  # a view
        stream = self.current_stream()
        if name in _ALLOCATE_ONLY and not inplace:  # a block handed out, no device work queued
            for t in outs:
                if not on_host(t):
                    self._allocated(t, stream, stream.pos)
            return
        for t in inputs:
            w = None if on_host(t) else self._writer(_storage(t))
            if w is not None and not self._visible(stream, w):
                self._hazard(
                    f"{name} on stream {stream.name} reads a tensor written on stream "
                    f"{w[0].name} without waiting for it, at {call_site()}"
                )
        before = stream.pos
        stream.pos += 1
        for t in inputs:
            if not on_host(t):
                self._used(_storage(t), stream)
        for t in outs:
            if not on_host(t):
                if not inplace and id(_storage(t)) not in keys:
                    self._allocated(t, stream, before)  # a new tensor: its block is this stream's
                else:
                    self._used(_storage(t), stream)
                self._wrote(_storage(t), stream)

    def _launch(self, pg: Any, op: str, args: tuple, kwargs: dict) -> tuple[FakeStream, int]:
        """A device collective: the stream it runs on (sync: the thread's current stream; async:
        the group's own, after it waited for the current one), its data dependencies, the
        issuing thread."""
        opts = next((a for a in args if hasattr(a, "asyncOp")), None)
        is_async = bool(opts.asyncOp) if opts is not None else op in ("send", "recv")
        try:
            group = str(pg.group_name)
        except Exception:  # noqa: BLE001 -- a group without a name
            group = hex(id(pg))
        issuer = self.current_stream()
        if is_async:
            stream = self._internal.get(group)
            if stream is None:
                stream = self._internal[group] = FakeStream(f"nccl:{group}")
                self._all_streams.append(stream)
            stream.wait_stream(issuer)
        else:
            stream = issuer
        with torch._C.DisableTorchFunction():
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            storages = [_storage(t) for t in tensors]
        site = call_site()
        for storage in storages:
            w = self._writer(storage)
            if w is not None and not self._visible(stream, w):
                self._hazard(
                    f"{op} on stream {stream.name} reads a tensor written on stream {w[0].name} "
                    f"without waiting for it, at {site}"
                )
        stream.pos += 1
        for storage in storages:  # in-place collectives: every tensor argument may be written
            self._wrote(storage, stream)
            self._used(storage, stream, site)
        thread = threading.current_thread().name
        if thread not in self._threads:
            self._threads.append(thread)
            if len(self._threads) > 1:
                self._hazard(
                    f"device collectives issued from threads {self._threads} (NCCL matches a "
                    "communicator's collectives by issue order; threads enqueueing onto one device "
                    f"in a rank-dependent order deadlock across communicators), at {site}"
                )
        self.launches.append((op, group, thread, stream.name, is_async))
        return stream, stream.pos

    def _patch(self, obj: Any, attr: str, value: Any) -> None:
        # A class's own entry, not getattr's: getattr(ProcessGroup, "allgather") unwraps pybind's
        # instance method into a plain builtin that no longer binds self once set back.
        own = isinstance(obj, type) and attr in vars(obj)
        self._undo.append((obj, attr, vars(obj)[attr] if own else getattr(obj, attr)))
        setattr(obj, attr, value)

    def _guard(self, orig: Any) -> Any:
        def collective(pg: Any, *args: Any, **kwargs: Any) -> Any:
            if self.is_cpu_group(pg):
                return orig(pg, *args, **kwargs)
            bad = [t for t in tree_flatten((args, kwargs))[0] if on_host(t)]
            if bad:
                msg = (
                    f"No backend type associated with device type cpu (fakecuda: {orig.__name__} "
                    "of a host "
                    f"tensor {tuple(bad[0].shape)} {bad[0].dtype} at {call_site()})"
                )
                self.violations.append(msg)
                raise RuntimeError(msg)
            if not self.active:
                return orig(pg, *args, **kwargs)
            stream, pos = self._launch(pg, orig.__name__, args, kwargs)
            work = orig(pg, *args, **kwargs)
            return None if work is None else FakeWork(work, self, stream, pos)

        return collective

    @contextlib.contextmanager
    def _capture(
        self,
        graph: _ReplayGraph,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
    ) -> Iterator[None]:
        """``torch.cuda.graph`` (graphs=True): record the device work (module docstring)."""
        if self.capturing is not None:
            raise RuntimeError("fakecuda: a CUDA-graph capture is already under way")
        side = stream or self.new_stream()
        side.wait_stream(self.current_stream())
        recorder = _Recorder(self)
        self.captures += 1
        with _StreamContext(self, side):
            self.capturing = threading.get_ident()
            try:
                with recorder:
                    yield
            finally:
                self.capturing = None
                recorder.restore()
        graph.ops = recorder.ops

    def is_cpu_group(self, group: Any) -> bool:
        """Whether ``group`` (None: the default group) is a gloo group made in the context."""
        return group is not None and getattr(group, "group_name", None) in self.cpu_groups

    def __enter__(self) -> FakeCuda:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        from torch._C._distributed_c10d import ProcessGroup

        for name in _COLLECTIVES:
            if hasattr(ProcessGroup, name):
                self._patch(ProcessGroup, name, self._guard(getattr(ProcessGroup, name)))
        new_group = dist.new_group

        def made(*args: Any, **kwargs: Any) -> Any:
            group = new_group(*args, **kwargs)
            if str(kwargs.get("backend") or "").lower() == "gloo" and group is not None:
                self.cpu_groups.add(group.group_name)
            return group

        self._patch(dist, "new_group", made)
        # object collectives run on the device (as under NCCL), except on the CPU groups
        self._patch(
            c10d,
            "_get_object_coll_device",
            lambda group=None: "cpu" if self.is_cpu_group(group) else "cuda",
        )

        def synchronize(device: Any = None) -> None:
            self.syncs.append(("synchronize", call_site()))
            for stream in self._all_streams:  # the host waited for every stream
                self._publish(stream, stream.pos)

        self._patch(torch.cuda, "synchronize", synchronize)
        # torch.from_numpy bypasses torch-function modes: mark its tensors as host tensors here
        from_numpy = torch.from_numpy
        self._patch(torch, "from_numpy", lambda a: _mark(from_numpy(a), True))
        # what the run asks about its device (MLPerf platform, the report's peak): an unknown part,
        # no SMs
        props = SimpleNamespace(
            name="fakecuda (CPU)", multi_processor_count=0, total_memory=0, major=0, minor=0
        )
        self._patch(torch.cuda, "get_device_properties", lambda device=None: props)
        self._patch(torch.cuda, "get_device_name", lambda device=None: props.name)
        if self.world is not None:
            self._patch(self.world, "device", DEVICE)
        # streams and events (module docstring)
        self._patch(torch.cuda, "Stream", self.new_stream)
        self._patch(torch.cuda, "Event", FakeEvent)
        self._patch(torch.cuda, "current_stream", self.current_stream)
        self._patch(torch.cuda, "default_stream", lambda device=None: self.default)
        self._patch(torch.cuda, "stream", lambda stream: _StreamContext(self, stream))
        # the caching allocator's note that a stream uses a tensor (torch's argument parser rejects
        # a fake stream before any torch-function mode sees the call): recorded
        self._patch(torch.Tensor, "record_stream", lambda t, s: self._record_stream(t, s))
        # process-wide: threads started from now on run under the mode too; the comm thread and
        # the comm streams of this context are its own
        boot = threading.Thread._bootstrap_inner
        owner = self

        def bootstrap(thread: threading.Thread) -> None:
            if not owner.active:
                return boot(thread)
            with _Mode(owner):
                return boot(thread)

        self._patch(threading.Thread, "_bootstrap_inner", bootstrap)
        if self.graphs:
            self._patch(torch.cuda, "CUDAGraph", lambda *a, **k: _ReplayGraph(self))
            self._patch(torch.cuda, "graph", self._capture)
            self._patch(
                torch.cuda,
                "is_current_stream_capturing",
                lambda: self.capturing == threading.get_ident(),
            )
        self._patch(handles, "_THREADS", weakref.WeakKeyDictionary())
        if hasattr(handles, "_COMM_STREAMS"):  # (absent before the comm stream existed)
            self._patch(handles, "_COMM_STREAMS", {})
        self._comm_threads = handles._THREADS
        _ACTIVE.insert(0, self)
        self.active = True
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        for thread in list(self._comm_threads.values()):
            thread.shutdown(30.0)
        self.active = False
        _ACTIVE.remove(self)
        for obj, attr, value in reversed(self._undo):
            setattr(obj, attr, value)
        self._undo.clear()


class _FakeStream:
    """A stand-in for ``torch.cuda.Stream``: an identity, ordering calls are no-ops."""

    def __init__(self, device: Any = None, name: str = "side"):
        self.name = name

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<fake stream {self.name}>"


class _FakeGraph:
    """A stand-in for ``torch.cuda.CUDAGraph``: counts replays (nothing was recorded to replay)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class FakeGraphs:
    """Mock of torch.cuda's stream and graph API (no GPU can exist here): records how a step is
    captured, not what a GPU would do with it.

        with FakeGraphs() as fg:
            graphs = StepGraphs(step_fn, "cuda")   # torch.cuda.is_available() answers True
            ...
        fg.captures        # one dict per torch.cuda.graph(...): its keyword arguments (torch's
                           # defaults filled in, e.g. capture_error_mode="global"), the thread
        fg.current         # the current stream (fg.default until torch.cuda.stream(s) changes it)
        fg.capturing       # True inside a capture

    The body of a capture runs for real on the CPU (the ops a GPU would record), so step code can
    check on which stream, in which mode and after how many warm-ups it ran."""

    def __init__(self) -> None:
        self.default = _FakeStream(name="default")
        self.current: Any = self.default
        self.capturing = False
        self.captures: list[dict[str, Any]] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def _patch(self, obj: Any, attr: str, value: Any) -> None:
        self._undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    @contextlib.contextmanager
    def _stream(self, s: Any) -> Iterator[None]:
        before, self.current = self.current, s if s is not None else self.current
        try:
            yield
        finally:
            self.current = before

    @contextlib.contextmanager
    def _graph(
        self,
        graph: Any,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",  # torch 2.13's default (torch/cuda/graphs.py)
    ) -> Iterator[None]:
        self.captures.append(
            {
                "graph": graph,
                "pool": pool,
                "stream": stream,
                "capture_error_mode": capture_error_mode,
                "thread": threading.get_ident(),
            }
        )
        before = self.current
        self.current, self.capturing = _FakeStream(name="capture"), True
        try:
            yield
        finally:
            self.current, self.capturing = before, False

    def __enter__(self) -> FakeGraphs:
        cuda = torch.cuda
        self._patch(cuda, "is_available", lambda: True)
        self._patch(cuda, "current_device", lambda: 0)
        self._patch(cuda, "Stream", _FakeStream)
        self._patch(cuda, "stream", self._stream)
        self._patch(cuda, "current_stream", lambda device=None: self.current)
        self._patch(cuda, "synchronize", lambda device=None: None)
        self._patch(cuda, "CUDAGraph", _FakeGraph)
        self._patch(cuda, "graph", self._graph)
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, attr, value in reversed(self._undo):
            setattr(obj, attr, value)
        self._undo.clear()


class _HostLog(list):
    """``FakeCuda.syncs`` / ``h2d``: a list that raises on an entry made by the capturing thread
    (module docstring, CUDA graphs)."""

    def __init__(self, owner: FakeCuda, what: str):
        super().__init__()
        self.owner, self.what = owner, what

    def append(self, item: Any) -> None:
        super().append(item)
        if self.owner.capturing is not None and self.owner.capturing == threading.get_ident():
            raise RuntimeError(
                f"fakecuda: {self.what} ({item[0]} at {item[1]}) while a CUDA graph is being "
                "captured: operation not permitted when stream is capturing "
                "(cudaErrorStreamCaptureUnsupported)"
            )


def _is_work(x: Any) -> bool:
    return hasattr(x, "wait") and not isinstance(x, torch.Tensor)


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes: its ``(a!)`` arguments; a collective (no such annotation),
    every tensor it takes."""
    if func.namespace == "c10d":
        return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        out += [t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]
    return out


class _Recorder(TorchDispatchMode):
    """The ops of one capture (FakeCuda graphs=True): (op, args, kwargs, outputs) in order, and
    what each write overwrote, to put back when the capture ends."""

    def __init__(self, owner: FakeCuda):
        super().__init__()
        self.owner = owner
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            threading.get_ident() != self.owner.capturing
            or getattr(self.owner._local, "in_wait", False)
            or func.namespace == "profiler"
        ):
            # not the capture's: a collective's own copies (gloo's reduce-scatter copies its
            # slice out in wait() or a worker thread; a replay of the collective runs them
            # again), or host-side profiler bookkeeping
            with torch._C.DisableTorchFunction():
                return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default and not on_host(args[0]):
            # a 0-d device tensor where a Python number is taken (an op's Scalar overload):
            # the argument parser reads it on the host, below the mode above
            self.owner.syncs.append(("a 0-d device tensor read as a number", call_site()))
        with torch._C.DisableTorchFunction():
            self._saved += [
                (t, t.detach().clone()) for t in _written(func, args, kwargs) if not on_host(t)
            ]
            out = func(*args, **kwargs)  # (the mode above saw this call already)
        self.ops.append((func, args, kwargs, out))
        return out

    def restore(self) -> None:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for t, before in reversed(self._saved):
                t.copy_(before)
        self._saved.clear()


def _host_only(args: tuple, kwargs: dict, out: Any) -> bool:
    tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(on_host(t) for t in tensors)


class _ReplayGraph:
    """``torch.cuda.CUDAGraph`` (FakeCuda graphs=True): ``replay()`` runs the captured device ops
    again (module docstring)."""

    def __init__(self, owner: FakeCuda):
        self.owner = owner
        self.ops: list[tuple[Any, tuple, dict, Any]] | None = None
        self.replays = 0

    def replay(self) -> None:
        if self.ops is None:
            raise RuntimeError("fakecuda: replay() of a graph that was never captured")
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for func, args, kwargs, out in self.ops:
                if _host_only(args, kwargs, out):
                    continue
                new = func(*args, **kwargs)
                olds, news = tree_flatten(out)[0], tree_flatten(new)[0]
                for old, fresh in zip(olds, news, strict=True):
                    if _is_work(fresh):
                        fresh.wait()
                    elif (
                        isinstance(old, torch.Tensor)
                        and isinstance(fresh, torch.Tensor)
                        and old.untyped_storage().data_ptr() != fresh.untyped_storage().data_ptr()
                    ):
                        old.copy_(fresh)
        self.replays += 1
        self.owner.replays += 1
