#!/usr/bin/env bash
# Install dtfm as system services: a `dtfm` user, a venv in /opt/dtfm, units, env files and a
# token. Run as root from a checkout: `deploy/install.sh [coordinator|agent N...]`.
# CPU-only hosts: TORCH_SPEC=torch==2.13.0; GPU hosts keep the default (the CUDA build).
# Agents also get TCP buffer settings for long links (deploy/sysctl.d/); SKIP_SYSCTL=1 skips.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
role="${1:-}"
case "$role" in
  coordinator|agent) ;;
  *) echo "usage: install.sh coordinator | install.sh agent GPU_INDEX..." >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "install.sh: run as root (it creates a user and units)" >&2; exit 2; }
id dtfm >/dev/null 2>&1 || useradd --system --home /var/lib/dtfm --shell /usr/sbin/nologin dtfm
install -d -o dtfm -g dtfm -m 0750 /var/lib/dtfm
install -d -m 0755 /opt/dtfm /etc/dtfm
rm -rf /opt/dtfm/src && cp -r "$here" /opt/dtfm/src
python3 -m venv /opt/dtfm/venv
/opt/dtfm/venv/bin/pip install --quiet "${TORCH_SPEC:-torch>=2.2,<2.15}"
/opt/dtfm/venv/bin/pip install --quiet /opt/dtfm/src
if [ ! -s /etc/dtfm/token ]; then
  umask 077
  head -c 32 /dev/urandom | base64 > /etc/dtfm/token
  echo "install.sh: wrote a new join token to /etc/dtfm/token; copy it to every machine"
fi
chown root:dtfm /etc/dtfm/token && chmod 0640 /etc/dtfm/token
if [ "$role" = coordinator ]; then
  [ -f /etc/dtfm/coordinator.env ] || install -m 0640 -g dtfm "$here/deploy/coordinator.env" /etc/dtfm/
  install -m 0644 "$here/deploy/dtfm-coordinator.service" /etc/systemd/system/
  units=(dtfm-coordinator)
else
  shift
  [ $# -gt 0 ] || set -- 0
  [ -f /etc/dtfm/agent.env ] || install -m 0640 -g dtfm "$here/deploy/agent.env" /etc/dtfm/
  install -m 0644 "$here/deploy/dtfm-agent@.service" /etc/systemd/system/
  if [ "${SKIP_SYSCTL:-0}" != 1 ]; then  # bigger TCP buffers for long links; see the file
    install -m 0644 "$here/deploy/sysctl.d/60-dtfm-wan.conf" /etc/sysctl.d/
    sysctl --quiet --load /etc/sysctl.d/60-dtfm-wan.conf \
      || echo "install.sh: could not apply /etc/sysctl.d/60-dtfm-wan.conf now; it applies at boot" >&2
  fi
  units=()
  for gpu in "$@"; do
    [ -f "/etc/dtfm/agent-$gpu.env" ] || echo "DTFM_LISTEN=0.0.0.0:$((7071 + gpu))" > "/etc/dtfm/agent-$gpu.env"
    units+=("dtfm-agent@$gpu")
  done
fi
systemctl daemon-reload
echo "install.sh: edit /etc/dtfm/*.env, then: systemctl enable --now ${units[*]}"
echo "install.sh: logs: journalctl -u '${units[0]}' -f"
