"""Build hooks (metadata: pyproject.toml): ship ``ckptcache-startup.pth`` into
``site-packages``, and build the copy, base64 and collector extensions
(``ckptcache/format/_copy.c``, ``_b64.c``, ``_gcpause.c``), a save's write-protect scans
(``ckptcache/client/_pagescan.c``), the data plane's record
extension (``ckptcache/server/cluster/dataplane/_records.c``) and, where torch is importable at
build time, the tensor table's C++ loop (``ckptcache/codec/table/_tensors.cpp``).

The file lets ``CKPTCACHE_DEEPSPEED=1`` switch the DeepSpeed adapter on with no code (see
``ckptcache/adapters/_startup.py``). A ``.pth`` file only takes effect at the top of a site
directory, which no ``pyproject.toml`` key of setuptools can target, hence this ``build_py``: it
writes the file at the root of a wheel, and of an editable wheel (``pip install -e``).
"""

from __future__ import annotations

import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

PTH = "ckptcache-startup.pth"


class BuildPyWithStartupHook(build_py):
    """``build_py`` that also puts :data:`PTH` at the top of the wheel."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            # An editable wheel is made of what lands in install_lib (the unpacked wheel);
            # build_lib is a scratch directory there.
            target = self.get_finalized_command("install").install_lib
        else:
            target = self.build_lib
        self.copy_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH),
                       os.path.join(target, PTH))  # fmt: skip

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs.append(os.path.join(self.build_lib, PTH))
        return outputs


# Optional: where it cannot be built (no C compiler), saves copy with libc's memmove
# (ckptcache/format/fastcopy.py says which copy is in use).
COPY = Extension("ckptcache.format._copy", ["ckptcache/format/_copy.c"], optional=True,
                 extra_compile_args=["-O2"])  # fmt: skip
# Optional too: where it cannot be built, base64 is decoded by binascii (ckptcache/format/b64.py).
B64 = Extension("ckptcache.format._b64", ["ckptcache/format/_b64.c"], optional=True,
                extra_compile_args=["-O2"])  # fmt: skip

# Optional too: where it cannot be built, the collector's pauses are counted in Python, where a
# Ctrl-C landing in their bookkeeping may leave the collector off (ckptcache/format/gcpause.py).
GCPAUSE = Extension("ckptcache.format._gcpause", ["ckptcache/format/_gcpause.c"], optional=True,
                    extra_compile_args=["-O2"])  # fmt: skip

# Optional too: where it cannot be built, a save's write-protect scans loop in Python
# (ckptcache/client/_watch.py).
PAGESCAN = Extension("ckptcache.client._pagescan", ["ckptcache/client/_pagescan.c"], optional=True,
                     extra_compile_args=["-O2"])  # fmt: skip

# Optional too: where it cannot be built (no compiler or no OpenSSL headers), the data plane tags
# records with cryptography's Poly1305 and hashes them in a second pass
# (ckptcache/server/cluster/dataplane/_tagging.py says which is in use).
RECORDS = Extension("ckptcache.server.cluster.dataplane._records",
                    ["ckptcache/server/cluster/dataplane/_records.c"], optional=True,
                    libraries=["crypto"], extra_compile_args=["-O2"])  # fmt: skip


def torch_extensions() -> list[Extension]:
    """The tensor table's C++ loop and a save's walk (one module), built against the torch the
    build sees, when ``CKPTCACHE_TORCH_EXTENSION=1`` asks for it (``scripts/setup.sh`` does,
    in place after the install: compiling against torch's headers takes a minute or two, which
    every other install is spared); none where torch cannot be imported: zero-copy loads then
    make their tensors in Python, and saves walk in Python (``ckptcache/codec/table/tensors.py``
    and ``ckptcache/codec/plan/walk.py`` say which is in use)."""
    if os.environ.get("CKPTCACHE_TORCH_EXTENSION", "") != "1":
        return []
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
    except ImportError:
        return []
    abi = str(int(torch._C._GLIBCXX_USE_CXX11_ABI))
    sources = ["ckptcache/codec/table/_tensors.cpp", "ckptcache/codec/table/_walk.cpp"]
    return [CppExtension("ckptcache.codec.table._tensors", sources,
                         depends=["ckptcache/codec/table/_walk.h"], optional=True,
                         extra_compile_args=["-O2", "-std=c++17"],
                         define_macros=[("_GLIBCXX_USE_CXX11_ABI", abi)])]  # fmt: skip


setup(cmdclass={"build_py": BuildPyWithStartupHook},
      ext_modules=[COPY, B64, GCPAUSE, PAGESCAN, RECORDS, *torch_extensions()])  # fmt: skip
