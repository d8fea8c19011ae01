"""The Horovod face (bitscom.horovod) on the shared stack: init's timeout reaches its handles,
and it refuses to run as a silent local no-op before init under a multi-process launcher.

Both tests need a special start (a 5 s init timeout; no init at all), so they spawn their own
processes instead of using the shared pools.
"""

import datetime
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from bitscom.comm import Rounds

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compat", "scripts")


# ----------------------------------------------------------- a stalled peer (issue 20, 1b)
def _stalled_pair(rank, world, port, queue, release):
    from distpool import worker_env
    os.environ.update(worker_env(rank, world, port, world))
    torch.set_num_threads(1)
    import bitscom                    # run_spawned: every rank has imported it by now
    try:
        bitscom.init(timeout=datetime.timedelta(seconds=5))
    except Exception as err:  # noqa: BLE001 — reported to the test
        queue.put((-1.0, f"init failed: {err!r}"))
        os._exit(1)
    if rank == 1:
        release.wait(40)              # the stalled peer: does not reach the call for 40 s
        os._exit(0)
    start = time.monotonic()
    try:
        bitscom.synchronize(bitscom.allreduce_async(torch.ones(3), name="stalled"))
        outcome = "completed"
    except Exception as err:  # noqa: BLE001 — reported to the test
        outcome = f"{type(err).__name__}: {err}"
    queue.put((time.monotonic() - start, outcome))
    queue.close()
    queue.join_thread()
    os._exit(0)


def test_async_allreduce_with_a_stalled_peer_fails_within_the_init_timeout():
    from distpool import run_spawned
    [(elapsed, outcome)] = run_spawned(_stalled_pair, 2, results=1,
                                       timeout=90)
    assert outcome != "completed" and not outcome.startswith("init failed"), outcome
    assert elapsed < 30, f"rank 0 waited {elapsed:.0f} s for a stalled peer (init timeout: 5 s)"
    assert outcome.startswith("RuntimeError") and "bitscom.allreduce_async 'stalled'" in outcome, outcome
    assert "timeout" in outcome and "0:00:05" in outcome, outcome


class _FailingWork:
    def is_completed(self):
        return True

    def wait(self, timeout=None):
        raise RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")


def test_a_failed_collective_names_the_bitscom_call():
    from bitscom.horovod.failures import guard

    def rounds():
        yield guard(_FailingWork(), "bitscom.allgather 'x'")

    with pytest.raises(RuntimeError, match=r"bitscom.allgather 'x'.*did not complete.*Timed out") as info:
        Rounds(rounds()).wait()
    assert isinstance(info.value.__cause__, RuntimeError)


# ----------------------------------------------- before init under a launcher (issue 20, 2)
def test_calls_before_init_under_a_launcher_raise_instead_of_running_locally():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "hvd_before_init.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["initialized"] is False
    for call, outcome in result["calls"].items():
        assert outcome.startswith("RuntimeError: "), f"{call}: {outcome}"
        face = call if call.startswith("acpsgd.") else f"bitscom.{call}"
        assert face in outcome and "before bitscom.init()" in outcome, f"{call}: {outcome}"
        assert "started 2 processes" in outcome, f"{call}: {outcome}"


# ----------------------------------------------------------------- one stack underneath
def _counted(rank, world):
    import bitscom
    from bitscom.horovod.negotiation import H_FIXED, MAX_DIMS
    header = (H_FIXED + MAX_DIMS + world) * 8                  # int64 header, all-gathered
    h = bitscom.allreduce_async(torch.ones(3, 5))             # float32: 60 bytes of payload
    gathered = bitscom.allgather_async(torch.ones(rank + 1, 2, dtype=torch.float64))
    bitscom.synchronize(h), bitscom.synchronize(gathered)
    return h.bytes_sent - header, gathered.bytes_sent - header


def test_handles_count_their_bytes_through_comm(pools):
    for reduced, gathered in pools.run(2, _counted, timeout=60):
        assert reduced == 60
        assert gathered == 2 * 2 * 8          # padded to the longest first dimension (2 rows)


def test_codec_base_class_is_one_class_under_every_spelling():
    import bitscom
    from bitscom.horovod import HorovodCodec, HorovodCompressor
    assert bitscom.compression.Compressor is HorovodCodec is HorovodCompressor
    with pytest.warns(DeprecationWarning, match="bitscom.compression.Compressor"):
        from bitscom.compressors.hvd_adapter import HorovodCompressor as old
    assert old is HorovodCodec
    import bitscom.hvd_ops
    assert bitscom.hvd_ops.allreduce is bitscom.allreduce and bitscom.hvd_ops.Handle is bitscom.Handle
