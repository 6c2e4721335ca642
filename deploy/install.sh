#!/usr/bin/env bash
# Install dtfm as system services: a `dtfm` user, a venv in /opt/dtfm, units, env files and a
# token (and on the coordinator an operator token). Run as root from a checkout:
#   deploy/install.sh coordinator [--make-certs [--name HOST] [--advertise ADDR]...]
#   deploy/install.sh agent N... [--make-certs [--name HOST] [--advertise ADDR]...]
# Running it again upgrades in place: the tokens, every env file and TLS file already there
# are kept.
# The coordinator also gets /etc/dtfm/operator-token, which `coordinator submit/cancel/admit`
# need on top of the join token (--operator-token-file): unlike the join token it never leaves
# this machine, so an agent (a volunteer) cannot cancel jobs or admit an excluded agent.
# --make-certs: make this machine's TLS certificate in /etc/dtfm/tls (node.pem, node.key,
# ca.pem; `coordinator certs`), signed by the cluster CA there (ca.pem + ca.key), which it
# makes first when neither file exists (the first machine). SANs: --name (default
# `hostname -f`), localhost, the host's addresses (`hostname -I`) and each --advertise.
# Without the flag, on a terminal, it asks.
# PREFIX=DIR installs the source and venv there instead of /opt/dtfm; the units name it.
# CPU-only hosts: TORCH_SPEC=torch==2.13.0; GPU hosts keep the default (the CUDA build);
# TORCH_SPEC= (empty) installs no torch (the coordinator does not need it to plan).
# PYTHON=python3.12 picks the venv's interpreter (default: python3).
# The coordinator also gets the Grafana dashboard (deploy/grafana/) where /etc/grafana exists;
# GRAFANA=1 installs it regardless.
# Agents also get TCP buffer settings for long links (deploy/sysctl.d/); SKIP_SYSCTL=1 skips.
# DESTDIR=DIR stages every file under DIR instead of / (packaging, tests): no user, no chown,
# no systemctl, no sysctl, root not needed; the venv is built in place under DIR, so the
# staged units run it there (DIR/opt/dtfm/venv/bin/...), and `systemd-analyze verify` passes.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
usage() {
  echo "usage: install.sh coordinator [--make-certs [--name HOST] [--advertise ADDR]...]" >&2
  echo "       install.sh agent GPU_INDEX... [--make-certs [--name HOST] [--advertise ADDR]...]" >&2
  exit 2
}
role="${1:-}"
case "$role" in
  coordinator|agent) shift ;;
  *) usage ;;
esac
make_certs=0; name=""; advertise=(); gpus=()
while [ $# -gt 0 ]; do
  case "$1" in
    --make-certs) make_certs=1 ;;
    --advertise) [ $# -ge 2 ] || usage; advertise+=(--advertise "$2"); shift ;;
    --name) [ $# -ge 2 ] || usage; name="$2"; shift ;;
    *) [ "$role" = agent ] && [[ "$1" =~ ^[0-9]+$ ]] || usage; gpus+=("$1") ;;
  esac
  shift
