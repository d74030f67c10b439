#!/usr/bin/env bash
# Install edge-batcher as a systemd service from this source tree.
#
#   sudo tools/install-service.sh [--extras gpu,tensorrt] [--socket-activation]
#   tools/install-service.sh --dry-run          # show what would be done; needs no root
#
# Idempotent: an existing user, venv, /etc/edge-batcher/config.toml or model repository is kept
# (the package itself is re-installed into the venv, so running it again upgrades the daemon).
set -euo pipefail

readonly SERVICE=edge-batcher
readonly SERVICE_USER=edge-batcher
readonly SERVICE_GROUP=edge-batcher
readonly DEFAULT_PREFIX=/opt/edge-batcher
readonly CONFIG_DIR=/etc/edge-batcher
readonly STATE_DIR=/var/lib/edge-batcher
readonly CACHE_DIR=/var/cache/edge-batcher
readonly UNIT_DIR=/etc/systemd/system

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="$DEFAULT_PREFIX"
CONFIG_SRC="$REPO_DIR/configs/jetson-orin-nano.toml"
EXTRAS=""
SOCKET_ACTIVATION=0
DRY_RUN=0
SYSTEM_SITE=auto # auto = yes on Jetson (/etc/nv_tegra_release), no elsewhere
ORIG_ARGS=("$@")

usage() {
    cat <<EOF
Usage: $(basename "$0") [OPTIONS]

Install edge-batcher from $REPO_DIR as the systemd service "$SERVICE". Run as root.

Steps: create the system user/group $SERVICE_USER (+ groups video, render if present);
create PREFIX/venv and pip-install this project into it; install $CONFIG_DIR/config.toml
(never overwrites an existing one); copy the model repository (engines/) to
$STATE_DIR/engines if absent; install the unit(s) into $UNIT_DIR; systemctl daemon-reload.
Nothing is started; it prints the command that starts the service.

Options:
  --prefix DIR             install root; the venv goes to DIR/venv (default $DEFAULT_PREFIX)
  --config FILE            config to install as $CONFIG_DIR/config.toml if none exists
                           (default configs/jetson-orin-nano.toml)
  --extras LIST            pip extras, comma-separated, e.g. gpu,tensorrt
  --system-site-packages   let the venv see system Python packages. Default on Jetson (JetPack's
                           TensorRT/pycuda bindings come from apt, not pip), off elsewhere.
  --no-system-site-packages
  --socket-activation      also install $SERVICE.socket + a drop-in that keeps
                           /run/edge-batcher alive while the service is stopped
  --dry-run                print the commands without running them (no root needed)
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
        --system-site-packages) SYSTEM_SITE=yes; shift ;;
        --no-system-site-packages) SYSTEM_SITE=no; shift ;;
        --socket-activation) SOCKET_ACTIVATION=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "error: unknown option: $1" >&2; usage >&2; exit 2 ;;
    esac
done

