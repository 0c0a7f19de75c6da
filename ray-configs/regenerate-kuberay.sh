#!/bin/sh
# Regenerates serveConfigV2 in ray-configs/kuberay-rayservice.yaml (the lines after
# `serveConfigV2: |`, the manifest's last key): `rayinfer config` for the example repository as
# the image holds it, at /home/ray/models. tests/unit/cluster/test_kuberay.py checks it is current.
#   ray-configs/regenerate-kuberay.sh            # uses .venv/bin/rayinfer
#   RAYINFER=rayinfer ray-configs/regenerate-kuberay.sh
set -eu
cd "$(dirname "$0")/.."
rayinfer=${RAYINFER:-.venv/bin/rayinfer}
# RAYINFER_* variables would change the settings; the manifest shows the defaults.
for name in $(env | sed -n 's/^\(RAYINFER_[A-Za-z0-9_]*\)=.*/\1/p'); do unset "$name"; done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$rayinfer" example-repository --no-extras "$work/models" > /dev/null
manifest=ray-configs/kuberay-rayservice.yaml
{
    sed '/^  serveConfigV2: |$/q' "$manifest"
    "$rayinfer" config --model-repository "$work/models" --http-address 0.0.0.0 --metrics-address 0.0.0.0 \
        --front-on-head --front-on-every-node | sed "s#$work/models#/home/ray/models#g; s/^/    /"
} > "$manifest.new"
mv "$manifest.new" "$manifest"
