#!/usr/bin/env bash
# Install edge-batcher as a systemd service from this source tree.
#
#   sudo tools/install-service.sh [--extras gpu,tensorrt] [--socket-activation]
#   tools/install-service.sh --dry-run          # show what would be done; needs no root
#   tools/install-service.sh --root /tmp/eb     # everything under /tmp/eb, runnable from there
#   sudo tools/install-service.sh --uninstall   # the service, its venv and the CLI link go
#
# Idempotent: an existing user, venv, /etc/edge-batcher/config.toml, model repository or
# document index is kept (the package itself is re-installed into the venv, so running it
# again upgrades the daemon).
set -euo pipefail

readonly SERVICE=edge-batcher
readonly SERVICE_USER=edge-batcher
readonly SERVICE_GROUP=edge-batcher
readonly SYSTEM_PREFIX=/opt/edge-batcher
readonly SYSTEM_STATE_DIR=/var/lib/edge-batcher

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT=""
PREFIX=""
CONFIG_SRC="$REPO_DIR/configs/jetson-orin-nano.toml"
EXTRAS=""
PYTHON=""
PIP_OPTIONS=()
SOCKET_ACTIVATION=0
DRY_RUN=0
UNINSTALL=0
SYSTEM_SITE=auto # auto = yes on Jetson (/etc/nv_tegra_release), no elsewhere
ORIG_ARGS=("$@")

usage() {
    cat <<EOF
Usage: $(basename "$0") [OPTIONS]

Install edge-batcher from $REPO_DIR as the systemd service "$SERVICE". Run as root.

Steps: create the system user/group $SERVICE_USER (+ groups video, render if present);
create PREFIX/venv with the system Python and pip-install this project into it, with the
extras the models need; check the service user can run the venv's interpreter and that every
model's backend imports; install /etc/edge-batcher/config.toml (never overwrites an existing
one); copy the model repository (engines/) to $SYSTEM_STATE_DIR/engines and the document index
(state/index) to $SYSTEM_STATE_DIR/index if absent; install the unit(s) into
/etc/systemd/system; systemctl daemon-reload; link /usr/local/bin/edge-batcher to the venv's
CLI. Nothing is started; it prints the command that starts the service.

Options:
  --prefix DIR             install root; the venv goes to DIR/venv (default $SYSTEM_PREFIX)
  --config FILE            config to install as /etc/edge-batcher/config.toml if none exists
                           (default configs/jetson-orin-nano.toml)
  --extras LIST            pip extras, comma-separated, e.g. gpu,tensorrt; added to the ones
                           the models need (rag for a [tokenizer] or a rag/generator model,
                           tensorrt for a tensorrt model unless the system Python provides it)
  --python PY              the interpreter the venv is built from (default /usr/bin/python3,
                           the system Python, which the service user can execute; a pyenv or
                           conda Python under a private home directory cannot be)
  --pip-option OPT         pass OPT to pip install (repeat), e.g. --pip-option=--index-url=URL
  --root DIR               install everything under DIR instead of / (the installed config and
                           unit point into DIR); no user, chown or systemctl, no root needed:
                           to try the installer, and for its test, which starts the daemon
                           from there
  --system-site-packages   let the venv see system Python packages. Default on Jetson (JetPack's
                           TensorRT/pycuda bindings come from apt, not pip), off elsewhere.
  --no-system-site-packages
  --socket-activation      also install $SERVICE.socket + a drop-in that keeps
                           /run/edge-batcher alive while the service is stopped
  --dry-run                print the commands without running them (no root needed)
  --uninstall              stop and disable the service, remove its units, the venv and the
                           CLI link; keep the config, the models, the index and the user
  -h, --help               show this help
EOF
}