done
prefix="${PREFIX:-/opt/dtfm}"
case "$prefix" in /*) ;; *) echo "install.sh: PREFIX=$prefix must be an absolute path" >&2; exit 2 ;; esac
root="${DESTDIR:-}"
if [ -z "$root" ]; then
  [ "$(id -u)" = 0 ] || { echo "install.sh: run as root (it creates a user and units)" >&2; exit 2; }
  id dtfm >/dev/null 2>&1 || useradd --system --home /var/lib/dtfm --shell /usr/sbin/nologin dtfm
  owner=(-o dtfm -g dtfm); group=(-g dtfm)
else
  root="$(mkdir -p "$root" && cd "$root" && pwd)"
  owner=(); group=()
fi
dest="$root$prefix"  # where the source and the venv really are; the units run it from here
case "$dest" in
  *[[:space:]%\\\"\']*) echo "install.sh: $dest: the systemd units name this path, so it may not hold" \
    "spaces, quotes, backslashes or %; choose another PREFIX or DESTDIR" >&2; exit 2 ;;
esac
etc="$root/etc/dtfm"
install -d "${owner[@]}" -m 0700 "$root/var/lib/dtfm"
install -d -m 0755 "$dest" "$etc" "$root/etc/systemd/system"
# the source without build leftovers or the checkout's own venv
rm -rf "$dest/src" && mkdir "$dest/src"
tar -C "$here" --exclude=./.git --exclude=./.venv --exclude=./build --exclude='*.egg-info' \
  --exclude=__pycache__ --exclude=.pytest_cache --exclude=.ruff_cache -cf - . \
  | tar -C "$dest/src" -xf -
"${PYTHON:-python3}" -m venv "$dest/venv"
torch_spec="${TORCH_SPEC-torch>=2.2,<2.15}"
[ -z "$torch_spec" ] || "$dest/venv/bin/pip" install --quiet "$torch_spec"
"$dest/venv/bin/pip" install --quiet "$dest/src"
if [ ! -s "$etc/token" ]; then
  (umask 077 && head -c 32 /dev/urandom | base64 > "$etc/token")
  echo "install.sh: wrote a new join token to $etc/token; copy it to every machine"
fi
[ -n "$root" ] || chown dtfm:dtfm "$etc/token"  # the daemons' user alone reads it
chmod 0600 "$etc/token"
env_file() {  # install deploy/$1 as $etc/$1 unless the operator already has one
  [ -f "$etc/$1" ] || install -m 0640 "${group[@]}" "$here/deploy/$1" "$etc/"
}
unit() {  # deploy/$1 as the system's unit, running the venv installed above
  local text
  text="$(<"$here/deploy/$1")"
  printf '%s\n' "${text//\/opt\/dtfm\//"$dest/"}" > "$root/etc/systemd/system/$1"
  chmod 0644 "$root/etc/systemd/system/$1"
}
if [ "$role" = coordinator ]; then
  if [ ! -s "$etc/operator-token" ]; then
    (umask 077 && head -c 32 /dev/urandom | base64 > "$etc/operator-token")
    echo "install.sh: wrote an operator token to $etc/operator-token; keep it on this machine" \
      "(coordinator submit/cancel/admit --operator-token-file $etc/operator-token, as root)"
  fi
  [ -n "$root" ] || chown dtfm:dtfm "$etc/operator-token"  # the coordinator reads it, and root
  chmod 0600 "$etc/operator-token"
  env_file coordinator.env
  grep -q '^DTFM_OPERATOR_TOKEN_FILE=' "$etc/coordinator.env" || echo "install.sh:" \
    "$etc/coordinator.env (kept) does not name the operator token: add" \
    "DTFM_OPERATOR_TOKEN_FILE=/etc/dtfm/operator-token, or any agent can cancel jobs" >&2
  unit dtfm-coordinator.service
  units=(dtfm-coordinator)
  # the dashboard of the coordinator's metrics, where Grafana is installed (or GRAFANA=1)
  if [ -d "$root/etc/grafana" ] || [ "${GRAFANA:-0}" = 1 ]; then
    DESTDIR="$root" "$here/deploy/grafana/install-dashboard.sh"
  fi
else
  [ ${#gpus[@]} -gt 0 ] || gpus=(0)
  env_file agent.env
  unit dtfm-agent@.service
  if [ "${SKIP_SYSCTL:-0}" != 1 ]; then  # bigger TCP buffers for long links; see the file
    install -d -m 0755 "$root/etc/sysctl.d"
    install -m 0644 "$here/deploy/sysctl.d/60-dtfm-wan.conf" "$root/etc/sysctl.d/"
    [ -n "$root" ] || sysctl --quiet --load /etc/sysctl.d/60-dtfm-wan.conf \
      || echo "install.sh: could not apply /etc/sysctl.d/60-dtfm-wan.conf now; it applies at boot" >&2
  fi
  units=()
  for gpu in "${gpus[@]}"; do
    if [ ! -f "$etc/agent-$gpu.env" ]; then
      printf '# its one TCP port to open (gRPC and the dtfm data plane share it)\nDTFM_LISTEN=0.0.0.0:%d\n# DTFM_METRICS_LISTEN=0.0.0.0:%d\n' \
        $((7071 + gpu)) $((9171 + gpu)) > "$etc/agent-$gpu.env"
      chmod 0640 "$etc/agent-$gpu.env"
    fi
    units+=("dtfm-agent@$gpu")
  done
fi
tls="$etc/tls"
if [ "$make_certs" = 0 ] && [ ! -f "$tls/node.pem" ] && [ -z "$root" ] && [ -t 0 ]; then
  read -r -p "install.sh: make this machine's TLS certificate in $tls (and the cluster CA, if \
none is there)? [y/N] " answer || answer=
  if [[ "$answer" =~ ^[yY] ]]; then make_certs=1; fi
fi
if [ "$make_certs" = 1 ]; then  # the daemons' --tls-cert/--tls-key/--tls-ca (the env files)
  certs=("$dest/venv/bin/coordinator" certs)
  install -d -m 0750 "${group[@]}" "$tls"
  if [ ! -f "$tls/ca.pem" ] && [ ! -f "$tls/ca.key" ]; then
    "${certs[@]}" ca --out "$tls"
    echo "install.sh: made the cluster CA in $tls; sign the other machines' certificates here:"
    echo "  $dest/venv/bin/coordinator certs node --ca-dir $tls --out DIR --name HOST --advertise ADDR"
    echo "  and copy DIR/* to their $tls/ (ca.key signs what the cluster trusts: keep it here)"
  fi
  if [ -f "$tls/node.pem" ]; then
    echo "install.sh: kept $tls/node.pem (delete it and node.key to sign a new one)"
  elif [ ! -f "$tls/ca.key" ]; then
    echo "install.sh: $tls has ca.pem but not ca.key, so it cannot sign this machine's" \
      "certificate: copy ca.key there from the machine that made the CA and run again with" \
      "--make-certs, or sign there (coordinator certs node -h) and copy node.pem and node.key" >&2
    exit 2
  else
    [ -n "$name" ] || name="$(hostname -f 2>/dev/null || cat /proc/sys/kernel/hostname)"
    sans=(--advertise localhost --advertise 127.0.0.1)
    for addr in $(hostname -I 2>/dev/null || true); do sans+=(--advertise "$addr"); done
    "${certs[@]}" node --ca-dir "$tls" --out "$tls" --name "$name" "${sans[@]}" "${advertise[@]}"
  fi
  [ -n "$root" ] || chown dtfm:dtfm "$tls/node.key"  # the daemons read it; ca.key stays root's
elif [ ! -f "$tls/node.pem" ]; then
  echo "install.sh: no TLS certificate in $tls yet (the env files name it): run again with" \
    "--make-certs, or see \`coordinator certs -h\`"
fi
if [ -z "$root" ]; then
  systemctl daemon-reload
  echo "install.sh: edit /etc/dtfm/*.env, then: systemctl enable --now ${units[*]}"
  echo "install.sh: logs: journalctl -u '${units[0]}' -f"
else
  echo "install.sh: staged under $root (units: ${units[*]})"
fi
