"""The emulated cluster (scripts/cluster.py): namespaces come and go, links are shaped, ranks get env.

Needs root and iproute2; skips cleanly otherwise. Uses its own namespace prefix, so it never
touches a cluster a benchmark has up. No torch here: throughput is checked with plain sockets.
"""
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import cluster  # noqa: E402

PREFIX = f"bct{os.getpid() % 10000}"
OK, WHY = cluster.have_tools()
needs_netns = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")


def test_parse_rate():
    assert cluster.parse_rate("1gbit") == 10**9
    assert cluster.parse_rate("10G") == 10 * 10**9
    assert cluster.parse_rate("500mbit") == 500 * 10**6
    assert cluster.parse_rate("2.5gbit/s") == 2_500_000_000
    assert cluster.parse_rate(1e9) == 10**9
    for bad in ("fast", "-1gbit", "0", "1 parsec"):
        with pytest.raises(ValueError):
            cluster.parse_rate(bad)


def test_tbf_burst_scales_with_rate():
    assert int(cluster.tbf_params(10**9)["burst"]) == 128 * 1024            # floor: one GSO packet+
    assert int(cluster.tbf_params(10 * 10**9)["burst"]) == 10 * 10**9 // 8 // 1000   # 1 ms at 10G


def test_bad_settings_rejected():
    with pytest.raises(ValueError, match="prefix"):
        cluster.Cluster(prefix="Bad-Name")
    with pytest.raises(ValueError, match="nodes"):
        cluster.Cluster(nodes=0)
    with pytest.raises(ValueError, match="subnet"):
        cluster.Cluster(subnet="10.213")
    c = cluster.Cluster(nodes=2, ranks_per_node=2, bandwidth="none", prefix="x1")
    assert c.bits_per_s is None and c.world_size == 4


def test_rank_env_is_torchrun_style():
    c = cluster.Cluster(nodes=2, ranks_per_node=2, bandwidth="1gbit", prefix="x1")
    env = c.rank_env(3, base={"OMPI_COMM_WORLD_RANK": "9"})
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "2" and env["NODE_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.213.0.1" and env["GLOO_SOCKET_IFNAME"] == "veth0"
    assert "OMPI_COMM_WORLD_RANK" not in env


@pytest.fixture
def clean():
    cluster.teardown(PREFIX)
    yield
    cluster.teardown(PREFIX)
    assert cluster.list_namespaces(PREFIX) == []


@needs_netns
def test_up_down_creates_and_removes_namespaces(clean):
    with cluster.Cluster(nodes=2, bandwidth="1gbit", prefix=PREFIX) as c:
        assert cluster.list_namespaces(PREFIX) == sorted([c.bridge_ns, c.ns(0), c.ns(1)])
        q = subprocess.run(["tc", "-n", c.ns(0), "qdisc", "show", "dev", "veth0"],
                           capture_output=True, text=True).stdout
        assert "tbf" in q and "1Gbit" in q
        q = subprocess.run(["tc", "-n", c.bridge_ns, "qdisc", "show", "dev", "p1"],
                           capture_output=True, text=True).stdout
        assert "tbf" in q
        # nothing in the root namespace: no bridge, no veth, no route to the private subnet
        assert c.subnet not in subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
        with pytest.raises(RuntimeError, match="exist already"):
            cluster.Cluster(nodes=1, prefix=PREFIX).up()
    assert cluster.list_namespaces(PREFIX) == []


@needs_netns
def test_launch_env_and_failure_kills_the_rest(clean, tmp_path):
    with cluster.Cluster(nodes=2, ranks_per_node=2, bandwidth=None, prefix=PREFIX) as c:
        rc = c.launch(["sh", "-c", 'echo "$RANK $LOCAL_RANK $WORLD_SIZE $MASTER_ADDR"; '
                       'ip -4 -o addr show veth0'], log_dir=str(tmp_path), timeout=30)
        assert rc == 0
        out = [open(tmp_path / f"rank{r}.log").read() for r in range(4)]
        assert out[3].startswith("3 1 4 10.213.0.1") and "10.213.0.2/24" in out[3]
        assert "10.213.0.1/24" in out[0]
        t0 = time.monotonic()
        rc = c.launch(["sh", "-c", '[ "$RANK" = 1 ] && exit 7; sleep 60'], grace_s=0.5, timeout=30)
        assert rc == 7 and time.monotonic() - t0 < 15


@needs_netns
def test_run_always_tears_down_even_on_failure():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "cluster.py"), "run",
                        "--prefix", PREFIX, "--nodes", "2", "--", "sh", "-c", "exit 5"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 5
    assert cluster.list_namespaces(PREFIX) == []


