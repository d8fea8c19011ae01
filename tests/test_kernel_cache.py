"""The native CPU kernel cache: private directory, owner/mode checks, hash before loading."""

import os
import shutil
import stat
import subprocess
import tempfile

import pytest

from bitscom.kernels import cpu_native

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler")

PLANT = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("BITSCOM_TEST_MARKER"), "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


TINY = r"""
extern "C" int bq_quantize() { return 0; }
extern "C" int bq_dequant_acc() { return 0; }
extern "C" int bq_dsr() { return 0; }
extern "C" int bq_sign_encode() { return 0; }
extern "C" int bq_sign_decode_sum() { return 0; }
"""


@pytest.fixture(autouse=True)
def tiny_source(tmp_path, monkeypatch):
    """The cache logic does not depend on the kernel's source; a tiny one builds in a blink
    (the real kernel is built and checked in test_kernels.py)."""
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY)
    monkeypatch.setattr(cpu_native, "SOURCE", src)
    monkeypatch.setattr(cpu_native, "FLAG_SETS", ([],))
    monkeypatch.setattr(cpu_native, "BASE_FLAGS", ["-O0", "-shared", "-fPIC"])


def _lib_files(d):
    return sorted(p for p in os.listdir(d) if p.endswith(".so"))


@needs_compiler
def test_builds_into_a_private_directory_with_a_hash(tmp_path):
    root = tmp_path / "cache" / "bitscom"
    assert cpu_native.load(root) is not None
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    libs = _lib_files(root)
    assert len(libs) == 1 and len(os.listdir(root)) == 2, os.listdir(root)   # no temporary file left
    digest = (root / libs[0].replace(".so", ".sha256")).read_text().strip()
    assert digest == cpu_native._sha256(root / libs[0])
    assert cpu_native.load(root) is not None          # second load: from the cache


@needs_compiler
def test_planted_library_is_never_loaded(tmp_path, monkeypatch):
    root = tmp_path / "bitscom"
    assert cpu_native.load(root) is not None
    (lib,) = _lib_files(root)
    good = cpu_native._sha256(root / lib)
    # Replace the cached library with one that announces itself when loaded.
    src = tmp_path / "plant.c"
    src.write_text(PLANT)
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(root / lib)], check=True)
    marker = tmp_path / "marker"
    monkeypatch.setenv("BITSCOM_TEST_MARKER", str(marker))
    assert cpu_native.load(root) is not None
    assert not marker.exists(), "a library whose hash does not match was loaded"
    assert cpu_native._sha256(root / lib) == good     # rebuilt and republished


@needs_compiler
def test_group_writable_library_is_rebuilt(tmp_path):
    root = tmp_path / "bitscom"
    cpu_native.load(root)
    (lib,) = _lib_files(root)
    os.chmod(root / lib, 0o666)
    assert cpu_native.load(root) is not None
    assert stat.S_IMODE(os.stat(root / lib).st_mode) & 0o022 == 0


@pytest.mark.parametrize("setup,words", [
    (lambda d: (d.mkdir(), os.chmod(d, 0o777)), "writable by group or others (mode 777)"),
    (lambda d: (d.mkdir(), os.chmod(d, 0o770)), "writable by group or others (mode 770)"),
    (lambda d: (d.parent.joinpath("elsewhere").mkdir(), d.symlink_to(d.parent / "elsewhere")),
     "symbolic link"),
    (lambda d: d.write_text("not a directory"), "not a directory"),
])
def test_unsafe_cache_directory_falls_back_to_torch(tmp_path, setup, words):
    d = tmp_path / "bitscom"
    setup(d)
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.warns(UserWarning, match="slower eager torch path") as record:
        assert cpu_native.load(d) is None
    assert any(words in str(w.message) for w in record), [str(w.message) for w in record]
    new = {n for n in set(os.listdir(tempfile.gettempdir())) - before if "bitscom" in n}
    assert not new, f"fell back to the shared temp directory: {new}"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory to another user")
def test_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "bitscom"
    d.mkdir(mode=0o700)
    os.chown(d, 1, 1)
    with pytest.warns(UserWarning, match="owned by uid 1"):
        assert cpu_native.load(d) is None


def test_uncreatable_cache_directory_falls_back_to_torch(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.warns(UserWarning, match="cannot be created"):
        assert cpu_native.load(blocker / "bitscom") is None


# Every directory from the file-system root down to the cache must be safe: a directory above
# it that another user can write to lets that user swap the cache (or a parent) for their own.
def _ancestor(tmp_path):
    top = tmp_path / "shared"
    top.mkdir(mode=0o755)
    return top, top / "cache" / "bitscom"


@pytest.mark.parametrize("mode,owner,words", [
    (0o777, None, "writable by group or others (mode 777)"),
    (0o775, None, "writable by group or others (mode 775)"),
    (0o755, 12345, "owned by uid 12345"),
    (0o1777, 12345, "owned by uid 12345"),                  # sticky, but not root's: no exception
])
def test_unsafe_directory_above_the_cache_is_refused(tmp_path, mode, owner, words):
    top, d = _ancestor(tmp_path)
    if owner is not None:
        if os.geteuid() != 0:
            pytest.skip("needs root to hand a directory to another user")
        os.chown(top, owner, owner)
    os.chmod(top, mode)
    with pytest.warns(UserWarning, match="slower eager torch path") as record:
        assert cpu_native.cache_dir(d) is None
    text = " ".join(str(w.message) for w in record)
    assert words in text and str(top) in text, text
    assert not (top / "cache").exists(), "created a directory inside an unsafe one"


def test_root_owned_sticky_directory_above_the_cache_is_accepted(tmp_path):
    top, d = _ancestor(tmp_path)
    os.chmod(top, 0o1777)                                    # like /tmp (owned by root here only as root)
    if os.stat(top).st_uid != 0:
        pytest.skip("needs root: the sticky exception is for root-owned directories")
    got = cpu_native.cache_dir(d)
    assert got is not None and got == d.resolve()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_missing_directories_above_the_cache_are_created_private(tmp_path):
    d = tmp_path / "a" / "b" / "bitscom"
    old = os.umask(0)                                        # a permissive umask must not leak through
    try:
        assert cpu_native.cache_dir(d) is not None
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a" / "b", d):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p


def test_symlinked_directory_above_the_cache_is_judged_by_its_target(tmp_path):
    target = tmp_path / "open"
    target.mkdir()
    os.chmod(target, 0o777)
    (tmp_path / "link").symlink_to(target)
    with pytest.warns(UserWarning, match=r"writable by group or others \(mode 777\)"):
        assert cpu_native.cache_dir(tmp_path / "link" / "bitscom") is None


def test_default_cache_under_a_world_writable_dot_cache_is_refused(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    os.chmod(home, 0o755)
    os.chmod(home / ".cache", 0o777)
    monkeypatch.setenv("HOME", str(home))
    with pytest.warns(UserWarning, match=r"\.cache above it: it is writable by group or others \(mode 777\)"):
        assert cpu_native.cache_dir() is None
    assert not (home / ".cache" / "bitscom").exists()
