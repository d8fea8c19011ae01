"""Process-group setup: find who we are from the launcher, start torch.distributed, build groups.
The one place that reads environment variables (the launchers: docs/api.md, "bitscom.init()")."""

from __future__ import annotations

import datetime
import hashlib
import itertools
import os
import pathlib
import socket
import subprocess
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from .build_info import __version__
from .channel import Channel
from .validate import instance, number

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "world_group", "intra_group", "inter_group", "device",
           "LaunchInfo", "discover", "timeout", "new_group", "shared_group", "channel", "node_layout",
           "node_groups", "world_token", "on_world_gone", "group_device"]


@dataclass(frozen=True)
class LaunchInfo:
    """Who this process is, as the launcher said."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str
    master_addr: Optional[str] = None
    master_port: Optional[int] = None


def _int(env, *names, default=None, minimum=0):
    """The first of ``names`` set in ``env`` as an int (Slurm's ``2(x3),1``: 2), else ``default``."""
    for n in names:
        if n in env and env[n] != "":
            text = str(env[n]).split("(")[0].split(",")[0].strip()
            try:
                value: Any = int(text)
            except ValueError:            # no int: number() refuses the text, naming the variable
                value = env[n]
            return number(f"environment variable {n}", value, minimum=minimum, integer=True)
    return default


_LAUNCHERS = (   # launcher, the variables that identify it, rank, size, local rank, local size(s)
    ("torchrun", ("RANK", "WORLD_SIZE"), "RANK", "WORLD_SIZE", "LOCAL_RANK", ("LOCAL_WORLD_SIZE",)),
    ("mpi", ("OMPI_COMM_WORLD_RANK",), "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    ("mpi", ("PMI_RANK", "PMI_SIZE"), "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", ("MPI_LOCALNRANKS",)),
    ("slurm", ("SLURM_PROCID", "SLURM_NTASKS"), "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
     ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")),
)


def discover(env: Optional[Mapping[str, str]] = None) -> LaunchInfo:
    """Read the launcher's environment (a dict for tests; ``os.environ`` by default). Example::

        info = bitscom.runtime.discover()   # LaunchInfo(rank=0, size=1, ..., launcher='none')
    """
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR")
    port = _int(env, "MASTER_PORT")
    found = next((row for row in _LAUNCHERS if all(n in env for n in row[1])), None)
    if found is None:
        return LaunchInfo(0, 1, 0, 1, "none", addr, port)
    launcher, _, rank_var, size_var, local_rank_var, local_size_vars = found
    size = _int(env, size_var, minimum=1)
    rank = _int(env, rank_var)
    local_rank = _int(env, local_rank_var, default=0)
    local_size = _int(env, *local_size_vars, default=size, minimum=1)
    if launcher == "slurm":
        if addr is None and "SLURM_NODELIST" in env:
            addr = _first_slurm_host(env["SLURM_NODELIST"])
        if port is None:
            port = 29500 + _int(env, "SLURM_JOB_ID", default=0) % 20000
    return LaunchInfo(rank, size, local_rank, local_size, launcher, addr, port)


def _first_slurm_host(nodelist: str) -> str:
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        head = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
    return head


def _mpi_rendezvous(info: LaunchInfo) -> tuple:
    """Rank 0 picks an address and a free port; mpi4py broadcasts them to every rank."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise RuntimeError("launched by mpirun without MASTER_ADDR/MASTER_PORT: install the "
                           "'mpi' extra (pip install bitscom[mpi]) so rank 0 can share its "
                           "address, or export MASTER_ADDR and MASTER_PORT") from err
    payload = (info.master_addr or _my_address(), info.master_port or _free_port()) if info.rank == 0 else None
    return MPI.COMM_WORLD.bcast(payload, root=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _my_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _none():
    return None


def _ref(group) -> Callable[[], Any]:
    """A weak reference to a process group; a plain closure for None / NON_GROUP_MEMBER."""
    if isinstance(group, dist.ProcessGroup):
        return weakref.ref(group)
    return _none if group is None else lambda: group


def _weak(name: str) -> Any:
    return property(lambda self: getattr(self, name)(), lambda self, group: setattr(self, name, _ref(group)))


class _Runtime:
    """What :func:`init` (or adoption) recorded; groups held weakly (docs/reliability.md)."""

    world = _weak("_world")
    intra = _weak("_intra")
    inter = _weak("_inter")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.info: Optional[LaunchInfo] = None
        self.owns_pg = False
        self._world: Callable[[], Any] = _none
        self._intra: Callable[[], Any] = _none
        self._inter: Callable[[], Any] = _none
        self.device = torch.device("cpu")
        self.timeout: Optional[datetime.timedelta] = None
        self.adopted = False          # info taken from a process group the user started

    def stale(self) -> bool:
        """Whether the recorded world is no longer torch's default group (destroyed or replaced)."""
        world = self._world()
        recorded = self._world is not _none      # a world group was recorded (it may have died since)
        return self.info is not None and (world is not _current_world() or (recorded and world is None))


def _current_world():
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


_rt = _Runtime()
_lowbit_registrar: list = []     # [bitscom.register_lowbit_backend], set by use_lowbit_backend()
_worlds: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # world group -> serial
_serials = itertools.count(1)
_gone_callbacks: list = []


def use_lowbit_backend(register: Callable[..., Any]) -> None:
    """Hand runtime the ``lowbit`` registrar ``init(bitwidth=...)`` calls (runtime imports no face)."""
    _lowbit_registrar[:] = [register]


def world_token() -> Optional[int]:
    """A number naming torch's current world (None when not running), to see groups gone."""
    world = _current_world()
    if world is not None and world not in _worlds:
        _worlds[world] = next(_serials)
    return None if world is None else _worlds[world]


def on_world_gone(callback: Callable[[], None]) -> None:
    """Call ``callback()`` when the recorded world is gone, so the layers above drop groups."""
    if callback not in _gone_callbacks:
        _gone_callbacks.append(callback)


def _world_gone() -> None:
    for callback in list(_gone_callbacks):
        callback()


def _forget_if_stale() -> None:
    if _rt.stale():
        _world_gone()
        _rt.reset()


def init(backend: Optional[str] = None, *, timeout: Optional[datetime.timedelta] = None,
         device: Optional[str] = None, bitwidth: Optional[int] = None, **lowbit_options) -> LaunchInfo:
    """Start torch.distributed from the launcher's environment and build bitscom's groups.

    ``backend`` defaults to ``nccl`` with CUDA, else ``gloo``. Calling ``init()`` again is
    harmless; a process group the user started is adopted; after the recorded one is gone,
    ``init()`` starts (or adopts) a new one.

    Example::

        import bitscom
        bitscom.init()
        print(bitscom.rank(), bitscom.size(), bitscom.local_rank())
    """
    _forget_if_stale()
    if _rt.info is not None and not _rt.adopted:
        return _rt.info
    instance("timeout", timeout, (type(None), datetime.timedelta), "None or a datetime.timedelta")
    _rt.adopted = False
    if bitwidth is not None or lowbit_options:
        if bitwidth is not None:
            lowbit_options["bitwidth"] = bitwidth
        _lowbit_registrar[0](**lowbit_options)   # the LowBitConfig settings, by name (or config=)
        backend = "lowbit"
    info = discover()
    backend = _backend_and_device(backend, device, info)
    if dist.is_initialized():
        info = _adopted_info(info)
    elif info.size > 1:
        _start(info, backend, timeout)
    _rt.info = info
    _rt.timeout = timeout
    if dist.is_initialized():
        _rt.world = dist.group.WORLD
        # Node groups use the plain backend even when the world is "lowbit": the hierarchical
        # algorithms compress their stages themselves and must not be compressed twice.
        world_backend = str(dist.get_backend())
        if world_backend not in ("nccl", "gloo", "mpi"):
            world_backend = "nccl" if _rt.device.type == "cuda" else "gloo"
        _build_node_groups(info, world_backend)
    return info


def _backend_and_device(backend: Optional[str], device: Optional[str], info: LaunchInfo) -> str:
    use_cuda = (device == "cuda") or (device is None and torch.cuda.is_available())
    if backend is None:
        backend = "nccl" if use_cuda else "gloo"
    if backend not in ("nccl", "gloo", "mpi") and backend not in dist.Backend.backend_list:
        raise ValueError(f"backend {backend!r} is not known; use 'nccl', 'gloo' or a registered backend")
    if use_cuda and torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        _rt.device = torch.device("cuda", torch.cuda.current_device())
    return backend


class _PreviousStore:
    """The old world's store, which ranks but 0 wait to see gone (docs/reliability.md)."""

    store: Any = None
    world_id: Optional[str] = None
    KEY = "bitscom/world-id"

    @classmethod
    def remember(cls, info: LaunchInfo) -> None:
        """Name this world in its store (rank 0 writes an id; the others read it, keep a client)."""
        cls.store, cls.world_id = None, None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return
        try:
            store = dist.distributed_c10d._get_default_store()
            if info.rank == 0:
                store.set(cls.KEY, f"{os.getpid()}-{time.time_ns()}")
            else:
                cls.world_id, cls.store = store.get(cls.KEY).decode(), store
        except (RuntimeError, ValueError):
            pass                     # no store to name: the next init does not wait for it

    @classmethod
    def _old_server_up(cls, store) -> bool:
        try:
            return bool(store.check([cls.KEY])) and store.get(cls.KEY).decode() == cls.world_id
        except (RuntimeError, OSError):                   # DistNetworkError: it is gone
            return False

    @classmethod
    def wait_until_gone(cls, timeout: Optional[datetime.timedelta]) -> None:
        store, cls.store = cls.store, None
        if store is None:
            return
        limit = (timeout or datetime.timedelta(minutes=30)).total_seconds()
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if not cls._old_server_up(store):
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"bitscom.init(): the previous world's store (rank 0's, at MASTER_PORT) is still up "
            f"after {limit:.0f} s; call bitscom.shutdown() (or dist.destroy_process_group()) on "
            "every rank, rank 0 included, before init() starts a new world, and release what "
            "still holds its process groups")


def _start(info: LaunchInfo, backend: str, timeout: Optional[datetime.timedelta]) -> None:
    """``init_process_group`` on the agreed port, else after the old store is gone."""
    port, _NextWorld.port = _NextWorld.port, None
    if port is None:                  # a new port needs no wait: the old server may live on
        _PreviousStore.wait_until_gone(timeout)
    _PreviousStore.store = None
    kwargs: dict = {"backend": backend, "rank": info.rank, "world_size": info.size, "timeout": timeout}
    if port is not None and info.master_addr is not None:
        kwargs["init_method"] = f"tcp://{info.master_addr}:{port}"
    elif info.launcher == "torchrun":
        kwargs["init_method"] = "env://"
    else:
        addr, port = (info.master_addr, info.master_port)
        if info.launcher == "mpi" and (addr is None or port is None):
            addr, port = _mpi_rendezvous(info)
        if addr is None or port is None:
            raise RuntimeError(f"launcher {info.launcher!r} gave no MASTER_ADDR/MASTER_PORT; export both")
        kwargs["init_method"] = f"tcp://{addr}:{port}"
    dist.init_process_group(**kwargs)
    _rt.owns_pg = True
    _PreviousStore.remember(info)


def _adopted_info(env_info: LaunchInfo) -> LaunchInfo:
    """Who we are in a group the user started (``mp.spawn``: every rank on one node)."""
    rank_, size_ = dist.get_rank(), dist.get_world_size()
    if env_info.size == size_ and env_info.rank == rank_:
        return LaunchInfo(rank_, size_, env_info.local_rank, env_info.local_size, env_info.launcher)
    return LaunchInfo(rank_, size_, rank_, size_, "external")


def _adopt() -> bool:
    """Adopt a default group the user started, without a collective (node groups: :func:`init`)."""
    _forget_if_stale()
    if _rt.info is None and dist.is_available() and dist.is_initialized():
        _rt.info = _adopted_info(discover())
        _rt.world = dist.group.WORLD
        _rt.adopted = True
        if str(dist.get_backend()) == "nccl":
            _rt.device = torch.device("cuda", torch.cuda.current_device())
    return _rt.info is not None


def _build_node_groups(info: LaunchInfo, backend: str) -> None:
    """Intra- and inter-node groups, after checking the layout and the builds."""
    size, local = info.size, info.local_size
    if local < 1 or size % local != 0:
        raise RuntimeError(f"world size {size} is not a multiple of the local size {local}")
    gathered = _exchange_layout(info, backend)
    builds = [b for _, _, b in gathered]
    if len(set(builds)) > 1:
        raise RuntimeError("ranks run different bitscom builds (version or kernel source), which would "
                           "quantize differently and silently diverge; build fingerprint per rank: "
                           + ", ".join(f"rank {r}: {b:014x}" for r, b in enumerate(builds))
                           + ". Install the same bitscom on every node")
    layout = [(lr, ls) for lr, ls, _ in gathered]
    for r, (lr, ls) in enumerate(layout):
        if ls != local or lr != r % local:
            raise RuntimeError(f"rank {r} reports local rank {lr} of {ls}; bitscom needs the ranks "
                               f"of a node to be contiguous with equal local sizes "
                               f"(use mpirun --map-by slot); layout seen: {layout}")
    world = list(range(size))
    for n in range(size // local):
        g = new_group(node_layout(world, local, n * local)[0], backend=backend)
        if info.rank // local == n:
            _rt.intra = g
    for lr in range(local):
        g = new_group(node_layout(world, local, lr)[1], backend=backend)
        if info.rank % local == lr:
            _rt.inter = g


def node_layout(ranks: Iterable[int], local_size: int, rank: int) -> tuple:
    """The one node-layout rule: (``rank``'s node, the ranks sharing its local rank) in ``ranks``."""
    ranks = list(ranks)
    node, local = divmod(rank, local_size)
    return ranks[node * local_size:(node + 1) * local_size], ranks[local::local_size]


def node_groups(group, local_size: int) -> tuple:
    """(intra, inter) groups for this rank of ``group``: :func:`init`'s if they fit, else shared."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) % number("local_size", local_size, minimum=1, integer=True):
        raise ValueError(f"local_size={local_size} must divide the group size {len(ranks)}")
    _forget_if_stale()
    pair = zip(node_layout(ranks, local_size, dist.get_rank(group)), (_rt.intra, _rt.inter))
    return tuple(group if len(want) == len(ranks) else
                 made if made is not None and dist.get_process_group_ranks(made) == want else
                 shared_group(want, tag="node") for want, made in pair)


def build_fingerprint() -> int:
    """A 56-bit digest of the version and kernel sources; :func:`init` refuses ranks that differ."""
    h = hashlib.sha256(__version__.encode())
    kernels = pathlib.Path(__file__).with_name("kernels")
    for name in ("quant_cpu.cpp", "quant.cu"):
        path = kernels / name
        h.update(b"\0" + name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"missing"))
    return int.from_bytes(h.digest()[:7], "big")


def _exchange_layout(info: LaunchInfo, backend: str) -> list:
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = torch.tensor([info.local_rank, info.local_size, build_fingerprint()], dtype=torch.int64, device=dev)
    everyone = [torch.empty_like(mine) for _ in range(info.size)]
    dist.all_gather(everyone, mine)
    return [tuple(int(v) for v in t.tolist()) for t in everyone]


def timeout() -> Optional[datetime.timedelta]:
    """The ``timeout`` given to :func:`init` (None: torch's), which every group bitscom makes gets. Example::

        bitscom.init(timeout=datetime.timedelta(seconds=60))
        assert bitscom.runtime.timeout().total_seconds() == 60
    """
    return _rt.timeout


def new_group(ranks: Iterable[int], *, backend: Optional[str] = None, use_local_synchronization: bool = False,
              settle: bool = False) -> Any:
    """``dist.new_group`` with :func:`init`'s timeout; ``settle``: all connected before any leaves."""
    group = dist.new_group(list(ranks), timeout=_rt.timeout, backend=backend,
                           use_local_synchronization=use_local_synchronization)
    if settle and group is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.all_reduce(torch.zeros(1, device=group_device(group)), group=group)
    return group


def group_device(group: Any, tensor: Optional[torch.Tensor] = None) -> torch.device:
    """Where small control tensors for ``group`` live: CUDA for NCCL, CPU for gloo (else ``tensor``'s)."""
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if backend == "gloo" or tensor is None else tensor.device


_shared: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # world -> {key: group}
_channels: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # world -> {group: Channel}


def shared_group(ranks: Iterable[int], *, tag: str, backend: Optional[str] = None) -> Any:
    """A group of ``ranks`` made once per tag and world (members only), held weakly."""
    world = _current_world()
    if world is None:
        raise RuntimeError("shared_group() needs torch.distributed: call bitscom.init() first")
    made = _shared.setdefault(world, weakref.WeakValueDictionary())
    ranks = list(ranks)
    key = (tag, tuple(ranks), backend)
    group = made.get(key)
    if group is None:
        group = new_group(ranks, backend=backend, use_local_synchronization=True)
        if isinstance(group, dist.ProcessGroup):
            made[key] = group
    return group


def channel(group, *, later: bool = False) -> Channel:
    """The one :class:`~bitscom.channel.Channel` of ``group`` (``later``: with its later group)."""
    world = _current_world()
    if group is None or world is None or dist.get_world_size(group) <= 1:    # -1: not a member
        return Channel(group)
    made = _channels.setdefault(world, weakref.WeakKeyDictionary())
    ch = made.get(group)
    if ch is None:
        ch = made[group] = Channel(group)
    if later and ch.later_group is None:
        ranks = dist.get_process_group_ranks(group)
        whole = len(ranks) == dist.get_world_size()
        ch.set_later_group(new_group(ranks, use_local_synchronization=not whole, settle=whole))
    return ch


def shutdown() -> None:
    """Destroy the process group bitscom created (if still the default) and forget the groups. Example::

        bitscom.init(); train(); bitscom.shutdown()
    """
    if _rt.owns_pg and not _rt.stale() and dist.is_initialized():
        _NextWorld.agree_port(_rt.info)
        dist.destroy_process_group()
    try:
        _world_gone()
    finally:
        _rt.reset()                   # a failing callback must not leave a dead world recorded


class _NextWorld:
    """The port the next :func:`init` uses, agreed by :func:`shutdown` (docs/reliability.md)."""

    port: Optional[int] = None
    KEY = "bitscom/next-port"

    @classmethod
    def agree_port(cls, info: Optional[LaunchInfo]) -> None:
        cls.port = None
        if info is None or info.size < 2 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return
        try:
            store = dist.distributed_c10d._get_default_store()
            if info.rank == 0:
                store.set(cls.KEY, str(_free_port()))
            port = int(store.get(cls.KEY))
            store.add(cls.KEY + "/read", 1)
            if info.rank == 0:               # keep the store up until every rank has read it
                deadline = time.monotonic() + (timeout() or datetime.timedelta(minutes=30)).total_seconds()
                while store.add(cls.KEY + "/read", 0) < info.size and time.monotonic() < deadline:
                    time.sleep(0.01)
        except (RuntimeError, ValueError, OSError):
            return                             # a peer is gone: the next init uses MASTER_PORT
        cls.port = port


def is_initialized() -> bool:
    """Whether :func:`init` ran, or the user started torch.distributed (then it is adopted). Example::

        if not bitscom.is_initialized():
            bitscom.init()
    """
    return _adopt()


def _info() -> LaunchInfo:
    if not _adopt():
        raise RuntimeError("bitscom is not initialized: call bitscom.init() (or "
                           "torch.distributed.init_process_group) first")
    assert _rt.info is not None
    return _rt.info


def _node_group(which: str) -> Optional[dist.ProcessGroup]:
    _info()
    if _rt.adopted and dist.get_world_size() > 1:
        raise RuntimeError(f"bitscom.{which}() needs the node groups, which bitscom builds in "
                           "init(); the process group was started outside bitscom, so call "
                           "bitscom.init() on every rank first (it adopts the group)")
    return getattr(_rt, which.split("_")[0])


def rank() -> int:
    """This process's rank in the world. Example::

        if bitscom.rank() == 0:
            torch.save(model.state_dict(), "ckpt.pt")
    """
    return _info().rank


def size() -> int:
    """Number of processes in the world. Example::

        lr = 0.01 * bitscom.size()   # the usual linear scaling
    """
    return _info().size


def local_rank() -> int:
    """Rank within this node (the CUDA device bitscom selected). Example::

        loader = make_loader(shard=bitscom.rank(), cache_dir=f"/tmp/cache{bitscom.local_rank()}")
    """
    return _info().local_rank


def local_size() -> int:
    """Number of processes on this node. Example::

        torch.set_num_threads(os.cpu_count() // bitscom.local_size())
    """
    return _info().local_size


def cross_rank() -> int:
    """Index of this node (rank of this process among processes with its local rank). Example::

        print(f"node {bitscom.cross_rank()} of {bitscom.cross_size()}")
    """
    info = _info()
    return info.rank // info.local_size


def cross_size() -> int:
    """Number of nodes. Example::

        hierarchical = bitscom.cross_size() > 1
    """
    info = _info()
    return info.size // info.local_size


def world_group() -> Optional[dist.ProcessGroup]:
    """The world process group (None when running as a single process)."""
    _info()
    return _rt.world


def intra_group() -> Optional[dist.ProcessGroup]:
    """The process group of this node's ranks (None for a single process). Example::

        LowBit(bits=4, hierarchical="two_level", intra_group=bitscom.intra_group(),
               inter_group=bitscom.inter_group())
    """
    return _node_group("intra_group")


def inter_group() -> Optional[dist.ProcessGroup]:
    """The process group of ranks with this local rank, one per node (None for one process). Example::

        dist.all_reduce(node_sums, group=bitscom.inter_group())   # across nodes only
    """
    return _node_group("inter_group")


def device() -> torch.device:
    """The device bitscom selected for this rank (CUDA from the local rank, else CPU)."""
    return _rt.device
