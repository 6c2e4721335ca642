#!/usr/bin/env bash
# Install dtfm as system services: a `dtfm` user, a venv in /opt/dtfm, units, env files and a
# token. Run as root from a checkout: `deploy/install.sh [coordinator|agent N...]`.
# Running it again upgrades in place: the token and every env file already there are kept.
# CPU-only hosts: TORCH_SPEC=torch==2.13.0; GPU hosts keep the default (the CUDA build);
# TORCH_SPEC= (empty) installs no torch (the coordinator does not need it to plan).
# PYTHON=python3.12 picks the venv's interpreter (default: python3).
# Agents also get TCP buffer settings for long links (deploy/sysctl.d/); SKIP_SYSCTL=1 skips.
# DESTDIR=DIR stages every file under DIR instead of / (packaging, tests): no user, no chown,
# no systemctl, no sysctl, root not needed; the venv is built in place under DIR.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
role="${1:-}"
case "$role" in
  coordinator|agent) ;;
  *) echo "usage: install.sh coordinator | install.sh agent GPU_INDEX..." >&2; exit 2 ;;
esac
root="${DESTDIR:-}"
if [ -z "$root" ]; then
  [ "$(id -u)" = 0 ] || { echo "install.sh: run as root (it creates a user and units)" >&2; exit 2; }
  id dtfm >/dev/null 2>&1 || useradd --system --home /var/lib/dtfm --shell /usr/sbin/nologin dtfm
  owner=(-o dtfm -g dtfm); group=(-g dtfm)
else
  root="$(mkdir -p "$root" && cd "$root" && pwd)"
  owner=(); group=()
fi
etc="$root/etc/dtfm"
install -d "${owner[@]}" -m 0700 "$root/var/lib/dtfm"
install -d -m 0755 "$root/opt/dtfm" "$etc" "$root/etc/systemd/system"
# the source without build leftovers or the checkout's own venv
rm -rf "$root/opt/dtfm/src" && mkdir "$root/opt/dtfm/src"
tar -C "$here" --exclude=./.git --exclude=./.venv --exclude=./build --exclude='*.egg-info' \
  --exclude=__pycache__ --exclude=.pytest_cache --exclude=.ruff_cache -cf - . \
  | tar -C "$root/opt/dtfm/src" -xf -
"${PYTHON:-python3}" -m venv "$root/opt/dtfm/venv"
torch_spec="${TORCH_SPEC-torch>=2.2,<2.15}"
[ -z "$torch_spec" ] || "$root/opt/dtfm/venv/bin/pip" install --quiet "$torch_spec"
"$root/opt/dtfm/venv/bin/pip" install --quiet "$root/opt/dtfm/src"
if [ ! -s "$etc/token" ]; then
  (umask 077 && head -c 32 /dev/urandom | base64 > "$etc/token")
  echo "install.sh: wrote a new join token to $etc/token; copy it to every machine"
fi
[ -n "$root" ] || chown dtfm:dtfm "$etc/token"  # the daemons' user alone reads it
chmod 0600 "$etc/token"
env_file() {  # install deploy/$1 as $etc/$1 unless the operator already has one
  [ -f "$etc/$1" ] || install -m 0640 "${group[@]}" "$here/deploy/$1" "$etc/"
}
if [ "$role" = coordinator ]; then
  env_file coordinator.env
  install -m 0644 "$here/deploy/dtfm-coordinator.service" "$root/etc/systemd/system/"
  units=(dtfm-coordinator)
else
  shift
  [ $# -gt 0 ] || set -- 0
  env_file agent.env
  install -m 0644 "$here/deploy/dtfm-agent@.service" "$root/etc/systemd/system/"
  if [ "${SKIP_SYSCTL:-0}" != 1 ]; then  # bigger TCP buffers for long links; see the file
    install -d -m 0755 "$root/etc/sysctl.d"
    install -m 0644 "$here/deploy/sysctl.d/60-dtfm-wan.conf" "$root/etc/sysctl.d/"
    [ -n "$root" ] || sysctl --quiet --load /etc/sysctl.d/60-dtfm-wan.conf \
      || echo "install.sh: could not apply /etc/sysctl.d/60-dtfm-wan.conf now; it applies at boot" >&2
  fi
  units=()
  for gpu in "$@"; do
    if [ ! -f "$etc/agent-$gpu.env" ]; then
      printf '# its one TCP port to open (gRPC and the dtfm data plane share it)\nDTFM_LISTEN=0.0.0.0:%d\n# DTFM_METRICS_LISTEN=0.0.0.0:%d\n' \
        $((7071 + gpu)) $((9171 + gpu)) > "$etc/agent-$gpu.env"
      chmod 0640 "$etc/agent-$gpu.env"
    fi
    units+=("dtfm-agent@$gpu")
  done
fi
if [ -z "$root" ]; then
  systemctl daemon-reload
  echo "install.sh: edit /etc/dtfm/*.env, then: systemctl enable --now ${units[*]}"
  echo "install.sh: logs: journalctl -u '${units[0]}' -f"
else
  echo "install.sh: staged under $root (units: ${units[*]})"
fi
