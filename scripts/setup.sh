#!/usr/bin/env bash
# Idempotent environment set-up shared by demo.sh and test.sh: a virtualenv in .venv with the
# CPU build of torch installed FIRST (any other torch spec would pull a multi-GB CUDA build),
# then the project and, with "test", its test extras and system packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip_install() { python -m pip install -q --disable-pip-version-check "$@"; }
python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
    || pip_install torch==2.13.0
if [ "${1:-}" = "test" ]; then
    # The save's copy extension (ckptcache/format/_copy.c) is built by the install below and
    # needs a C compiler; its test fails where the build was skipped. The data plane's record
    # extension (ckptcache/server/cluster/dataplane/_records.c) needs OpenSSL's headers too,
    # and the tensor table's loop (ckptcache/codec/table/_tensors.cpp) a C++ compiler.
    BUILD=()
    command -v cc >/dev/null 2>&1 || BUILD+=(gcc)
    command -v c++ >/dev/null 2>&1 || BUILD+=(g++)
    [ -f /usr/include/openssl/evp.h ] || BUILD+=(libssl-dev)
    if [ ${#BUILD[@]} -gt 0 ]; then
        SUDO=""
        [ "$(id -u)" = "0" ] || SUDO="sudo -n"
        ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${BUILD[@]}" >/dev/null) \
            || echo "warning: could not install ${BUILD[*]}; the C extensions may not be built" >&2
    fi
    # torch is named again so that no framework's requirement can swap the CPU build out.
    DS_BUILD_OPS=0 pip_install -e ".[test,frameworks]" "torch==2.13.0"
    # The cluster tests start a real etcd (Debian's etcd-server) and run a daemon with a
    # shifted wall clock under libfaketime (Debian's faketime); scripts/test.sh fails without.
    MISSING=()
    command -v etcd >/dev/null 2>&1 || MISSING+=(etcd-server)
    compgen -G "/usr/lib/*/faketime/libfaketime.so.1" >/dev/null || MISSING+=(faketime)
    # The cluster lab (tests/lab.py): network namespaces, tc shaping, nftables partitions.
    command -v nft >/dev/null 2>&1 || MISSING+=(nftables)
    { command -v ip && command -v tc; } >/dev/null 2>&1 || MISSING+=(iproute2)
    # The persist's write-back test counts the kernel's record of its calls.
    command -v strace >/dev/null 2>&1 || MISSING+=(strace)
    if [ ${#MISSING[@]} -gt 0 ]; then
        SUDO=""
        [ "$(id -u)" = "0" ] || SUDO="sudo -n"
        ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${MISSING[@]}" >/dev/null) \
            || echo "warning: could not install ${MISSING[*]}; the cluster tests will fail" >&2
    fi
else
    pip_install -e .
fi
# The tensor table's C++ loop (ckptcache/codec/table/_tensors.cpp) is built against torch,
# which pip's isolated build does not see: built here, in place, next to the installed torch
# (needs a C++ compiler; without it a zero-copy load makes its tensors with numpy, and
# ckptcache.codec.table.tensors.MADE_BY says so).
CKPTCACHE_TORCH_EXTENSION=1 python setup.py -q build_ext --inplace >/dev/null 2>&1 \
    || echo "warning: the C extensions could not be built in place" >&2
