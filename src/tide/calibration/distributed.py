"""The processes a calibration runs on: one, or the N that `accelerate launch` (or `torchrun`) started.

`Processes.current(device)` looks at the launcher's environment; with one process every method is the
identity, so single-process calibration is unchanged. With N, each process calibrates on its shard of the
texts, and these collectives keep them in step: gradient means (every process holds the same exit heads
and routers), integer maxima (every process takes the same number of steps), gathers (the held-out scores
every process selects thresholds from; each process's share of the work, for the calibration record), sums
and broadcasts. The process group is accelerate's
(`PartialState`: NCCL on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["Processes", "Rank", "processes_asked_of_accelerate", "join_as_rank_zero"]


def processes_asked_of_accelerate(parent_argv: list[str] | None = None) -> int:
    """How many processes `accelerate launch --cpu --num_processes N` was asked for, where it started this process
    alone: accelerate (1.15) starts several CPU processes only on its torchrun path, and with `--cpu` it runs one,
    telling it nothing of N. 1 otherwise (another launcher, one process asked, or a process group already set up).
    `parent_argv`: the launching process's command line (read from /proc where not given)."""
    if os.environ.get("ACCELERATE_USE_CPU") != "True" or "WORLD_SIZE" in os.environ:
        return 1
    if parent_argv is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parent_argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            return 1
    if "launch" not in parent_argv or any(a.startswith("--mpirun_hostfile") for a in parent_argv):
        return 1
    for i, arg in enumerate(parent_argv):
        name, _, value = arg.partition("=")
        if name in ("--num_processes", "--num-processes"):
            value = value or (parent_argv[i + 1] if i + 1 < len(parent_argv) else "")
            return int(value) if value.isdigit() and int(value) > 1 else 1
    return 1


def join_as_rank_zero(processes: int, run, command: list[str]) -> list["Rank"]:
    """Make this process rank 0 of `processes` on this machine and start ranks 1..N-1, with the environment torchrun
    gives its workers (MASTER_ADDR and MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE). Where the
    system forks, each rank is a fork of this process that calls `run()` (an exit status) and exits: it has Python,
    torch and Tide imported already, so it starts loading at once (a fresh interpreter's imports cost about 3 s of
    a CPU core, which the first process would spend waiting at the process group); elsewhere it runs `command`.
    This process ends where another fails (its collectives would wait for that one)."""
    import socket

    with socket.socket() as probe:  # a free port for the process group's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(processes),
              "LOCAL_WORLD_SIZE": str(processes)}
    others = [Rank(rank, processes, {**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)}, run, command)
              for rank in range(1, processes)]
    os.environ.update(shared, RANK="0", LOCAL_RANK="0")
    return others


class Rank:
    """Another process of this machine's calibration (`join_as_rank_zero`): a fork calling `run`, or `command`
    where the system does not fork. A watchdog thread waits for it and ends this process if it fails."""

    def __init__(self, rank: int, processes: int, env: dict, run, command: list[str]):
        import subprocess
        import sys
        import threading

        self.rank, self.processes, self.status = rank, processes, None
        if hasattr(os, "fork"):
            sys.stdout.flush(), sys.stderr.flush()
            self.pid = os.fork()
            if self.pid == 0:  # the new rank: run, and leave without this process's exit handlers
                status = 1
                try:
                    os.environ.update(env)
                    status = run()
                finally:
                    sys.stdout.flush(), sys.stderr.flush()
                    os._exit(status)
            reap = lambda: os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])  # noqa: E731
        else:
            process = subprocess.Popen(command, env={**os.environ, **env})
            self.pid, reap = process.pid, process.wait
        self._watchdog = threading.Thread(target=self._watch, args=(reap,), daemon=True)
        self._watchdog.start()

    def _watch(self, reap) -> None:
        import sys

        self.status = reap()
        if self.status != 0:
            print(f"process {self.rank} of {self.processes} failed (exit status {self.status}); stopping",
                  file=sys.stderr, flush=True)
            os._exit(self.status if self.status > 0 else 1)  # (negative: ended by a signal)

    def wait(self) -> int:
        """Its exit status, once it has ended."""
        self._watchdog.join()
        return self.status

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


