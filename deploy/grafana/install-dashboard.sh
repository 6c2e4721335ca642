#!/usr/bin/env bash
# Drop dtfm's Grafana dashboard where Grafana's provisioning reads dashboards:
#   /etc/grafana/provisioning/dashboards/dtfm.yaml  (the provider: the folder below)
#   /var/lib/grafana/dashboards/dtfm/dtfm-dashboard.json
# Grafana loads it at its next start (systemctl restart grafana-server); the dashboard asks
# for a Prometheus data source that scrapes the coordinator (deploy/prometheus.yml).
# deploy/install.sh coordinator runs this where /etc/grafana exists (or with GRAFANA=1).
# DESTDIR=DIR stages the files under DIR instead of /.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${DESTDIR:-}"
install -d -m 0755 "$root/etc/grafana/provisioning/dashboards" "$root/var/lib/grafana/dashboards/dtfm"
install -m 0644 "$here/dtfm-provider.yaml" "$root/etc/grafana/provisioning/dashboards/dtfm.yaml"
install -m 0644 "$here/dtfm-dashboard.json" "$root/var/lib/grafana/dashboards/dtfm/"
echo "install.sh: Grafana dashboard in $root/var/lib/grafana/dashboards/dtfm; restart" \
  "grafana-server to load it"
