#!/usr/bin/env python3
"""An emulated bandwidth-limited cluster on one machine: network namespaces, veth links, tc tbf.

Compression only pays off when the network is slow; loopback hides that. This module builds
``nodes`` network namespaces (``<prefix>0``, ``<prefix>1``, ...) each joined by one veth pair to a
Linux bridge living in its own namespace (``<prefix>br``). Every link is shaped with a token
bucket (``tc qdisc ... tbf``) on *both* veth ends, so each direction of each node's "NIC" is
limited to ``bandwidth`` — a full-duplex link, like a real Ethernet port. Ranks of one node share
its namespace and talk over the kernel's local path (unshaped, fast), so ``nodes x ranks_per_node``
emulates fast intra-node and slow inter-node traffic.

Nothing touches the root namespace: the bridge is not in it, no address or route is added
to it, the addresses (``10.213.0.0/24`` by default) exist only inside these namespaces, and so
no packet can leave the machine.

Needs root and iproute2 (``ip``, ``tc``); ``apt-get install -y iproute2`` on a bare Debian.
``netem`` is *not* used (not available everywhere); there is no added propagation delay.

Command line (see ``scripts/cluster.sh`` for the thin shell wrapper)::

    python scripts/cluster.py up --nodes 2 --bandwidth 1gbit      # create and leave up
    python scripts/cluster.py status
    python scripts/cluster.py launch -- python scripts/allreduce_bench.py   # on the cluster that is up
    python scripts/cluster.py down                                 # remove everything by prefix
    python scripts/cluster.py run --nodes 2 --ranks-per-node 2 --bandwidth 10gbit -- \\
        python scripts/allreduce_bench.py                          # up + launch + always down

Each rank gets torchrun-style variables: ``MASTER_ADDR`` (node 0's address), ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``NODE_RANK``,
plus ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set to the node's veth and
``OMP_NUM_THREADS`` (cores / world size) unless already set.

Python API::

    from cluster import Cluster
    with Cluster(nodes=2, ranks_per_node=1, bandwidth="1gbit") as c:
        rc = c.launch(["python", "train.py"])
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields

DEFAULT_PREFIX = "bcns"
DEFAULT_SUBNET = "10.213.0"          # /24, only inside the namespaces
NODE_IFNAME = "veth0"                # the node's "NIC" inside its namespace
BRIDGE = "br0"                       # the switch, inside <prefix>br
STATE_DIR = tempfile.gettempdir()   # state files: mkstemp names, mode 0600, checked on read

_RATE_UNITS = {"": 1, "bit": 1, "k": 1e3, "kbit": 1e3, "m": 1e6, "mbit": 1e6,
               "g": 1e9, "gbit": 1e9, "t": 1e12, "tbit": 1e12}


def parse_rate(rate) -> int:
    """Parse ``"1gbit"``, ``"10G"``, ``"500mbit"``, ``"1e9"`` or a number (bits/s) into bits/s."""
    if isinstance(rate, (int, float)):
        bits = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*(?:/s|ps)?\s*", str(rate))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _RATE_UNITS:
            raise ValueError(f"bandwidth {rate!r} not understood; use e.g. 1gbit, 10gbit, 500mbit, 1e9")
        bits = float(m.group(1)) * _RATE_UNITS[unit]
    if not bits > 0:
        raise ValueError(f"bandwidth must be positive, got {rate!r}")
    return int(bits)


def format_rate(bits: int) -> str:
    for unit, div in (("Gbit", 1e9), ("Mbit", 1e6), ("Kbit", 1e3)):
        if bits >= div:
            return f"{bits / div:g}{unit}"
    return f"{bits}bit"


def tbf_params(bits_per_s: int, burst_ms: float = 1.0, latency_ms: float = 20.0) -> dict:
    """Token-bucket parameters for one link.

    ``burst`` is the bucket size: it must hold at least one timer tick's worth of bytes at the
    target rate, or the link runs slower than asked (at 10 Gbit/s, 1 ms is 1.25 MB); it also
    must hold a 64 KiB GSO super-packet. ``latency`` bounds the queue (limit = rate*latency +
    burst); too short a queue drops packets and TCP then under-fills the link.
    """
    burst = max(int(bits_per_s / 8 * burst_ms / 1e3), 128 * 1024)
    return {"rate": f"{bits_per_s}bit", "burst": str(burst), "latency": f"{latency_ms:g}ms"}


def have_tools() -> tuple[bool, str]:
    """Whether this machine can build the cluster; the reason when it cannot."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found; apt-get install -y iproute2"
    return True, ""


def _sh(*cmd, check=True, capture=False):
    r = subprocess.run([str(c) for c in cmd], text=True,
                       stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
    if check and r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stderr.strip()}")
    return r.stdout if capture else r.returncode


