# The project's own virtual environment, shared by scripts/mnist.sh and scripts/test.sh
# (sourced, not run). Everything the scripts install goes into it; the interpreter that
# creates it ($PY, default python3) is left exactly as it was.
#
#   source scripts/venv.sh      # make ./.venv once, put torch in it, activate it; PY=its python
#   venv_install examples       # pip install -e ".[examples]" into it, unless already there
#
# BITSCOM_VENV=/path  use (or create) that environment instead of ./.venv (e.g. a conda env
#                     that already has the CUDA build of torch you want).
# TORCH_VERSION       the torch pip installs when the environment has none (default 2.13.0;
#                     pip's index decides CPU or CUDA build: on a GPU machine install the
#                     CUDA build you want into the environment first).
VENV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BITSCOM_VENV:-$VENV_ROOT/.venv}"
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

venv_say() { echo "[venv] $*" >&2; }

# venv_create : make $VENV with "$PY -m venv" unless it already has a python.
venv_create() {
    [ -x "$VENV/bin/python" ] && return 0
    venv_say "creating $VENV with ${PY:-python3} -m venv (the interpreter itself is not changed)"
    if ! "${PY:-python3}" -m venv "$VENV"; then
        venv_say "'${PY:-python3} -m venv $VENV' failed: install your distribution's venv package" \
                 "(Debian/Ubuntu: python3-venv) or set PY= to a Python >= 3.10 that has it"
        return 1
    fi
}

# venv_activate : activate $VENV (PATH, VIRTUAL_ENV) and point PY at its python.
venv_activate() {
    if [ -f "$VENV/bin/activate" ]; then
        # shellcheck disable=SC1091
        . "$VENV/bin/activate"
    else
        export PATH="$VENV/bin:$PATH"
    fi
    PY="$VENV/bin/python"
}

# venv_torch : pip install torch==$TORCH_VERSION into $VENV when it cannot import torch.
venv_torch() {
    # find_spec, not `import torch`: installed is what matters here, and importing torch costs
    # seconds of CPU on every script start (a broken install still fails loudly at first use)
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
        >/dev/null 2>&1 && return 0
    venv_say "pip install torch==$TORCH_VERSION into $VENV (the first time: a few minutes)"
    "$PY" -m pip install "torch==$TORCH_VERSION"
}

# venv_has EXTRAS : true when $VENV imports bitscom from $VENV_ROOT (pip install -e) and every
# distribution bitscom and the comma-separated EXTRAS require is installed there.
venv_has() {
    (cd / && env -u PYTHONPATH "$PY" - "$VENV_ROOT" "$1" <<'EOF'
import importlib.metadata as md, importlib.util, os, re, sys
root, wanted = os.path.realpath(sys.argv[1]), set(filter(None, sys.argv[2].split(",")))
spec = importlib.util.find_spec("bitscom")       # where it would import from, without importing torch
if spec is None or os.path.realpath(os.path.dirname(os.path.dirname(spec.origin or ""))) != root:
    sys.exit(1)
if wanted - set(md.metadata("bitscom").get_all("Provides-Extra") or []):
    sys.exit(1)
for req in md.requires("bitscom") or []:
    spec, _, marker = req.partition(";")
    extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
    if extra and extra.group(1) not in wanted:
        continue
    try:
        md.distribution(re.match(r"[A-Za-z0-9._-]+", spec.strip()).group(0))
    except md.PackageNotFoundError:
        sys.exit(1)
EOF
    )
}

# venv_install EXTRAS : pip install -e "$VENV_ROOT[EXTRAS]" into $VENV unless venv_has says it is there.
venv_install() {
    local extras="${1:-}"
    venv_has "$extras" && return 0
    venv_say "pip install -e \"$VENV_ROOT${extras:+[$extras]}\" into $VENV (the first time: a minute or two)"
    "$PY" -m pip install -q -e "$VENV_ROOT${extras:+[$extras]}"
}

venv_create
venv_activate
venv_torch
