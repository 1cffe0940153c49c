"""An emulated CUDA device on a CPU-only machine, for device-discipline and host-sync tests.

    with FakeCuda() as fc:          # in the rank, after scaleout.init(); world.device = fc.device
        ...training code...
    fc.violations                   # collectives issued on host tensors (also raised at the call)
    fc.syncs                        # device -> host reads: (kind, "file:line") per read

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
- reads of device values on the host (``item``, ``tolist``, ``bool``/``float``/``int``, ``.cpu()``,
  boolean
  masks, ``nonzero``, ``torch.cuda.synchronize``) are recorded with their call site.

Limits: the mode is thread-local, so ops in other threads (the comm thread) are not classified
(their new tensors count as device tensors, which they are on a GPU); ops inside a torch function's
own implementation are not seen, only the call.
"""

from __future__ import annotations

import os
import traceback
from types import SimpleNamespace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

DEVICE = torch.device("cuda", 0)
HOST = torch.device("cpu")
_MARK = "_fakecuda_host"
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


def on_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


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
        kwargs.pop("pin_memory", None)
        target = _emulated(kwargs["device"]) if "device" in kwargs else None
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
        if name.endswith("_") and not name.endswith("__") and src is not None:
            return out  # in place: the tensor keeps its placement
        return _mark(out, host)

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
            return out if out is src else _mark(out, here == HOST)
        if target == HOST:
            self.owner.syncs.append(("to host", call_site()))
        if out is src:
            out = src.clone()
        return _mark(out, target == HOST)


class FakeCuda:
    """Context manager: the emulated device (module docstring). ``device`` is what world.device
    becomes."""

    device = DEVICE

    def __init__(self, world: Any = None):
        self.world = world
        self.violations: list[str] = []
        self.syncs: list[tuple[str, str]] = []
        self.cpu_groups = _CPU_GROUPS  # names of the gloo groups made under FakeCuda
        self._undo: list[tuple[Any, str, Any]] = []

    def _patch(self, obj: Any, attr: str, value: Any) -> None:
        self._undo.append((obj, attr, getattr(obj, attr)))
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
            return orig(pg, *args, **kwargs)

        return collective

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
        self._patch(
            torch.cuda,
            "synchronize",
            lambda device=None: self.syncs.append(("synchronize", call_site())),
        )
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
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        for obj, attr, value in reversed(self._undo):
            setattr(obj, attr, value)
        self._undo.clear()