def list_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Namespaces that belong to a cluster with this prefix (<prefix>br and <prefix><digits>)."""
    out = _sh("ip", "netns", "list", capture=True, check=False) or ""
    pat = re.compile(rf"^{re.escape(prefix)}(br|\d+)$")
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if pat.match(n))


def _kill_ns_processes(ns: str):
    out = _sh("ip", "netns", "pids", ns, capture=True, check=False) or ""
    pids = [int(p) for p in out.split() if p.isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        time.sleep(0.5)
        pids = alive


def teardown(prefix: str = DEFAULT_PREFIX, quiet: bool = True) -> list[str]:
    """Remove every namespace (and so every veth, bridge and qdisc) of the cluster ``prefix``.

    Processes still running inside are killed first, or the namespace would outlive its name.
    Idempotent: safe to call when nothing is up.
    """
    removed = []
    for ns in list_namespaces(prefix):
        _kill_ns_processes(ns)
        if _sh("ip", "netns", "del", ns, check=False) == 0:
            removed.append(ns)
    for path in _state_files(prefix):
        _unlink(path)
    if removed and not quiet:
        print(f"[cluster] removed {' '.join(removed)}", file=sys.stderr)
    return removed


# The state `up` leaves for `launch` lives in the shared temporary directory, so it is written
# only through mkstemp (an unpredictable name, O_EXCL, mode 0600: nothing planted there or
# linked from there is followed or overwritten) and read back only from a regular file that
# this user owns and nobody else can read or write (checked on the open file descriptor).
def _private(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _state_files(prefix: str) -> list[str]:
    """This user's private state files for ``prefix``, oldest first."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(STATE_DIR), f"bitscom_cluster_{prefix}.*.json")):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if _private(st):
            found.append((st.st_mtime_ns, path))
    return [path for _, path in sorted(found)]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _save_state(c: "Cluster") -> str:
    """Write ``c``'s settings for a later ``launch``; replaces earlier files of its prefix."""
    old = _state_files(c.prefix)
    fd, path = tempfile.mkstemp(prefix=f"bitscom_cluster_{c.prefix}.", suffix=".json", dir=STATE_DIR)
    with os.fdopen(fd, "w") as f:
        json.dump({k: v for k, v in asdict(c).items() if not k.startswith("_")}, f)
    for p in old:
        _unlink(p)
    return path


def _load_state(prefix: str) -> dict:
    files = _state_files(prefix)
    if not files:
        raise RuntimeError(f"no cluster with prefix {prefix!r} is up; run 'cluster.py up' first")
    path = files[-1]
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        if not _private(os.fstat(f.fileno())):
            raise RuntimeError(f"{path} is not a state file of this user (owner or mode changed); remove it")
        cfg = json.load(f)
    known = {fl.name for fl in fields(Cluster) if not fl.name.startswith("_")}
    if not isinstance(cfg, dict) or set(cfg) - known:
        what = sorted(cfg) if isinstance(cfg, dict) else type(cfg).__name__
        raise RuntimeError(f"{path} is not a state file of cluster.py (got {what}); remove it")
    return cfg