[[ "$PREFIX" == /* ]] || die "--prefix must be an absolute path, got '$PREFIX'"
PREFIX="${PREFIX%/}"
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
elif [[ $(id -u) -ne 0 ]]; then
    die "must run as root (try: sudo $0 ${ORIG_ARGS[*]:-}), or use --dry-run"
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
if command -v python3 >/dev/null 2>&1; then
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
        die "python3 >= 3.10 required, found $(python3 -V 2>&1)"
elif [[ $DRY_RUN -eq 0 ]]; then
    die "python3 not found"
fi
if [[ $DRY_RUN -eq 0 ]] && ! command -v systemctl >/dev/null 2>&1; then
    die "systemctl not found: this installer is for systemd hosts"
fi
if [[ "$SYSTEM_SITE" == auto ]]; then
    if [[ -f /etc/nv_tegra_release ]]; then SYSTEM_SITE=yes; else SYSTEM_SITE=no; fi
fi

echo "edge-batcher installer"
note "source tree:   $REPO_DIR"
note "venv:          $VENV (system site-packages: $SYSTEM_SITE)"
note "pip extras:    ${EXTRAS:-none}"
note "config source: $CONFIG_SRC"
note "socket activation: $([[ $SOCKET_ACTIVATION -eq 1 ]] && echo yes || echo no)"

# ---- 1. user and group -------------------------------------------------------------------------

step "1. System user and group '$SERVICE_USER'"
if group_exists "$SERVICE_GROUP"; then
    note "group $SERVICE_GROUP exists, kept"
else
    run groupadd --system "$SERVICE_GROUP"
fi
if user_exists "$SERVICE_USER"; then
    note "user $SERVICE_USER exists, kept"
else
    # Home = the StateDirectory (systemd creates it); --no-create-home because systemd owns it.
    run useradd --system --no-create-home --home-dir "$STATE_DIR" --shell /usr/sbin/nologin \
        --gid "$SERVICE_GROUP" --comment "edge-batcher inference daemon" "$SERVICE_USER"
fi
MISSING_GROUPS=()
for g in video render; do
    if group_exists "$g"; then
        run usermod --append --groups "$g" "$SERVICE_USER"
    else
        note "group $g does not exist on this system, skipped"
        MISSING_GROUPS+=("$g")
    fi
done

# ---- 2. virtual environment --------------------------------------------------------------------

step "2. Python environment $VENV"
run install -d -m 0755 "$PREFIX"
if [[ -x "$VENV/bin/python" ]]; then
    note "venv exists, reused"
else
    venv_args=()
    [[ "$SYSTEM_SITE" == yes ]] && venv_args+=(--system-site-packages)
    run python3 -m venv ${venv_args[@]+"${venv_args[@]}"} "$VENV"
fi
pkg="$REPO_DIR"
[[ -n "$EXTRAS" ]] && pkg="$REPO_DIR[$EXTRAS]"
run "$VENV/bin/pip" install --no-cache-dir --upgrade "$pkg"
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
run install -d -m 0755 -o root -g root "$CONFIG_DIR"
if [[ -e "$CONFIG_DIR/config.toml" ]]; then
    note "$CONFIG_DIR/config.toml exists, NOT overwritten (new default: $CONFIG_SRC)"
else
    # 0640 root:edge-batcher: the daemon can read it, may hold MQTT/peer credentials.
    run install -m 0640 -o root -g "$SERVICE_GROUP" "$CONFIG_SRC" "$CONFIG_DIR/config.toml"
fi

# ---- 4. state: model repository ----------------------------------------------------------------

step "4. Model repository $STATE_DIR/engines"
# Modes match StateDirectoryMode=/CacheDirectoryMode= in the unit (systemd warns on a mismatch).
run install -d -m 0750 -o "$SERVICE_USER" -g "$SERVICE_GROUP" "$STATE_DIR" "$CACHE_DIR"
if [[ -e "$STATE_DIR/engines" ]]; then
    note "$STATE_DIR/engines exists, kept"
elif [[ -d "$REPO_DIR/engines" ]]; then
    run cp -a "$REPO_DIR/engines" "$STATE_DIR/engines"
    run chown -R "$SERVICE_USER:$SERVICE_GROUP" "$STATE_DIR/engines"
else
    run install -d -m 0750 -o "$SERVICE_USER" -g "$SERVICE_GROUP" "$STATE_DIR/engines"
fi

# ---- 5. systemd units --------------------------------------------------------------------------

step "5. systemd units in $UNIT_DIR"
if [[ "$PREFIX" == "$DEFAULT_PREFIX" ]]; then
    run install -m 0644 "$REPO_DIR/systemd/$SERVICE.service" "$UNIT_DIR/$SERVICE.service"
else
    # Same file with ExecStart= pointing into --prefix.
    unit_text="$(cat "$REPO_DIR/systemd/$SERVICE.service")"
    unit_text="${unit_text//$DEFAULT_PREFIX\/venv\/bin\/edge-batcher/$BIN}"
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

if command -v systemd-analyze >/dev/null 2>&1 && [[ $DRY_RUN -eq 0 ]]; then
    units=("$UNIT_DIR/$SERVICE.service")
    [[ $SOCKET_ACTIVATION -eq 1 ]] && units+=("$UNIT_DIR/$SERVICE.socket")
    run systemd-analyze verify "${units[@]}" || echo "warning: systemd-analyze verify reported problems (above)" >&2
fi
run systemctl daemon-reload

# ---- done --------------------------------------------------------------------------------------

step "Done$([[ $DRY_RUN -eq 1 ]] && echo ' (dry run: nothing was changed)')"
note "Edit $CONFIG_DIR/config.toml (models directory: $STATE_DIR/engines), then start it:"
if [[ $SOCKET_ACTIVATION -eq 1 ]]; then
    note "  systemctl enable --now $SERVICE.socket    # starts the daemon on the first connection"
    note "  systemctl enable --now $SERVICE           # optional: also start at boot"
else
    note "  systemctl enable --now $SERVICE"
fi
note "Status and logs:  systemctl status $SERVICE;  journalctl -u $SERVICE -f"
note "API socket clients must be in group $SERVICE_GROUP:  usermod -aG $SERVICE_GROUP <user>"
