"""The gradient reducer: launches each bucket's all-reduce during backward as soon as it is
complete.

Per synchronising backward:

1. A post-accumulate-grad hook fires once per parameter after its ``.grad`` is final for this
   backward (``Tensor.register_post_accumulate_grad_hook``, torch >= 2.1). The gradient already
   lives in its bucket (``.grad`` is a view, see :mod:`scaleout.parallel.buckets`); if the user
   replaced or cleared ``.grad`` (``zero_grad(set_to_none=True)``), the fresh tensor is copied in
   and ``.grad`` re-pointed.
2. When the last parameter of bucket b is ready, buckets are launched strictly in index order:
   bucket b goes out only after every bucket < b, so all ranks issue the same collectives in the
   same order even when their gradients become ready in different orders (c10d matches collectives
   by order).
3. At the end of backward (an autograd-engine callback queued by the first hook, as DDP's reducer
   does) parameters that got no gradient in this backward are marked ready with what their slot
   holds (their accumulated gradient from ``no_sync`` micro-steps, or zeros), the remaining buckets
   are launched, and the reducer waits for all of them, so ``loss.backward()`` returns with averaged
   gradients. The wait is the *exposed* communication, reported in ``last_stats``.

On a CUDA device each launch is issued from the thread running the hooks (the autograd thread) and
enqueued on the comm stream; ``wait`` makes the waiting stream wait for it (no host block):
scaleout.comm.handles, the stream/thread rule.

Averaging. An fp32 bucket on an fp32 wire is summed as it is and divided by the world size after
its wait, in one fused pass that also flags non-finite values (``_amp_foreach_non_finite_check_
and_unscale_``, the loss scaler's kernel): the pass the trainer's non-finite check makes anyway, so
averaging costs no pass of its own (torch DDP folds its division into the copy into the bucket
instead). Buckets that finish early are divided while the last one is still on the wire. For a
power-of-two world size the result is bit-identical to dividing first. Any other bucket is
pre-divided before the sum (DDP's default hook does the same). With compression the pre-divided
bucket is cast to bf16/fp16 for the wire and the result is cast back into the parameters' dtype:
dividing *before* the cast is what keeps an fp16 sum of p gradients from overflowing (Horovod issue
#326, PyTorch issue #57410: fp16 all-reduce of un-divided gradients hits inf at 65504).

Completion times are read by polling the in-flight buckets' handles (from the hooks, and before
the wait), not from callbacks: a Python callback per bucket would run on the backend's completion
thread and take the GIL from the training thread mid-backward.

Unused parameters: the last bucket carries one extra element per parameter, 1 (1/p in a
pre-divided bucket) if this rank gave the parameter a gradient since the last synchronisation, 0
otherwise. It is summed with the
gradients (no extra collective), so every rank learns the same set of parameters that got no
gradient on *any* rank, and every rank raises the same error naming them (unless ``allow_unused``):
no rank is left waiting in a collective the others abandoned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from scaleout.comm import handles
from scaleout.errors import UserError
from scaleout.parallel.buckets import Bucket, Slot, build_buckets
from scaleout.parallel.timeline import Timeline, now_us
from scaleout.telemetry import profiler
from scaleout.units import DEFAULT_BUCKET_MB

if TYPE_CHECKING:
    from scaleout.comm.collective import Collective
    from scaleout.world import World

COMPRESSION = {None: None, "none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compression_dtype(compression: Any) -> torch.dtype | None:
    if compression in COMPRESSION:
        return COMPRESSION[compression]
    if compression in (torch.bfloat16, torch.float16):
        return compression
    raise UserError(f"compression={compression!r}: expected None, 'none', 'bf16' or 'fp16'")


def _same_storage(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return (
        a is not None
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


class Reducer:
    """Owns the buckets of one wrapped module and their in-flight all-reduces."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        world: World,
        collective: Collective,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        compression: Any = None,
        overlap: bool = True,
        allow_unused: bool = False,
        timeline: Timeline | None = None,
        first_bucket_mb: float | None = None,
        rebuild_buckets: bool = True,
        rider: int = 0,
    ):
        self.world = world
        self.rider = rider
        # The all-reduce, resolved once (algorithm, options, groups): a sum over ranks in place.
        # A single native collective (flat) the reducer starts itself (``_start``: the async work
        # or None, nothing to send) when nothing is queued on the World's comm thread (no
        # hand-off, no Python layer per bucket)
        self.collective = collective
        self._start: Callable[[torch.Tensor], Any] | None = (
            collective.start if collective.single_collective else None
        )
        self.comm_dtype = compression_dtype(compression)
        self.overlap = overlap
        self.allow_unused = allow_unused
        self.timeline = timeline
        n_grad = sum(1 for _, p in named_params if p.requires_grad)
        self._layout = (named_params, bucket_mb, n_grad, first_bucket_mb)
        self.buckets, self.slots = build_buckets(
            named_params, bucket_mb, n_grad, first_bucket_mb, rider=rider
        )
        self.slots.sort(key=lambda s: s.index)
        self._rebuild_pending = rebuild_buckets
        self._ready_order: list[
            int
        ] = []  # slot positions in the order hooks fired (first sync step)
        self._k = {s.index: k for k, s in enumerate(self.slots)}  # param index -> usage position
        self.sync = True
        self.never_used: set[str] | None = (
            None  # names with no gradient on any rank in every step so far
        )
        # True: wait() keeps the usage on the device instead of reading it (unused_flag /
        # check_unused), so a trainer that reads one agreement flag per step reads the usage with
        # it (train/trainer.py).
        self.defer_unused = False
        self.pending_usage: torch.Tensor | None = None
        self.last_stats: dict[str, Any] = {}
        self.steps = 0
        # For the heartbeat (scaleout/train/liveness.py Progress.watch), read from its thread:
        # bucket all-reduces issued so far (every rank issues the same ones, in the same order),
        # and whether backward is blocked waiting for them. Plain writes, nothing else.
        self.issued = 0
        self.waiting = False
        # True: the next synchronising backward records when each gradient became ready
        # (last_stats["ready_s"]), the gradient-ready profile of comm.algorithm=auto
        # (scaleout/parallel/autotune.py)
        self.record_ready = False
        # The rider: ``rider`` elements at the end of the last bucket that carry a caller's own
        # values, summed over the ranks with the gradients (no collective of their own). Once per
        # synchronising backward, when the last bucket is about to go out on the wire in its own
        # dtype (no compression: the values are summed exactly as written, never pre-divided or
        # rounded), the ``fill(view)`` offered by :meth:`ride` writes them into the wire buffer;
        # after the wait, ``rider_result`` holds their sums (a copy: a bucket rebuild may follow),
        # else None.
        self._rider_fill: Callable[[torch.Tensor], None] | None = None
        self.rider_result: torch.Tensor | None = None
        self._rode = False
        # Host work for the wait: once per synchronising backward, after the last bucket went out
        # and before the host blocks on the wire, the work given to :meth:`while_waiting` runs in
        # this thread (the trainer builds the next step's batch there), when the host really
        # waits (no CUDA stream) and no collective in flight needs this process's GIL (no
        # comm-thread schedule). Its seconds are last_stats["idle_s"], not counted as exposed
        # communication.
        self._wait_work: Callable[[], None] | None = None
        self._idle_s = 0.0
        # After a synchronising backward whose buckets were all divided after their sums: 1.0 on
        # the device if any averaged gradient is NaN/Inf, else 0.0 (read nothing: the trainer
        # folds it into its step's one host read). None otherwise. Valid until the next one.
        self.nonfinite: torch.Tensor | None = None
        self._found: torch.Tensor | None = None
        self._inv: torch.Tensor | None = None
        self._hooks = [
            s.param.register_post_accumulate_grad_hook(self._hook_for(k))
            for k, s in enumerate(self.slots)
        ]
        for s in self.slots:
            s.param.grad = s.view
        self._used = [False] * len(self.slots)  # got a gradient since the last synchronisation
        self._usage_host: torch.Tensor | None = None  # the usage flags' host staging buffer
        self._usage_copied: Any = None  # CUDA: an event after the last copy out of it
        self._reset_step()

    # -- per-step state ---------------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._ready = [False] * len(self.slots)
        self._pending = [len(b.slots) for b in self.buckets]
        self._next = 0
        self._handles: list[Any] = [None] * len(self.buckets)
        self._comm_bufs: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._launch_us = [0.0] * len(self.buckets)
        self._done_us = [0.0] * len(self.buckets)
        self._open = 0  # buckets below this one were seen complete (or were waited for)
        self._post = [False] * len(self.buckets)  # summed undivided: divide after the wait
        self.launch_order: list[int] = []
        self._in_backward = False
        self._bwd_start_us = 0.0
        self._prof_backward: Any = None
        self._unreached: set[int] | None = None  # slots no forward since the last backward reached
        self._ready_at = [0.0] * len(self.slots)  # now_us() of each slot's hook (record_ready)

    def expect_unused(self, outputs: list[torch.Tensor]) -> None:
        """Find the parameters the autograd graph of ``outputs`` cannot reach, so that backward
        marks them ready at its start instead of its end: otherwise their bucket, and every later
        bucket (launch order is fixed), would wait for the end of backward. DDP's
        ``find_unused_parameters`` does the same traversal; it costs one walk over the graph per
        forward, so it only runs with ``allow_unused=True``. Several forwards before one
        backward: only what none of them reached."""
        seen: set[Any] = set()
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        reached: set[int] = set()
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf tensor
            if var is not None:
                reached.add(id(var))
            stack.extend(nxt for nxt, _ in fn.next_functions)
        unreached = {k for k, s in enumerate(self.slots) if id(s.param) not in reached}
        self._unreached = unreached if self._unreached is None else self._unreached & unreached

    def begin_backward(self) -> None:
        """Called once per backward (from the output marker or the first hook): queue the end
        callback."""
        if self._in_backward:
            return
        self._in_backward = True
        self._bwd_start_us = now_us()
        self._prof_backward = profiler.enter(
            "backward"
        )  # the timeline's spans as profiler ranges too
        Variable._execution_engine.queue_callback(self._end_backward)
        if self.sync:
            unreached, self._unreached = self._unreached or set(), None
            for k in sorted(unreached):
                if not self._ready[k]:
                    self._adopt(self.slots[k])
                    self._mark_ready(self.slots[k], k)

    # -- hooks ------------------------------------------------------------------------------------
    def _hook_for(self, k: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            slot = self.slots[k]  # looked up per call: buckets may be rebuilt after the first step
            self.begin_backward()
            self._adopt(slot)
            self._used[k] = True
            if not self.sync:
                return
            if self._ready[k]:
                self._reset_step()
                raise UserError(
                    f"parameter {slot.name!r} received a gradient twice in one synchronising "
                    "backward "
                    "(two backward passes per step or reentrant checkpointing): run all but the "
                    "last under dp.no_sync()"
                )
            if self._rebuild_pending:
                self._ready_order.append(k)
            if self.record_ready:
                self._ready_at[k] = now_us()
            self._mark_ready(slot, k)

        return hook

    @staticmethod
    def _adopt(slot: Slot) -> None:
        """Make ``param.grad`` the bucket view again if the user cleared or replaced it."""
        g = slot.param.grad
        if g is slot.view or _same_storage(g, slot.view):  # the first test: the common case
            return
        if g is None:
            slot.view.zero_()
        else:
            slot.view.copy_(g)
        slot.param.grad = slot.view

    def _mark_ready(self, slot: Slot, k: int) -> None:
        self._ready[k] = True
        self._pending[slot.bucket] -= 1
        if self._open < self._next:
            self._poll()
        if self.overlap and self._pending[slot.bucket] == 0:
            self._launch_ready()

    def _poll(self) -> None:
        """Stamp the completion of launched buckets that have finished (in launch order)."""
        while self._open < self._next and self._handles[self._open].is_completed():
            if not self._done_us[self._open]:
                self._done_us[self._open] = now_us()
            self._open += 1

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        b = bucket.index
        if bucket.extra:  # the usage of parameters that got a gradient (see module docstring)
            self._copy_usage(self._usage_view(bucket))
        self._launch_us[b] = now_us()
        self.launch_order.append(b)
        buf = self._wire(bucket, post=True)
        self._post[b] = buf is bucket.buffer and self._divides_after(buf)  # sent undivided
        if buf is not bucket.buffer:
            self._comm_bufs[b] = buf
        elif bucket.rider and self._rider_fill is not None:  # after the pre-divide: sums as written
            fill, self._rider_fill = self._rider_fill, None  # once: offered per synchronisation
            fill(buf.narrow(0, buf.numel() - bucket.rider, bucket.rider))
            self._rode = True
        self.issued += 1
        handle = None
        if self._start is not None and handles.thread_idle(self.world):
            handle = self._start(buf)  # a work, waited for as it is
            if handle is None:  # nothing to send (one rank)
                handle = handles.completed(buf)
        if handle is None:
            handle = self.collective.all_reduce(buf, async_op=True)
        self._handles[b] = handle
        if profiler.recording():
            profiler.until_done(f"bucket {b}", getattr(handle, "future", None))

    def _copy_usage(self, usage: torch.Tensor) -> None:
        """This step's used flags into ``usage`` through a preallocated host buffer, pinned for a
        CUDA ``usage``: the copy is then an asynchronous DMA mid-backward, not a pageable staging
        copy (which may wait for the stream). On CUDA an event guards the buffer: it is rewritten
        only once the previous step's copy out of it has completed (long since, in practice: the
        step's agreement read the device in between)."""
        cuda = usage.device.type == "cuda"
        host = self._usage_host
        if host is None or host.numel() != usage.numel() or host.dtype != usage.dtype:
            host = torch.empty(usage.numel(), dtype=usage.dtype, pin_memory=cuda)
            self._usage_host = host
        elif self._usage_copied is not None:
            self._usage_copied.synchronize()
        host.copy_(torch.tensor(self._used, dtype=usage.dtype))
        usage.copy_(host, non_blocking=True)
        if cuda and torch.cuda.is_available():
            self._usage_copied = torch.cuda.Event()
            self._usage_copied.record()

    def _wire(self, bucket: Bucket, post: bool = False) -> torch.Tensor:
        """The bucket as sent: pre-divided by the world size, then cast to the wire dtype
        (Horovod #326, PyTorch #57410: divide before the cast); with ``post``, an fp32 bucket on
        its own wire as it is (divided after the sum, see :meth:`_divides_after`)."""
        buf, p = bucket.buffer, self.world.world_size
        if self.comm_dtype is not None and self.comm_dtype != buf.dtype:
            return buf.div(p).to(self.comm_dtype)
        if p > 1 and not (post and self._divides_after(buf)):
            buf.div_(p)
        return buf

    def _divides_after(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` (sent as it is) is summed undivided and divided after its wait: fp32
        (no overflow to fear from a sum of p gradients), more than one rank."""
        return self.world.world_size > 1 and buf.dtype == torch.float32

    def _divide(self, bucket: Bucket) -> None:
        """Average a summed bucket's gradients and flag non-finite ones, in one pass (the loss
        scaler's fused kernel: grads *= 1/p, found = 1 if any is NaN/Inf). The usage and rider
        elements after the gradients stay sums."""
        buf = bucket.buffer
        if self._found is None or self._found.device != buf.device:
            self._found = torch.zeros(1, dtype=torch.float32, device=buf.device)
            self._inv = torch.full(
                (1,), 1.0 / self.world.world_size, dtype=torch.float32, device=buf.device
            )
        torch._amp_foreach_non_finite_check_and_unscale_([bucket.grads], self._found, self._inv)

    def reduce_now(self) -> None:
        """Average every bucket now, synchronously, from the calling thread and stream: the same
        algorithm, compression and pre-divide as the overlapped path, without hooks, usage or
        comm thread. It is what a captured CUDA-graph step runs after its backward under
        ``no_sync()`` (scaleout/train/capture.py)."""
        self.nonfinite = None
        for bucket in self.buckets:
            buf = self._wire(bucket)
            self.issued += 1
            self.collective.all_reduce(buf, async_op=False)
            if buf is not bucket.buffer:
                bucket.buffer.copy_(buf)

    # -- end of backward --------------------------------------------------------------------------
    def _end_backward(self) -> None:
        end_us = now_us()
        start_us = self._bwd_start_us
        self._in_backward = False
        profiler.leave(self._prof_backward)
        self._prof_backward = None
        if not self.sync:
            self._span("backward (no_sync)", "backward", start_us, end_us)
            return
        for k, s in enumerate(
            self.slots
        ):  # unused in this backward: ready with what the slot holds
            if not self._ready[k]:
                self._adopt(s)
                self._ready[k] = True
                self._pending[s.bucket] -= 1
        self._launch_ready()
        self._poll()
        self._idle_s = 0.0
        work, self._wait_work = self._wait_work, None
        if work is not None and self._host_waits():
            t0 = now_us()
            work()
            self._idle_s = (now_us() - t0) / 1e6
        with profiler.prange("wait"):
            self.wait(start_us, end_us)

    def _host_waits(self) -> bool:
        """Whether wait() blocks this thread on the wire with nothing else needing it: a host
        (gloo) bucket and no comm-thread schedule in flight (a hierarchical or torus schedule is
        Python on the comm thread: work holding the GIL here would delay its phases)."""
        if self.buckets[-1].buffer.device.type != "cpu":
            return False
        return handles.thread_idle(self.world)

    def wait(self, start_us: float, end_us: float) -> dict[str, Any]:
        """Wait for every bucket, write results back, check the usage, record stats and the
        timeline."""
        self.waiting = True
        if any(self._post) and self._found is not None:
            self._found.zero_()
        for b, bucket in enumerate(self.buckets):
            self._handles[b].wait()
            if not self._done_us[b]:
                self._done_us[b] = now_us()
            if self._comm_bufs[b] is not None:
                bucket.buffer.copy_(self._comm_bufs[b])  # back into the parameters' dtype
            elif self._post[b]:  # the earlier buckets: while the last one is on the wire
                self._divide(bucket)
        self.waiting = False
        self.nonfinite = self._found if all(self._post) else None
        done_us = now_us()
        last = self.buckets[-1]
        usage = self._usage_view(last)
        rode, self._rode = self._rode, False
        n = last.buffer.numel()
        rider = last.buffer.narrow(0, n - last.rider, last.rider)
        self.rider_result = rider.clone() if rode else None
        if (
            self.defer_unused
        ):  # the caller folds unused_flag() into its own host read, then check_unused()
            self.pending_usage = usage.clone()
            unused: list[str] = []
        else:
            unused = self._unused(
                usage.tolist()
            )  # one device -> host read for every parameter's flag
        usage.zero_()
        self._record(start_us, end_us, done_us, unused)
        self._used = [False] * len(self.slots)
        self._reset_step()
        if self._rebuild_pending:
            self._rebuild()
        if unused and not self.allow_unused:
            raise UserError(
                f"parameters received no gradient on any rank in step {self.steps}: {unused}; "
                "pass allow_unused=True to DataParallel if that is expected (their gradients are "
                "zero)"
            )
        return self.last_stats

    def ride(self, fill: Callable[[torch.Tensor], None] | None) -> bool:
        """Offer ``fill`` for the rider of the next synchronising backward (see ``__init__``);
        False, keeping nothing, when no rider goes on the wire (:attr:`rides`)."""
        self._rider_fill = fill if self.rides else None
        return self._rider_fill is not None

    def while_waiting(self, work: Callable[[], None]) -> None:
        """Run ``work`` once in the next synchronising backward's wire wait (see ``__init__``)."""
        self._wait_work = work

    @property
    def rides(self) -> bool:
        """Whether a rider goes on the wire with the last bucket (there is one, and the bucket is
        sent in its own dtype)."""
        dtype = self.buckets[-1].buffer.dtype
        return self.rider > 0 and (self.comm_dtype is None or self.comm_dtype == dtype)

    @staticmethod
    def _usage_view(bucket: Bucket) -> torch.Tensor:
        n, usage = bucket.buffer.numel(), bucket.extra - bucket.rider
        return bucket.buffer.narrow(0, n - bucket.extra, usage)

    def _unused(self, got: list[float]) -> list[str]:
        unused = [s.name for k, s in enumerate(self.slots) if got[k] == 0]
        self.never_used = set(unused) if self.never_used is None else self.never_used & set(unused)
        return unused

    def unused_flag(self) -> torch.Tensor | None:
        """With ``defer_unused``: 1.0 on the device if some parameter got no gradient on any rank
        in the last synchronisation (the same value on every rank: the usage was all-reduced),
        without reading it."""
        if self.pending_usage is None:
            return None
        return (self.pending_usage == 0).any().float()

    def check_unused(self) -> list[str]:
        """With ``defer_unused``: read the last usage (a host read: call it when unused_flag()
        was set), record the unused parameters and raise as a non-deferred backward would have."""
        pending, self.pending_usage = self.pending_usage, None
        unused = self._unused(pending.tolist()) if pending is not None else []
        self.last_stats["unused"] = unused
        if unused and not self.allow_unused:
            raise UserError(
                f"parameters received no gradient on any rank in step {self.steps}: {unused}; "
                "pass allow_unused=True to DataParallel if that is expected (their gradients are "
                "zero)"
            )
        return unused

    def _record(self, start_us: float, end_us: float, done_us: float, unused: list[str]) -> None:
        self.steps += 1
        first = min(self._launch_us)
        wires = [
            cb if cb is not None else b.buffer
            for cb, b in zip(self._comm_bufs, self.buckets, strict=True)
        ]
        comm_bytes = sum(w.numel() * w.element_size() for w in wires)
        self.last_stats = {
            "step": self.steps,
            "backward_s": (end_us - start_us)
            / 1e6,  # first gradient-producing op to end of backward
            # blocked on communication after backward (less the host work done meanwhile)
            "exposed_s": max(0.0, (done_us - end_us) / 1e6 - self._idle_s),
            "idle_s": self._idle_s,  # while_waiting's seconds
            "comm_s": (max(self._done_us) - first) / 1e6,  # first launch to last completion
            "bytes": comm_bytes,
            "buckets": len(self.buckets),
            "launch_order": list(self.launch_order),
            "launch_s": [(t - start_us) / 1e6 for t in self._launch_us],
            "first_launch_at": first / 1e6,  # time.time() of the first launch (straggler skew)
            "done_s": [(t - start_us) / 1e6 for t in self._done_us],
            "unused": unused,
        }
        if self.record_ready:  # by slot (parameter index order); not reached: end of backward
            self.last_stats["ready_s"] = [((t or end_us) - start_us) / 1e6 for t in self._ready_at]
        if self.timeline is not None:
            step = f"step {self.steps}"
            self._span(f"backward {step}", "backward", start_us, end_us)
            for b, bucket in enumerate(self.buckets):
                self._span(
                    f"bucket {b}",
                    "comm",
                    self._launch_us[b],
                    self._done_us[b],
                    step=self.steps,
                    bytes=bucket.nbytes,
                    params=len(bucket.slots),
                )
            self._span(f"wait {step}", "wait", end_us, done_us)

    def _rebuild(self) -> None:
        """Re-bucket once, after the first synchronising step, in the order gradients actually
        became ready (the DDP paper's bucket rebuilding, sec. 3.2.3 / torch DDP
        ``_rebuild_buckets``): reverse registration order is only a guess (a Transformer layer
        registers its LayerNorms before the FFN but gets their gradients after it), and one late
        parameter holds back its whole bucket. Rank 0's order is broadcast so every rank builds
        the same buckets."""
        self._rebuild_pending = False
        seen = set(self._ready_order)
        order = [self.slots[k].index for k in self._ready_order]
        order += [s.index for s in reversed(self.slots) if self._k[s.index] not in seen]
        self._ready_order = []
        if self.world.world_size > 1:
            box = [order]
            dist.broadcast_object_list(box, src=0)
            order = box[0]
        default = [s.index for s in reversed(self.slots)]
        if order == default:
            return
        named_params, bucket_mb, n_grad, first_bucket_mb = self._layout
        buckets, slots = build_buckets(
            named_params, bucket_mb, n_grad, first_bucket_mb, order=order, rider=self.rider
        )
        slots.sort(key=lambda s: s.index)
        for old, new in zip(self.slots, slots, strict=True):
            new.view.copy_(old.view)  # keep this step's averaged gradients for the optimizer
            new.param.grad = new.view
        self.buckets, self.slots = buckets, slots
        self._reset_step()

    def relayout(
        self,
        collective: Collective,
        bucket_mb: float,
        first_bucket_mb: float | None = None,
        compression: Any = None,
    ) -> None:
        """Between steps: new buckets of ``bucket_mb`` (first ``first_bucket_mb``) filled in the
        current buckets' order, a new all-reduce and wire dtype (comm.algorithm=auto's switch,
        scaleout/parallel/autotune.py). The current buckets' order is already the same on every
        rank (the rebuild broadcasts rank 0's), so every rank builds the same buckets. Gradients
        held now are kept."""
        named_params, _, n_grad, _ = self._layout
        order = [s.index for b in self.buckets for s in b.slots]
        buckets, slots = build_buckets(
            named_params, bucket_mb, n_grad, first_bucket_mb, order=order, rider=self.rider
        )
        slots.sort(key=lambda s: s.index)
        for old, new in zip(self.slots, slots, strict=True):
            new.view.copy_(old.view)
            new.param.grad = new.view
        self._layout = (named_params, bucket_mb, n_grad, first_bucket_mb)
        self.buckets, self.slots = buckets, slots
        self.collective = collective
        self._start = collective.start if collective.single_collective else None
        self.comm_dtype = compression_dtype(compression)
        self._reset_step()

    def _span(self, name: str, track: str, start_us: float, end_us: float, **args: Any) -> None:
        if self.timeline is not None:
            self.timeline.span(name, track, start_us, end_us, **args)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