_SERVER = textwrap.dedent("""
    import socket, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 29555)); s.listen(1); c, _ = s.accept()
    n, t0 = 0, None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        if t0 is None: t0 = time.perf_counter()
        n += len(b)
    print(n * 8 / (time.perf_counter() - t0))
""")
_CLIENT = textwrap.dedent("""
    import socket, time
    for _ in range(100):
        try: c = socket.create_connection(("10.213.0.1", 29555)); break
        except OSError: time.sleep(0.05)
    c.sendall(b"x" * (3 << 20)); c.close()
""")


@needs_netns
def test_shaped_link_limits_throughput(clean):
    rate = 50 * 10**6     # 3 MiB at 50 Mbit/s: ~0.5 s
    with cluster.Cluster(nodes=2, bandwidth=rate, prefix=PREFIX) as c:
        srv = subprocess.Popen(["ip", "netns", "exec", c.ns(0), sys.executable, "-c", _SERVER],
                               stdout=subprocess.PIPE, text=True)
        subprocess.run(["ip", "netns", "exec", c.ns(1), sys.executable, "-c", _CLIENT], timeout=30, check=True)
        out, _ = srv.communicate(timeout=30)
    measured = float(out)
    assert 0.4 * rate < measured < 1.3 * rate, f"measured {measured / 1e6:.1f} Mbit/s on a 50 Mbit/s link"


# The state file `up` leaves for `launch`/`down` lives in a shared temporary directory: it must
# be created unpredictably and privately (mkstemp, 0600), and only a private regular file of
# this user may be read back (another user could plant or link one there).
@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(cluster, "STATE_DIR", str(d))
    return d


def test_state_file_is_private_and_unpredictable(state_dir):
    c = cluster.Cluster(nodes=3, ranks_per_node=2, bandwidth="10gbit", prefix="xs")
    path = cluster._save_state(c)
    assert os.path.dirname(path) == str(state_dir) and path != str(state_dir / "bitscom_cluster_xs.json")
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    back = cluster.Cluster.attach("xs")
    assert (back.nodes, back.ranks_per_node, back.bits_per_s, back._is_up) == (3, 2, 10**10, True)
    again = cluster._save_state(c)                 # a second `up` replaces the first file
    assert os.listdir(state_dir) == [os.path.basename(again)]
    cluster.teardown("xs")
    assert os.listdir(state_dir) == []


def _plant(state_dir, name, text='{"nodes": 9, "prefix": "xs"}'):
    path = state_dir / name
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


@pytest.mark.parametrize("how", ["predictable name", "group readable", "other owner", "symlink",
                                 "unknown key"])
def test_planted_state_file_is_not_trusted(state_dir, tmp_path, how):
    if how == "predictable name":          # what older versions wrote and read
        _plant(state_dir, "bitscom_cluster_xs.json")
    elif how == "group readable":
        os.chmod(_plant(state_dir, "bitscom_cluster_xs.abc123.json"), 0o640)
    elif how == "other owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to hand a file to another user")
        os.chown(_plant(state_dir, "bitscom_cluster_xs.abc123.json"), 12345, 12345)
    elif how == "symlink":
        target = _plant(tmp_path, "elsewhere.json")
        (state_dir / "bitscom_cluster_xs.abc123.json").symlink_to(target)
    else:
        _plant(state_dir, "bitscom_cluster_xs.abc123.json", '{"nodes": 2, "__class__": 1}')
    with pytest.raises(RuntimeError, match="no cluster with prefix 'xs' is up|not a state file"):
        cluster.Cluster.attach("xs")