@dataclass
class Cluster:
    """``nodes`` namespaces x ``ranks_per_node`` ranks, each node linked at ``bandwidth``.

    ``bandwidth=None`` leaves links unshaped (veth speed, many Gbit/s). Use as a context
    manager, or call :meth:`up` and :meth:`down` yourself (``down`` in a ``finally``).
    """

    nodes: int = 2
    ranks_per_node: int = 1
    bandwidth: str | int | None = "1gbit"   # per direction per node; None = unshaped
    prefix: str = DEFAULT_PREFIX            # namespace names: <prefix>0.., <prefix>br
    subnet: str = DEFAULT_SUBNET            # first three octets of a /24 private to the cluster
    burst_ms: float = 1.0                   # tbf bucket, in ms of traffic at the rate
    latency_ms: float = 20.0                # tbf queue bound
    mtu: int = 1500                         # 9000 emulates jumbo frames (less CPU per byte)
    master_port: int = 29500
    _is_up: bool = field(default=False, repr=False)

    def __post_init__(self):
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: use 1-8 lower-case letters/digits, starting with a letter")
        if not (1 <= self.nodes <= 250):
            raise ValueError(f"nodes must be in 1..250, got {self.nodes}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        octets = self.subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
            raise ValueError(f"subnet {self.subnet!r}: give three octets, e.g. 10.213.0")
        if self.bandwidth is not None and str(self.bandwidth).lower() not in ("", "none", "0"):
            self.bits_per_s = parse_rate(self.bandwidth)
        else:
            self.bits_per_s = None

    # ---- names -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def ns(self, node: int) -> str:
        return f"{self.prefix}{node}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}br"

    def addr(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    # ---- life cycle --------------------------------------------------------------------
    def up(self):
        ok, why = have_tools()
        if not ok:
            raise RuntimeError(f"cannot build the emulated cluster: {why}")
        if list_namespaces(self.prefix):
            raise RuntimeError(f"namespaces with prefix {self.prefix!r} exist already "
                               f"({' '.join(list_namespaces(self.prefix))}); "
                               f"run 'scripts/cluster.sh down' or pick another prefix")
        self._is_up = True   # from here on, down() must run even if we fail half-way
        br = self.bridge_ns
        _sh("ip", "netns", "add", br)
        _sh("ip", "-n", br, "link", "set", "lo", "up")
        _sh("ip", "-n", br, "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "-n", br, "link", "set", BRIDGE, "up")
        for i in range(self.nodes):
            ns, port = self.ns(i), f"p{i}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            # the pair is born inside the bridge namespace; one end moves straight into the node
            _sh("ip", "-n", br, "link", "add", port, "mtu", self.mtu, "type", "veth",
                "peer", "name", NODE_IFNAME, "mtu", self.mtu, "netns", ns)
            _sh("ip", "-n", br, "link", "set", port, "master", BRIDGE)
            _sh("ip", "-n", br, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", NODE_IFNAME)
            _sh("ip", "-n", ns, "link", "set", NODE_IFNAME, "up")
            if self.bits_per_s:
                p = tbf_params(self.bits_per_s, self.burst_ms, self.latency_ms)
                for where, dev in ((ns, NODE_IFNAME), (br, port)):   # node->switch, switch->node
                    _sh("tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf",
                        "rate", p["rate"], "burst", p["burst"], "latency", p["latency"])
        _save_state(self)
        return self

    def down(self):
        teardown(self.prefix)
        self._is_up = False

    def __enter__(self):
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc):
        self.down()
        return False

    @classmethod
    def attach(cls, prefix: str = DEFAULT_PREFIX) -> "Cluster":
        """The cluster that ``up`` left running under ``prefix`` (for ``launch``)."""
        c = cls(**_load_state(prefix))
        c._is_up = True
        return c

    def describe(self) -> str:
        bw = format_rate(self.bits_per_s) + "/s per direction" if self.bits_per_s else "unshaped"
        return (f"{self.nodes} node(s) x {self.ranks_per_node} rank(s), links {bw}, "
                f"namespaces {self.ns(0)}..{self.ns(self.nodes - 1)} + {self.bridge_ns}, "
                f"{self.subnet}.0/24, master {self.addr(0)}:{self.master_port}")

    # ---- ranks -------------------------------------------------------------------------
    def rank_env(self, rank: int, base: dict | None = None) -> dict:
        node, local = divmod(rank, self.ranks_per_node)
        env = dict(os.environ if base is None else base)
        env.update({
            "MASTER_ADDR": self.addr(0), "MASTER_PORT": str(self.master_port),
            "RANK": str(rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "GROUP_RANK": str(node), "NODE_RANK": str(node),
            "GLOO_SOCKET_IFNAME": NODE_IFNAME, "NCCL_SOCKET_IFNAME": NODE_IFNAME,
            "BITSCOM_CLUSTER": self.describe(),
        })
        for var in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                    "SLURM_PROCID", "SLURM_NTASKS"):
            env.pop(var, None)   # so launcher discovery sees torchrun-style variables only
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.world_size)))
        return env

    def launch(self, cmd: list[str], timeout: float | None = None, grace_s: float = 10.0,
               log_dir: str | None = None, env: dict | None = None) -> int:
        """Start rank i of ``cmd`` inside node i // ranks_per_node's namespace; wait for all.

        Returns the first non-zero exit status (or 0). When one rank fails, the others get
        ``grace_s`` seconds to fail on their own (their error says more) and are then killed;
        on ``timeout`` everyone is killed and 124 is returned.
        """
        if not cmd:
            raise ValueError("launch: empty command")
        procs, logs = [], []
        try:
            for r in range(self.world_size):
                node = r // self.ranks_per_node
                out = None
                if log_dir:
                    os.makedirs(log_dir, exist_ok=True)
                    out = open(os.path.join(log_dir, f"rank{r}.log"), "w")
                    logs.append(out)
                procs.append(subprocess.Popen(["ip", "netns", "exec", self.ns(node), *cmd],
                                              env=self.rank_env(r, env), stdout=out,
                                              stderr=subprocess.STDOUT if out else None,
                                              start_new_session=True))
            deadline = time.monotonic() + timeout if timeout else None
            failed_at, rc = None, 0
            while True:
                codes = [p.poll() for p in procs]
                bad = [c for c in codes if c not in (None, 0)]
                if bad and failed_at is None:
                    failed_at, rc = time.monotonic(), bad[0]
                if all(c is not None for c in codes):
                    return rc
                now = time.monotonic()
                if deadline and now > deadline:
                    print(f"[cluster] timeout after {timeout:g}s; killing ranks", file=sys.stderr)
                    return 124
                if failed_at is not None and now - failed_at > grace_s:
                    print(f"[cluster] a rank exited with {rc}; killing the others", file=sys.stderr)
                    return rc
                time.sleep(0.05)
        finally:
            _kill_all(procs)
            for f in logs:
                f.close()