die() {
    echo "error: $*" >&2
    exit 1
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) [[ $# -ge 2 ]] || die "--prefix needs a directory"; PREFIX="$2"; shift 2 ;;
        --prefix=*) PREFIX="${1#*=}"; shift ;;
        --config) [[ $# -ge 2 ]] || die "--config needs a file"; CONFIG_SRC="$2"; shift 2 ;;
        --config=*) CONFIG_SRC="${1#*=}"; shift ;;
        --extras) [[ $# -ge 2 ]] || die "--extras needs a list, e.g. gpu,tensorrt"; EXTRAS="$2"; shift 2 ;;
        --extras=*) EXTRAS="${1#*=}"; shift ;;
        --python) [[ $# -ge 2 ]] || die "--python needs an interpreter"; PYTHON="$2"; shift 2 ;;
        --python=*) PYTHON="${1#*=}"; shift ;;
        --pip-option) [[ $# -ge 2 ]] || die "--pip-option needs an option"; PIP_OPTIONS+=("$2"); shift 2 ;;
        --pip-option=*) PIP_OPTIONS+=("${1#*=}"); shift ;;
        --root) [[ $# -ge 2 ]] || die "--root needs a directory"; ROOT="$2"; shift 2 ;;
        --root=*) ROOT="${1#*=}"; shift ;;
        --system-site-packages) SYSTEM_SITE=yes; shift ;;
        --no-system-site-packages) SYSTEM_SITE=no; shift ;;
        --socket-activation) SOCKET_ACTIVATION=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "error: unknown option: $1" >&2; usage >&2; exit 2 ;;
    esac
done