class Processes:
    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @classmethod
    def current(cls, device: torch.device, pin_cores: bool = False) -> "Processes":
        """The processes of this launch. With `pin_cores` (calibration's default), CPU processes of one machine
        that may all run on the same cores each take a disjoint share of them (`pin_to_own_cores`)."""
        if not (dist.is_available() and (dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1)):
            return cls()
        from accelerate import PartialState

        state = PartialState(cpu=device.type == "cpu")
        procs = cls(state.process_index, state.num_processes)
        if pin_cores and device.type == "cpu" and procs.world > 1:
            procs.pin_to_own_cores()
        return procs

    def pin_to_own_cores(self) -> list[int] | None:
        """Give each CPU process of this machine its own share of the cores it may run on, and at most that many
        threads; the cores it got, or None where nothing changed.

        Processes that share cores contend for them, and each times the others' load in the timing trials, so
        they time on the main process alone; with cores of their own they run side by side and share the trials
        out (`own_devices`). Only processes on this host whose allowed cores are the same set are pinned (a
        launcher or a user who gave them other sets is left alone), and only where there is at least one core
        each: the cores in order, the k-th process of n taking the k-th of n equal runs."""
        if not hasattr(os, "sched_getaffinity"):
            return None
        import socket

        mine = (socket.gethostname(), sorted(os.sched_getaffinity(0)))
        parts = [None] * self.world
        dist.all_gather_object(parts, mine)
        sharing = [rank for rank, part in enumerate(parts) if part == mine]
        cores, n = mine[1], len(sharing)
        if n < 2 or len(cores) < n:
            return None
        k = sharing.index(self.rank)
        own = cores[k * len(cores) // n:(k + 1) * len(cores) // n]
        os.sched_setaffinity(0, own)
        torch.set_num_threads(max(1, min(torch.get_num_threads(), len(own))))
        return own

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: list) -> list:
        """This process's share of `items` (every world-th item from its rank)."""
        return items[self.rank :: self.world]

    def shard_by_size(self, items: list, sizes: list[int]) -> list:
        """This process's share of `items` balanced by `sizes`: each item in turn goes to the process with the least
        so far (the same split on every process), in their order."""
        load, mine = [0] * self.world, []
        for item, size in zip(items, sizes):
            rank = load.index(min(load))
            load[rank] += size
            if rank == self.rank:
                mine.append(item)
        return mine

    def mean_grads(self, params) -> None:
        """Replace each parameter's `.grad` by its mean over the processes: one all-reduce over the gradients
        flattened into one buffer (per dtype and device), since a step's collectives cost their latency, not their
        size, on the small heads and routers calibration trains."""
        if self.world == 1:
            return
        groups: dict = {}
        for p in params:
            if p.grad is not None:
                groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in groups.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= self.world
            offset = 0
            for g in grads:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()

    def max_int(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def per_rank(self, values: list[float]) -> list[list[float]]:
        """Every process's `values` (the same length everywhere), in rank order, on every process."""
        if self.world == 1:
            return [list(values)]
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return [p.tolist() for p in parts]

    def gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's `tensor` (any length along dim 0), concatenated in rank order, on every process."""
        if self.world == 1:
            return tensor
        parts = [None] * self.world
        dist.all_gather_object(parts, tensor.cpu())
        return torch.cat(parts).to(tensor.device)

    def deal(self, items: list, fn) -> list:
        """`[fn(item) for item in items]` with the items dealt out round-robin: each process calls `fn` on its
        share, and every process gets every result, in the items' order."""
        if self.world == 1:
            return [fn(item) for item in items]
        mine = [(i, fn(item)) for i, item in enumerate(items) if i % self.world == self.rank]
        parts = [None] * self.world
        dist.all_gather_object(parts, mine)
        results = dict(pair for part in parts for pair in part)
        return [results[i] for i in range(len(items))]

    def on_main(self, fn):
        """`fn()` on the main process, its result on every process."""
        return self.broadcast(fn() if self.is_main else None)

    def own_devices(self, device: torch.device) -> bool:
        """Whether every process has a device of its own: distinct GPUs, or CPU processes pinned to disjoint cores
        (then each can time on its own device what the others time on theirs)."""
        if self.world == 1:
            return True
        if device.type == "cuda":
            mine = {f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"}
        elif hasattr(os, "sched_getaffinity"):
            mine = set(os.sched_getaffinity(0))
        else:
            return False
        parts = [None] * self.world
        dist.all_gather_object(parts, mine)
        return all(not (parts[i] & parts[j]) for i in range(self.world) for j in range(i + 1, self.world))

    def gather_to(self, tensor: torch.Tensor, dst: int) -> torch.Tensor | None:
        """Every process's `tensor` (any length along dim 0), concatenated in rank order, on process `dst` (None on
        the others)."""
        if self.world == 1:
            return tensor
        parts = [None] * self.world if self.rank == dst else None
        dist.gather_object(tensor.cpu(), parts, dst=dst)
        return torch.cat(parts).to(tensor.device) if self.rank == dst else None

    def broadcast_tensors(self, tensors, src: int) -> None:
        """Process `src`'s values of `tensors` (the same shapes on every process) copied into every process's."""
        if self.world == 1:
            return
        tensors = list(tensors)
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]).to(self._device())
        dist.broadcast(flat, src=src)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset: offset + t.numel()].view_as(t).to(t.dtype))
                offset += t.numel()

    def broadcast(self, obj):
        """The main process's `obj`, on every process."""
        if self.world == 1:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @staticmethod
    def _device() -> torch.device:
        return (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                else torch.device("cpu"))