def _kill_all(procs):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 3
        while any(p.poll() is None for p in live) and time.monotonic() < end:
            time.sleep(0.05)


class _Stop(BaseException):
    pass


def _install_signal_handlers():
    def handler(signum, frame):
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)   # a second ^C must not interrupt the teardown
        raise _Stop(signum)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)


def _cluster_from_args(a) -> Cluster:
    return Cluster(nodes=a.nodes, ranks_per_node=a.ranks_per_node, bandwidth=a.bandwidth,
                   prefix=a.prefix, subnet=a.subnet, burst_ms=a.burst_ms,
                   latency_ms=a.latency_ms, mtu=a.mtu, master_port=a.master_port)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, shape=True):
        p.add_argument("--prefix", default=os.environ.get("BITSCOM_NS_PREFIX", DEFAULT_PREFIX),
                       help="namespace name prefix (default %(default)s)")
        if not shape:
            return
        p.add_argument("--nodes", type=int, default=2, help="namespaces (emulated hosts)")
        p.add_argument("--ranks-per-node", type=int, default=1, help="ranks sharing one namespace")
        p.add_argument("--bandwidth", default="1gbit",
                       help="per-link rate each direction, e.g. 1gbit, 10gbit; 'none' = unshaped")
        p.add_argument("--subnet", default=DEFAULT_SUBNET, help="three octets of the private /24")
        p.add_argument("--burst-ms", type=float, default=1.0, help="tbf bucket in ms at the rate")
        p.add_argument("--latency-ms", type=float, default=20.0, help="tbf queue bound in ms")
        p.add_argument("--mtu", type=int, default=1500)
        p.add_argument("--master-port", type=int, default=29500)

    def launch_opts(p):
        p.add_argument("--timeout", type=float, default=None, help="kill all ranks after this many s")
        p.add_argument("--log-dir", default=None, help="write rank<i>.log here instead of the terminal")
        p.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run on every rank")

    common(sub.add_parser("up", help="create the namespaces and shaped links, and leave them up"))
    common(sub.add_parser("down", help="remove every namespace with the prefix"), shape=False)
    common(sub.add_parser("status", help="list the cluster's namespaces and qdiscs"), shape=False)
    p = sub.add_parser("launch", help="run a command on every rank of the cluster that is up")
    common(p, shape=False)
    launch_opts(p)
    p = sub.add_parser("run", help="up, run a command on every rank, always down")
    common(p)
    launch_opts(p)
    a = ap.parse_args(argv)

    if a.cmd == "down":
        removed = teardown(a.prefix)
        print(f"removed: {' '.join(removed) or 'nothing'}")
        return 0
    if a.cmd == "status":
        names = list_namespaces(a.prefix)
        if not names:
            print(f"no namespaces with prefix {a.prefix!r}")
            return 1
        for ns in names:
            print(f"== {ns}")
            print(_sh("ip", "-n", ns, "-br", "addr", capture=True, check=False).rstrip())
            print(_sh("tc", "-n", ns, "qdisc", "show", capture=True, check=False).rstrip())
        return 0
    if a.cmd == "up":
        c = _cluster_from_args(a)
        try:
            c.up()
        except BaseException:
            c.down()
            raise
        print(f"up: {c.describe()}")
        return 0

    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the command to run after --")
    _install_signal_handlers()
    if a.cmd == "launch":
        c = Cluster.attach(a.prefix)
        try:
            return c.launch(cmd, timeout=a.timeout, log_dir=a.log_dir)
        except _Stop as s:
            print(f"[cluster] stopped by signal {s.args[0]}", file=sys.stderr)
            return 130
    c = _cluster_from_args(a)   # run
    try:
        c.up()
        print(f"[cluster] {c.describe()}", file=sys.stderr, flush=True)
        return c.launch(cmd, timeout=a.timeout, log_dir=a.log_dir)
    except _Stop as s:
        print(f"[cluster] stopped by signal {s.args[0]}", file=sys.stderr)
        return 130
    finally:
        c.down()


if __name__ == "__main__":
    sys.exit(main())