if [[ -n "$ROOT" ]]; then
    [[ "$ROOT" == /* ]] || die "--root must be an absolute path, got '$ROOT'"
    ROOT="${ROOT%/}"
fi
readonly DEFAULT_PREFIX="$ROOT$SYSTEM_PREFIX"
readonly CONFIG_DIR="$ROOT/etc/edge-batcher"
readonly STATE_DIR="$ROOT$SYSTEM_STATE_DIR"
readonly CACHE_DIR="$ROOT/var/cache/edge-batcher"
readonly UNIT_DIR="$ROOT/etc/systemd/system"
readonly CLI_LINK="$ROOT/usr/local/bin/$SERVICE"
PREFIX="${PREFIX:-$DEFAULT_PREFIX}"
[[ "$PREFIX" == /* ]] || die "--prefix must be an absolute path, got '$PREFIX'"
PREFIX="${PREFIX%/}"
# Owner options for install(1): the service user owns its state; under --root, whoever runs this.
OWN_SERVICE=(-o "$SERVICE_USER" -g "$SERVICE_GROUP")
OWN_CONFIG=(-o root -g "$SERVICE_GROUP")
OWN_ROOT=(-o root -g root)
if [[ -n "$ROOT" ]]; then
    OWN_SERVICE=()
    OWN_CONFIG=()
    OWN_ROOT=()
fi
[[ -z "$EXTRAS" || "$EXTRAS" =~ ^[A-Za-z0-9_-]+(,[A-Za-z0-9_-]+)*$ ]] ||
    die "--extras must be a comma-separated list of names, got '$EXTRAS'"
[[ "$CONFIG_SRC" == /* ]] || CONFIG_SRC="$PWD/$CONFIG_SRC"
VENV="$PREFIX/venv"
BIN="$VENV/bin/edge-batcher"

# ---- helpers -----------------------------------------------------------------------------------

step() { printf '\n==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }

# Print a command (shell-quoted), then run it unless --dry-run.
run() {
    printf '    +'
    printf ' %q' "$@"
    printf '\n'
    if [[ $DRY_RUN -eq 0 ]]; then
        "$@"
    fi
}

# write_file MODE DEST: content on stdin; printed in full under --dry-run.
write_file() {
    local mode="$1" dest="$2" content
    content="$(cat)"
    printf '    + write %s (mode %s):\n' "$dest" "$mode"
    printf '%s\n' "$content" | sed 's/^/    |   /'
    if [[ $DRY_RUN -eq 0 ]]; then
        printf '%s\n' "$content" >"$dest.tmp.$$"
        chmod "$mode" "$dest.tmp.$$"
        mv -f "$dest.tmp.$$" "$dest"
    fi
}

group_exists() { getent group "$1" >/dev/null 2>&1; }
user_exists() { getent passwd "$1" >/dev/null 2>&1; }

# ---- preflight ---------------------------------------------------------------------------------

if [[ $DRY_RUN -eq 1 ]]; then
    echo "DRY RUN: printing the commands that would run; nothing is changed."
elif [[ $(id -u) -ne 0 && -z "$ROOT" ]]; then
    die "must run as root (try: sudo $0 ${ORIG_ARGS[*]:-}), or use --dry-run or --root DIR"
fi

# ---- uninstall ---------------------------------------------------------------------------------

if [[ $UNINSTALL -eq 1 ]]; then
    echo "edge-batcher uninstaller"
    step "1. the service"
    if [[ -n "$ROOT" ]]; then
        note "--root: no systemctl"
    else
        run systemctl disable --now "$SERVICE.socket" "$SERVICE.service" || true
    fi
    run rm -rf "$UNIT_DIR/$SERVICE.service" "$UNIT_DIR/$SERVICE.socket" "$UNIT_DIR/$SERVICE.service.d"
    [[ -z "$ROOT" ]] && run systemctl daemon-reload
    step "2. the CLI link and the venv"
    if [[ -L "$CLI_LINK" && "$(readlink "$CLI_LINK")" == "$BIN" ]]; then
        run rm -f "$CLI_LINK"
    else
        note "$CLI_LINK is not this install's link to $BIN: left alone"
    fi
    run rm -rf "$VENV"
    step "Done$([[ $DRY_RUN -eq 1 ]] && echo ' (dry run: nothing was changed)')"
    note "kept: $CONFIG_DIR (config), $STATE_DIR (models, index), $CACHE_DIR and the user $SERVICE_USER;"
    note "remove them by hand if they are not wanted: rm -rf $CONFIG_DIR $STATE_DIR $CACHE_DIR; userdel $SERVICE_USER"
    exit 0
fi

for f in "$REPO_DIR/pyproject.toml" "$REPO_DIR/systemd/$SERVICE.service"; do
    [[ -f "$f" ]] || die "$f not found: run this script from an edge-batcher source tree"
done
if [[ $SOCKET_ACTIVATION -eq 1 && ! -f "$REPO_DIR/systemd/$SERVICE.socket" ]]; then
    die "$REPO_DIR/systemd/$SERVICE.socket not found"
fi
if [[ ! -f "$CONFIG_SRC" ]]; then
    if [[ $DRY_RUN -eq 1 || -f "$CONFIG_DIR/config.toml" ]]; then
        echo "warning: config source $CONFIG_SRC not found (an installed config would be required)" >&2
    else
        die "config source $CONFIG_SRC not found (pass --config FILE)"
    fi
fi
# The system Python by default, not whichever python3 is first on root's PATH: a pyenv or
# conda interpreter under /root (mode 0700) builds a venv the service user cannot execute.
if [[ -z "$PYTHON" ]]; then
    if [[ -x /usr/bin/python3 ]]; then PYTHON=/usr/bin/python3; else PYTHON="$(command -v python3 || true)"; fi
fi
if [[ -n "$PYTHON" ]] && command -v "$PYTHON" >/dev/null 2>&1; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
        die "Python >= 3.10 required, $PYTHON is $("$PYTHON" -V 2>&1) (pass --python PY)"
elif [[ $DRY_RUN -eq 0 ]]; then
    die "no Python interpreter found (${PYTHON:-python3}); pass --python PY"
fi
if [[ $DRY_RUN -eq 0 && -z "$ROOT" ]] && ! command -v systemctl >/dev/null 2>&1; then
    die "systemctl not found: this installer is for systemd hosts"
fi
if [[ "$SYSTEM_SITE" == auto ]]; then
    if [[ -f /etc/nv_tegra_release ]]; then SYSTEM_SITE=yes; else SYSTEM_SITE=no; fi
fi

# The extras the models need, from the repository the service will load: the installed one
# when it exists (it is kept), else the engines/ this run copies. A missing extra is not
# noticed until the daemon exits 2 at start (e.g. "the tokenizers package is not installed").
if [[ -d "$STATE_DIR/engines" ]]; then MODELS_SRC="$STATE_DIR/engines"; else MODELS_SRC="$REPO_DIR/engines"; fi
model_extras=()
for toml in "$MODELS_SRC"/*/model.toml; do
    [[ -f "$toml" ]] || continue
    model="$(basename "$(dirname "$toml")")"
    if grep -Eq '^[[:space:]]*\[tokenizer\]|^[[:space:]]*backend[[:space:]]*=[[:space:]]*"(rag|generator)"' "$toml"; then
        model_extras+=("rag:$model")
    fi
    if grep -Eq '^[[:space:]]*backend[[:space:]]*=[[:space:]]*"tensorrt"' "$toml" && [[ "$SYSTEM_SITE" != yes ]]; then
        model_extras+=("tensorrt:$model")  # on Jetson, TensorRT comes from JetPack (system site-packages)
    fi
done
DERIVED_NOTE=""
for entry in ${model_extras[@]+"${model_extras[@]}"}; do
    extra="${entry%%:*}"
    DERIVED_NOTE+="${DERIVED_NOTE:+, }$extra (model ${entry#*:})"
    [[ ",$EXTRAS," == *",$extra,"* ]] || EXTRAS="${EXTRAS:+$EXTRAS,}$extra"
done

echo "edge-batcher installer"
note "source tree:   $REPO_DIR"
[[ -n "$ROOT" ]] && note "root:          $ROOT (no user, chown or systemctl)"
note "venv:          $VENV, from $PYTHON (system site-packages: $SYSTEM_SITE)"
note "pip extras:    ${EXTRAS:-none}${DERIVED_NOTE:+ (needed by the models: $DERIVED_NOTE)}"
note "models:        $MODELS_SRC"
note "config source: $CONFIG_SRC"
note "socket activation: $([[ $SOCKET_ACTIVATION -eq 1 ]] && echo yes || echo no)"

# ---- 1. user and group -------------------------------------------------------------------------

step "1. System user and group '$SERVICE_USER'"
MISSING_GROUPS=()
if [[ -n "$ROOT" ]]; then
    note "--root: no user or group is created; the files belong to $(id -un)"
elif group_exists "$SERVICE_GROUP"; then
    note "group $SERVICE_GROUP exists, kept"
else
    run groupadd --system "$SERVICE_GROUP"
fi
if [[ -z "$ROOT" ]]; then
    if user_exists "$SERVICE_USER"; then
        note "user $SERVICE_USER exists, kept"
    else
        # Home = the StateDirectory (systemd creates it); --no-create-home because systemd owns it.
        run useradd --system --no-create-home --home-dir "$STATE_DIR" --shell /usr/sbin/nologin \
            --gid "$SERVICE_GROUP" --comment "edge-batcher inference daemon" "$SERVICE_USER"
    fi
    for g in video render; do
        if group_exists "$g"; then
            run usermod --append --groups "$g" "$SERVICE_USER"
        else
            note "group $g does not exist on this system, skipped"
            MISSING_GROUPS+=("$g")
        fi
    done
fi

# ---- 2. virtual environment --------------------------------------------------------------------

step "2. Python environment $VENV"
run install -d -m 0755 "$PREFIX"
if [[ -x "$VENV/bin/python" ]]; then
    note "venv exists, reused"
else
    venv_args=()
    [[ "$SYSTEM_SITE" == yes ]] && venv_args+=(--system-site-packages)
    run "$PYTHON" -m venv ${venv_args[@]+"${venv_args[@]}"} "$VENV"
fi
# The service runs $VENV/bin/python as $SERVICE_USER: every directory up to the real
# interpreter (the venv's python is a symlink to it) must be searchable by that user.
if [[ $DRY_RUN -eq 0 && -z "$ROOT" ]]; then
    if ! runuser -u "$SERVICE_USER" -- "$VENV/bin/python" -c '' 2>/dev/null; then
        die "user $SERVICE_USER cannot execute $VENV/bin/python (-> $(readlink -f "$VENV/bin/python")):" \
            "the interpreter or a directory above it is not accessible to that user (a pyenv or conda" \
            "Python under /root?). Remove $VENV and run again with --python /usr/bin/python3"
    fi
    note "user $SERVICE_USER can execute $VENV/bin/python (-> $(readlink -f "$VENV/bin/python"))"
elif [[ -n "$ROOT" ]]; then
    note "--root: not checking that $SERVICE_USER can execute the interpreter"
else
    note "then: check that user $SERVICE_USER can execute $VENV/bin/python"
fi
pkg="$REPO_DIR"
[[ -n "$EXTRAS" ]] && pkg="$REPO_DIR[$EXTRAS]"
run "$VENV/bin/pip" install --no-cache-dir --upgrade ${PIP_OPTIONS[@]+"${PIP_OPTIONS[@]}"} "$pkg"
if [[ $DRY_RUN -eq 0 ]]; then
    [[ -x "$BIN" ]] || die "$BIN was not installed by pip"
fi
# NVIDIA's onnxruntime-gpu (JetPack) and PyPI's onnxruntime, a dependency of this package,
# install the same `onnxruntime` import package: keep the accelerated build
# (shadowed_build() in edge_batcher/engines/onnxruntime.py explains).
if [[ $DRY_RUN -eq 0 ]]; then
    shadowed=$("$VENV/bin/python" -c 'from edge_batcher.engines.onnxruntime import shadowed_build
found = shadowed_build()
if found:
    from importlib.metadata import version
    print(found[0], version(found[0]), found[1])')
    if [[ -n "$shadowed" ]]; then
        read -r build_name build_version build_dir <<<"$shadowed"
        note "$build_name $build_version is installed ($build_dir): removing PyPI's CPU onnxruntime from the venv"
        run "$VENV/bin/pip" uninstall -y onnxruntime
        if [[ "$build_dir" == "$VENV"/* ]]; then  # the same directory: the CPU wheel overwrote its files
            run "$VENV/bin/pip" install --no-cache-dir --force-reinstall --no-deps "$build_name==$build_version"
        fi
    fi
else
    note "then: if onnxruntime-gpu (or another accelerated onnxruntime build) is installed, uninstall PyPI's CPU onnxruntime"
fi

# ---- 3. configuration --------------------------------------------------------------------------

step "3. Configuration $CONFIG_DIR/config.toml"
run install -d -m 0755 ${OWN_ROOT[@]+"${OWN_ROOT[@]}"} "$CONFIG_DIR"
if [[ -e "$CONFIG_DIR/config.toml" ]]; then
    note "$CONFIG_DIR/config.toml exists, NOT overwritten (new default: $CONFIG_SRC)"
elif [[ -n "$ROOT" ]]; then
    # The same file with its /etc/edge-batcher and /var/lib/edge-batcher paths moved into --root.
    sed -e "s#/etc/edge-batcher#$CONFIG_DIR#g" -e "s#$SYSTEM_STATE_DIR#$STATE_DIR#g" "$CONFIG_SRC" |
        write_file 0640 "$CONFIG_DIR/config.toml"
else
    # 0640 root:edge-batcher: the daemon can read it, may hold MQTT/peer credentials.
    run install -m 0640 ${OWN_CONFIG[@]+"${OWN_CONFIG[@]}"} "$CONFIG_SRC" "$CONFIG_DIR/config.toml"
fi

# ---- 4. state: model repository ----------------------------------------------------------------

step "4. Model repository $STATE_DIR/engines and document index $STATE_DIR/index"
# Modes match StateDirectoryMode=/CacheDirectoryMode= in the unit (systemd warns on a mismatch).
run install -d -m 0750 ${OWN_SERVICE[@]+"${OWN_SERVICE[@]}"} "$STATE_DIR" "$CACHE_DIR"
# copy_state NAME: $REPO_DIR/<src> -> $STATE_DIR/NAME, owned by the service user; kept if present.
copy_state() {
    local src="$1" name="$2"
    if [[ -e "$STATE_DIR/$name" ]]; then
        note "$STATE_DIR/$name exists, kept"
    elif [[ -d "$src" ]]; then
        run cp -a "$src" "$STATE_DIR/$name"
        [[ -n "$ROOT" ]] || run chown -R "$SERVICE_USER:$SERVICE_GROUP" "$STATE_DIR/$name"
    else
        return 1
    fi
}
copy_state "$REPO_DIR/engines" engines ||
    run install -d -m 0750 ${OWN_SERVICE[@]+"${OWN_SERVICE[@]}"} "$STATE_DIR/engines"
# The rag model's index ([rag] index_dir = "": $STATE_DIRECTORY/index under systemd), built
# by `make models` into ./state/index.
copy_state "$REPO_DIR/state/index" index ||
    note "no $REPO_DIR/state/index to copy; a rag model needs one: edge-batcher index add FILE... --index $STATE_DIR/index"

# Every model's backend must import in the venv (a missing extra, TensorRT not installed...):
# refuse now rather than let the service exit 2 at its first start.
if [[ $DRY_RUN -eq 0 ]]; then
    "$VENV/bin/python" - "$STATE_DIR/engines" <<'PY' || die "the installed daemon could not load the models above: pass the --extras they need (or remove the models from $STATE_DIR/engines), then run again"
import sys
from pathlib import Path

from edge_batcher.config import load_model_config
from edge_batcher.engines import registry
from edge_batcher.errors import ConfigError

failed = 0
for toml in sorted(Path(sys.argv[1]).glob("*/model.toml")):
    try:
        config = load_model_config(toml.parent)
        if registry.is_service(config.backend):
            registry.service_class(config.backend)
        else:
            registry.engine_class(config.backend)
        if config.tokenizer:
            import tokenizers  # noqa: F401
        if config.backend == "tensorrt":  # the backend imports TensorRT only when a model loads
            import tensorrt  # noqa: F401
    except (ConfigError, ImportError) as exc:
        failed += 1
        print(f"error: model {toml.parent.name}: {exc}", file=sys.stderr)
    else:
        print(f"    model {config.name}: backend {config.backend} imports")
sys.exit(1 if failed else 0)
PY
else
    note "then: check that every model's backend imports in the venv (refuse if not)"
fi

# ---- 5. systemd units --------------------------------------------------------------------------

step "5. systemd units in $UNIT_DIR"
[[ -n "$ROOT" ]] && run install -d -m 0755 "$UNIT_DIR"
if [[ "$PREFIX" == "$SYSTEM_PREFIX" && -z "$ROOT" ]]; then
    run install -m 0644 "$REPO_DIR/systemd/$SERVICE.service" "$UNIT_DIR/$SERVICE.service"
else
    # Same file with ExecStart= pointing into --prefix (and --root).
    unit_text="$(cat "$REPO_DIR/systemd/$SERVICE.service")"
    unit_text="${unit_text//$SYSTEM_PREFIX\/venv\/bin\/edge-batcher/$BIN}"
    [[ -n "$ROOT" ]] && unit_text="${unit_text//\/etc\/edge-batcher\/config.toml/$CONFIG_DIR/config.toml}"
    printf '    + install -m 0644 %q %q   # with ExecStart=%s\n' \
        "$REPO_DIR/systemd/$SERVICE.service" "$UNIT_DIR/$SERVICE.service" "$BIN"
    if [[ $DRY_RUN -eq 0 ]]; then
        printf '%s\n' "$unit_text" >"$UNIT_DIR/$SERVICE.service.tmp.$$"
        chmod 0644 "$UNIT_DIR/$SERVICE.service.tmp.$$"
        mv -f "$UNIT_DIR/$SERVICE.service.tmp.$$" "$UNIT_DIR/$SERVICE.service"
    fi
fi

dropin_dir="$UNIT_DIR/$SERVICE.service.d"
need_dropin_dir=0
[[ ${#MISSING_GROUPS[@]} -gt 0 || $SOCKET_ACTIVATION -eq 1 ]] && need_dropin_dir=1
[[ $need_dropin_dir -eq 1 ]] && run install -d -m 0755 "$dropin_dir"

if [[ ${#MISSING_GROUPS[@]} -gt 0 ]]; then
    # systemd refuses to start a unit whose SupplementaryGroups= names an unknown group.
    present=()
    for g in video render; do group_exists "$g" && present+=("$g"); done
    write_file 0644 "$dropin_dir/supplementary-groups.conf" <<EOF
# Written by install-service.sh: group(s) ${MISSING_GROUPS[*]} do not exist on this host.
[Service]
SupplementaryGroups=
SupplementaryGroups=${present[*]:-}
EOF
elif [[ -e "$dropin_dir/supplementary-groups.conf" ]]; then
    run rm -f "$dropin_dir/supplementary-groups.conf"
fi

if [[ $SOCKET_ACTIVATION -eq 1 ]]; then
    run install -m 0644 "$REPO_DIR/systemd/$SERVICE.socket" "$UNIT_DIR/$SERVICE.socket"
    # Without this, stopping the service removes /run/edge-batcher and with it the socket
    # that the .socket unit keeps listening on.
    write_file 0644 "$dropin_dir/socket-activation.conf" <<EOF
# Written by install-service.sh --socket-activation.
[Service]
RuntimeDirectoryPreserve=yes
EOF
fi

if [[ -n "$ROOT" ]]; then
    note "--root: systemctl daemon-reload skipped"
else
    if command -v systemd-analyze >/dev/null 2>&1 && [[ $DRY_RUN -eq 0 ]]; then
        units=("$UNIT_DIR/$SERVICE.service")
        [[ $SOCKET_ACTIVATION -eq 1 ]] && units+=("$UNIT_DIR/$SERVICE.socket")
        run systemd-analyze verify "${units[@]}" || echo "warning: systemd-analyze verify reported problems (above)" >&2
    fi
    run systemctl daemon-reload
fi

# ---- 6. the CLI on PATH ------------------------------------------------------------------------

step "6. the CLI on PATH: $CLI_LINK"
run install -d -m 0755 "$(dirname "$CLI_LINK")"
if [[ -e "$CLI_LINK" && ! -L "$CLI_LINK" ]]; then
    note "$CLI_LINK exists and is not a link: kept; the CLI is $BIN"
else
    run ln -sfn "$BIN" "$CLI_LINK"
fi

# ---- done --------------------------------------------------------------------------------------

step "Done$([[ $DRY_RUN -eq 1 ]] && echo ' (dry run: nothing was changed)')"
if [[ -n "$ROOT" ]]; then
    note "Run the installed daemon from $ROOT as the unit would (its socket in $ROOT/run/$SERVICE):"
    note "  mkdir -p $ROOT/run/$SERVICE && cd $STATE_DIR && STATE_DIRECTORY=$STATE_DIR RUNTIME_DIRECTORY=$ROOT/run/$SERVICE \\"
    note "    $BIN serve --config $CONFIG_DIR/config.toml"
    note "and talk to it:  $CLI_LINK models --url unix://$ROOT/run/$SERVICE/$SERVICE.sock"
    exit 0
fi
note "Edit $CONFIG_DIR/config.toml (models directory: $STATE_DIR/engines), then start it:"
if [[ $SOCKET_ACTIVATION -eq 1 ]]; then
    note "  systemctl enable --now $SERVICE.socket    # starts the daemon on the first connection"
    note "  systemctl enable --now $SERVICE           # optional: also start at boot"
else
    note "  systemctl enable --now $SERVICE"
fi
note "Status and logs:  systemctl status $SERVICE;  journalctl -u $SERVICE -f"
note "API socket clients must be in group $SERVICE_GROUP:  usermod -aG $SERVICE_GROUP <user>"
note "Then, from any shell:  edge-batcher models   (the CLI finds the service's socket)"
