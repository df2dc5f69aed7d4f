"""What the CPU kernels' build is called, where it is built, and a build lock that dies with its holder.

The extension's name carries a hash of every source and header in csrc/, so an edit to any of them
(a header torch's JIT does not track included) builds anew, and nobody bumps a version by hand.

torch's JIT builder (`torch.utils.cpp_extension.load`) guards a build directory with a `lock` file: a
loader creates it, builds or finds the build current, and removes it. A loader killed in between (Ctrl-C
during the first, minutes-long build; a pod killed by its startup probe; a test's timeout) leaves the file
behind, and every later load waits on it forever: the server stays at "loading" and says nothing. A
container restarted in the same pod keeps its cache volume, and the file with it.

So every load of these kernels first takes an flock on a file beside torch's. The kernel releases an
flock when its holder dies, so while we hold it a torch lock file can only be a dead loader's, and we
remove it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from torch.utils.cpp_extension import get_default_build_root

logger = logging.getLogger(__name__)

TORCH_LOCK_NAME = "lock"  # the file torch's FileBaton creates in the build directory
OWN_LOCK_NAME = "mili-build.flock"
SOURCE_SUFFIXES = (".cpp", ".h")
SOURCE_HASH_CHARS = 12


def extension_name(prefix: str, source_dir: Path, shared: tuple[Path, ...] = ()) -> str:
    """`prefix` and a hash of every source and header in `source_dir` (names and contents, in name order), then
    of the `shared` files outside it that its sources include (the AVX2 build's ../csrc headers)."""
    digest = hashlib.sha256()
    for path in [*sorted(p for p in source_dir.iterdir() if p.suffix in SOURCE_SUFFIXES), *shared]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{prefix}_{digest.hexdigest()[:SOURCE_HASH_CHARS]}"


def build_directory(extension_name: str, source_dir: Path) -> Path:
    """The extension's build directory: under TORCH_EXTENSIONS_DIR when set (the Docker image sets it to
    its cache volume), else under torch's per-user default root; one per source checkout. Two checkouts
    sharing a directory (a CI clone beside a working tree) differ in their build files' source paths,
    so ninja rebuilt everything, minutes on 2 cores, at every switch between them."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(get_default_build_root(), "mili-openai")
    checkout = hashlib.sha256(str(source_dir.resolve()).encode()).hexdigest()[:12]
    return Path(root) / f"{extension_name}-{checkout}"


@contextlib.contextmanager
def exclusive_build(directory: Path) -> Iterator[None]:
    """Hold the directory's build lock (waiting for a live loader to finish), with any lock file left by
    a dead one removed."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / OWN_LOCK_NAME, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish building the CPU kernels in %s", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        stale = directory / TORCH_LOCK_NAME
        if stale.exists():
            logger.warning("removing %s, left by a kernel build that was killed before it finished", stale)
            stale.unlink(missing_ok=True)
        yield  # the flock goes with the file's close


def compile_extension(prefix: str, source_dir: Path, sources: tuple[str, ...], cflags: list[str],
                      ldflags: list[str], shared: tuple[Path, ...] = ()):
    """Build (once per checkout and sources, cached by torch) and load an extension of `source_dir`'s `sources`
    under the build lock; None, with a warning, where it cannot be built (no compiler, no ninja, flags the
    compiler refuses): callers keep torch's ops. `shared`: as `extension_name`."""
    try:
        from torch.utils.cpp_extension import load

        name = extension_name(prefix, source_dir, shared)  # a new name, so a new build, for any source edit
        directory = build_directory(name, source_dir)
        with exclusive_build(directory):  # safe against a loader killed mid-build (above)
            return load(name=name, sources=[str(source_dir / source) for source in sources], extra_cflags=cflags,
                        extra_ldflags=ldflags, build_directory=str(directory), verbose=False)
    except Exception as exc:
        logger.warning("CPU kernels %s unavailable, using torch ops: %s", prefix, exc)
        return None
